"""The doctor's Spark checks: Java, pyspark, a real local session, and the GPU scheduling conf.

The session check starts ``local[1]`` in a child process (``SparkProbe``), so a JVM that hangs
or crashes cannot take the doctor with it; it is started first so the JVM boots while the other
checks run. ``check_gpu_conf`` is pure: a conf mapping in, a verdict out, judged with the same
rules Spark mode applies before a launch (``_placement``).

Non-goals: GPUs and torch of this machine (``_doctor``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping

from sparkdist._core.errors import ClusterError, ConfigError
from sparkdist._core.launch.config import DEFAULT_PREEMPTION_GRACE_S, LaunchConfig
from sparkdist._core.launch.placement import (
    TASK_GPU_KEY,
    TORCH_IGNORE_SSL_KEY,
    check_cluster_conf,
    place_on_cluster,
)
from sparkdist._doctor.ranges import in_range
from sparkdist._doctor.table import Check, Status

EXECUTOR_GPU_KEY = "spark.executor.resource.gpu.amount"
EXECUTOR_SCRIPT_KEY = "spark.executor.resource.gpu.discoveryScript"
#: How long the Spark session check may take (a cold JVM on a busy 2-core box needs ~15 s).
SPARK_PROBE_TIMEOUT_S = 120.0
_PROBE_MARKER = "sparkdist-doctor-probe "
_INSTALL_JAVA = (
    "install Java {need} or newer (e.g. apt-get install openjdk-17-jre-headless) and set "
    "JAVA_HOME to it"
)


def find_java(environ: Mapping[str, str]) -> str | None:
    """The java Spark would run: ``$JAVA_HOME/bin/java``, else the first java on PATH."""
    home = environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        return candidate if os.access(candidate, os.X_OK) else None
    return shutil.which("java")


def java_version_text(java: str) -> str:
    """The version line ``java -version`` prints (to stderr), or "" when it does not run."""
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return version_line(done.stderr or done.stdout)


def version_line(output: str) -> str:
    """The line of ``java -version`` output that names the version.

    It is not always the first: with JAVA_TOOL_OPTIONS or JDK_JAVA_OPTIONS set, java first
    prints "Picked up ...".
    """
    lines = output.strip().splitlines()
    for line in lines:
        if 'version "' in line:
            return line
    return lines[0] if lines else ""


def java_major(version_text: str) -> int | None:
    """17 from 'openjdk version "17.0.15"', 8 from 'java version "1.8.0_392"'."""
    found = re.search(r'version "(\d+)(?:\.(\d+))?', version_text)
    if found is None:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def check_java(java: str | None, version_text: str, pyspark_version: str | None) -> Check:
    """Spark 4 needs Java 17+, Spark 3.5 Java 8+."""
    need = 17 if pyspark_version is None or _major(pyspark_version) >= 4 else 8
    if java is None:
        why = (
            "JAVA_HOME/bin/java is missing"
            if os.environ.get("JAVA_HOME")
            else ("no java on PATH and JAVA_HOME unset")
        )
        return Check("java", Status.PROBLEM, why, _INSTALL_JAVA.format(need=need))
    major = java_major(version_text)
    if major is None:
        return Check(
            "java",
            Status.PROBLEM,
            f"{java} -version printed {version_text!r}",
            _INSTALL_JAVA.format(need=need),
        )
    if major < need:
        return Check(
            "java",
            Status.PROBLEM,
            f"Java {major} at {java}; pyspark {pyspark_version} needs {need}+",
            _INSTALL_JAVA.format(need=need),
        )
    return Check("java", Status.OK, f"Java {major} ({java})")


def _major(version: str) -> int:
    head = version.split(".")[0]
    return int(head) if head.isdigit() else 0


def check_pyspark(version: str | None) -> Check:
    if version is None:
        return Check(
            "pyspark",
            Status.PROBLEM,
            "not installed",
            "pip install 'sparkdist[spark]' (local mode alone works without it)",
        )
    return in_range("pyspark", version)


class SparkProbe:
    """A child process that starts a local[1] session and runs one Python task on it."""

    def __init__(self, timeout_s: float) -> None:
        env = dict(os.environ)
        # The probe session is local: keep its driver on loopback, whatever the host resolves to.
        env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from sparkdist._doctor.spark import probe_main; probe_main()"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,  # its own group: on timeout the JVM is killed with it
        )

    def check(self) -> Check:
        """Wait for the probe and judge what it reported."""
        try:
            out, err = self._process.communicate(
                timeout=max(0.0, self._deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            self.kill()
            return Check(
                "spark session",
                Status.PROBLEM,
                f"a local[1] session did not run a task within {self._timeout_s:.0f} s",
                "run `pyspark` to see why it hangs (a conf in spark-defaults.conf that asks "
                "for resources this machine lacks, or a slow DNS lookup: set SPARK_LOCAL_IP)",
            )
        return judge_probe(self._process.returncode, out, err)

    def running(self) -> bool:
        """Whether the probe has not ended yet."""
        return self._process.poll() is None

    def kill(self) -> None:
        """End the probe and its JVM if they are still running."""
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._process.wait()


def judge_probe(returncode: int, out: str, err: str) -> Check:
    """Turn the probe's exit code and output into the session check."""
    for line in out.splitlines():
        if line.startswith(_PROBE_MARKER) and returncode == 0:
            report = json.loads(line[len(_PROBE_MARKER) :])
            return Check(
                "spark session",
                Status.OK,
                f"Spark {report['spark_version']}: local[1] ran a Python task in "
                f"{report['seconds']:.1f} s",
            )
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    last = (errors or lines or [f"exit code {returncode}"])[-1]
    return Check(
        "spark session",
        Status.PROBLEM,
        f"a local[1] session failed: {last[:300]}",
        "run `pyspark` to see the whole error; check JAVA_HOME and spark-defaults.conf",
    )


