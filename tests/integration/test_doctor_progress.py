"""``sparkdist doctor`` says what it checks as it goes (stderr) and ends with one verdict line
(stdout), with a real Java, pyspark, torch and Spark session probe."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.integration.standalone_cluster import FAST_JVM_OPTIONS
from tests.integration.test_cli import doctor_rows

CHECKS = (
    "python",
    "java",
    "pyspark",
    "spark session",
    "torch",
    "gpus",
    "spark gpu conf",
    "preemption conf",
    "deepspeed",
    "mlflow",
)


def progress_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("doctor: ")]


def assert_each_check_starts_then_ends(lines: list[str]) -> None:
    for name in CHECKS:
        starts = [i for i, line in enumerate(lines) if line.startswith(f"doctor: checking {name} ")]
        ends = [i for i, line in enumerate(lines) if line.startswith(f"doctor: {name}: ")]
        assert len(starts) == len(ends) == 1, (name, lines)
        assert starts[0] < ends[0], (name, lines)


@pytest.mark.spark
def test_doctor_shows_each_check_while_it_runs(tmp_path):
    """One doctor run (its Spark probe starts a JVM) for both what it says while it runs and the
    table it ends with."""
    (tmp_path / "home").mkdir()
    (tmp_path / "conf").mkdir()
    doctor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparkdist",
            "doctor",
            "--properties-file",
            str(REPO / "conf" / "spark-defaults.conf"),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={
            **os.environ,
            "JDK_JAVA_OPTIONS": FAST_JVM_OPTIONS,
            # A fresh machine: an empty home, no Spark conf dir.
            "HOME": str(tmp_path / "home"),
            "SPARK_CONF_DIR": str(tmp_path / "conf"),
        },
    )
    try:
        assert doctor.stderr is not None and doctor.stdout is not None
        seen: list[tuple[str, bool]] = []  # (line, the doctor was still running)
        for line in doctor.stderr:
            seen.append((line.rstrip("\n"), doctor.poll() is None))
        out = doctor.stdout.read()
        doctor.wait(timeout=180)
    finally:
        if doctor.poll() is None:
            doctor.kill()
            doctor.wait()
    lines = progress_of("\n".join(line for line, _ in seen))
    # The Spark session starts first (its JVM boots meanwhile) and is the last to end.
    [session_start] = [i for i, line in enumerate(lines) if "checking spark session" in line]
    [torch_start] = [i for i, line in enumerate(lines) if "checking torch" in line]
    assert session_start < torch_start
    assert "(a local[1] session in a child process, up to 120 s" in lines[session_start]
    assert lines[-1].startswith("doctor: spark session: OK, Spark ") and lines[-1].endswith(" s)")
    assert_each_check_starts_then_ends(lines)
    # Said while checking, not all at the end: the session's start arrived before it ended.
    assert [running for line, running in seen if "checking spark session" in line] == [True]
    assert doctor.returncode == 0, out
    assert out.rstrip("\n").splitlines()[-1].startswith("doctor: ready: ")
    assert "doctor: checking" not in out  # stdout keeps the table and the verdict only
    assert_table_reports_no_gpu_and_passes_the_rest(out)


def test_doctor_without_java_names_the_problems_last(tmp_path):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sparkdist", "doctor"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "JAVA_HOME": str(tmp_path / "no-jdk")},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = progress_of(done.stderr)
    assert_each_check_starts_then_ends(lines)
    assert "doctor: java: PROBLEM, JAVA_HOME/bin/java is missing" in lines
    assert "doctor: spark session: PROBLEM, not tried: needs pyspark and Java" in lines
    last = done.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("doctor: not ready: ") and last.endswith(
        "(java, spark session); fix the PROBLEM rows above"
    )
    assert time.monotonic() - started < 120  # no JVM was waited for


def assert_table_reports_no_gpu_and_passes_the_rest(out: str) -> None:
    """The shipped GPU conf is judged too: sound, but its discovery script is not on this box.
    JDK_JAVA_OPTIONS speeds the probe's JVM up, and makes java print a note before its
    version, which the doctor must see past."""
    properties = REPO / "conf" / "spark-defaults.conf"
    rows = doctor_rows(out)
    for name in ("python", "java", "pyspark", "torch"):
        assert rows[name][0] == "OK", rows[name]
    assert (
        rows["spark session"][0] == "OK"
        and "local[1] ran a Python task" in rows["spark session"][1]
    )
    assert rows["gpus"][0] == "NOTE" and "no GPU visible" in rows["gpus"][1]
    status, text = rows["spark gpu conf"]
    assert text.startswith(
        f"{properties}: 8 GPU(s) per executor, 1 per task (1 rank(s) per barrier task)"
    ), text
    script = "/opt/sparkdist/getGpusResources.sh"
    if os.access(script, os.X_OK):
        assert status == "OK", text
    else:
        assert (
            status == "NOTE"
            and f"fix: the discovery script {script} is not an executable file here" in text
        ), text
