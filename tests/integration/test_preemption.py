"""Preemption: SIGTERM (what YARN and Kubernetes send before they kill) drains the run instead
of losing every step since the last periodic checkpoint.

Real processes, real gloo, no mocks. A 2-rank DDP loop calls ``runtime.should_stop()`` every
step and saves a checkpoint when told; the tests send SIGTERM to a rank, to the driver, and
(on a local[2] Spark stage) to an agent's Python worker, and check where the restart resumed,
what ``RunResult.attempts`` says, and that no process of the run survives (conftest's leak
check, and each test's own). Each prints the figures it measured (SIGTERM to the checkpoint
written, to the restarted training function).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from sparkdist import Distributor, WorkerFailedError
from tests.conftest import run_processes

#: The step at which rank 1 of the first attempt sends itself SIGTERM.
SIGNAL_AT = 23
#: Periodic checkpoints every this many steps.
EVERY = 10


def record(out: str, name: str, **fields: object) -> None:
    """Write one JSON record, atomically (a reader never sees half of it)."""
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        json.dump(fields, f)
    os.replace(path + ".tmp", path)


def read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def ddp_loop(out: str, steps: int, *, obey: bool = True, pace_s: float = 0.02) -> object:
    """A DDP loop that resumes from the latest checkpoint, saves one every ``EVERY`` steps,
    and (``obey``) saves and returns when ``runtime.should_stop()`` says so. Rank 1 of the
    first attempt sends itself SIGTERM after step ``SIGNAL_AT``."""
    import threading

    import torch
    import torch.distributed as dist

    from sparkdist import runtime

    started = time.time()
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), runtime.restart_count()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    latest = runtime.load_checkpoint()
    start = 0 if latest is None else latest.step
    if latest is not None:
        model.module.load_state_dict(latest.state["model"])
    record(
        out,
        f"start-{attempt}-{rank}",
        step=start,
        time=started,
        pid=os.getpid(),
    )
    runtime.on_preemption(
        lambda why: record(out, f"callback-{rank}", why=why, thread=threading.current_thread().name)
    )

    def state():
        return {"model": model.module.state_dict()}

    for step in range(start, steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        if (step + 1) % EVERY == 0:
            runtime.save_checkpoint(state(), step + 1)
            record(out, f"saved-{attempt}-{rank}-{step + 1}", step=step + 1)
        if attempt == 0 and rank == 1 and step + 1 == SIGNAL_AT:
            record(out, "signal", step=step + 1, time=time.time())
            os.kill(os.getpid(), signal.SIGTERM)
        if obey and runtime.should_stop():
            path = runtime.save_checkpoint(state(), step + 1)
            record(out, f"stop-{attempt}-{rank}", step=step + 1, time=time.time(), path=path)
            return ("stopped", step + 1)
        if attempt == 0:
            time.sleep(pace_s)
    return ("done", start, attempt)


@pytest.mark.parametrize("pool", ["warm", "cold"])
def test_sigterm_to_a_rank_drains_and_the_restart_resumes_at_the_signals_step(
    pool, tmp_path, monkeypatch
):
    """Both ranks stop at the step of the signal (should_stop is a collective), save it, and
    the restart resumes there, though max_restarts=0: a preemption is not a failure. Ranks
    forked from the warm pool's zygote and cold ones take the same path."""
    monkeypatch.setenv("SPARKDIST_WORKER_POOL", "1" if pool == "warm" else "0")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    result = Distributor(
        2, use_gpu=False, checkpoint_dir=ckpt, max_restarts=0, timeout_s=120
    ).run_all(ddp_loop, str(out), 60)

    signalled = read(out, "signal")
    stops = [read(out, f"stop-0-{rank}") for rank in (0, 1)]
    assert {s["step"] for s in stops} == {SIGNAL_AT}  # the same step on both, the signal's
    restarted = [read(out, f"start-1-{rank}") for rank in (0, 1)]
    assert {r["step"] for r in restarted} == {SIGNAL_AT}  # not 20, the last periodic one
    assert result.values == [("done", SIGNAL_AT, 1), ("done", SIGNAL_AT, 1)]
    first, second = result.attempts
    assert first.preempted == "node 0 (host 127.0.0.1): rank 1 got SIGTERM"
    assert first.failure is None and "was preempted: node 0" in first.summary()
    assert second.preempted == "" and second.failure is None
    # The notice reached both ranks' callbacks, off their training threads.
    for rank in (0, 1):
        callback = read(out, f"callback-{rank}")
        assert callback["thread"] == "sparkdist-preemption"
        assert "rank 1 got SIGTERM" in callback["why"]
    # The first attempt's ranks are gone: none lived past the run.
    for rank in (0, 1):
        assert not psutil.pid_exists(read(out, f"start-0-{rank}")["pid"])
    written = max(os.stat(s["path"]).st_mtime for s in stops)
    print(
        f"{pool}: SIGTERM -> checkpoint written {written - signalled['time']:.3f} s, -> "
        f"restarted training function {min(r['time'] for r in restarted) - signalled['time']:.3f} s"
    )
    assert not run_processes()