def probe_main() -> None:
    """The probe's body (run in the child): start local[1], run a task, report, stop."""
    from sparkdist._backends.session import create_session

    started = time.monotonic()
    # Task GPU amounts from spark-defaults.conf would leave the task waiting forever for a GPU
    # that local[1] does not have; the GPU conf is judged separately.
    session = create_session(
        "local[1]", {"spark.ui.enabled": "false", TASK_GPU_KEY: "0"}, app_name="sparkdist-doctor"
    )
    try:
        rdd = session.sparkContext.parallelize([0], 1)
        python = rdd.map(_executor_python).collect()[0]
        report = {
            "spark_version": session.version,
            "python": python,
            "seconds": time.monotonic() - started,
        }
    finally:
        session.stop()
    # The parent parses this one line; the JVM's own chatter goes to stderr.
    sys.stdout.write(_PROBE_MARKER + json.dumps(report) + "\n")


def _executor_python(_: int) -> str:
    return sys.executable


def check_gpu_conf(conf: Mapping[str, str], where: str, *, gpus_here: bool) -> Check:
    """Whether the Spark conf schedules GPUs the way Spark mode needs (pure).

    Args:
        conf: the Spark conf a session would get.
        where: where the conf came from, for the message.
        gpus_here: whether this machine has GPUs (then GPU scheduling is probably wanted).
    """
    name = "spark gpu conf"
    try:
        warnings = check_cluster_conf(conf, TORCH_IGNORE_SSL_KEY)
    except ClusterError as exc:
        what, fix = _split_fix(str(exc))
        return Check(name, Status.PROBLEM, f"{where}: {what}", fix)
    task, executor = conf.get(TASK_GPU_KEY, "").strip(), conf.get(EXECUTOR_GPU_KEY, "").strip()
    setup = (
        f"set {EXECUTOR_GPU_KEY}=<GPUs per executor>, {TASK_GPU_KEY}=1 and "
        f"{EXECUTOR_SCRIPT_KEY}=<path of getGpusResources.sh> (see conf/spark-defaults.conf)"
    )
    if not task and not executor:
        if gpus_here:
            return Check(
                name,
                Status.NOTE,
                f"{where}: GPU scheduling is off, so Spark mode would train on CPU",
                setup,
            )
        return Check(name, Status.OK, f"{where}: GPU scheduling off (CPU: one task per rank)")
    if task and not executor:
        return Check(
            name,
            Status.PROBLEM,
            f"{where}: {TASK_GPU_KEY}={task} but {EXECUTOR_GPU_KEY} is "
            "unset, so no task can get a GPU",
            setup,
        )
    if executor and not task:
        return Check(
            name,
            Status.NOTE,
            f"{where}: executors have GPUs but tasks ask for none, so Spark mode trains on CPU",
            f"set {TASK_GPU_KEY}=1 to train on the GPUs",
        )
    try:
        placement = place_on_cluster(
            LaunchConfig(num_processes=_whole(task), local_mode=False, use_gpu=True), conf
        )
    except ConfigError as exc:
        what, fix = _split_fix(str(exc))
        return Check(name, Status.PROBLEM, f"{where}: {what}", fix)
    detail = (
        f"{where}: {executor} GPU(s) per executor, {task} per task "
        f"({placement.processes_per_task} rank(s) per barrier task)"
    )
    notes = list(warnings)
    script = conf.get(EXECUTOR_SCRIPT_KEY, "").strip()
    if not script:
        notes.append(
            f"{EXECUTOR_SCRIPT_KEY} unset: fine where the cluster manager hands GPUs over "
            "(standalone Workers with spark.worker.resource.gpu.*), else executors find none"
        )
    elif not os.access(script, os.X_OK):
        notes.append(
            f"the discovery script {script} is not an executable file here (it must be on "
            "every executor host)"
        )
    if notes:
        return Check(name, Status.NOTE, detail, "; ".join(notes))
    return Check(name, Status.OK, detail)


