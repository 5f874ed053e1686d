"""The faults ``faults.py`` injects, one per name, for sparkdist and for torchrun alike.

Two ranks join a gloo group. Rank ``FAILING_RANK`` writes ``time.time()`` to a stamp file
(written whole, then renamed) at the moment of the fault, then faults; the other rank waits in
an ``all_reduce`` the failed rank never joins, so only the launcher can end the run:

- ``raise``: ``raise RuntimeError(FAILURE_MARKER)``;
- ``exit3``: ``os._exit(3)``;
- ``sigkill``: ``os.kill(os.getpid(), SIGKILL)``;
- ``segfault``: ``ctypes.string_at(0)``;
- ``hang``: both ranks call ``sparkdist.runtime.report(step)`` and all_reduce every 50 ms; at
  step ``HANG_STEP`` the failing rank stops reporting and sleeps. Its stamp is the time of its
  last report (the start of its silence), so the error comes ``heartbeat_timeout_s`` later at
  the earliest. (Needs sparkdist's heartbeat: not run under torchrun.)

Under torchrun: ``python _fault_jobs.py FAULT STAMP_PATH``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from _jobs import write_stamp

FAILING_RANK = 1
FAILURE_MARKER = "sparkdist-benchmark: this rank fails on purpose"
HANG_STEP = 3
FAULTS = ("raise", "exit3", "sigkill", "segfault", "hang")


def inject(fault: str, stamp_path: str) -> None:
    """Join a 2-rank gloo group and let ``FAILING_RANK`` fault as ``fault`` says."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if fault == "hang":
        _hang(rank, stamp_path)
    if rank == FAILING_RANK:
        write_stamp(stamp_path, time.time())
        if fault == "raise":
            raise RuntimeError(FAILURE_MARKER)
        if fault == "exit3":
            os._exit(3)
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "segfault":
            import ctypes

            ctypes.string_at(0)
        raise ValueError(f"unknown fault {fault!r}")
    dist.all_reduce(torch.ones(1))  # waits for the failed rank: only the launcher ends this


def _hang(rank: int, stamp_path: str) -> None:
    import torch
    import torch.distributed as dist

    from sparkdist import runtime

    last_report = time.time()
    for step in range(1_000_000):
        if step == HANG_STEP and rank == FAILING_RANK:
            write_stamp(stamp_path, last_report)
            time.sleep(3600)  # the hang: no report, no heartbeat
        runtime.report(step=step)
        last_report = time.time()
        dist.all_reduce(torch.ones(1))  # the other rank ends up waiting here
        time.sleep(0.05)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in FAULTS:
        sys.exit(f"usage: _fault_jobs.py {'|'.join(FAULTS)} STAMP_PATH")
    inject(sys.argv[1], sys.argv[2])
