"""Launch time against the number of ranks (1, 2, 4, 8) in local mode, cold and warm.

Issue 9 asks for the curve. The job is launch.py's trivial one (``_jobs.all_reduce_rank``:
``init_process_group("gloo")``, one ``all_reduce``, return the rank) on ``--ranks`` ranks:

- ``cold_s``: the first ``Distributor(n, use_gpu=False).run(fn)`` in a fresh driver process
  (this script re-invoked as a child; the warm pool is not started yet, so this includes the
  zygote's torch import); ``import_s`` is the child's ``import sparkdist`` before it;
- ``warm_s``: the later runs in that same process (``--warm-runs`` of them); ``second_s`` is
  the first of them alone (the pool keeps as many parked spares as ranks ever ran at once, so
  at 8 ranks the second run still forks some on demand);
- ``torchrun_s``: ``torchrun --standalone --nproc_per_node=n _jobs.py all_reduce``, the
  reference, run between the children.

Each round runs every rank count once (a fresh child each), then torchrun at that count; the
figures are medians over ``--runs`` rounds (cold, torchrun) and over every later run (warm).

Usage (see benchmarks/README.md)::

    python benchmarks/scaling.py --quick           # 1 round, 2 warm runs per child
    python benchmarks/scaling.py                   # 3 rounds, 5 warm runs per child
    python benchmarks/scaling.py --ranks 1 2 4 8 16 --runs 2

Non-goals: Spark masters (``launch.py``), training speed (``steady_state.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import _jobs
from _harness import Bench, Options, append_records
from _measure import run_torchrun
from _report import emit, median, ratio, rounded, runs_note, seconds, table, times

SCRIPT = "scaling"
DEFAULT_RANKS = (1, 2, 4, 8)

OPTIONS = Options(__doc__, quick_help="1 round, 2 warm runs")
OPTIONS.add("--runs", type=int, quick=(3, 1), help="rounds: fresh children per rank count")
OPTIONS.add("--warm-runs", type=int, quick=(5, 2), help="later launches per child")
OPTIONS.add(
    "--ranks",
    type=int,
    nargs="+",
    default=list(DEFAULT_RANKS),
    help="rank counts (default: 1 2 4 8)",
)


def run_child(args: argparse.Namespace) -> None:
    """A fresh driver: import sparkdist, one cold launch, then the warm ones."""
    started = time.perf_counter()
    from sparkdist import Distributor

    import_s = time.perf_counter() - started
    launches = []
    for _ in range(1 + args.warm_runs):
        began = time.perf_counter()
        values = Distributor(args.ranks[0], use_gpu=False).run_all(_jobs.all_reduce_rank).values
        launches.append(time.perf_counter() - began)
        if values != list(range(args.ranks[0])):
            raise RuntimeError(f"unexpected values {values}")
    append_records(
        args.results,
        [
            {
                "ranks": args.ranks[0],
                "import_s": import_s,
                "cold_s": launches[0],
                "warm_s": launches[1:],
            }
        ],
    )


def measure(bench: Bench, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rounds of: for each rank count, a fresh child, then torchrun."""
    samples: list[dict[str, Any]] = []
    for index in range(args.runs):
        for ranks in args.ranks:
            bench.note(f"round {index + 1}/{args.runs}: {ranks} rank(s)")
            samples += bench.child(
                f"local-{ranks}",
                ["--ranks", str(ranks), "--warm-runs", str(args.warm_runs)],
                budget_s=300 + 60 * ranks,
            )
            done = run_torchrun(
                ranks, _jobs.__file__, "all_reduce", timeout_s=300, cwd=bench.scratch
            )
            if done.returncode != 0:
                bench.note(
                    f"torchrun with {ranks} rank(s) failed ({done.returncode}):\n"
                    + done.output[-2000:]
                )
            samples.append(
                {"ranks": ranks, "torchrun_s": done.wall_s if done.returncode == 0 else None}
            )
    return samples


def summarize(samples: list[dict[str, Any]], ranks: list[int]) -> list[dict[str, Any]]:
    figures = []
    for n in ranks:
        children = [s for s in samples if s["ranks"] == n and "cold_s" in s]
        torchrun = [
            s["torchrun_s"] for s in samples if s["ranks"] == n and s.get("torchrun_s") is not None
        ]
        cold = [s["cold_s"] for s in children]
        warm = [w for s in children for w in s["warm_s"]]
        second = [s["warm_s"][0] for s in children if s["warm_s"]]
        later = [w for s in children for w in s["warm_s"][1:]]
        figures.append(
            {
                "figure": "launch_s",
                "ranks": n,
                "cold_s": rounded(median(cold)),
                "warm_s": rounded(median(warm)),
                "second_s": rounded(median(second)),
                "third_on_s": rounded(median(later)),
                "torchrun_s": rounded(median(torchrun)),
                "import_s": rounded(median([s["import_s"] for s in children])),
                "cold_runs": [rounded(c) for c in cold],
                "warm_runs": [[rounded(w) for w in s["warm_s"]] for s in children],
                "torchrun_runs": [rounded(t) for t in torchrun],
                "cold_vs_torchrun": rounded(ratio(median(cold), median(torchrun)), 3),
                "warm_vs_torchrun": rounded(ratio(median(warm), median(torchrun)), 4),
            }
        )
    return figures


def table_of(figures: list[dict[str, Any]]) -> str:
    return table(
        [
            {
                "ranks": str(f["ranks"]),
                "cold": seconds(f["cold_s"]),
                "warm": seconds(f["warm_s"]),
                "2nd run": seconds(f["second_s"]),
                "3rd+ runs": seconds(f["third_on_s"]),
                "torchrun": seconds(f["torchrun_s"]),
                "cold/torchrun": times(f["cold_vs_torchrun"]),
                "warm/torchrun": times(f["warm_vs_torchrun"]),
                "notes": f"import sparkdist {seconds(f['import_s'])}; "
                + runs_note(f["cold_runs"], "cold runs "),
            }
            for f in figures
        ]
    )


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv, positive=("runs", "warm_runs", "ranks"))
    if args.child:
        run_child(args)
        return
    with Bench(SCRIPT) as bench:
        samples = measure(bench, args)
    figures = summarize(samples, args.ranks)
    emit([*figures, bench.machine(rounds=args.runs, warm_runs=args.warm_runs)], table_of(figures))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
