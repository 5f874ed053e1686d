"""Files a run leaves on the driver: private (0600 files, 0700 directories), emptied or removed
whichever way the run ends, and swept at the next start when the driver was killed.

Real runs: local mode for checkpoints, Spark local[2] for a job large enough to travel as a
Spark file (over ``job_size_warn_mb``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import psutil
import pytest

from sparkdist import Distributor, WorkerFailedError
from sparkdist._backends.job_file import sweep_job_leftovers
from sparkdist._core import files
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._engine.launch import Launch
from sparkdist.distributor import make_job
from tests._helpers.files import mode_of
from tests.conftest import FAST_JVM_OPTIONS, REPO, _stop_session, run_processes


def served_job_file(run_id: str) -> str:
    """The job file the driver serves for ``run_id`` (exactly one)."""
    pattern = os.path.join(
        tempfile.gettempdir(), f"sparkdist_job-*-{run_id}-*", f"sparkdist-job-{run_id}.pkl"
    )
    [path] = glob.glob(pattern)
    return path


# -- checkpoints -------------------------------------------------------------------------------


def save_two_and_load():
    import torch

    from sparkdist import runtime

    torch.distributed.init_process_group("gloo")
    for step in (1, 2):
        runtime.save_checkpoint({"w": torch.full((3,), float(step))}, step)
    latest = runtime.load_checkpoint()
    torch.distributed.destroy_process_group()
    return latest.step, float(latest.state["w"][0])


def test_checkpoints_are_private_in_private_directories(tmp_path):
    directory = tmp_path / "new" / "ckpt"  # neither exists: the launcher creates both
    values = Distributor(2, use_gpu=False, checkpoint_dir=directory).run_all(save_two_and_load)
    assert values.values == [(2, 2.0), (2, 2.0)]
    assert sorted(os.listdir(directory)) == ["step-000000001", "step-000000002"]
    for name in os.listdir(directory):
        assert mode_of(directory / name) == 0o700, name
        files = os.listdir(directory / name)
        assert "COMMITTED" in files and ".metadata" in files, files
        for file in files:
            assert mode_of(directory / name / file) == 0o600, (name, file)
    assert mode_of(directory) == 0o700
    assert mode_of(tmp_path / "new") == 0o700


# -- the large-job file ------------------------------------------------------------------------


def large_job_waiting_for(go: str, outcome: str):
    """A job pickled at ~2.4 MB (over job_size_warn_mb=1) whose ranks wait for ``go`` (a file)
    and then return, or raise when ``outcome`` is "fails"."""
    data = np.arange(300_000, dtype=np.float64)

    def train():
        import time

        deadline = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)  # the test's signal is a file: nothing to block on across hosts
        if outcome == "fails":
            raise ValueError("this run fails on purpose")
        return float(data[-1])

    return make_job(train, (), {})


def start_large_run(spark, go) -> Launch:
    config = LaunchConfig(num_processes=2, local_mode=False, use_gpu=False, job_size_warn_mb=1)
    return Launch(config, large_job_waiting_for(str(go), "succeeds"), session=spark)


@pytest.mark.spark
def test_the_job_file_is_private_while_served_and_emptied_when_the_run_ends(spark_local, tmp_path):
    go = tmp_path / "go"
    run = start_large_run(spark_local, go)
    try:
        served = served_job_file(run.run_id)
        directory = os.path.dirname(served)
        assert mode_of(served) == 0o600 and os.path.getsize(served) > 2_000_000
        assert mode_of(directory) == 0o700
        assert os.listdir(directory) == [os.path.basename(served)]
        assert f"-{os.getpid()}-{run.run_id}-" in os.path.basename(directory)  # owner pid
        assert not glob.glob(os.path.join(spark_local.sparkContext._temp_dir, "sparkdist-*"))
    except BaseException:
        run.cancel()
        raise
    finally:
        go.touch()
    assert run.result(timeout=120).values == [299_999.0, 299_999.0]
    # Spark cannot forget an added file (a late executor fetches it): emptied, still private.
    assert os.path.getsize(served) == 0 and mode_of(served) == 0o600
    assert mode_of(directory) == 0o700
    assert directory not in sweep_job_leftovers()  # its driver (we) and context are alive
    assert os.path.exists(served)
    from pyspark import SparkFiles

    assert not os.path.exists(os.path.join(SparkFiles.getRootDirectory(), os.path.basename(served)))


@pytest.mark.spark
@pytest.mark.parametrize("ending", ["fails", "cancelled"])
def test_the_job_file_is_emptied_when_the_run_fails_or_is_cancelled(spark_local, tmp_path, ending):
    go = tmp_path / "go"
    config = LaunchConfig(num_processes=2, local_mode=False, use_gpu=False, job_size_warn_mb=1)
    run = Launch(config, large_job_waiting_for(str(go), ending), session=spark_local)
    served = served_job_file(run.run_id)
    assert os.path.getsize(served) > 2_000_000
    if ending == "fails":
        go.touch()
        with pytest.raises(WorkerFailedError, match="this run fails on purpose"):
            run.result(timeout=120)
    else:
        assert run.cancel("the test cancels it")
        with pytest.raises(concurrent.futures.CancelledError):
            run.result(timeout=120)
    assert os.path.getsize(served) == 0 and mode_of(served) == 0o600
    assert not run_processes()


def test_a_killed_drivers_leftover_is_swept_at_the_next_start(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # its pid now names no process: a driver that was killed
    host = files._host_tag()
    leftover = os.path.join(tempfile.gettempdir(), f"sparkdist_job-{host}-{proc.pid}-abc-x1")
    os.mkdir(leftover, 0o700)
    with open(os.path.join(leftover, "sparkdist-job-abc.pkl"), "wb") as f:
        f.write(b"a pickled job nobody serves any more")
    alive = files.make_owned_dir("job", "def")  # ours, and we are alive
    try:
        assert leftover in sweep_job_leftovers()
        assert not os.path.exists(leftover)
        assert os.path.isdir(alive)
    finally:
        os.rmdir(alive)


@pytest.mark.spark
def test_the_job_directory_goes_once_its_session_stopped(spark_local, tmp_path):
    go = tmp_path / "go"
    go.touch()
    run = start_large_run(spark_local, go)
    directory = os.path.dirname(served_job_file(run.run_id))
    run.result(timeout=120)
    assert os.path.isdir(directory)  # the live context may still serve it to a new executor
    _stop_session()  # the session ends (the next test that needs one starts a new one)
    assert directory in sweep_job_leftovers()  # what the next large job's start does
    assert not os.path.exists(directory)


_DRIVER = textwrap.dedent(
    """
    import json, os
    import numpy as np
    from pyspark.sql import SparkSession
    from sparkdist import Distributor

    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    data = np.arange(300_000, dtype=np.float64)
    result = Distributor(1, local_mode=False, use_gpu=False, job_size_warn_mb=1).run_all(
        lambda: float(data[-1]))
    tmp = os.environ["TMPDIR"]
    print(json.dumps([os.path.join(tmp, d) for d in os.listdir(tmp)
                      if d.startswith("sparkdist_job-") and result.run_id in d]))
    """
)


@pytest.mark.spark
@pytest.mark.slow  # its own JVM: 100 s measured here on a loaded 2-core box
@pytest.mark.timeout(300)
def test_the_job_directory_goes_when_the_driver_exits(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER], env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [directory] = json.loads(proc.stdout.strip().splitlines()[-1])  # there before exit
    assert not os.path.exists(directory)  # removed at exit, the session still up
    assert not glob.glob(os.path.join(tmp_path, "sparkdist_job-*"))


_WAITING_DRIVER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from pyspark.sql import SparkSession
    from sparkdist import Distributor

    go, jvm_options = sys.argv[1], sys.argv[2]
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.extraJavaOptions", jvm_options).getOrCreate())
    data = np.arange(300_000, dtype=np.float64)  # ~2.4 MB pickled: over job_size_warn_mb=1

    def train():
        while not os.path.exists(go):
            time.sleep(0.02)  # the test's signal is a file
        return float(data[-1])

    print(Distributor(1, local_mode=False, use_gpu=False, job_size_warn_mb=1).run(train))
    """
)


