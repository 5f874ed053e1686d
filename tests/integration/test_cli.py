"""The command line end to end: ``python -m sparkdist`` in a child process, real ranks.

Every driver is its own process (the CLI starts its own SparkSession for --master), so nothing
here touches the test session's SparkContext.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._helpers.spark import SMALL_APP_CONF
from tests.conftest import REPO, run_processes

RANK_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} of {dist.get_world_size()} args {sys.argv[1:]}", flush=True)
    # FAIL_AS="1:3": rank 1 exits with code 3; "1:kill": rank 1 is killed by SIGKILL.
    failing, _, how = os.environ.get("FAIL_AS", "").partition(":")
    if failing == str(rank):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(how))
""")


def sparkdist(
    *args: str, cwd: Path, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sparkdist ARGS`` and return what it did."""
    full_env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "sparkdist", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(RANK_SCRIPT)
    return path


def test_script_runs_on_every_rank_with_its_arguments(tmp_path, script):
    done = sparkdist("run", "-n", "2", "train.py", "--", "--lr", "1e-3", "two words", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2 args ['--lr', '1e-3', 'two words']" in done.stdout
    assert not run_processes()


def test_exit_code_is_the_failing_ranks_and_the_error_names_it(tmp_path, script):
    done = sparkdist("run", "-n", "2", "train.py", cwd=tmp_path, FAIL_AS="1:3")
    assert done.returncode == 3
    assert "sparkdist: error:" in done.stderr and "rank 1" in done.stderr
    assert not run_processes()


def test_rank_killed_by_a_signal_exits_128_plus_the_signal(tmp_path, script):
    done = sparkdist("run", "-n", "2", "train.py", cwd=tmp_path, FAIL_AS="1:kill")
    assert done.returncode == 128 + 9, done.stderr
    assert "SIGKILL" in done.stderr


def test_module_runs_like_python_dash_m_from_the_current_directory(tmp_path):
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(RANK_SCRIPT)
    done = sparkdist("run", "-n", "2", "-m", "trainpkg.main", "--", "--epochs", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[rank 1] rank 1 of 2 args ['--epochs', '1']" in done.stdout


def test_deepspeed_config_reaches_every_rank(tmp_path):
    (tmp_path / "show.py").write_text(
        textwrap.dedent("""
        import os, sys
        from sparkdist import runtime
        stage = runtime.deepspeed_config()["zero_optimization"]["stage"]
        print("stage", stage, "mode", os.environ["SPARKDIST_MODE"], "argv", sys.argv[1:3])
    """)
    )
    config = REPO / "conf" / "deepspeed" / "zero2.json"
    done = sparkdist(
        "run", "-n", "1", "--deepspeed-config", str(config), "show.py", "--x", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    # pyspark's DeepspeedTorchDistributor appends these to a script's own arguments.
    assert "[rank 0] stage 2 mode deepspeed argv ['--x', '--deepspeed']" in done.stdout


def test_bad_arguments_exit_2_before_any_rank_starts(tmp_path, script):
    (tmp_path / "broken.json").write_text("{not json")
    done = sparkdist(
        "run", "-n", "2", "--deepspeed-config", "broken.json", "train.py", cwd=tmp_path
    )
    assert done.returncode == 2
    assert "broken.json" in done.stderr and "not valid JSON" in done.stderr
    assert "[rank" not in done.stdout


@pytest.mark.spark
@pytest.mark.cluster
# Slow (three JVMs, ~18 s): the default run has the CLI on a cluster master
# (test_cluster_jobs' standalone cluster), a rank failing on an executor
# (test_local_cluster), and the CLI's exit codes (above).
@pytest.mark.slow
def test_local_cluster_master_runs_barrier_tasks_and_reports_the_exit_code(tmp_path, script):
    done = sparkdist(
        "run",
        "-n",
        "2",
        "--master",
        "local-cluster[2,1,1024]",
        "--cpu",
        *SMALL_APP_CONF,
        "train.py",
        "--",
        "--seed",
        "7",
        cwd=tmp_path,
        timeout=240,
        FAIL_AS="1:5",
    )
    assert done.returncode == 5, done.stderr
    assert "[rank 0] rank 0 of 2 args ['--seed', '7']" in done.stdout
    assert "[rank 1] rank 1 of 2 args ['--seed', '7']" in done.stdout
    assert "rank 1" in done.stderr and "exit code 5" in done.stderr
    assert not run_processes()


def doctor_rows(table: str) -> dict[str, tuple[str, str]]:
    """The doctor's table as {check: (status, text)}, each row's wrapped lines joined again.

    The detail column is wrapped at a fixed width, so where a phrase breaks depends on how long
    the paths in it are (where the repository was cloned): compare joined text, never lines.
    """
    lines = table.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    status_at = lines[rule].index(" -") + 1
    text_at = lines[rule].index(" -", status_at) + 1
    rows: dict[str, tuple[str, list[str]]] = {}
    name = ""
    for line in lines[rule + 1 :]:
        if not line.strip():
            break  # the summary follows the blank line
        if not line[0].isspace():
            name = line[:status_at].strip()
            rows[name] = (line[status_at:text_at].strip(), [])
        rows[name][1].append(line[text_at:].strip())
    joined = {}
    for name, (status, parts) in rows.items():
        text = ""
        for part in parts:  # textwrap breaks after hyphens too: "spark-" / "defaults.conf"
            text += part if text.endswith("-") or not text else " " + part
        joined[name] = (status, text)
    return joined


def test_doctor_exits_1_and_says_the_fix_when_java_is_missing(tmp_path):
    done = sparkdist("doctor", cwd=tmp_path, JAVA_HOME=str(tmp_path / "no-jdk"))
    assert done.returncode == 1
    assert "PROBLEM" in done.stdout and "fix: install Java 17" in done.stdout
    assert "not ready" in done.stdout


def test_ctrl_c_stops_every_rank_and_exits_130(tmp_path):
    (tmp_path / "sleepy.py").write_text(
        "import time\nprint('started', flush=True)\ntime.sleep(120)\n"
    )
    driver = subprocess.Popen(
        [sys.executable, "-m", "sparkdist", "run", "-n", "2", "sleepy.py"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT dumps every thread's stack
    )
    try:
        assert driver.stdout is not None
        started = 0
        for line in driver.stdout:  # the handshake: both ranks said they run
            started += line.rstrip().endswith("started")
            if started == 2:
                break
        assert started == 2, "the ranks did not start"
        driver.send_signal(signal.SIGINT)
        try:
            _, err = driver.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where the driver is stuck (once on CI)
            driver.send_signal(signal.SIGABRT)
            _, err = driver.communicate(timeout=30)
            pytest.fail(f"Ctrl-C did not end the driver within 60 s; its threads:\n{err}")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 130, err
    assert "interrupted" in err
    assert not run_processes()
