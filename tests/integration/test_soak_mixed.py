"""Soak (issue 19): 200 mixed runs in one driver return it to its baseline.

Successes, failures, timeouts and concurrent pairs, interleaved, all in local mode with the warm
pool. Afterwards this process's descriptors and threads, its children (the zygote only), the
zygote's descriptors, and the temp directory's entries are back where they were after warm-up,
and no rank is alive. Runs in the default test command (about a minute on 2 cores).
"""

from __future__ import annotations

import collections
import json
import threading
import time

import pytest

from sparkdist import Distributor, RunTimeoutError, WorkerFailedError
from sparkdist._node.pool import pool as _pool
from tests.integration.test_soak import FD_SLACK, THREAD_SLACK, snapshot

pytestmark = pytest.mark.timeout(900)

CYCLES = 20
#: One cycle: what each of its runs is (a pair counts as two runs).
CYCLE = ("ok", "ok", "fails", "ok", "pair", "ok", "times out", "fails", "ok")
RUNS = CYCLES * (len(CYCLE) + CYCLE.count("pair"))


def succeeds(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return int(total.item()) * scale


def fails():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("planted")
    dist.barrier()


def sleeps():
    import time

    time.sleep(60)


def _one(kind: str, distributor: Distributor, quick_timeout: Distributor) -> None:
    if kind == "ok":
        assert distributor.run_all(succeeds, 2).values == [2, 2]
    elif kind == "fails":
        with pytest.raises(WorkerFailedError, match="planted"):
            distributor.run(fails)
    elif kind == "times out":
        with pytest.raises(RunTimeoutError):
            quick_timeout.run(sleeps)
    else:
        values: dict[int, list[int]] = {}

        def run(scale: int) -> None:
            values[scale] = distributor.run_all(succeeds, scale).values

        pair = [threading.Thread(target=run, args=(scale,)) for scale in (3, 5)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join(timeout=120)
        assert values == {3: [3, 3], 5: [5, 5]}


def test_two_hundred_mixed_runs_return_to_baseline():
    _pool.shutdown()  # earlier tests' zygotes (other environments) are not this soak's
    distributor = Distributor(2, use_gpu=False, mlflow=False)
    quick_timeout = Distributor(2, use_gpu=False, mlflow=False, timeout_s=0.25)
    for kind in ("ok", "pair", "fails"):  # warm-up: the zygote and its spares exist
        _one(kind, distributor, quick_timeout)
    baseline = snapshot()
    pool = {  # what the pool knows of each zygote, should one be left over from earlier tests
        z.process.pid: {"leases": z.leases, "retired": z.retired}
        for z in [*_pool._zygotes.values(), *_pool._retired]
        if z.process is not None
    }
    assert len(baseline.zygotes) == 1 and not baseline.ranks, (baseline, pool)

    seconds: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(CYCLES):
        for kind in CYCLE:
            started = time.perf_counter()
            _one(kind, distributor, quick_timeout)
            seconds[kind].append(time.perf_counter() - started)
    deadline = time.monotonic() + 10  # the last run's ranks are reaped by its threads
    after = snapshot()
    while (after.ranks or after.children != baseline.children) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = snapshot()

    report = {
        "runs": RUNS,
        "median_s": {k: round(sorted(v)[len(v) // 2], 3) for k, v in seconds.items()},
        "fds": [baseline.fds, after.fds],
        "threads": [baseline.threads, after.threads],
        "zygote_fds": [baseline.zygote_fds, after.zygote_fds],
        "rss_mb": [round(baseline.rss_mb), round(after.rss_mb)],
    }
    print("sparkdist-soak-mixed: " + json.dumps(report))  # shown with -s
    assert not after.ranks, f"ranks alive after the soak: {after.ranks}"
    assert after.children == baseline.children, "this process's children changed"
    assert after.zygotes == baseline.zygotes, "the zygote was replaced"
    assert after.fds <= baseline.fds + FD_SLACK, report
    assert after.threads <= baseline.threads + THREAD_SLACK, report
    assert after.zygote_fds <= baseline.zygote_fds + FD_SLACK, report
    assert set(after.temp_entries) <= set(baseline.temp_entries), set(after.temp_entries) - set(
        baseline.temp_entries
    )
