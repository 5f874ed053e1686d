"""A real Spark standalone cluster on 127.0.0.1: one Master and N Workers from pyspark's own
``bin/spark-class``, each Worker advertising fake GPUs through conf/fakeGpusResources.sh.

Every daemon binds an OS-chosen port (``--port 0 --webui-port 0``) so nothing races for a fixed
one; readiness is read from their logs ("Starting Spark master at spark://...", "Successfully
registered with master") with a deadline, not guessed with sleeps. Every process the cluster
starts (daemons, executors, Python workers, ranks) inherits ``CLUSTER_MARK_VAR``, which is how
``processes`` finds them and ``stop`` proves none is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.conftest import FAST_JVM_OPTIONS

CLUSTER_MARK_VAR = "SPARKDIST_TEST_CLUSTER"
WORKER_NAME_VAR = "SPARKDIST_TEST_WORKER"
_MASTER_URL = re.compile(r"Starting Spark master at (spark://\S+)")
_REGISTERED = "Successfully registered with master"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@dataclass
class StandaloneCluster:
    """A cluster on this machine; call ``stop`` in a ``finally`` so it always ends."""

    directory: Path
    master_url: str = ""
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)
    _daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a daemon (or of a driver that should be found as part of it)."""
        return {
            **os.environ,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_DAEMON_JAVA_OPTS": FAST_JVM_OPTIONS,
            "SPARK_LOG_DIR": str(self.directory / "logs"),
            CLUSTER_MARK_VAR: self.mark,
            **extra,
        }

    def start(
        self,
        num_workers: int,
        cores: int,
        gpus: int,
        fake_gpu_script: Path,
        timeout_s: float = 90.0,
    ) -> StandaloneCluster:
        deadline = time.monotonic() + timeout_s
        master_log = self.directory / "master.log"
        self._spawn(
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--webui-port",
                "0",
            ],
            master_log,
            self.env(),
        )
        self.master_url = _wait_for(master_log, _MASTER_URL, deadline, self._daemons[0]).group(1)
        properties = self.directory / "worker.properties"
        properties.write_text(
            f"spark.worker.resource.gpu.amount {gpus}\n"
            f"spark.worker.resource.gpu.discoveryScript {fake_gpu_script}\n"
        )
        logs = []
        for index in range(num_workers):
            work_dir = self.directory / f"worker-{index}"
            work_dir.mkdir()
            log = self.directory / f"worker-{index}.log"
            self._spawn(
                [
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--webui-port",
                    "0",
                    "--cores",
                    str(cores),
                    "--memory",
                    "1g",
                    "--work-dir",
                    str(work_dir),
                    "--properties-file",
                    str(properties),
                    self.master_url,
                ],
                log,
                self.env(**{WORKER_NAME_VAR: f"worker-{index}", "SPARKDIST_FAKE_GPUS": str(gpus)}),
            )
            logs.append((log, self._daemons[-1]))
        for log, daemon in logs:
            _wait_for(log, re.compile(re.escape(_REGISTERED)), deadline, daemon)
        return self

    def _spawn(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        with open(log, "wb") as out:
            self._daemons.append(
                subprocess.Popen(
                    [str(spark_home() / "bin" / "spark-class"), *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # its own group: stop() signals the JVM and its shell
                )
            )

    def processes(self) -> list[psutil.Process]:
        """Live processes that belong to this cluster (daemons, executors, ranks...)."""
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if (
                    proc.status() != psutil.STATUS_ZOMBIE
                    and proc.environ().get(CLUSTER_MARK_VAR) == self.mark
                ):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def stop(self, timeout_s: float = 30.0) -> list[psutil.Process]:
        """Stop Workers (they stop their executors), then the Master; return survivors."""
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                os.killpg(daemon.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for daemon in self._daemons:
            try:
                daemon.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        survivors = self.processes()
        while survivors and time.monotonic() < deadline:
            time.sleep(0.1)  # executors exit after their Worker; nothing to wait on but them
            survivors = self.processes()
        for proc in survivors:
            proc.kill()
        return survivors


def _wait_for(
    log: Path, pattern: re.Pattern[str], deadline: float, daemon: subprocess.Popen[bytes]
) -> re.Match[str]:
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = pattern.search(text)
        if found:
            return found
        if daemon.poll() is not None:
            raise RuntimeError(
                f"{log.name}: the daemon exited ({daemon.returncode}):\n{text[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log.name}: no {pattern.pattern!r} in time:\n{text[-3000:]}")
        time.sleep(0.1)  # polling the log is the handshake; the daemon offers no other signal
