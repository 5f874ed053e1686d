"""A DeepSpeed run on a fresh or damaged node: nothing compiled, a dead build's lock cleared.

The ranks run with their own empty ``TORCH_EXTENSIONS_DIR``: DeepSpeed's CPU accelerator would
JIT-build its shared-memory comm op there (a minute or more on 2 cores) in
``deepspeed.init_distributed``; sparkdist's rank bootstrap keeps that build out of the run, and
removes the lock a killed build left behind (which would make every build wait forever).
"""

from __future__ import annotations

import os
import time

import pytest

from sparkdist import Distributor
from sparkdist._node.rank.torch_extensions import LOCK_NAME
from tests.conftest import run_processes

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed


def init_and_all_reduce():
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"shm_op": ds_comm.cdb.shm_comm_op is not None, "total": total.item()}


def test_deepspeed_ranks_compile_nothing_and_clear_a_dead_builds_lock(tmp_path, capfd):
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "fused_adam" / LOCK_NAME  # what a build killed by a timeout leaves
    lock.parent.mkdir(parents=True)
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))

    values = (
        Distributor(
            2,
            use_gpu=False,
            mode="deepspeed",
            start_timeout_s=240,
            env={"TORCH_EXTENSIONS_DIR": str(extensions)},
        )
        .run_all(init_and_all_reduce)
        .values
    )

    assert values == [{"shm_op": False, "total": 2.0}] * 2  # gloo did the all_reduce
    assert not lock.exists()
    err = capfd.readouterr().err
    assert f"sparkdist: removed {lock}" in err and "no process holds" in err
    # Nothing was built: the only folder is the dead build's, now without its lock.
    assert [p.name for p in extensions.iterdir()] == ["fused_adam"]
    assert not any((extensions / "fused_adam").iterdir())
    assert not run_processes()