def test_a_rank_that_ignores_should_stop_is_stopped_at_the_grace_and_resumes(tmp_path):
    """preemption_grace_s after the notice the ranks still run: they are stopped, and the
    restart resumes from the last checkpoint there is."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    result = Distributor(
        2,
        use_gpu=False,
        checkpoint_dir=ckpt,
        max_restarts=0,
        preemption_grace_s=2,
        timeout_s=120,
    ).run_all(ddp_loop, str(out), 400, obey=False)

    signalled = read(out, "signal")
    restarted = [read(out, f"start-1-{rank}") for rank in (0, 1)]
    noted = max(read(out, p.name)["step"] for p in out.glob("saved-0-0-*"))
    (latest,) = {r["step"] for r in restarted}
    # The newest committed checkpoint: the last one noted, or the next periodic one when the
    # grace stopped the ranks between its commit and their note of it.
    assert latest in (noted, noted + EVERY)
    assert latest >= 20 and latest % EVERY == 0  # periodic only: never saved at the signal
    assert result.values == [("done", latest, 1), ("done", latest, 1)]
    assert result.attempts[0].preempted.endswith("rank 1 got SIGTERM")
    stopped_after = min(r["time"] for r in restarted) - signalled["time"]
    print(f"SIGTERM -> ranks stopped at the grace, restarted function {stopped_after:.3f} s")
    assert 2.0 <= stopped_after < 30
    for rank in (0, 1):
        assert not psutil.pid_exists(read(out, f"start-0-{rank}")["pid"])
    assert not run_processes()


def sleeps_until_a_peer_fails(out: str) -> None:
    from sparkdist import runtime

    rank = runtime.get_global_rank()
    record(out, f"start-0-{rank}", pid=os.getpid())
    runtime.on_preemption(lambda why: record(out, f"callback-{rank}", why=why))
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("rank 1 fails")
    time.sleep(60)


def test_sparkdists_own_stop_still_ends_a_rank_at_once(tmp_path):
    """Ending ranks starts with SIGTERM (a clean-up chance for what they started): the agent's
    stop marker makes a rank take it as before, not as a preemption notice to drain on."""
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1 fails") as info:
        Distributor(2, use_gpu=False, timeout_s=60).run(sleeps_until_a_peer_fails, str(tmp_path))
    assert time.monotonic() - started < 30
    assert list(info.value.failures) == [1]  # rank 0 was stopped, not failed
    assert not list(tmp_path.glob("callback-*"))  # and never took our stop for a notice
    assert not psutil.pid_exists(read(tmp_path, "start-0-0")["pid"])
    assert not run_processes()


DRIVER = textwrap.dedent("""
    import sys

    from sparkdist import Distributor
    from preemption_helpers import ddp_loop

    Distributor(2, use_gpu=False, checkpoint_dir=sys.argv[2], max_restarts=3).run(
        ddp_loop, sys.argv[1], 100_000, pace_s=0.05
    )
    print("RETURNED", flush=True)
