"""The warm worker pool: ranks forked from a zygote that imported torch, with nothing of one
run leaking into the next."""

from __future__ import annotations

import glob
import os
import signal
import sys
import tempfile
import time

import psutil
import pytest

from sparkdist import Distributor, RendezvousError
from sparkdist._node.pool import pool as _pool


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
    first = Distributor(2, use_gpu=False, env={"EXTRA_FLAG": "on"}).run_all(pollute, str(tmp_path))
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


def imports_at_entry():
    return {
        "ppid": os.getppid(),
        "dcp": "torch.distributed.checkpoint" in sys.modules,
        "dynamo": "torch._dynamo" in sys.modules,  # what DistributedDataParallel imports first
    }


def test_a_checkpointing_runs_ranks_start_with_what_a_restarted_rank_imports(tmp_path):
    # A run with checkpoint_dir may restart: its zygote imported the checkpoint load's and
    # DDP's modules before it was ready (~1 s once), so no rank of any attempt pays them.
    plain = Distributor(2, use_gpu=False).run_all(imports_at_entry)
    checkpointing = Distributor(2, use_gpu=False, checkpoint_dir=str(tmp_path / "ckpt"))
    first, again = checkpointing.run_all(imports_at_entry), checkpointing.run_all(imports_at_entry)
    assert not any(v["dcp"] or v["dynamo"] for v in plain.values), plain.values
    assert all(v["dcp"] and v["dynamo"] for v in first.values + again.values), first.values
    zygotes = {v["ppid"] for v in first.values + again.values}  # one zygote, kept
    assert len(zygotes) == 1 and zygotes.isdisjoint({v["ppid"] for v in plain.values})
    assert zygotes != {os.getpid()}


def _zygote_of(tmp_path, name):
    """The zygote a run whose import-time environment is ``name`` forks from."""
    library_dir = tmp_path / name
    library_dir.mkdir(exist_ok=True)
    env = {"LD_LIBRARY_PATH": str(library_dir)}  # shapes imports: a zygote of its own
    return Distributor(1, use_gpu=False, env=env).run(rank_view)["ppid"]


def test_zygotes_are_kept_per_import_environment_and_bounded(tmp_path):
    """A run with another import-time environment gets a zygote of its own and leaves the
    others alone; at most MAX_ZYGOTES are kept, the least recently used idle one makes room."""
    assert _pool.MAX_ZYGOTES == 3
    first = _zygote_of(tmp_path, "a")
    second = _zygote_of(tmp_path, "b")
    assert second != first and psutil.pid_exists(first)  # both kept
    assert _zygote_of(tmp_path, "a") == first  # found again, not restarted
    third = _zygote_of(tmp_path, "c")
    assert _pool.zygote_count() == 3
    fourth = _zygote_of(tmp_path, "d")  # the pool is full: "b" was used least recently
    assert len({first, second, third, fourth}) == 4
    assert _pool.zygote_count() == 3
    assert not psutil.pid_exists(second) or psutil.Process(second).status() == "zombie"
    assert all(psutil.pid_exists(pid) for pid in (first, third, fourth))


def test_pool_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(_pool.POOL_VAR, "0")
    view = Distributor(1, use_gpu=False).run(rank_view)
    assert view["ppid"] == os.getpid()  # spawned directly by this driver
    assert view["name"] != "sparkdist-r0"


@pytest.fixture(autouse=True)
def _fresh_pool_afterwards():
    yield
    _pool.shutdown()


def _stopped_zygote():
    """Warm the pool, then freeze its zygote (SIGSTOP): it accepts requests, answers none."""
    Distributor(1, use_gpu=False).run(int)
    (zygote,) = list(_pool._zygotes.values())
    assert zygote.process is not None
    os.kill(zygote.process.pid, signal.SIGSTOP)
    return zygote.process.pid


@pytest.fixture
def short_fork_answer(monkeypatch):
    """A frozen zygote is given up sooner than in production (a healthy one answers in ms)."""
    from sparkdist._node.pool import zygote_client

    monkeypatch.setattr(zygote_client, "FORK_ANSWER_TIMEOUT_S", 2.5)


def test_a_stuck_zygote_fails_only_the_start_it_delays(tmp_path, short_fork_answer):
    """A frozen zygote: the rank that asked it starts cold after FORK_ANSWER_TIMEOUT_S, the
    zygote is retired (and ended: no rank of it is left), and the run succeeds."""
    frozen = _stopped_zygote()
    started = time.monotonic()
    values = Distributor(2, use_gpu=False, start_timeout_s=120).run_all(rank_view).values
    took = time.monotonic() - started
    assert [v["ppid"] != frozen for v in values] == [True, True]
    assert not psutil.pid_exists(frozen) or psutil.Process(frozen).status() == "zombie"
    assert took < _pool.FORK_ANSWER_TIMEOUT_S + 60
    # The pool recovers: the next run forks from a fresh zygote.
    again = Distributor(1, use_gpu=False).run(rank_view)
    assert again["name"] == "sparkdist-r0" and again["ppid"] != frozen


