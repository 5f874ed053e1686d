"""Returning a large result: time and the driver's peak memory against the payload size.

Issue 9: a 100 MB result from rank 0. Two ranks run ``payload(size, kind)``; rank 0 returns
``size`` MB (2^20 bytes) as ``bytes`` or as a numpy ``uint8`` array, rank 1 returns None.
For each size (``--sizes-mb``, always with 0, the launch alone) and kind:

- ``seconds``: wall time of ``run(fn)`` on the driver; ``over_empty_s`` subtracts the median
  of the size-0 runs of the same launcher and mode (what moving the payload costs);
- ``driver_peak_mb``: the driver process's peak RSS during the call (its ``VmHWM``, reset just
  before) minus its RSS just before; the children run with ``MALLOC_MMAP_THRESHOLD_=1048576`` so
  freed payload copies leave RSS and the next call's copies show; ``peak_per_payload`` divides
  it by the payload size (1.0: one copy of the payload on the driver at the peak);
- ``jvm_peak_mb`` (Spark modes): the same for the driver's JVM (in ``local[2]`` also the
  executor) — the JVM rarely gives memory back, so this is the growth past its earlier peak.

Modes: ``local`` (``Distributor(2, use_gpu=False)``, a child without Spark) and ``local[2]``
(``local_mode=False``, a child with a local[2] session). Baselines measured in the same run:
``pickle`` (``pickle.dumps`` + ``loads`` of the same payload in the local child: the cost of one
serialization round trip, no processes) and pyspark's ``TorchDistributor`` (bytes only, both
modes, in the local[2] child; ``--no-pyspark`` skips it). pyspark's local mode returns whichever
rank wrote its output last, so there every rank returns the payload (all write it to the same
file); its Spark mode returns rank 0's.

Usage (see benchmarks/README.md)::

    python benchmarks/result_size.py --quick                 # 0 and 10 MB, 1 run
    python benchmarks/result_size.py                         # 0, 10, 100 MB, 3 runs
    python benchmarks/result_size.py --sizes-mb 1 100 500 --no-pyspark

Non-goals: results from every rank (``run_all``), Spark Connect (``connect.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _harness import Bench, Options, append_records, classic_session
from _measure import PeakSampler, pickled_by_value
from _report import emit, median, megabytes, rounded, runs_note, seconds, table, times

SCRIPT = "result_size"
NUM_PROCESSES = 2
MB = 1 << 20
KINDS = ("bytes", "numpy")
SAMPLE_INTERVAL_S = 0.002
#: glibc raises its mmap threshold after a large block is freed (up to 32 MB), so a second
#: 10 MB payload would land in heap memory freed earlier and not show in RSS. A fixed threshold
#: (set in the children's environment) keeps every block over 1 MB its own mapping, returned
#: to the OS when freed: RSS deltas then count every copy of the payload.
MMAP_THRESHOLD = 1 << 20

OPTIONS = Options(__doc__, quick_help="10 MB only, 1 round")
OPTIONS.add("--runs", type=int, quick=(3, 1), help="rounds")
OPTIONS.add(
    "--sizes-mb",
    type=float,
    nargs="+",
    quick=([10, 100], [10]),
    help="payload sizes in MB of 2^20 bytes; 0 (the launch alone) is always measured",
)
OPTIONS.add("--modes", nargs="+", choices=("local", "local[2]"), default=["local", "local[2]"])
OPTIONS.add(
    "--no-pyspark", dest="pyspark", action="store_false", help="skip pyspark's TorchDistributor"
)


def payload(size_mb: float, kind: str, every_rank: bool = False) -> Any:
    """Rank 0's result: ``size_mb`` MB of bytes or a numpy uint8 array; None elsewhere
    (``every_rank``: every rank returns it)."""
    if os.environ.get("RANK", "0") != "0" and not every_rank:
        return None
    size = int(size_mb * MB)
    if kind == "bytes":
        return b"\x07" * size
    import numpy as np

    return np.full(size, 7, dtype=np.uint8)


def check(value: Any, size_mb: float) -> None:
    size = value.nbytes if hasattr(value, "nbytes") else len(value)
    if size != int(size_mb * MB):
        raise RuntimeError(f"got {size} bytes back, expected {int(size_mb * MB)}")


# --- in a child ----------------------------------------------------------------------------


def sparkdist_call(local_mode: bool) -> Callable[[float, str], Any]:
    from sparkdist import Distributor

    distributor = Distributor(NUM_PROCESSES, local_mode=local_mode, use_gpu=False)
    return lambda size_mb, kind: distributor.run(payload, size_mb, kind)


def pyspark_call(local_mode: bool) -> Callable[[float, str], Any]:
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(
        num_processes=NUM_PROCESSES, local_mode=local_mode, use_gpu=False
    )

    def call(size_mb: float, kind: str) -> Any:
        # pyspark's local mode returns whichever rank wrote its output last, so there every
        # rank returns the payload (and writes it to the same file); Spark mode returns rank 0's.
        with pickled_by_value(sys.modules[__name__]):
            return distributor.run(payload, size_mb, kind, local_mode)

    return call


def pickle_call(size_mb: float, kind: str) -> Any:
    """The floor: one pickle round trip of the payload in this process."""
    return pickle.loads(pickle.dumps(payload(size_mb, kind), protocol=pickle.HIGHEST_PROTOCOL))


def trial(
    call: Callable[[float, str], Any], size_mb: float, kind: str, jvm_pid: int | None
) -> dict[str, Any]:
    """One call: its wall time and the peaks of the driver (and JVM) over it."""
    gc.collect()
    jvm = PeakSampler(jvm_pid, SAMPLE_INTERVAL_S) if jvm_pid else None
    with PeakSampler(None, SAMPLE_INTERVAL_S) as driver, jvm or contextlib.nullcontext():
        started = time.perf_counter()
        value = call(size_mb, kind)
        elapsed = time.perf_counter() - started
    check(value, size_mb)
    del value
    return {
        "seconds": elapsed,
        "driver_peak_mb": driver.rss_mb - driver.start_rss_mb,
        "jvm_peak_mb": jvm.rss_mb - jvm.start_rss_mb if jvm else None,
    }


def run_child(args: argparse.Namespace) -> None:
    """This child's mode(s): local without Spark, or a local[2] session (stopped at the end)."""
    if args.child == "local":
        measure(
            args,
            {("local", "sparkdist"): sparkdist_call(True), ("local", "pickle"): pickle_call},
            None,
        )
        return
    session = classic_session(
        args.child,
        "sparkdist-benchmark-result-size",
        Path.cwd(),
        {
            "spark.driver.maxResultSize": "0",
            "spark.driver.memory": "2g",
        },
    )
    try:
        calls = {("local[2]", "sparkdist"): sparkdist_call(False)}
        if args.pyspark:
            calls[("local", "pyspark")] = pyspark_call(True)
            calls[("local[2]", "pyspark")] = pyspark_call(False)
        measure(args, calls, session.sparkContext._gateway.proc.pid)
    finally:
        session.stop()


