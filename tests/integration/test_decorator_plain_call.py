"""A plain call of a @distributed function: this process, rank 0 of a world of one, real gloo.

The docs show ``train(1e-3)`` on a function that calls ``init_process_group()``; these tests
hold that promise: the call works, leaves the environment as it found it, and closes the
process group it opened so the next call can open one again.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from sparkdist import distributed, runtime

WORLD_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@distributed(gpus=2, use_gpu=False)
def all_reduce_one(value):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group()  # env://, as under torchrun
    tensor = torch.tensor([float(value)])
    dist.all_reduce(tensor)
    return {
        "sum": tensor.item(),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "runtime": (
            runtime.get_global_rank(),
            runtime.get_world_size(),
            runtime.get_local_rank(),
            runtime.is_main_process(),
        ),
        "port": os.environ["MASTER_PORT"],
    }


@distributed(gpus=2, use_gpu=False)
def open_group_then_raise():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    raise ValueError("bad batch")


@pytest.fixture
def outside_any_world(monkeypatch):
    for name in WORLD_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29555")  # a user's own setting: must come back as it was


def world_vars():
    import os

    return {name: os.environ.get(name) for name in WORLD_VARS}


def group_open():
    import torch.distributed as dist

    return dist.is_initialized()


def test_plain_call_runs_a_process_group_of_one_and_puts_everything_back(outside_any_world):
    before = world_vars()

    first = all_reduce_one(3)
    second = all_reduce_one(4)  # only possible because the first call's group was closed

    assert first == {
        "sum": 3.0,
        "rank": 0,
        "world_size": 1,
        "runtime": (0, 1, 0, True),
        "port": "0",
    }
    assert second["sum"] == 4.0
    assert world_vars() == before
    assert not group_open()


def test_a_failing_plain_call_raises_its_error_and_still_cleans_up(outside_any_world):
    before = world_vars()

    with pytest.raises(ValueError, match="bad batch"):
        open_group_then_raise()

    assert world_vars() == before
    assert not group_open()


def test_inside_an_existing_world_the_call_leaves_the_environment_alone(monkeypatch):
    @distributed(gpus=2)
    def where():
        import os

        return os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ.get("MASTER_PORT")

    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_PORT", "29501")

    assert where() == ("5", "8", "29501")


def test_concurrent_plain_calls_share_the_world_and_the_last_one_restores_it(outside_any_world):
    inside = threading.Barrier(3, timeout=30)
    seen = []

    @distributed(gpus=2)
    def wait_for_the_others():
        import os

        inside.wait()  # both calls are in flight here
        seen.append(os.environ["RANK"])
        inside.wait()

    before = world_vars()
    threads = [threading.Thread(target=wait_for_the_others) for _ in range(2)]
    for thread in threads:
        thread.start()
    inside.wait()
    assert world_vars()["WORLD_SIZE"] == "1"
    inside.wait()
    for thread in threads:
        thread.join(timeout=30)

    assert seen == ["0", "0"]
    assert world_vars() == before


def test_a_plain_call_that_needs_no_torch_does_not_import_it(tmp_path):
    code = textwrap.dedent("""
        import sys
        from sparkdist import distributed

        @distributed(gpus=2)
        def add(a, b):
            return a + b

        print(add(2, 3), "torch" in sys.modules)
    """)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5", "False"]