""")


def test_sigterm_to_the_driver_drains_the_run_and_ends_the_driver_by_it(tmp_path):
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "preemption_helpers.py").write_text(
        "import json, os, signal, time\n"
        f"SIGNAL_AT, EVERY = {SIGNAL_AT}, {EVERY}\n"
        + inspect.getsource(record)
        + inspect.getsource(ddp_loop)
    )
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    driver = subprocess.Popen(
        [sys.executable, "driver.py", str(out), str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"start-0-{r}").exists() for r in (0, 1)):
            if time.monotonic() > deadline or driver.poll() is not None:
                driver.kill()
                pytest.fail(f"the ranks did not start: {driver.communicate(timeout=30)[0]}")
            time.sleep(0.05)
        time.sleep(0.5)  # a few steps in
        signalled = time.time()
        driver.send_signal(signal.SIGTERM)
        output, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    ended = time.time()
    assert driver.returncode == -signal.SIGTERM, output  # ended by the signal, as sent
    assert "RETURNED" not in output and "the driver got SIGTERM" in output
    stops = [read(out, f"stop-0-{rank}") for rank in (0, 1)]
    step = stops[0]["step"]
    assert stops[1]["step"] == step  # the same step on both ranks
    assert os.path.exists(stops[0]["path"]) and f"step-{step:09d}" in stops[0]["path"]
    assert not (out / "start-1-0").exists()  # no restart
    for rank in (0, 1):
        assert not psutil.pid_exists(read(out, f"start-0-{rank}")["pid"])
    written = max(os.stat(s["path"]).st_mtime for s in stops)
    print(
        f"SIGTERM to the driver -> checkpoint written {written - signalled:.3f} s, -> driver "
        f"ended {ended - signalled:.3f} s"
    )
    assert not run_processes()


def agent_pid() -> int:
    """The pid of this rank's agent: the nearest ancestor that is a PySpark Python worker."""
    for parent in psutil.Process().parents():
        if "pyspark" in " ".join(parent.cmdline()):
            return parent.pid
    raise RuntimeError("no PySpark worker among this rank's ancestors")


def signals_its_agent(out: str, steps: int) -> object:
    """``ddp_loop``, but the first attempt's rank 1 sends SIGTERM to its agent instead."""
    import torch
    import torch.distributed as dist

    from sparkdist import runtime

    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), runtime.restart_count()
    latest = runtime.load_checkpoint()
    start = 0 if latest is None else latest.step
    record(out, f"start-{attempt}-{rank}", step=start, time=time.time(), pid=os.getpid())
    for step in range(start, steps):
        dist.all_reduce(torch.ones(1))
        if attempt == 0 and rank == 1 and step + 1 == SIGNAL_AT:
            record(out, "signal", step=step + 1, time=time.time(), agent=agent_pid())
            os.kill(agent_pid(), signal.SIGTERM)
        if runtime.should_stop():
            runtime.save_checkpoint({"step": step + 1}, step + 1)
            record(out, f"stop-{attempt}-{rank}", step=step + 1, time=time.time())
            return ("stopped", step + 1)
        if attempt == 0:
            time.sleep(0.02)
    return ("done", start, attempt)


@pytest.mark.spark
def test_sigterm_to_an_agents_python_worker_drains_the_run(spark_local, tmp_path):
    """The agent's process (a PySpark worker) is told to go: it keeps its ranks for the drain,
    the whole run drains, and the restart resumes from the checkpoint of the drain."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    result = Distributor(
        2, local_mode=False, use_gpu=False, checkpoint_dir=ckpt, timeout_s=180
    ).run_all(signals_its_agent, str(out), 60)
    stops = {read(out, f"stop-0-{rank}")["step"] for rank in (0, 1)}
    assert len(stops) == 1  # the same step on both ranks
    (step,) = stops
    assert step >= SIGNAL_AT
    assert result.values == [("done", step, 1), ("done", step, 1)]
    preempted = result.attempts[0].preempted
    assert preempted.startswith("node 1 (host ") and preempted.endswith(") got SIGTERM")
    signalled = read(out, "signal")["time"]
    stopped = max(read(out, f"stop-0-{rank}")["time"] for rank in (0, 1))
    restarted = min(read(out, f"start-1-{rank}")["time"] for rank in (0, 1))
    print(
        f"local[2]: SIGTERM to an agent -> both ranks saved {stopped - signalled:.3f} s, -> "
        f"restarted training function {restarted - signalled:.3f} s"
    )
    assert psutil.pid_exists(read(out, "signal")["agent"])  # the worker was not ended by it
    assert not run_processes()
