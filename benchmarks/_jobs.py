"""The work every launcher runs in ``launch.py``: a trivial 2-rank gloo job, and a failing one.

The same functions run under sparkdist, pyspark's TorchDistributor and plain torchrun (this file
is also the torchrun script: ``torchrun ... _jobs.py all_reduce`` or ``... _jobs.py fail DIR``),
so every launcher pays for exactly the same body.

Non-goals: any timing (the driver side times), any launcher logic.
"""

from __future__ import annotations

import os
import sys
import time

#: The rank that raises in ``fail_one_rank`` (not rank 0, which hosts the store under torchrun).
FAILING_RANK = 1
#: Text of the exception the failing rank raises; the driver looks for it in the error it gets.
FAILURE_MARKER = "sparkdist-benchmark: this rank fails on purpose"


def all_reduce_rank() -> int:
    """Join a gloo process group, all_reduce a 1-element tensor, and return this rank."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def fail_one_rank(stamp_path: str) -> None:
    """Join a gloo group; ``FAILING_RANK`` raises, every other rank blocks in an all_reduce.

    Just before raising, the failing rank writes ``time.time()`` to ``stamp_path`` (written
    whole, then renamed, so a reader never sees half a number). The other ranks wait for a
    collective the failed rank never joins: only the launcher can end them in good time.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == FAILING_RANK:
        write_stamp(stamp_path, time.time())
        raise RuntimeError(FAILURE_MARKER)
    dist.all_reduce(torch.ones(1))


def write_stamp(path: str, seconds: float) -> None:
    """Write a wall-clock time to ``path`` atomically."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as out:
        out.write(repr(seconds))
    os.replace(partial, path)


def read_stamp(path: str) -> float | None:
    """The time written by ``write_stamp``, or None when the rank never wrote it."""
    try:
        with open(path, encoding="utf-8") as stamp:
            return float(stamp.read())
    except FileNotFoundError:
        return None


def main(argv: list[str]) -> None:
    """The torchrun entry point: ``_jobs.py all_reduce`` or ``_jobs.py fail STAMP_PATH``."""
    if argv[:1] == ["all_reduce"]:
        all_reduce_rank()
    elif argv[:1] == ["fail"] and len(argv) == 2:
        fail_one_rank(argv[1])
    else:
        sys.exit("usage: _jobs.py all_reduce | _jobs.py fail STAMP_PATH")


if __name__ == "__main__":
    main(sys.argv[1:])
