"""Warm launch across hosts, in the multi-host lab: sparkdist beside Spark's own floor and
pyspark's ``TorchDistributor``, without and with added round-trip time between hosts.

One lab (``sparkdist._lab``): the driver's host plus two worker hosts, one core each for the
driver's application, names that resolve well (so pyspark's class can run at all). For each
network (no delay; then ``--rtt-ms`` of round trip added between every two hosts by the lab's
user-space relay), interleaved, median of ``--runs`` after one warm-up:

- ``floor``: an empty 2-task barrier job reading ``getTaskInfos()`` (Spark's own cost);
- ``sparkdist_nocomm``: ``Distributor(2, local_mode=False).run(fn)`` with a function that does
  no communication: sparkdist's own protocol on top of the floor;
- ``sparkdist_gloo``: the same with ``init_process_group`` + ``all_reduce`` + destroy, whose
  in-rank time is reported apart (gloo's own share);
- ``pyspark``: pyspark's ``TorchDistributor(num_processes=2, local_mode=False)`` (``--pyspark-runs``
  runs: each takes many seconds).

Then the growth under delay, in round trips: ``(sparkdist growth - floor growth) / RTT``, the
round trips sparkdist adds over Spark's own (goal: at most 3 for a job with no communication).

Usage::

    python benchmarks/multihost.py                 # 5 runs, +10 ms RTT
    python benchmarks/multihost.py --quick         # 2 runs, 1 pyspark run

Needs root (or user namespaces): the lab's rule, see docs/testing.md. Every byte stays inside
the lab's namespaces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import markdown_table

from sparkdist._lab.spark import start_lab_cluster
from sparkdist._lab.support import probe

DRIVER_CODE = """
import statistics, time
import sparkdist
from pyspark import BarrierTaskContext
from pyspark.ml.torch.distributor import TorchDistributor

def barrier_floor():
    def task(_):
        yield BarrierTaskContext.get().getTaskInfos()[0].address
    began = time.perf_counter()
    spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(task).collect()
    return time.perf_counter() - began

def no_comm():
    return 1

def gloo_job():
    import time
    import torch
    import torch.distributed as dist
    began = time.perf_counter()
    dist.init_process_group("gloo")
    initialised = time.perf_counter()
    dist.all_reduce(torch.ones(1))
    reduced = time.perf_counter()
    dist.destroy_process_group()
    return [initialised - began, reduced - initialised, time.perf_counter() - reduced]

def timed(call):
    began = time.perf_counter()
    value = call()
    return time.perf_counter() - began, value

distributor = sparkdist.Distributor(2, local_mode=False, use_gpu=False)
"""

ROUND = """
samples = {"floor": [], "sparkdist_nocomm": [], "sparkdist_gloo": [], "gloo_in_rank": []}
barrier_floor(); distributor.run(no_comm); distributor.run(gloo_job)  # warm-up
for _ in range(RUNS):
    samples["floor"].append(barrier_floor())
    samples["sparkdist_nocomm"].append(timed(lambda: distributor.run(no_comm))[0])
    took, phases = timed(lambda: distributor.run(gloo_job))
    samples["sparkdist_gloo"].append(took)
    samples["gloo_in_rank"].append(phases)
samples["pyspark"] = []
for _ in range(PYSPARK_RUNS):
    samples["pyspark"].append(
        timed(lambda: TorchDistributor(2, local_mode=False, use_gpu=False).run(no_comm))[0])
result = samples
"""


def medians(samples: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, values in samples.items():
        if name == "gloo_in_rank":
            for index, phase in enumerate(("gloo_init", "gloo_all_reduce", "gloo_destroy")):
                out[phase] = statistics.median(v[index] for v in values) if values else None
        else:
            out[name] = statistics.median(values) if values else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pyspark-runs", type=int, default=2)
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.pyspark_runs = 2, 1
    support = probe()
    if not support.ok:
        raise SystemExit(f"multihost.py: {support.reason}")
    cluster = start_lab_cluster(Path(tempfile.mkdtemp(prefix="sparkdist-bench-lab-")), hosts=2)
    figures: dict[str, dict[str, float | None]] = {}
    try:
        driver = cluster.start_driver(SPARKDIST_MLFLOW="0")
        driver.check(DRIVER_CODE)
        round_code = ROUND.replace("PYSPARK_RUNS", str(args.pyspark_runs)).replace(
            "RUNS", str(args.runs)
        )
        figures["no delay"] = medians(driver.check(round_code, timeout_s=1200))
        for host in cluster.workers + ["driver"]:
            cluster.lab.delay(host, args.rtt_ms / 4)  # four relay hops per round trip
        figures[f"+{args.rtt_ms:g} ms RTT"] = medians(driver.check(round_code, timeout_s=1200))
    finally:
        cluster.lab.close()
    names = [
        "floor",
        "sparkdist_nocomm",
        "sparkdist_gloo",
        "pyspark",
        "gloo_init",
        "gloo_all_reduce",
        "gloo_destroy",
    ]
    rows = []
    for network, row in figures.items():
        cells = [f"{row[n]:.3f} s" if row.get(n) is not None else "-" for n in names]
        speedup = (
            row["pyspark"] / row["sparkdist_gloo"]
            if row.get("pyspark") and row.get("sparkdist_gloo")
            else None
        )
        rows.append([network, *cells, f"{speedup:.0f}x" if speedup else "-"])
    print(markdown_table(["network", *names, "pyspark / sparkdist_gloo"], rows))
    base, delayed = figures["no delay"], figures[f"+{args.rtt_ms:g} ms RTT"]
    rtt_s = args.rtt_ms / 1000
    growth = {
        n: (delayed[n] or 0) - (base[n] or 0)
        for n in ("floor", "sparkdist_nocomm", "sparkdist_gloo")
    }
    extra = {
        "rtt_s": rtt_s,
        "floor_growth_rtts": growth["floor"] / rtt_s,
        "sparkdist_nocomm_extra_rtts": (growth["sparkdist_nocomm"] - growth["floor"]) / rtt_s,
        "sparkdist_gloo_extra_rtts": (growth["sparkdist_gloo"] - growth["floor"]) / rtt_s,
    }
    print(json.dumps({"figures": figures, "growth": extra, "time": time.strftime("%F %T")}))
    print(
        f"sparkdist's own protocol adds {extra['sparkdist_nocomm_extra_rtts']:.1f} round trips "
        f"over Spark's floor (goal: <= 3); with gloo, {extra['sparkdist_gloo_extra_rtts']:.1f}"
    )


if __name__ == "__main__":
    main()
