"""Fault tolerance: restarts that resume, start-up deadline, hang watchdog, crashes, a lost
channel. Every test checks that no process of the run survives (conftest's leak check)."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time

import pytest

from sparkdist import (
    ClusterError,
    Distributor,
    RendezvousError,
    SparkdistError,
    WorkerFailedError,
)
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._engine.launch import Launch
from sparkdist.distributor import make_job
from tests.conftest import run_processes

TOTAL_STEPS = 60


def deterministic_training(kill_at_step):
    """60 steps of DDP-style training with checkpoints every 10 steps; rank 1 SIGKILLs itself
    at ``kill_at_step`` on the first attempt only."""
    import torch
    import torch.distributed as dist

    from sparkdist import runtime

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    latest = runtime.load_checkpoint()
    if latest is not None:
        model.load_state_dict(latest.state["model"])
        optimizer.load_state_dict(latest.state["optimizer"])
        start = latest.step
    for step in range(start, TOTAL_STEPS):
        if step == kill_at_step and rank == 1 and runtime.restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        generator = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 4, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # average gradients by hand: fully deterministic
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        if (step + 1) % 10 == 0:
            runtime.save_checkpoint(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step + 1
            )
    return {
        "restart_count": runtime.restart_count(),
        "resumed_from": start,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def test_restart_resumes_from_checkpoint_bit_for_bit(tmp_path):
    uninterrupted = Distributor(2, use_gpu=False, checkpoint_dir=tmp_path / "a").run(
        deterministic_training, None
    )
    resumed = Distributor(2, use_gpu=False, max_restarts=1, checkpoint_dir=tmp_path / "b").run(
        deterministic_training, 30
    )
    assert uninterrupted["restart_count"] == 0 and uninterrupted["resumed_from"] == 0
    assert resumed["restart_count"] == 1 and resumed["resumed_from"] == 30
    for key, value in uninterrupted["state"].items():
        assert value.equal(resumed["state"][key]), key  # bit for bit
    # Only complete checkpoints are there, each committed: no temporary file survives.
    assert sorted(os.listdir(tmp_path / "b")) == [f"step-{s:09d}" for s in range(10, 61, 10)]
    for step in range(10, 61, 10):
        assert (tmp_path / "b" / f"step-{step:09d}" / "COMMITTED").is_file()


def always_fails():
    from sparkdist import runtime

    if runtime.get_global_rank() == 1:
        raise ValueError(f"bad shard on attempt {runtime.restart_count()}")
    time.sleep(60)


def test_exhausted_restarts_list_every_attempts_root_cause():
    with pytest.raises(WorkerFailedError) as info:
        Distributor(2, use_gpu=False, max_restarts=2, timeout_s=100).run(always_fails)
    error = info.value
    assert len(error.attempts) == 2
    assert [a.message for a in error.attempts] == [
        "bad shard on attempt 0",
        "bad shard on attempt 1",
    ]
    assert error.root_cause.message == "bad shard on attempt 2"
    assert "attempt 0 (on 127.0.0.1) failed first at rank 1" in str(error)
    assert not run_processes()


class FailsWhenUnpickled:
    """An argument that cannot be unpickled on a rank (as a module missing there would be):
    every rank fails before it ever runs the training function."""

    def __reduce__(self):
        return (_fail_to_import, ())


def _fail_to_import():
    raise ModuleNotFoundError("No module named 'only_on_the_driver'")


def test_a_failure_before_the_ranks_start_is_retried_once_not_blindly():
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        Distributor(2, use_gpu=False, max_restarts=5, timeout_s=100).run(
            lambda arg: arg, FailsWhenUnpickled()
        )
    error = info.value
    assert [a.number for a in error.history] == [0, 1]  # 2 attempts, though 5 restarts were left
    assert all(a.before_start for a in error.history)
    assert error.note.startswith("not restarted again: 2 attempts in a row failed before")
    assert "attempt 0 (on 127.0.0.1) failed before every rank started" in str(error)
    assert "only_on_the_driver" in error.root_cause.message
    assert time.monotonic() - started < 60
    assert not run_processes()


def test_a_successful_run_lists_every_attempt_with_its_hosts(tmp_path):
    result = Distributor(2, use_gpu=False, max_restarts=2, checkpoint_dir=str(tmp_path)).run_all(
        fails_on_the_first_attempt
    )
    assert [(a.number, a.hosts, a.failure is None) for a in result.attempts] == [
        (0, ("127.0.0.1",), False),
        (1, ("127.0.0.1",), True),
    ]
    assert result.attempts[0].failure.rank == 1
    assert not run_processes()


def fails_on_the_first_attempt():
    from sparkdist import runtime

    if runtime.restart_count() == 0 and runtime.get_global_rank() == 1:
        raise ValueError("first attempt")
    return runtime.restart_count()


class BlocksWhenUnpickledOnRankOne:
    """An argument whose unpickling never finishes on rank 1: that rank never joins."""

    def __reduce__(self):
        return (_block_on_rank_one, ())


def _block_on_rank_one():
    if os.environ.get("RANK") == "1":
        time.sleep(120)
    return "ok"


def test_rank_that_never_joins_is_named_by_the_start_deadline():
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank\(s\) 1 did not join"):
        # Rank 0 must join in time even on a loaded machine with a cold worker pool.
        Distributor(2, use_gpu=False, start_timeout_s=12).run(
            lambda arg: arg, BlocksWhenUnpickledOnRankOne()
        )
    assert time.monotonic() - started < 60  # the start deadline, not the run's timeout
    assert not run_processes()


def hangs_while_peer_waits():
    import torch
    import torch.distributed as dist

    from sparkdist import runtime

    dist.init_process_group("gloo")
    for step in range(1000):
        if step == 3 and dist.get_rank() == 1:
            time.sleep(120)  # the hang: rank 1 never reports step 3
        runtime.report(step=step)
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1
        time.sleep(0.05)


def test_hung_rank_is_named_with_its_stack_and_the_run_stops():
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        # Long enough that rank 0, waiting in init_process_group for a slow-starting rank 1 on
        # a loaded machine, is never taken for the hung one.
        Distributor(2, use_gpu=False, heartbeat_timeout_s=6, timeout_s=100).run(
            hangs_while_peer_waits
        )
    root = info.value.root_cause
    assert root.rank == 1
    assert "hung: no heartbeat or report for" in root.message
    dump = "\n".join(root.last_lines)
    assert "hangs_while_peer_waits" in dump and "Current thread" in dump  # faulthandler
    assert time.monotonic() - started < 60
    assert not run_processes()


def returns_then_hangs_at_exit():
    import atexit

    def hang_in_an_atexit_hook():
        time.sleep(3600)

    if os.environ["RANK"] == "0":
        atexit.register(hang_in_an_atexit_hook)
    return f"value of rank {os.environ['RANK']}"


def test_a_rank_that_wrote_its_outcome_but_never_exits_is_ended_and_its_value_stands(
    monkeypatch, capfd
):
    from sparkdist._node.agent import watchdog

    monkeypatch.setattr(watchdog, "EXIT_AFTER_DONE_S", 2.0)
    started = time.monotonic()
    result = Distributor(2, use_gpu=False, timeout_s=100).run_all(returns_then_hangs_at_exit)
    assert result.values == ["value of rank 0", "value of rank 1"]
    assert time.monotonic() - started < 30
    _, err = capfd.readouterr()
    assert "rank 0 wrote its outcome 2 s ago but its process has not exited" in err
    assert "hang_in_an_atexit_hook" in err  # its stack, dumped before it was ended
    assert not run_processes()


def segfaults_on_rank_zero():
    import ctypes

    if os.environ["RANK"] == "0":
        ctypes.string_at(0)
    time.sleep(60)


def test_segfault_is_reported_with_the_signal_and_python_stack():
    with pytest.raises(WorkerFailedError, match="killed by SIGSEGV") as info:
        Distributor(2, use_gpu=False, timeout_s=100).run(segfaults_on_rank_zero)
    assert info.value.root_cause.rank == 0
    assert any("Segmentation fault" in line for line in info.value.root_cause.last_lines)
    assert not run_processes()


def test_training_finishes_when_the_drivers_channel_goes_away():
    def steady():
        import time

        from sparkdist import runtime

        for step in range(30):
            print("step", step)
            runtime.report(step=step)
            time.sleep(0.05)
        return "finished"

    run = Launch(LaunchConfig(num_processes=2, use_gpu=False), make_job(steady, (), {}))
    deadline = time.monotonic() + 60
    while len(run._attempt.monitor.state.joined) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    run._attempt.server.close()  # the driver side of the channel is gone mid-run
    result = run.result(timeout=60)
    assert result.values == ["finished", "finished"]
    assert not run_processes()


def test_ranks_end_a_grace_after_the_drivers_channel_goes_away():
    """The channel closed mid-run and the ranks would run on: after the grace
    (heartbeat_timeout_s here) the agent ends them, since nobody may be collecting."""

    def endless():
        import time

        from sparkdist import runtime

        while True:
            runtime.heartbeat()
            time.sleep(0.05)

    config = LaunchConfig(num_processes=2, use_gpu=False, heartbeat_timeout_s=2)
    run = Launch(config, make_job(endless, (), {}))
    deadline = time.monotonic() + 60
    while len(run._attempt.monitor.state.joined) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    closed = time.monotonic()
    run._attempt.server.close()
    with pytest.raises(SparkdistError) as info:
        run.result(timeout=60)
    took = time.monotonic() - closed
    assert 2 <= took < 20, took
    assert "driver is gone" in str(info.value)
    assert not run_processes()


def test_a_local_spawn_failure_is_reported_at_once_and_as_local(monkeypatch):
    """The OS refuses to start a rank (EAGAIN from fork). Injected in the agent's call, as a
    real process limit (RLIMIT_NPROC) would starve the whole test session."""
    from sparkdist._node.agent import ranks

    def refused(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(ranks, "start_rank", refused)
    started = time.monotonic()
    with pytest.raises(ClusterError) as info:
        Distributor(2, use_gpu=False).run(int)
    took = time.monotonic() - started
    message = str(info.value)
    assert message.startswith("the local agent failed before the ranks reported")
    assert "Resource temporarily unavailable" in message
    assert "Spark" not in message and "executor" not in message
    assert took < 3.0, f"{took:.2f} s: waited for a goodbye that never comes"
    assert not run_processes()


def test_run_directory_is_private():
    def run_dir_mode():
        import stat

        pattern = os.path.join(
            tempfile.gettempdir(), f"sparkdist-{os.environ['TORCHELASTIC_RUN_ID']}-*"
        )
        return [stat.S_IMODE(os.stat(path).st_mode) for path in glob.glob(pattern)]

    assert Distributor(1, use_gpu=False).run(run_dir_mode) == [0o700]