def _job_file_of(pid: int, deadline: float) -> str:
    """The job file the driver ``pid`` serves, once it exists (its run has started)."""
    pattern = os.path.join(tempfile.gettempdir(), f"sparkdist_job-*-{pid}-*", "sparkdist-job-*")
    while time.monotonic() < deadline:
        found = glob.glob(pattern)
        if found and os.path.getsize(found[0]) > 2_000_000:  # written whole before it is named
            return found[0]
        time.sleep(0.1)  # the driver starts a JVM first: nothing to handshake with
    raise AssertionError(f"driver {pid} served no job file in time")


def _gone(processes: list[psutil.Process], timeout_s: float) -> bool:
    """Whether every one of ``processes`` ended within ``timeout_s`` (zombies count as ended)."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() != psutil.STATUS_ZOMBIE:
                return False
    return True


@pytest.mark.spark
@pytest.mark.slow  # two drivers with a JVM each
@pytest.mark.timeout(300)
def test_a_killed_spark_drivers_job_file_goes_at_a_local_mode_start(tmp_path):
    """A driver SIGKILLed mid-run (Spark mode, a large job) leaves its job file; the next run
    on the host, in local mode, removes it, and leaves a live driver's job file alone."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def driver(go):
        return subprocess.Popen(
            [sys.executable, "-c", _WAITING_DRIVER, str(go), FAST_JVM_OPTIONS],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    killed, live = driver(tmp_path / "never"), driver(tmp_path / "go")
    everything = [psutil.Process(killed.pid), psutil.Process(live.pid)]
    try:
        deadline = time.monotonic() + 240
        killed_file = _job_file_of(killed.pid, deadline)
        live_file = _job_file_of(live.pid, deadline)
        killed_tree = psutil.Process(killed.pid).children(recursive=True)
        everything += killed_tree + psutil.Process(live.pid).children(recursive=True)
        killed.kill()
        killed.wait()
        # Its JVM sees its stdin close, and everything under it ends (the ranks too).
        assert _gone(killed_tree, 60), "the killed driver's processes outlived it"
        assert os.path.exists(killed_file)  # nobody removed it: the next start must

        assert Distributor(1, use_gpu=False).run(int) == 0  # the next start: local mode

        assert not os.path.exists(os.path.dirname(killed_file))
        assert os.path.getsize(live_file) > 2_000_000 and mode_of(live_file) == 0o600
        (tmp_path / "go").touch()
        out, err = live.communicate(timeout=120)
        assert live.returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == "299999.0"  # its run read its job file
    finally:
        for proc in everything:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for proc in (killed, live):
            proc.communicate()
    assert _gone(everything, 30)
    assert not os.path.exists(os.path.dirname(live_file))  # its own exit removed it
