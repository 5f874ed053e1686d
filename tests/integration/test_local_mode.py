"""Local mode end to end: real processes, real gloo, no SparkSession needed."""

from __future__ import annotations

import os
import signal
import textwrap
import threading

import pytest

from sparkdist import (
    ClusterError,
    ConfigError,
    Distributor,
    RunTimeoutError,
    TorchDistributor,
    WorkerFailedError,
)
from tests.conftest import run_processes


def all_reduce_rank_sum(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "total": total.item() * scale, "world": dist.get_world_size()}


def whoami(tag=""):
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
    )
    return {"tag": tag, **{k: os.environ.get(k) for k in keys}}


def test_all_reduce_on_two_ranks_returns_rank_zero_value():
    value = Distributor(2, use_gpu=False).run(all_reduce_rank_sum, 10)
    assert value == {"rank": 0, "total": 30.0, "world": 2}


def test_run_all_is_in_rank_order_with_timings_and_hosts():
    result = Distributor(3, use_gpu=False).run_all(whoami, tag="x")
    assert [v["RANK"] for v in result.values] == ["0", "1", "2"]
    assert [v["LOCAL_RANK"] for v in result.values] == ["0", "1", "2"]
    assert {v["WORLD_SIZE"] for v in result.values} == {"3"}
    assert {v["MASTER_ADDR"] for v in result.values} == {"127.0.0.1"}
    assert len({v["MASTER_PORT"] for v in result.values}) == 1
    assert {v["TORCHELASTIC_RUN_ID"] for v in result.values} == {result.run_id}
    assert {v["CUDA_VISIBLE_DEVICES"] for v in result.values} == {""}  # CPU: GPUs hidden
    assert {v["tag"] for v in result.values} == {"x"}
    assert len(result.wall_times_s) == 3 and all(t > 0 for t in result.wall_times_s)
    assert result.hosts == ["127.0.0.1"] * 3 and result.local_mode and not result.use_gpu


def test_torch_distributor_drop_in_returns_rank_zero_even_when_rank_zero_finishes_first():
    def rank_zero_first():
        import time

        rank = int(os.environ["RANK"])
        time.sleep(0.5 * rank)  # pyspark would return the last writer: rank 1
        return rank

    assert (
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(rank_zero_first) == 0
    )


def test_use_gpu_true_without_gpus_fails_before_launch():
    with pytest.raises(ClusterError, match="pass use_gpu=False"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True).run(whoami)


def test_output_streams_prefixed_per_rank_and_robust(capfd):
    def noisy():
        import sys

        rank = int(os.environ["RANK"])
        print(f"plain line from {rank}")
        sys.stdout.buffer.write(b"bad bytes \xff\xfe here\n")
        sys.stdout.buffer.write(b"progress 10%\rprogress 50%\rprogress 100%\n")
        sys.stdout.buffer.write(b"L" * (64 * 1024 + 10) + b"\n")
        sys.stdout.flush()
        print(f"to stderr {rank}", file=sys.stderr)
        return rank

    assert Distributor(2, use_gpu=False).run(noisy) == 0
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert out.count(f"[rank {rank}] plain line from {rank}\n") == 1
        assert f"[rank {rank}] bad bytes \ufffd\ufffd here\n" in out
        assert f"[rank {rank}] progress 50%\n" in out
        assert f"[rank {rank}] {'L' * 64 * 1024}\n" in out
        assert f"[rank {rank}] {'L' * 10}\n" in out
        assert f"[rank {rank}] to stderr {rank}\n" in err
        assert f"to stderr {rank}" not in out