def measure(
    args: argparse.Namespace,
    calls: dict[tuple[str, str], Callable[[float, str], Any]],
    jvm_pid: int | None,
) -> None:
    """Every (size, kind, launcher), in turns, ``--runs`` times, after one warm-up each."""
    sizes = [0.0, *args.sizes_mb]
    for (_mode, launcher), call in calls.items():  # warm-up: pool, executors, numpy import
        for kind in KINDS:
            if launcher != "pyspark" or kind == "bytes":
                call(0.0, kind)
    items = list(calls.items())
    for index in range(args.runs):
        # Each round starts with another launcher: the JVM rarely returns memory, so whoever
        # moves a large payload first would otherwise always carry its growth.
        turn = items[index % len(items) :] + items[: index % len(items)]
        for size_mb in sizes:
            for kind in KINDS:
                for (mode, launcher), call in turn:
                    if launcher == "pyspark" and kind != "bytes":
                        continue
                    measured = trial(call, size_mb, kind, jvm_pid if launcher != "pickle" else None)
                    where = {"mode": mode, "launcher": launcher, "kind": kind, "size_mb": size_mb}
                    append_records(args.results, [{**where, "round": index, **measured}])


# --- the parent ----------------------------------------------------------------------------


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str, float], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["mode"], s["launcher"], s["kind"], s["size_mb"]), []).append(s)
    figures = []
    for (mode, launcher, kind, size_mb), trials in groups.items():
        empty = [
            s["seconds"]
            for s in samples
            if s["mode"] == mode
            and s["launcher"] == launcher
            and s["kind"] == kind
            and s["size_mb"] == 0
        ]
        took = median([t["seconds"] for t in trials])
        driver = median([t["driver_peak_mb"] for t in trials])
        jvm = [t["jvm_peak_mb"] for t in trials if t["jvm_peak_mb"] is not None]
        over = None if took is None or not empty else took - (median(empty) or 0.0)
        figures.append(
            {
                "figure": "result",
                "mode": mode,
                "launcher": launcher,
                "kind": kind,
                "size_mb": size_mb,
                "seconds": rounded(took),
                "over_empty_s": rounded(over) if size_mb else None,
                "mb_per_s": rounded(size_mb / over, 1) if size_mb and over and over > 0 else None,
                "driver_peak_mb": rounded(driver, 1),
                "peak_per_payload": rounded(driver / size_mb, 2) if size_mb and driver else None,
                "jvm_peak_mb": rounded(median(jvm), 1) if jvm else None,
                "runs": [rounded(t["seconds"]) for t in trials],
                "driver_peak_runs": [rounded(t["driver_peak_mb"], 1) for t in trials],
            }
        )
    order = {"local": 0, "local[2]": 1}
    figures.sort(
        key=lambda f: (
            order[f["mode"]],
            f["launcher"] != "sparkdist",
            f["launcher"],
            f["kind"],
            f["size_mb"],
        )
    )
    return figures


def table_of(figures: list[dict[str, Any]]) -> str:
    return table(
        [
            {
                "mode": f["mode"],
                "launcher": f["launcher"],
                "kind": f["kind"],
                "payload": f"{f['size_mb']:g} MB",
                "time": seconds(f["seconds"]),
                "over empty": seconds(f["over_empty_s"]),
                "MB/s": "-" if f["mb_per_s"] is None else f"{f['mb_per_s']:.0f}",
                "driver peak": megabytes(f["driver_peak_mb"]),
                "peak/payload": times(f["peak_per_payload"]),
                "JVM peak": megabytes(f["jvm_peak_mb"]),
                "notes": runs_note(f["runs"]),
            }
            for f in figures
        ]
    )


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv)
    args.sizes_mb = sorted({s for s in args.sizes_mb if s > 0})
    if args.child:
        run_child(args)
        return
    budget_s = 300 + args.runs * (len(args.sizes_mb) + 1) * 240
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    samples = []
    with Bench(SCRIPT) as bench:
        for mode in args.modes:
            samples += bench.child(mode, OPTIONS.forward(args), budget_s=budget_s, env=env)
    figures = summarize(samples)
    emit([*figures, bench.machine(rounds=args.runs, sizes_mb=args.sizes_mb)], table_of(figures))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
