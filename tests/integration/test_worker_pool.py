"""The warm worker pool: ranks forked from a zygote that imported torch, with nothing of one
run leaking into the next."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from sparkdist import Distributor
from sparkdist._node import pool as _pool


def rank_view():
    import torch  # already imported in a pooled rank: cheap

    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "leak": os.environ.get("SPARKDIST_TEST_LEAK"),
        "extra": os.environ.get("EXTRA_FLAG"),
        "user_module": "sparkdist_user_helper" in sys.modules,
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_threads": torch.get_num_threads(),
        "name": psutil.Process().name(),
    }


def pollute(helper_dir):
    """Change everything a later run could inherit by mistake."""
    sys.path.insert(0, helper_dir)
    import sparkdist_user_helper  # noqa: F401

    os.environ["SPARKDIST_TEST_LEAK"] = "1"
    os.chdir("/")
    return rank_view()


def test_nothing_leaks_from_one_pooled_run_into_the_next(tmp_path):
    (tmp_path / "sparkdist_user_helper.py").write_text("VALUE = 1\n")
    first = Distributor(2, use_gpu=False, env={"EXTRA_FLAG": "on"}).run_all(
        pollute, str(tmp_path))
    second = Distributor(2, use_gpu=False).run_all(rank_view)
    assert [v["user_module"] for v in first.values] == [True, True]
    assert [v["extra"] for v in first.values] == ["on", "on"]
    for view in second.values:
        assert view["leak"] is None and view["extra"] is None
        assert view["user_module"] is False
        assert view["cwd"] == os.getcwd()
        assert view["cuda"] == ""
        assert view["torch_threads"] == 1  # OMP_NUM_THREADS=1 applies to a forked rank too
    # Fresh processes every run, forked from the same warm zygote.
    assert {v["pid"] for v in first.values}.isdisjoint({v["pid"] for v in second.values})
    zygotes = {v["ppid"] for v in first.values + second.values}
    assert len(zygotes) == 1 and zygotes != {os.getpid()}
    assert {v["name"] for v in second.values} == {"sparkdist-r0", "sparkdist-r1"}


def test_a_changed_environment_gets_a_new_zygote(monkeypatch, tmp_path):
    before = Distributor(1, use_gpu=False).run(rank_view)["ppid"]
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    after = Distributor(1, use_gpu=False).run(rank_view)["ppid"]
    assert before != after
    assert not psutil.pid_exists(before) or psutil.Process(before).status() == "zombie"


def test_pool_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(_pool.POOL_VAR, "0")
    view = Distributor(1, use_gpu=False).run(rank_view)
    assert view["ppid"] == os.getpid()  # spawned directly by this driver
    assert view["name"] != "sparkdist-r0"


@pytest.fixture(autouse=True)
def _fresh_pool_afterwards():
    yield
    _pool.shutdown()
