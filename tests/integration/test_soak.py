"""Soak (issue 8): 100 consecutive runs in one driver leave nothing behind.

Local mode, a trivial 2-rank gloo job, one driver process (this one). After two warm-up runs
the baseline is taken: the warm pool's zygote (a child of this process) and its parked spares
(children of the zygote, named ``sparkdist-spare``) exist from then on and are expected to
persist, so they are accounted for explicitly (same zygote, same number of spares, and the
zygote's own descriptors and threads) rather than tolerated as noise. After 100 more runs this
process's open file descriptors and threads, its children, the zygote's descriptors and
threads, and the temp directory's entries must be back at the baseline; finally the pool is
shut down and must take the zygote, its spares and its directory with it.

Excluded from the default run (``slow``); run it with::

    python -m pytest -m slow tests/integration/test_soak.py

The numbers are printed as one JSON line (``sparkdist-soak: {...}``) even under capture.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import psutil
import pytest

from sparkdist import Distributor
from sparkdist._node.pool import pool as _pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

RUNS = 100
WARMUP_RUNS = 2
#: Descriptors and threads may differ by this much from the baseline (a lazily created
#: logging handler, a descriptor the interpreter caches): anything that grows per run would
#: exceed it long before 100 runs.
FD_SLACK = 2
THREAD_SLACK = 1


def trivial_all_reduce():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


@dataclass(frozen=True)
class Snapshot:
    fds: int
    threads: int  # Python threads (threading)
    native_threads: int  # the OS's count for this process
    children: tuple[int, ...]  # live direct children of this process
    zygotes: tuple[int, ...]
    spares: tuple[int, ...]  # parked spares under the zygote(s)
    ranks: tuple[int, ...]  # live rank processes anywhere below this process
    zygote_fds: int
    zygote_threads: int
    temp_entries: tuple[str, ...]
    rss_mb: float


def _live(procs):
    alive = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def snapshot() -> Snapshot:
    me = psutil.Process()
    children = _live(me.children())
    zygotes = [c for c in children if c.environ().get("SPARKDIST_ZYGOTE") == "1"]
    spares, zygote_fds, zygote_threads = [], 0, 0
    for zygote in zygotes:
        spares += [g for g in _live(zygote.children()) if g.name() == "sparkdist-spare"]
        zygote_fds += zygote.num_fds()
        zygote_threads += zygote.num_threads()
    ranks = [
        p
        for p in _live(me.children(recursive=True))
        if p.name().startswith("sparkdist-r")
        or "sparkdist._node.rank.worker" in " ".join(p.cmdline())
    ]
    return Snapshot(
        fds=len(os.listdir("/proc/self/fd")),
        threads=threading.active_count(),
        native_threads=me.num_threads(),
        children=tuple(sorted(c.pid for c in children)),
        zygotes=tuple(sorted(z.pid for z in zygotes)),
        spares=tuple(sorted(s.pid for s in spares)),
        ranks=tuple(sorted(r.pid for r in ranks)),
        zygote_fds=zygote_fds,
        zygote_threads=zygote_threads,
        temp_entries=tuple(sorted(os.listdir(tempfile.gettempdir()))),
        rss_mb=me.memory_info().rss / 2**20,
    )


def test_a_hundred_runs_return_to_baseline(capsys):
    distributor = Distributor(2, use_gpu=False, mlflow=False)
    for _ in range(WARMUP_RUNS):
        assert distributor.run_all(trivial_all_reduce).values == [0, 1]
    baseline = snapshot()
    assert len(baseline.zygotes) == 1 and baseline.children == baseline.zygotes
    assert len(baseline.spares) >= 2 and not baseline.ranks

    seconds, fds, threads = [], [], []
    for _ in range(RUNS):
        started = time.perf_counter()
        assert distributor.run_all(trivial_all_reduce).values == [0, 1]
        seconds.append(time.perf_counter() - started)
        fds.append(len(os.listdir("/proc/self/fd")))
        threads.append(threading.active_count())
    after = snapshot()

    _pool.shutdown()  # the pool's processes and directory go with it
    zygote = psutil.Process(baseline.zygotes[0]) if psutil.pid_exists(baseline.zygotes[0]) else None
    spares = [psutil.Process(pid) for pid in after.spares if psutil.pid_exists(pid)]
    _, still_alive = psutil.wait_procs([p for p in [zygote, *spares] if p], timeout=10)
    shut = snapshot()

    report = {
        "runs": RUNS,
        "median_run_s": round(statistics.median(seconds), 4),
        "max_run_s": round(max(seconds), 4),
        "baseline": {k: v for k, v in asdict(baseline).items() if k != "temp_entries"},
        "after": {k: v for k, v in asdict(after).items() if k != "temp_entries"},
        "fds_min_max_during": [min(fds), max(fds)],
        "threads_min_max_during": [min(threads), max(threads)],
        "temp_entries_baseline": list(baseline.temp_entries),
        "temp_entries_after": list(after.temp_entries),
        "after_pool_shutdown": {
            "children": list(shut.children),
            "fds": shut.fds,
            "threads": shut.threads,
            "temp_entries": list(shut.temp_entries),
            "pool_processes_alive": len(_live(still_alive)),
        },
        "rss_growth_mb": round(after.rss_mb - baseline.rss_mb, 1),
    }
    with capsys.disabled():
        print("\nsparkdist-soak: " + json.dumps(report))

    # The pool persisted, unchanged: the same zygote, as many parked spares, no rank left.
    assert after.zygotes == baseline.zygotes
    assert after.children == baseline.children
    assert len(after.spares) == len(baseline.spares)
    assert not after.ranks
    # This process and the zygote hold what they held before the 100 runs.
    assert after.fds <= baseline.fds + FD_SLACK, report
    assert max(fds) <= baseline.fds + FD_SLACK, report
    assert after.threads <= baseline.threads + THREAD_SLACK, report
    assert after.native_threads <= baseline.native_threads + THREAD_SLACK, report
    assert after.zygote_fds <= baseline.zygote_fds + FD_SLACK, report
    assert after.zygote_threads <= baseline.zygote_threads, report
    # No run directory or other temp entry was left behind.
    assert after.temp_entries == baseline.temp_entries, report
    # Shutting the pool down leaves nothing: no child, no pool process, no pool directory.
    assert not shut.children and not _live(still_alive), report
    assert not [e for e in shut.temp_entries if e.startswith("sparkdist_pool-")], report
