"""@distributed end to end: real ranks, real gloo, in local mode (remote=True is in
test_spark_mode_decorator.py, which runs while the shared local[2] session is up).

Functions that need no torch avoid importing it: each launch then costs little more than the
ranks' interpreter start-up.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time

import cloudpickle
import pytest

from sparkdist import (
    ClusterError,
    Distributor,
    GPUType,
    RunTimeoutError,
    WorkerFailedError,
    distributed,
    runtime,
)
from tests.conftest import REPO, run_processes

CPU_WARNING = "CPU process(es) with gloo"


def where_am_i(tag):
    print(f"rank {runtime.get_global_rank()} says {tag}")
    return {
        "tag": tag,
        "rank": runtime.get_global_rank(),
        "local_rank": runtime.get_local_rank(),
        "world_size": runtime.get_world_size(),
        "local_world_size": runtime.get_local_world_size(),
        "node_rank": runtime.get_node_rank(),
        "main": runtime.is_main_process(),
    }


@distributed(gpus=2)
def ddp_weights(steps):
    """A few deterministic DDP steps; every rank returns the weights it ends with."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(runtime.get_global_rank())
    x = torch.randn(16, 4, generator=data)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return [round(w, 6) for w in model.module.weight.flatten().tolist()]


def cpu_warnings(caplog):
    return [r for r in caplog.records if r.name == "sparkdist" and CPU_WARNING in r.message]


@pytest.mark.parametrize("gpus", [2, 3])
def test_results_are_ordered_by_rank_and_runtime_helpers_answer_inside(gpus, caplog, capfd):
    caplog.set_level(logging.WARNING, logger="sparkdist")
    values = distributed(gpus=gpus)(where_am_i).distributed("x")
    assert values == [
        {
            "tag": "x",
            "rank": r,
            "local_rank": r,
            "world_size": gpus,
            "local_world_size": gpus,
            "node_rank": 0,
            "main": r == 0,
        }
        for r in range(gpus)
    ]
    # No GPU here and no gpu_type: CPU with gloo, and exactly one line says so.
    [warning] = cpu_warnings(caplog)
    assert f"where_am_i runs on {gpus} CPU process(es) with gloo" in warning.message
    assert "pass use_gpu=False" in warning.message and "\n" not in warning.message
    out, _ = capfd.readouterr()
    for rank in range(gpus):
        assert f"[rank {rank}] rank {rank} says x\n" in out