def test_a_stuck_zygote_and_a_short_start_timeout_name_the_stage(tmp_path):
    """start_timeout_s counts from submission: a start stuck in the warm pool ends the run in
    time (the agent's stop wakes the wait for the zygote's answer: the run does not wait out
    FORK_ANSWER_TIMEOUT_S), with an error naming the stage, and leaves no process (checked
    after every test)."""
    frozen = _stopped_zygote()
    started = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        Distributor(2, use_gpu=False, start_timeout_s=2).run(rank_view)
    took = time.monotonic() - started
    print(f"stuck zygote, start_timeout_s=2: raised after {took:.2f} s: {caught.value}")
    assert "start_timeout_s=2" in str(caught.value)
    assert "warm pool" in str(caught.value)
    assert took < 2 + 0.5 < _pool.FORK_ANSWER_TIMEOUT_S
    # The stuck zygote was given up (and ended), and the next run forks from a fresh one.
    assert not psutil.pid_exists(frozen) or psutil.Process(frozen).status() == "zombie"
    again = Distributor(1, use_gpu=False).run(rank_view)
    assert again["name"] == "sparkdist-r0" and again["ppid"] != frozen


def test_a_zygote_stuck_in_its_start_and_a_short_start_timeout_end_the_run_in_time(tmp_path):
    """A zygote that never gets through its imports (a sitecustomize that sleeps in zygotes
    only) ends the run by start_timeout_s: the agent's stop wakes the wait for its "ready"
    instead of the run waiting out ZYGOTE_START_TIMEOUT_S; the stuck zygote is ended."""
    from sparkdist._node.pool import zygote_client

    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('SPARKDIST_ZYGOTE') == '1':\n    time.sleep(300)\n"
    )
    Distributor(1, use_gpu=False).run(rank_view)  # a process's first run pays its imports
    started = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        Distributor(1, use_gpu=False, start_timeout_s=2, env={"PYTHONPATH": str(tmp_path)}).run(
            rank_view
        )
    took = time.monotonic() - started
    print(f"zygote stuck starting, start_timeout_s=2: raised after {took:.2f} s: {caught.value}")
    assert "start_timeout_s=2" in str(caught.value)
    assert took < 2 + 0.5 < zygote_client.ZYGOTE_START_TIMEOUT_S
    stuck = [
        p
        for p in psutil.process_iter(["cmdline", "environ"])
        if "sparkdist._node.pool.zygote" in " ".join(p.info["cmdline"] or [])
        and (p.info["environ"] or {}).get("PYTHONPATH") == str(tmp_path)
    ]
    assert stuck == [] or all(p.status() == "zombie" for p in stuck)


def test_a_failed_pool_start_leaves_no_directory_and_runs_cold(monkeypatch):
    """The zygote does not come up in time: the run starts its ranks cold, and the pool's
    directory of that attempt is gone."""
    from sparkdist._node.pool import zygote_client

    def pool_dirs():
        return set(glob.glob(os.path.join(tempfile.gettempdir(), "sparkdist_pool-*")))

    before = pool_dirs()
    monkeypatch.setattr(zygote_client, "ZYGOTE_START_TIMEOUT_S", 0.001)
    view = Distributor(1, use_gpu=False).run(rank_view)
    assert view["ppid"] == os.getpid() and view["name"] != "sparkdist-r0"  # cold
    assert _pool.zygote_count() == 0
    assert pool_dirs() <= before


def test_a_temp_dir_too_long_for_a_socket_path_keeps_the_pool_warm(tmp_path, monkeypatch):
    """The zygote's socket lives in a private directory under TMPDIR; past the kernel's
    AF_UNIX path limit (108 bytes) it is reached through a descriptor of that directory, so a
    long TMPDIR (a pytest tmp_path, a cluster's scratch path) does not silently cost every
    run a cold start."""
    long_tmp = tmp_path / ("t" * 60) / ("u" * 40)
    long_tmp.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    _pool.shutdown()
    view = Distributor(1, use_gpu=False).run(rank_view)
    assert view["name"] == "sparkdist-r0" and view["ppid"] != os.getpid()  # forked: warm
    [pool_dir] = glob.glob(str(long_tmp / "sparkdist_pool-*"))
    assert len(os.path.join(pool_dir, "zygote.sock")) > 108


def sleep_in_rank():
    time.sleep(120)


def test_shutdown_ends_a_retired_zygote_that_still_serves_a_rank():
    """A zygote retired under a run in flight stays until its last rank ends; shutting the pool
    down (as this process's exit does) ends it too, and its rank with it."""
    run = Distributor(1, use_gpu=False).run_async(sleep_in_rank)
    try:
        deadline = time.monotonic() + 60
        while not _pool._zygotes and time.monotonic() < deadline:
            time.sleep(0.05)
        (zygote,) = list(_pool._zygotes.values())
        while zygote.leases == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert zygote.leases == 1 and zygote.process is not None
        _pool._retire(zygote, "retired by the test")
        assert zygote.process.poll() is None  # its rank still runs: it stays
        _pool.shutdown()
        assert zygote.process.poll() is not None
        with pytest.raises(Exception):  # noqa: B017, PT011 - the rank went with its zygote
            run.result(timeout=60)
    finally:
        run.cancel()