def test_two_runs_at_once_from_two_threads_do_not_collide():
    results = {}

    def go(tag):
        results[tag] = Distributor(2, use_gpu=False).run_all(whoami, tag=tag)

    threads = [threading.Thread(target=go, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {v["tag"] for v in results["a"].values} == {"a"}
    assert {v["tag"] for v in results["b"].values} == {"b"}
    assert results["a"].run_id != results["b"].run_id


# -- script targets ----------------------------------------------------------------------


@pytest.fixture
def script(tmp_path):
    def write(body: str):
        path = tmp_path / "train_script.py"
        path.write_text(textwrap.dedent(body))
        return path

    return write


def test_script_gets_argv_and_torchrun_env(script, capfd):
    path = script("""
        import os, sys
        print("argv", sys.argv[1:], "rank", os.environ["RANK"], "name", __name__)
    """)
    assert TorchDistributor(2, True, False).run(str(path), "--lr", 0.5) is None
    out, _ = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] argv ['--lr', '0.5'] rank {rank} name __main__" in out


def test_script_exit_code_is_a_failure_not_a_success(script):
    path = script("""
        import os, sys
        if os.environ["RANK"] == "1":
            print("about to fail")
            sys.exit(3)
    """)
    with pytest.raises(WorkerFailedError) as info:
        Distributor(2, use_gpu=False).run(path)
    assert info.value.root_cause.rank == 1
    assert info.value.root_cause.exit_code == 3
    assert "about to fail" in info.value.root_cause.last_lines
    assert not run_processes()


def test_script_kwargs_are_refused(script):
    path = script("print('x')")
    with pytest.raises(ConfigError, match="cannot be passed to a script"):
        Distributor(2, use_gpu=False).run(path, lr=0.1)


@pytest.mark.parametrize("target", ["/no/such/train.py", 42, None])
def test_target_neither_callable_nor_script_is_refused(target):
    with pytest.raises(ConfigError, match="train_object"):
        Distributor(2, use_gpu=False).run(target)


def test_unpicklable_closure_fails_before_launch():
    lock = threading.Lock()

    def train():
        with lock:
            return 1

    with pytest.raises(ConfigError, match="variable 'lock'"):
        Distributor(2, use_gpu=False).run(train)
    assert not run_processes()


# -- failures ----------------------------------------------------------------------------


def raise_on_rank_one():
    import time

    if os.environ["RANK"] == "1":
        print("rank one is about to raise")
        raise KeyError("missing-key")
    time.sleep(120)  # must be stopped, not waited for


def test_raising_rank_is_named_with_traceback_and_others_are_stopped():
    with pytest.raises(WorkerFailedError) as info:
        Distributor(2, use_gpu=False, timeout_s=100).run(raise_on_rank_one)
    error = info.value
    assert error.root_cause.rank == 1 and list(error.failures) == [1]
    assert error.root_cause.exc_type == "KeyError"
    assert 'raise KeyError("missing-key")' in error.root_cause.traceback
    assert "test_local_mode.py" in error.root_cause.traceback
    assert "rank one is about to raise" in str(error)
    assert isinstance(error.__cause__, KeyError)
    assert not run_processes()


def exit_three_on_rank_zero():
    import time

    if os.environ["RANK"] == "0":
        os._exit(3)
    time.sleep(120)


def sigkill_rank_one():
    import time

    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def hang_in_all_reduce_after_peer_dies():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))  # would wait for the 30-minute gloo timeout
    return "unreachable"


@pytest.mark.parametrize(
    ("fn", "rank", "code", "message"),
    [
        (exit_three_on_rank_zero, 0, 3, "exited with code 3"),
        (sigkill_rank_one, 1, -signal.SIGKILL, "killed by SIGKILL"),
        (hang_in_all_reduce_after_peer_dies, 1, 7, "exited with code 7"),
    ],
)
def test_dead_rank_is_named_and_nothing_survives(fn, rank, code, message):
    with pytest.raises(WorkerFailedError, match=message) as info:
        Distributor(2, use_gpu=False, timeout_s=100).run(fn)
    assert info.value.root_cause.rank == rank
    assert info.value.root_cause.exit_code == code
    # A peer may fail too ("connection reset") before it is stopped; the root cause is named.
    assert rank in info.value.failures
    assert not run_processes()


def test_run_timeout_stops_every_rank():
    def sleepy():
        import time

        time.sleep(120)

    with pytest.raises(RunTimeoutError, match="timeout_s=1"):
        Distributor(2, use_gpu=False, timeout_s=1).run(sleepy)
    assert not run_processes()


def test_unpicklable_return_value_is_a_clear_failure():
    def returns_lock():
        return threading.Lock()

    with pytest.raises(WorkerFailedError, match="cannot be pickled to send it to the driver"):
        Distributor(1, use_gpu=False).run(returns_lock)


def test_works_with_no_spark_session(no_spark):
    assert Distributor(1, use_gpu=False).run(whoami)["WORLD_SIZE"] == "1"
    # Local mode only reads a session that exists: it never starts one.
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is None


def test_a_long_silence_loses_no_output(monkeypatch, capfd):
    """The channel's send timeout must never apply to reads: a quiet node is not a lost one."""
    import sparkdist._wire.channel.client as client

    monkeypatch.setattr(client, "SEND_TIMEOUT_S", 1.0)

    def quiet():
        import time

        print("before")
        time.sleep(2.5)
        print("after")
        return "done"

    result = Distributor(2, use_gpu=False).run_all(quiet)
    assert result.values == ["done", "done"] and result.dropped_lines == 0
    out, _ = capfd.readouterr()
    assert "[rank 0] after" in out and "[rank 1] after" in out


def _finds_shadow_probe() -> dict[str, object]:
    import importlib.util
    import os

    return {"found": importlib.util.find_spec("shadow_probe") is not None, "cwd": os.getcwd()}


def test_ranks_do_not_import_from_their_working_directory(tmp_path, monkeypatch):
    """A module lying in the directory the ranks start in is not importable unless the driver
    could import it too (its sys.path is what the ranks get): never the implicit '' entry."""
    import importlib.util

    (tmp_path / "shadow_probe.py").write_text("raise SystemExit('shadowed')\n")
    monkeypatch.chdir(tmp_path)
    assert importlib.util.find_spec("shadow_probe") is None  # the driver cannot see it
    for attempt in range(2):  # cold start or fresh zygote, then a warm fork
        values = Distributor(2, use_gpu=False).run_all(_finds_shadow_probe).values
        assert [v["cwd"] for v in values] == [str(tmp_path)] * 2, attempt
        assert [v["found"] for v in values] == [False, False], attempt
