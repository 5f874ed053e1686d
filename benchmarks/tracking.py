"""Launch time with MLflow tracking on and off (a trivial 2-rank gloo job, local mode).

The MLflow run is created on a thread while the workers start, and the rendezvous waits for it;
this measures what that costs. Figures, each the median over ``--processes`` fresh driver
processes (every child is this script re-invoked with ``--child``):

- ``first_s``: the first launch in a fresh driver process (the worker pool starts cold; with
  tracking on, mlflow is imported and the sqlite store opened, in parallel with that).
- ``first_new_store_s``: the same with a store that does not exist yet (MLflow creates its
  tables: once per store).
- ``next_s``: the median of ``--runs`` later launches in the same process (a notebook's case).

Usage::

    python benchmarks/tracking.py                # 3 processes x 5 later launches
    python benchmarks/tracking.py --processes 5 --runs 10

Non-goals: the cost of mlflow.log_* inside the ranks (the user's), Spark mode (benchmarks/
launch.py has the launch figures for every master).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def trivial() -> int:
    return 1


def child(tracking: bool, runs: int) -> None:
    from sparkdist import Distributor

    times = []
    for _ in range(runs + 1):
        started = time.perf_counter()
        result = Distributor(2, use_gpu=False, mlflow=tracking).run_all(trivial)
        times.append(time.perf_counter() - started)
        assert (result.mlflow_run_id is not None) == tracking
    print(json.dumps({"first_s": times[0], "next_s": statistics.median(times[1:])}))


def measure(tracking: bool, new_store: bool, runs: int, scratch: str) -> dict[str, float]:
    store = os.path.join(scratch, f"fresh-{time.monotonic_ns()}.db" if new_store else "kept.db")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", "on" if tracking else "off", "--runs", str(runs)],
        env=env,
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", choices=("on", "off"))
    args = parser.parse_args()
    if args.child:
        child(args.child == "on", args.runs)
        return
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as scratch:
        measure(True, False, 1, scratch)  # creates the kept store once
        rows = {"off": [], "on": [], "on, new store": []}
        for _ in range(args.processes):  # interleaved, so machine load hits all alike
            rows["off"].append(measure(False, False, args.runs, scratch))
            rows["on"].append(measure(True, False, args.runs, scratch))
            rows["on, new store"].append(measure(True, True, args.runs, scratch))
    print(f"{'tracking':<16}{'first launch':>14}{'later launches':>16}")
    for name, samples in rows.items():
        first = statistics.median(s["first_s"] for s in samples)
        later = statistics.median(s["next_s"] for s in samples)
        print(f"{name:<16}{first:>13.2f}s{later:>15.3f}s")
        print(
            json.dumps(
                {
                    "tracking": name,
                    "first_s": round(first, 3),
                    "next_s": round(later, 4),
                    "processes": args.processes,
                }
            ),
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