def test_runtime_helpers_outside_a_rank_describe_a_world_of_one(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert where_am_i("out") == {
        "tag": "out",
        "rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "local_world_size": 1,
        "node_rank": 0,
        "main": True,
    }


def test_same_function_through_distributor_and_decorator_gives_identical_results(caplog):
    caplog.set_level(logging.WARNING, logger="sparkdist")
    through_decorator = ddp_weights.distributed(3)
    # The decorated object is still a plain callable, so Distributor runs it as is.
    through_distributor = Distributor(2, use_gpu=False).run_all(ddp_weights, 3).values
    assert through_decorator == through_distributor
    assert len(through_decorator) == 2 and through_decorator[0] == through_decorator[1]
    assert len(cpu_warnings(caplog)) == 1  # the decorator's launch only


def test_failures_are_the_same_worker_failed_error_and_nothing_survives():
    def fail_on_rank_one():
        if runtime.get_global_rank() == 1:
            raise ValueError("bad batch on rank one")
        time.sleep(120)  # must be stopped, not waited for

    with pytest.raises(WorkerFailedError, match="ValueError: bad batch on rank one") as info:
        distributed(gpus=2, use_gpu=False, timeout_s=100)(fail_on_rank_one).distributed()
    assert info.value.root_cause.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert not run_processes()


# -- gpu_type ----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="needs a machine without GPUs")
@pytest.mark.parametrize("gpu_type", ["H100", "h100", GPUType.H100])
def test_gpu_type_on_a_cpu_machine_fails_before_launch_naming_both(gpu_type, caplog):
    fn = distributed(gpus=2, gpu_type=gpu_type)(where_am_i)
    with pytest.raises(
        ClusterError,
        match="gpu_type='H100' was requested but no NVIDIA GPU is visible on the driver",
    ):
        fn.distributed("never")
    assert not run_processes()
    assert not cpu_warnings(caplog)


@pytest.fixture
def fake_a10g(tmp_path, monkeypatch):
    """An nvidia-smi that lists one A10G: the driver's GPU discovery reads it like the real one.

    No GPU is used: ranks that do not touch CUDA run on CPU. This is the one way to see a
    mismatch between two real model names on a machine without GPUs.
    """
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho '0, NVIDIA A10G'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_gpu_type_mismatch_names_the_requested_and_the_found_model(fake_a10g):
    fn = distributed(gpus=1, gpu_type=GPUType.H100)(where_am_i)
    with pytest.raises(
        ClusterError, match="gpu_type='H100' was requested but the driver has NVIDIA A10G"
    ):
        fn.distributed("never")
    assert not run_processes()


def test_gpu_type_match_is_case_insensitive_and_the_run_gets_the_gpu(fake_a10g, caplog):
    caplog.set_level(logging.WARNING, logger="sparkdist")

    def visible_devices():
        return os.environ["CUDA_VISIBLE_DEVICES"]

    assert distributed(gpus=1, gpu_type="a10")(visible_devices).distributed() == ["0"]
    assert not cpu_warnings(caplog)


# -- the non-blocking handle -------------------------------------------------------------


def test_distributed_async_runs_a_sweep_concurrently():
    fn = distributed(gpus=2, use_gpu=False)(where_am_i)
    runs = [fn.distributed_async(tag) for tag in ("a", "b")]
    assert runs[0].run_id != runs[1].run_id
    results = [run.result(timeout=120) for run in runs]
    assert [[v["tag"] for v in values] for values in results] == [["a", "a"], ["b", "b"]]
    assert [[v["rank"] for v in values] for values in results] == [[0, 1], [0, 1]]
    assert all(run.done() for run in runs)
    assert runs[0].cancel() is False  # already over


def sleep_after_marking(marker_dir):
    with open(os.path.join(marker_dir, str(runtime.get_global_rank())), "w"):
        pass
    time.sleep(120)


def test_handle_times_out_without_stopping_then_cancel_leaves_no_process(tmp_path):
    run = distributed(gpus=2, use_gpu=False)(sleep_after_marking).distributed_async(str(tmp_path))
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the ranks' handshake files, with a deadline
    assert sorted(os.listdir(tmp_path)) == ["0", "1"], "ranks did not start"

    with pytest.raises(TimeoutError) as info:
        run.result(timeout=0.2)
    assert not isinstance(info.value, RunTimeoutError)  # the wait timed out, not the run
    assert not run.done() and len(run_processes()) == 2

    assert run.cancel() is True
    assert run.done()
    assert not run_processes()
    with pytest.raises(concurrent.futures.CancelledError):
        run.result()
    assert run.cancel() is False


# -- pickling through a fresh interpreter ------------------------------------------------


def _fresh_python(code, data, cwd, **env_vars):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_vars)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        input=data,
        capture_output=True,
        cwd=cwd,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


def test_local_function_round_trips_by_value_and_still_launches(tmp_path):
    @distributed(gpus=2, gpu_type=None, use_gpu=False, timeout_s=60)
    def shipped(x):
        """Shipped by value."""
        import os

        return (int(os.environ.get("RANK", "-1")), x)

    data = cloudpickle.dumps(shipped)
    # tmp_path as the working directory: this test module cannot be imported there.
    out = _fresh_python(
        """
        import sys, cloudpickle
        fn = cloudpickle.loads(sys.stdin.buffer.read())
        assert "tests" not in sys.modules
        print(fn.__name__, fn.__doc__, fn.gpus, fn.gpu_type, fn.remote, fn.config.timeout_s)
        print("plain", fn(7))
        print("distributed", fn.distributed(8))
    """,
        data,
        tmp_path,
    )
    assert "shipped Shipped by value. 2 None False 60" in out
    assert "plain (0, 7)" in out  # a plain call: rank 0 of a world of one
    assert "distributed [(0, 8), (1, 8)]" in out


def test_module_level_function_round_trips_by_name_with_plain_pickle(tmp_path):
    data = pickle.dumps(ddp_weights)
    assert pickle.loads(data) is ddp_weights
    out = _fresh_python(
        """
        import sys, pickle
        fn = pickle.loads(sys.stdin.buffer.read())
        print(type(fn).__name__, fn.__module__, fn.__qualname__, fn.gpus)
        print(fn.__doc__)
    """,
        data,
        REPO,
        TMPDIR=str(tmp_path),
    )  # importing tests.conftest makes a temp dir
    assert "DistributedFunction tests.integration.test_decorator ddp_weights 2" in out
    assert "A few deterministic DDP steps" in out
