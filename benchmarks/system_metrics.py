"""What a node's system sampler costs (issue 22: at most 1% of a node's CPU at the default
10 s interval).

The real ``NodeSampler`` (``sparkdist._node.agent.sampler``) samples ``--ranks`` real rank
stand-ins: each a sleeping Python process with ``--children`` children of its own, so the
ranks' process trees are as deep as a data loader makes them. Two figures:

- ``per_sample_ms``: CPU time (the sampling thread's own, ``time.thread_time``) of one sample
  and of encoding it as the ``Sample`` message the agent sends; median and max over
  ``--samples`` samples, taken back to back;
- ``overhead_pct``: that CPU time over the interval (``--interval-s``, default 10 s), as a
  share of one core and of the whole node (``os.cpu_count()`` cores). The sampler thread's
  other work between samples is a single ``Event.wait``: nothing.

Also a check of the running sampler: started at ``--live-interval-s`` for ``--live-s``
seconds, the samples it sends are counted and the sampling thread's CPU time is read from
``/proc/self/task/<tid>/stat`` (Linux), so the figure includes the thread's wake-ups.

The process table's size is printed: each sample reads every process's parent once (one pass
for all trees), so a busier host costs more.

Usage::

    python benchmarks/system_metrics.py                 # 8 ranks x 2 children
    python benchmarks/system_metrics.py --ranks 64 --children 4 --samples 50
    python benchmarks/system_metrics.py --json out.json

Non-goals: the driver's side (one MLflow batch a second, ``_tracking``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from sparkdist._node.agent.sampler import NodeSampler
from sparkdist._wire import protocol

_STAND_IN = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        for _ in range({children})]
print("ready", flush=True)
sys.stdin.read()
for kid in kids:
    kid.kill()
"""


def start_ranks(ranks: int, children: int) -> list[subprocess.Popen[str]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STAND_IN.format(children=children)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(ranks)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return procs


def stop_ranks(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
    for proc in procs:
        proc.wait(30)


def thread_cpu_s(tid: int) -> float:
    """CPU time of one of this process's threads, from /proc (utime + stime)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    procs = start_ranks(args.ranks, args.children)
    try:
        pids = [p.pid for p in procs]
        sent: list[protocol.Sample] = []
        sampler = NodeSampler(0, args.interval_s, lambda: pids, sent.append)
        sampler._psutil = psutil  # what start() does, without its thread
        sampler.open()
        costs_ms, encode_ms = [], []
        for _ in range(args.samples):
            start = time.thread_time()
            metrics = sampler.sample()
            middle = time.thread_time()
            protocol.encode(protocol.Sample(0, time.time(), metrics))
            costs_ms.append((middle - start) * 1000)
            encode_ms.append((time.thread_time() - middle) * 1000)
        assert metrics["ranks_memory_rss_megabytes"] > 5 * args.ranks, metrics
        per_sample_ms = statistics.median(costs_ms) + statistics.median(encode_ms)

        # The sampler as the agent runs it: its own thread, at a short interval.
        live = NodeSampler(0, args.live_interval_s, lambda: pids, sent.append)
        assert live.start() and live._thread is not None
        time.sleep(0.2)  # let the thread start; its id is known once it runs
        tid = live._thread.native_id
        assert tid is not None
        cpu_before, wall_before, count_before = thread_cpu_s(tid), time.monotonic(), len(sent)
        time.sleep(args.live_s)
        cpu_live = thread_cpu_s(tid) - cpu_before
        wall_live = time.monotonic() - wall_before
        samples_live = len(sent) - count_before
        live.stop()
    finally:
        stop_ranks(procs)
    cores = os.cpu_count() or 1
    live_per_sample_ms = 1000 * cpu_live / max(samples_live, 1)
    return {
        "ranks": args.ranks,
        "children_per_rank": args.children,
        "processes_on_host": len(psutil.pids()),
        "cores": cores,
        "sample_ms_median": statistics.median(costs_ms),
        "sample_ms_max": max(costs_ms),
        "encode_ms_median": statistics.median(encode_ms),
        "interval_s": args.interval_s,
        "overhead_pct_of_one_core": 100 * per_sample_ms / 1000 / args.interval_s,
        "overhead_pct_of_node": 100 * per_sample_ms / 1000 / args.interval_s / cores,
        "live_interval_s": args.live_interval_s,
        "live_samples": samples_live,
        "live_wall_s": wall_live,
        "live_thread_cpu_s": cpu_live,
        "live_cpu_ms_per_sample": live_per_sample_ms,
        "live_overhead_pct_of_one_core_at_interval": 100
        * live_per_sample_ms
        / 1000
        / args.interval_s,
        "metrics": sorted(metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--interval-s", type=float, default=10.0)
    parser.add_argument("--live-interval-s", type=float, default=0.1)
    parser.add_argument("--live-s", type=float, default=3.0)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    figures = measure(args)
    print(
        f"{figures['ranks']} ranks x {figures['children_per_rank']} children, "
        f"{figures['processes_on_host']} processes on the host, {figures['cores']} cores\n"
        f"one sample: {figures['sample_ms_median']:.2f} ms CPU (max "
        f"{figures['sample_ms_max']:.2f}), encoding it {figures['encode_ms_median']:.3f} ms\n"
        f"at one sample per {figures['interval_s']:g} s: "
        f"{figures['overhead_pct_of_one_core']:.3f}% of one core, "
        f"{figures['overhead_pct_of_node']:.4f}% of the node\n"
        f"running sampler: {figures['live_samples']} samples in {figures['live_wall_s']:.1f} s, "
        f"{figures['live_cpu_ms_per_sample']:.2f} ms CPU each (thread, wake-ups included): "
        f"{figures['live_overhead_pct_of_one_core_at_interval']:.3f}% of one core at "
        f"{figures['interval_s']:g} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
