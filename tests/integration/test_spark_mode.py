"""Spark mode on local[2]: one barrier stage, the same agent and worker as local mode."""

from __future__ import annotations

import os
import time

import pytest

from sparkdist import (
    ClusterError,
    Distributor,
    RunTimeoutError,
    TorchDistributor,
    WorkerFailedError,
)
from tests.conftest import run_processes

pytestmark = pytest.mark.spark


def all_reduce_rank_sum(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "total": total.item() * scale,
        "node": os.environ["GROUP_RANK"],
        "local": os.environ["LOCAL_RANK"],
    }


def test_barrier_stage_all_reduce_in_rank_order(spark_local):
    result = Distributor(2, local_mode=False, use_gpu=False).run_all(all_reduce_rank_sum, 10)
    assert result.values == [
        # local[2]: both tasks on this host, so one node (torchrun's numbering).
        {"rank": 0, "total": 30.0, "node": "0", "local": "0"},
        {"rank": 1, "total": 30.0, "node": "0", "local": "1"},
    ]
    assert result.num_tasks == 2 and not result.local_mode


def test_torch_distributor_spark_mode_output_streams_to_driver(spark_local, capfd):
    def hello():
        print("hello from", os.environ["RANK"])
        return int(os.environ["RANK"])

    assert TorchDistributor(2, local_mode=False, use_gpu=False).run(hello) == 0
    out, _ = capfd.readouterr()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


def test_failing_rank_raises_and_stops_the_other(spark_local):
    def fail_rank_one():
        import time

        if os.environ["RANK"] == "1":
            raise ValueError("bad batch")
        time.sleep(120)

    with pytest.raises(WorkerFailedError, match="ValueError: bad batch") as info:
        Distributor(2, local_mode=False, use_gpu=False, timeout_s=100).run(fail_rank_one)
    assert info.value.root_cause.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert not run_processes()


def test_timeout_cancels_the_stage(spark_local):
    def sleepy():
        import time

        time.sleep(120)

    with pytest.raises(RunTimeoutError):
        Distributor(2, local_mode=False, use_gpu=False, timeout_s=2).run(sleepy)
    # The session is still usable afterwards.
    assert Distributor(2, local_mode=False, use_gpu=False).run(lambda: "ok") == "ok"


def test_more_tasks_than_slots_fails_fast_naming_both_counts(spark_local):
    # local[2] has no executors to wait for: the count is final at once, whatever the timeout.
    started = time.monotonic()
    with pytest.raises(
        ClusterError,
        match="needs 3 task slots at once but master 'local.2.' "
        r"runs 2 task\(s\) at once .*local\[3\] or more",
    ):
        Distributor(3, local_mode=False, use_gpu=False, start_timeout_s=600).run(lambda: 1)
    assert time.monotonic() - started < 60
    assert not run_processes()


def world_sizes():
    from sparkdist import runtime

    return runtime.get_world_size(), runtime.requested_world_size()


def test_an_elastic_run_starts_with_the_slots_there_are_down_to_min_processes(spark_local):
    # local[2] runs 2 tasks at once: 3 ranks asked for, 2 allowed, 2 run.
    elastic = {"local_mode": False, "use_gpu": False, "grow_after_s": None}  # no checkpoint_dir
    result = Distributor(3, min_processes=2, **elastic).run_all(world_sizes)
    assert result.values == [(2, 3), (2, 3)]
    with pytest.raises(ClusterError, match="needs 3 task slots at once but master 'local.2.'"):
        Distributor(4, min_processes=3, **elastic).run(world_sizes)
    assert not run_processes()


def test_use_gpu_without_task_gpu_conf_names_the_conf_key(spark_local):
    # Distributor: a ConfigError (ValueError) at run(); TorchDistributor: pyspark's moment and
    # type, a RuntimeError (ClusterError) when the distributor is made.
    with pytest.raises(ValueError, match="spark.task.resource.gpu.amount is unset"):
        Distributor(2, local_mode=False, use_gpu=True).run(lambda: 1)
    with pytest.raises(ClusterError, match="spark.task.resource.gpu.amount is unset"):
        TorchDistributor(2, local_mode=False, use_gpu=True)


def test_gpu_type_is_checked_on_the_executors_before_any_rank_starts(spark_local):
    from sparkdist._core.launch.config import LaunchConfig
    from sparkdist._engine.start import launch
    from sparkdist.distributor import make_job

    config = LaunchConfig(num_processes=2, local_mode=False, gpu_type="h100")
    with pytest.raises(ClusterError, match="gpu_type='H100' was requested but no NVIDIA GPU"):
        launch(config, make_job(lambda: 1, (), {}))
    assert not run_processes()
