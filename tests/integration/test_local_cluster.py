"""local-cluster[2,1,1024]: separate executor JVMs, each advertising 2 fake GPUs.

(Named to run last: it replaces the local[2] session, and one session per master is started.)
"""

from __future__ import annotations

import os
import time

import pytest

from sparkdist import ClusterError, Distributor, TorchDistributor, WorkerFailedError
from tests.conftest import run_processes

pytestmark = [pytest.mark.spark, pytest.mark.cluster]


def placement_seen():
    import socket

    return {
        k: os.environ[k]
        for k in (
            "RANK",
            "LOCAL_RANK",
            "NODE_RANK",
            "LOCAL_WORLD_SIZE",
            "WORLD_SIZE",
            "CUDA_VISIBLE_DEVICES",
            "MASTER_ADDR",
            "SPARKDIST_USE_GPU",
            "SPARKDIST_GPU",
        )
    } | {"pid_host": socket.gethostname()}


def all_reduce():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return t.item()


def test_cpu_ranks_on_separate_executors(spark_cluster):
    result = Distributor(2, local_mode=False, use_gpu=False).run_all(all_reduce)
    assert result.values == [2.0, 2.0] and result.num_tasks == 2


def test_too_few_slots_once_every_executor_registered_fails_at_once(spark_cluster):
    # Both executors are there and offer 2 slots: waiting the whole start_timeout_s for a
    # third would be pointless, so the error comes at once with the counts and the settings.
    started = time.monotonic()
    with pytest.raises(ClusterError) as info:
        Distributor(3, local_mode=False, use_gpu=False, start_timeout_s=600).run(lambda: 1)
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert (
        "needs 3 task slots at once but the cluster offers 2: 2 of 2 executors registered"
        in message
    )
    assert "master 'local-cluster[2,1,1024]'" in message
    assert "spark.executor.resource.gpu.amount=2, spark.task.resource.gpu.amount=1" in message
    assert not run_processes()


def test_fake_gpus_become_cuda_visible_devices_and_local_rank(spark_cluster):
    # spark.task.resource.gpu.amount=1: one rank per task, each with its own GPU address.
    result = TorchDistributor(2, local_mode=False, use_gpu=True).run_all(placement_seen)
    seen = result.values
    assert [s["RANK"] for s in seen] == ["0", "1"]
    # Both executors run on this host: one node, numbered as torchrun numbers one machine.
    assert [s["NODE_RANK"] for s in seen] == ["0", "0"]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert {s["LOCAL_WORLD_SIZE"] for s in seen} == {"2"}
    assert {s["SPARKDIST_USE_GPU"] for s in seen} == {"1"}
    # Each executor owns fake GPUs "0" and "1" (its own: the two name the same ones, as
    # containers do) and hands one to its single task: each rank keeps its task's GPU.
    assert all(s["CUDA_VISIBLE_DEVICES"] in ("0", "1") for s in seen)
    assert all(s["SPARKDIST_GPU"] == s["CUDA_VISIBLE_DEVICES"] for s in seen)


def test_failure_on_an_executor_is_reported_with_rank(spark_cluster):
    def fail():
        if os.environ["RANK"] == "0":
            raise RuntimeError("executor-side failure")
        import time

        time.sleep(120)

    with pytest.raises(WorkerFailedError, match="executor-side failure") as info:
        Distributor(2, local_mode=False, use_gpu=False, timeout_s=100).run(fail)
    assert info.value.root_cause.rank == 0
    assert not run_processes()


def test_killed_executor_jvm_fails_the_run_and_leaves_nothing(spark_cluster):
    """Runs last in this file: the killed executor is replaced by the cluster afterwards."""
    import time

    import psutil

    from sparkdist._core.launch.config import LaunchConfig
    from sparkdist._engine.launch import Launch
    from sparkdist.distributor import make_job
    from tests.conftest import SESSION_MARKER

    def sleepy():
        import time

        time.sleep(120)

    run = Launch(
        LaunchConfig(num_processes=2, local_mode=False, use_gpu=False, timeout_s=100),
        make_job(sleepy, (), {}),
        session=spark_cluster,
    )
    deadline = time.monotonic() + 60
    while len(run._attempt.monitor.state.joined) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    executors = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend"
        in " ".join(p.info["cmdline"] or [])
        and p.environ().get(SESSION_MARKER) == os.environ[SESSION_MARKER]
    ]
    assert executors, "no executor JVM of this session found"
    started = time.monotonic()
    executors[0].kill()
    with pytest.raises(WorkerFailedError) as info:
        run.result(timeout=90)
    assert info.value.root_cause.rank in (0, 1)
    assert time.monotonic() - started < 60
