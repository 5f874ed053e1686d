"""What MLflow tracking adds to a launch (a trivial 2-rank gloo job, local mode), and where the
time goes.

The MLflow run is created on a thread while the workers start, and the rendezvous waits for it;
this measures what that costs. Every figure is a median over ``--processes`` fresh driver
processes (each child is this script re-invoked with ``--child``), interleaved so that machine
load hits every variant alike:

- ``first_s``: ``Distributor(2, local_mode=True).run(fn)`` as the first launch of a fresh
  process (the worker pool starts cold; with tracking on, mlflow is imported and the store
  opened, in parallel with that). The Distributor is made right before ``run``: the worst case
  for the warm-up that starts when it is made.
- ``next_s``: the median of ``--runs`` later launches in the same process (a notebook's case).
- ``on, made early``: the Distributor is made ``--gap`` seconds before its first ``run`` (a
  notebook: one cell makes it, the next runs it), so the warm-up has had that long.
- ``on, new store``: the store does not exist yet (MLflow creates its tables: once per store).

``added`` is each variant's figure minus tracking off's. Then one fresh process times the
phases of MLflow's set-up on their own (nothing else running): ``import mlflow``, the sqlite
store's modules, opening an existing store, creating a new one (migrations), creating a run,
and the end of a run (last metrics + outcome, one batch, then the run's end).

Usage::

    python benchmarks/tracking.py                # 3 processes x 3 later launches
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

VARIANTS = ("off", "on", "on, made early", "on, new store")


def trivial() -> int:
    return 1


def child(variant: str, runs: int, gap_s: float) -> None:
    from sparkdist import Distributor

    tracking = variant != "off"
    times = []
    for index in range(runs + 1):
        if index == 0 and variant == "on, made early":
            distributor = Distributor(2, local_mode=True, use_gpu=False, mlflow=True)
            time.sleep(gap_s)  # the user's next cell; the warm-up runs meanwhile
            started = time.perf_counter()
        else:
            started = time.perf_counter()
            distributor = Distributor(2, local_mode=True, use_gpu=False, mlflow=tracking)
        result = distributor.run_all(trivial)  # .run(), keeping the MLflow run id to check
        times.append(time.perf_counter() - started)
        assert (result.mlflow_run_id is not None) == tracking, result
    print(json.dumps({"first_s": times[0], "next_s": statistics.median(times[1:])}))


def phases(scratch: str) -> None:
    """Each phase of MLflow's set-up timed alone, in this (fresh) process."""
    laps: dict[str, float] = {}
    started = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal started
        now = time.perf_counter()
        laps[name] = round(now - started, 3)
        started = now

    import mlflow  # noqa: F401

    lap("import mlflow")
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

    lap("import the sqlite store's modules")
    try:
        from sparkdist._tracking.mlflow_store import open_client
    except ImportError:  # a sparkdist from before the warm-up (to measure a baseline)
        from mlflow.tracking import MlflowClient as open_client
    client = open_client(f"sqlite:///{os.path.join(scratch, 'kept.db')}")
    lap("open an existing store")
    open_client(f"sqlite:///{os.path.join(scratch, f'phases-{time.monotonic_ns()}.db')}")
    lap("create a new store (migrations)")
    run = client.create_run("0", tags={"sparkdist.run_id": "x"})
    lap("create a run")
    from mlflow.entities import Metric, RunTag

    client.log_batch(
        run.info.run_id, metrics=[Metric("loss", 0.5, 0, 1)], tags=[RunTag("outcome", "ok")]
    )
    client.set_terminated(run.info.run_id, "FINISHED")
    lap("end a run (one batch + its end)")
    print(json.dumps(laps))


def spawn(args: list[str], store: str, scratch: str) -> dict[str, float]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}", "SPARKDIST_MLFLOW": "0"}
    done = subprocess.run(
        [sys.executable, __file__, *args],
        env=env,
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{done.stdout}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(variant: str, runs: int, gap_s: float, scratch: str) -> dict[str, float]:
    new_store = variant == "on, new store"
    store = os.path.join(scratch, f"fresh-{time.monotonic_ns()}.db" if new_store else "kept.db")
    return spawn(["--child", variant, "--runs", str(runs), "--gap", str(gap_s)], store, scratch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gap", type=float, default=5.0, help="seconds, for 'made early'")
    parser.add_argument("--child", choices=VARIANTS)
    parser.add_argument("--phases", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    if args.child:
        child(args.child, args.runs, args.gap)
        return
    if args.phases:
        phases(os.getcwd())
        return
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as scratch:
        measure("on", 1, 0, scratch)  # creates the kept store once
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
        for _ in range(args.processes):
            for name in VARIANTS:
                samples[name].append(measure(name, args.runs, args.gap, scratch))
        laps = spawn(["--phases"], os.path.join(scratch, "kept.db"), scratch)
    first = {n: statistics.median(s["first_s"] for s in samples[n]) for n in VARIANTS}
    later = {n: statistics.median(s["next_s"] for s in samples[n]) for n in VARIANTS}
    print(f"{'tracking':<16}{'first launch':>14}{'added':>9}{'later launches':>17}{'added':>9}")
    for name in VARIANTS:
        print(
            f"{name:<16}{first[name]:>13.2f}s{first[name] - first['off']:>+8.2f}s"
            f"{later[name]:>16.3f}s{later[name] - later['off']:>+8.3f}s"
        )
        record = {
            "tracking": name,
            "first_s": round(first[name], 3),
            "first_added_s": round(first[name] - first["off"], 3),
            "next_s": round(later[name], 4),
            "next_added_s": round(later[name] - later["off"], 4),
            "processes": args.processes,
        }
        print(json.dumps(record), file=sys.stderr)
    print("\nMLflow set-up, phase by phase (one fresh process, nothing else running):")
    for name, seconds in laps.items():
        print(f"  {name:<36}{seconds:>7.3f} s")
    print(json.dumps({"phases_s": laps}), file=sys.stderr)


if __name__ == "__main__":
    main()
