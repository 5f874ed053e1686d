"""Steady-state step time: the same DDP loop under sparkdist (local mode) and under torchrun.

Issue 9's target: sparkdist's per-step time is at most 1.02x torchrun's (the launcher is not in
the data path). The loop is ``_train_loop.ddp_mlp_steps``: a small MLP, 2 ranks, gloo,
``--steps`` timed steps after ``--warmup`` untimed ones. Launchers, in turns per round:

- ``sparkdist``: ``Distributor(2, use_gpu=False).run_all(ddp_mlp_steps, ...)``;
- ``torchrun``: ``torchrun --standalone --nproc_per_node=2 _train_loop.py ...``;
- ``sparkdist-cold``: sparkdist with ``SPARKDIST_WORKER_POOL=0``: ranks are fresh interpreters,
  not forks of the warm pool's zygote (tells a cost of forking from one apart);
- ``sparkdist+report``: sparkdist with ``runtime.report(step, total, loss)`` every step (what
  a heartbeat/progress per step costs; not part of the target);
- ``sparkdist+torchft``: the same model across torchft replica groups
  (``Distributor(2, replica_groups=2)``, ``_train_loop.torchft_mlp_steps``): a quorum, the
  gradients averaged by ``runtime.average_gradients`` and a commit vote every step (what
  torchft's fault tolerance costs a step; compared with ``sparkdist``, not part of the target).

Round 0 is a warm-up (not kept). The figure per launcher is the median of rank 0's step times
over all kept rounds; ``run_medians`` has each round's median. Everything runs in one child
process (a fresh driver), which also runs torchrun.

Usage (see benchmarks/README.md)::

    python benchmarks/steady_state.py --quick      # 2 rounds
    python benchmarks/steady_state.py              # 5 rounds of 200 steps

Non-goals: launch time (``launch.py``, ``scaling.py``), GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import _train_loop
from _harness import Bench, Options, append_records
from _measure import run_torchrun
from _report import emit, median, ratio, rounded, table, times

SCRIPT = "steady_state"
NUM_PROCESSES = 2
LAUNCHERS = ("sparkdist", "torchrun", "sparkdist-cold", "sparkdist+report", "sparkdist+torchft")
TARGET_RATIO = 1.02
POOL_VAR = "SPARKDIST_WORKER_POOL"

OPTIONS = Options(__doc__, quick_help="2 rounds")
OPTIONS.add(
    "--runs",
    type=int,
    quick=(5, 2),
    help="timed rounds; one more untimed warm-up round comes first",
)
OPTIONS.add("--steps", type=int, default=200, help="timed steps per run")
OPTIONS.add("--warmup", type=int, default=20, help="untimed steps first")
OPTIONS.add("--hidden", type=int, default=256, help="the MLP's hidden width")


def run_once(launcher: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One training run under ``launcher``; rank 0's result."""
    if launcher == "torchrun":
        done = run_torchrun(
            NUM_PROCESSES,
            _train_loop.__file__,
            str(out),
            str(args.steps),
            str(args.warmup),
            str(args.hidden),
            timeout_s=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"torchrun exited with {done.returncode}:\n{done.output[-3000:]}")
        return json.loads(out.read_text(encoding="utf-8"))  # type: ignore[no-any-return]
    from sparkdist import Distributor

    if launcher == "sparkdist+torchft":
        groups = Distributor(NUM_PROCESSES, use_gpu=False, replica_groups=NUM_PROCESSES)
        result = groups.run_all(_train_loop.torchft_mlp_steps, args.steps, args.warmup, args.hidden)
        return result.values[0]  # type: ignore[no-any-return]
    pool = os.environ.pop(POOL_VAR, None)
    if launcher == "sparkdist-cold":
        os.environ[POOL_VAR] = "0"
    try:
        result = Distributor(NUM_PROCESSES, use_gpu=False).run_all(
            _train_loop.ddp_mlp_steps,
            args.steps,
            args.warmup,
            args.hidden,
            report=launcher == "sparkdist+report",
        )
    finally:
        os.environ.pop(POOL_VAR, None)
        if pool is not None:
            os.environ[POOL_VAR] = pool
    return result.values[0]  # type: ignore[no-any-return]