#: Spark's wait, once it lost an executor, before it kills the other tasks of a barrier stage.
KILL_TIMEOUT_KEY = "spark.python.task.killTimeout"
_SPARK_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$")
_SECONDS_PER = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def spark_seconds(text: str, default_unit: str = "s") -> float | None:
    """A Spark time conf value ("2s", "500ms", "1min", "30") in seconds; None if unreadable."""
    match = _SPARK_TIME.match(text)
    if match is None:
        return None
    return float(match.group(1)) * _SECONDS_PER[match.group(2) or default_unit]


def check_preemption_conf(conf: Mapping[str, str], where: str) -> Check:
    """Whether a preempted executor's drain has time on the other hosts (pure).

    When one executor of a barrier stage is lost (its JVM got SIGTERM), Spark kills the stage's
    other tasks after ``spark.python.task.killTimeout`` (2 s by default): their ranks die before
    the drain's checkpoint unless that is at least ``preemption_grace_s``.
    """
    name = "preemption conf"
    text = conf.get(KILL_TIMEOUT_KEY, "").strip() or "2s"
    seconds = spark_seconds(text)
    wanted = f"{DEFAULT_PREEMPTION_GRACE_S:g}s"
    fix = (
        f"set {KILL_TIMEOUT_KEY}={wanted} (at least preemption_grace_s), so the other hosts' "
        "ranks finish the drain's checkpoint when one executor is preempted"
    )
    if seconds is None:
        return Check(name, Status.NOTE, f"{where}: {KILL_TIMEOUT_KEY}={text} is unreadable", fix)
    if seconds < DEFAULT_PREEMPTION_GRACE_S:
        return Check(
            name,
            Status.NOTE,
            f"{where}: {KILL_TIMEOUT_KEY}={text}: a preempted executor's peers are killed "
            f"{seconds:g} s after it is lost",
            fix,
        )
    return Check(name, Status.OK, f"{where}: {KILL_TIMEOUT_KEY}={text}")


def _whole(amount: str) -> int:
    """A task GPU amount as a rank count for the placement check (bad values fail there)."""
    try:
        value = float(amount)
    except ValueError:
        return 1
    return int(value) if value >= 1 and value == int(value) else 1


def _split_fix(message: str) -> tuple[str, str]:
    """The library's errors say what is wrong, then "; " and the fix: split the two."""
    what, sep, fix = message.rpartition("; ")
    return (what, fix) if sep else (message, "")