def run_child(args: argparse.Namespace) -> None:
    """Rounds of every launcher in turns; one record per run."""
    out = Path.cwd() / "torchrun-rank0.json"
    for index in range(args.runs + 1):
        for launcher in LAUNCHERS:
            value = run_once(launcher, args, out)
            steps = value["step_s"]
            append_records(
                args.results,
                [
                    {
                        "launcher": launcher,
                        "round": index,
                        "median": statistics.median(steps),
                        "steps": steps,
                        "torch_threads": value["torch_threads"],
                        "omp_num_threads": value["omp_num_threads"],
                        "parameters": value["parameters"],
                    }
                ],
            )
    out.unlink(missing_ok=True)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One figure per launcher (warm-up round left out), then the ratios to torchrun."""
    figures = []
    for launcher in LAUNCHERS:
        kept = [r for r in runs if r["launcher"] == launcher and r["round"] > 0]
        pooled = sorted(s for r in kept for s in r["steps"])
        figures.append(
            {
                "figure": "step_s",
                "launcher": launcher,
                "median": rounded(median(pooled), 6),
                "p10": rounded(pooled[len(pooled) // 10], 6) if pooled else None,
                "p90": rounded(pooled[len(pooled) * 9 // 10], 6) if pooled else None,
                "run_medians": [rounded(r["median"], 6) for r in kept],
                "steps": len(pooled),
                "torch_threads": sorted({r["torch_threads"] for r in kept}),
                "omp_num_threads": sorted({str(r["omp_num_threads"]) for r in kept}),
                "parameters": kept[0]["parameters"] if kept else None,
            }
        )
    by_launcher = {f["launcher"]: f["median"] for f in figures}
    for launcher in ("sparkdist", "sparkdist-cold", "sparkdist+report"):
        value = ratio(by_launcher.get(launcher), by_launcher.get("torchrun"))
        figures.append(
            {
                "figure": "step_s_ratio",
                "launcher": f"{launcher}/torchrun",
                "value": rounded(value, 4),
                "target": TARGET_RATIO if launcher == "sparkdist" else None,
            }
        )
    torchft = ratio(by_launcher.get("sparkdist+torchft"), by_launcher.get("sparkdist"))
    figures.append(
        {
            "figure": "step_s_ratio",
            "launcher": "sparkdist+torchft/sparkdist",
            "value": rounded(torchft, 4),
            "target": None,
        }
    )
    return figures


def table_of(figures: list[dict[str, Any]]) -> str:
    ratios = {f["launcher"]: f["value"] for f in figures if f["figure"] == "step_s_ratio"}
    rows = []
    for f in (f for f in figures if f["figure"] == "step_s"):
        per_run = " ".join(f"{m * 1e3:.2f}" for m in f["run_medians"])
        versus = ratios.get(f"{f['launcher']}/torchrun")
        extra = ratios.get(f"{f['launcher']}/sparkdist")
        rows.append(
            {
                "launcher": f["launcher"],
                "median step": _ms(f["median"]),
                "p10": _ms(f["p10"]),
                "p90": _ms(f["p90"]),
                "vs torchrun": times(versus) if f["launcher"] != "torchrun" else "1.00x",
                "steps": f"{f['steps']}",
                "notes": (f"{times(extra)} sparkdist's; " if extra is not None else "")
                + f"per-run medians (ms): {per_run}; torch threads {f['torch_threads']}",
            }
        )
    return table(rows)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.3f} ms"


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv)
    if args.child:
        run_child(args)
        return
    with Bench(SCRIPT) as bench:
        budget_s = 300 + (args.runs + 1) * len(LAUNCHERS) * 120
        runs = bench.child("local", OPTIONS.forward(args), budget_s)
    figures = summarize(runs)
    records = [
        *figures,
        bench.machine(steps=args.steps, warmup=args.warmup, hidden=args.hidden, rounds=args.runs),
    ]
    emit(records, table_of(figures))
    if len({r["launcher"] for r in runs}) < len(LAUNCHERS):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
