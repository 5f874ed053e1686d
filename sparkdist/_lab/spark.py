"""A real Spark standalone cluster in the lab, and a driver program on a host of its own.

The Master runs on the driver's host, one Worker per other host (pyspark's own
``bin/spark-class``), each bound to its host's lab address. Readiness is read from the daemons'
logs ("Successfully registered with master") with a deadline; then every host proves it reaches
every other (a TCP connection to each Worker's port), so a test starts on a checked cluster.

``LabCluster.driver`` is a kernel (``kernel``) on the driver's host holding one SparkSession:
tests send it code, as a notebook would, so the session and sparkdist's warm pool are shared by
the tests that do not break them. ``restart_host`` brings back a host a fault test killed.

Non-goals: YARN or Kubernetes; Spark's web UIs (they bind ports and are never used).
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdist._lab.client import LabError
from sparkdist._lab.lab import DRIVER_ADDRESS, Host, Lab, NameResolution

MASTER_PORT = 7077
WORKER_PORT = 7078
MASTER_URL = f"spark://{DRIVER_ADDRESS}:{MASTER_PORT}"
#: C1 only and the serial collector: JVMs start about 3.5 s sooner on a 2-core box.
FAST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
_REGISTERED = "Successfully registered with master"
_RE_REGISTER = "Attempted to re-register worker at same address"
_MASTER_UP = "Starting Spark master at"


def spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).resolve().parent / "bin" / "spark-class")


def session_code(master_url: str, conf: dict[str, str]) -> str:
    """The driver's SparkSession, as code for the kernel (and for a user's own driver)."""
    settings = {
        "spark.executor.memory": "512m",
        "spark.executor.cores": "1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.extraJavaOptions": FAST_JVM_OPTIONS,
        "spark.executor.extraJavaOptions": FAST_JVM_OPTIONS,
        "spark.sql.execution.pyspark.udf.faulthandler.enabled": "true",
        **conf,
    }
    return textwrap.dedent(
        f"""
        from pyspark.sql import SparkSession
        builder = SparkSession.builder.master({master_url!r}).appName("sparkdist-lab")
        for key, value in {settings!r}.items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        """
    )


@dataclass
class DriverKernel:
    """The driver program on the driver's host (see ``kernel``)."""

    lab: Lab
    proc: int
    pid: int
    log: Path

    def run(self, code: str, timeout_s: float = 240.0) -> dict[str, Any]:
        """Run ``code`` on the driver; its ``result``, output and error (a traceback or None)."""
        self.lab.call(
            "send", proc=self.proc, data=json.dumps({"code": textwrap.dedent(code)}) + "\n"
        )
        reply = self.lab.call("read_line", timeout_s=timeout_s, proc=self.proc)
        if not reply["line"]:
            raise LabError(
                f"the lab's driver exited ({reply['rc']}): {self.log.read_text()[-3000:]}"
            )
        return json.loads(reply["line"])  # type: ignore[no-any-return]

    def check(self, code: str, timeout_s: float = 240.0) -> Any:
        """Run ``code`` and return its ``result``; raise with its traceback and output."""
        reply = self.run(code, timeout_s)
        if reply["error"]:
            raise LabError(
                f"the driver's code raised:\n{reply['error']}\noutput:\n{reply['output'][-4000:]}"
            )
        return reply["result"]


@dataclass
class LabCluster:
    """A Spark standalone cluster on the lab's hosts (``hosts[0]`` is the driver's)."""

    lab: Lab
    workers: list[str]
    #: Each Worker's cores: two, so that a second application (spark-submit, a Connect server)
    #: finds executors while the driver's own holds one core per host (``spark.cores.max``).
    cores: int = 2
    master: dict[str, Any] = field(default_factory=dict)
    worker_procs: dict[str, dict[str, Any]] = field(default_factory=dict)
    driver: DriverKernel | None = None

    @property
    def master_url(self) -> str:
        return MASTER_URL

    def _daemon_env(self, host: str) -> dict[str, str]:
        return self.lab.env(
            host,
            SPARK_DAEMON_MEMORY="256m",
            SPARK_DAEMON_JAVA_OPTS=FAST_JVM_OPTIONS,
            SPARK_WORKER_DIR="/tmp/spark-work",
            SPARK_LOCAL_DIRS="/tmp/spark-local",
            SPARK_LOG_DIR="/tmp/spark-logs",
        )

    def _log(self, name: str) -> Path:
        return self.lab.directory / "logs" / f"{name}.log"

    def start(self, timeout_s: float = 120.0) -> LabCluster:
        deadline = time.monotonic() + timeout_s
        self.master = self.lab.spawn(
            "driver",
            [
                spark_class(),
                "org.apache.spark.deploy.master.Master",
                "--host",
                DRIVER_ADDRESS,
                "--port",
                str(MASTER_PORT),
                "--webui-port",
                "8080",
            ],
            self._log("master"),
            env=self._daemon_env("driver"),
        )
        self._wait_for_log(self._log("master"), _MASTER_UP, deadline)
        for host in self.workers:
            self._start_worker(host)
        for host in self.workers:
            self._wait_for_log(self._log(f"worker-{host}"), _REGISTERED, deadline)
        self.check_reachability()
        return self

    def _start_worker(self, host: str) -> None:
        log = self._log(f"worker-{host}")
        log.write_bytes(b"")
        self.worker_procs[host] = self.lab.spawn(
            host,
            [
                spark_class(),
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                self.lab.hosts[host].address,
                "--port",
                str(WORKER_PORT),
                "--webui-port",
                "8081",
                "--cores",
                str(self.cores),
                "--memory",
                "1g",
                MASTER_URL,
            ],
            log,
            env=self._daemon_env(host),
        )

    def _wait_for_log(self, log: Path, text: str, deadline: float) -> None:
        while True:
            content = log.read_text(errors="replace") if log.exists() else ""
            if text in content:
                return
            if time.monotonic() > deadline:
                raise LabError(f"{log.name}: no {text!r} in time:\n{content[-3000:]}")
            time.sleep(0.1)  # the daemon's log is its only readiness signal

    def check_reachability(self) -> None:
        """Every host reaches every other: a TCP connection to each Worker's port (and the
        Master's), from every host."""
        targets = [(DRIVER_ADDRESS, MASTER_PORT)] + [
            (self.lab.hosts[h].address, WORKER_PORT) for h in self.workers
        ]
        probe = (
            "import socket, sys\n"
            f"for address, port in {targets!r}:\n"
            "    socket.create_connection((address, port), timeout=5).close()\n"
        )
        for host in ["driver", *self.workers]:
            done = self.lab.python(host, probe, timeout_s=30)
            if done.rc != 0:
                raise LabError(f"lab host {host} does not reach its peers: {done.stderr[-1500:]}")

    def start_driver(self, conf: dict[str, str] | None = None, **env: str) -> DriverKernel:
        """Start the driver program (once) and its SparkSession; returns the kernel."""
        if self.driver is None:
            self.driver = self._start_kernel(self._log("driver"), env)
            # One core per host: the rest is left for a second application.
            cores = {"spark.cores.max": str(len(self.workers))}
            self.driver.check(session_code(MASTER_URL, {**cores, **(conf or {})}))
            self.wait_for_executors(len(self.workers))
        return self.driver

    def start_application(
        self, conf: dict[str, str], executors: int, timeout_s: float = 90.0, **env: str
    ) -> DriverKernel:
        """Another driver program with an application of its own (``conf`` over the lab's
        session settings), once it has ``executors`` executors; the caller stops it
        (``stop_application``). The cores it can get are those the other applications left."""
        driver = self._start_kernel(self._log(f"driver-{time.monotonic_ns()}"), env)
        driver.check(session_code(MASTER_URL, conf))
        wait_for_executors(driver, executors, timeout_s)
        return driver

    def _start_kernel(self, log: Path, env: dict[str, str]) -> DriverKernel:
        reply = self.lab.spawn(
            "driver",
            [sys.executable, "-m", "sparkdist._lab.kernel"],
            log,
            env=self.lab.env("driver", **env),
            pipes=True,
        )
        return DriverKernel(self.lab, reply["proc"], reply["pid"], log)

    def stop_application(self, driver: DriverKernel) -> None:
        """End an application of ``start_application``: its session (its executors go), then
        its driver program."""
        try:
            driver.check("spark.stop()")
        finally:
            self.lab.signal(driver.pid, 9)

    def wait_for_executors(self, count: int, timeout_s: float = 90.0) -> None:
        """Wait until the driver's application has ``count`` executors."""
        assert self.driver is not None
        wait_for_executors(self.driver, count, timeout_s)

    def restart_host(self, host: str, timeout_s: float = 90.0) -> None:
        """Bring back a host that a fault killed: fresh namespaces, a Worker, and the driver's
        executors one per host again."""
        if host in self.lab.hosts and any(p["host"] == host for p in self.lab.processes(host)):
            self.lab.kill_host(host)
        self.lab.replace_host(host)
        deadline = time.monotonic() + timeout_s
        log = self._log(f"worker-{host}")
        while True:
            self._start_worker(host)
            try:
                self._wait_for_log(log, _REGISTERED, min(deadline, time.monotonic() + 15))
                break
            except LabError:
                # The master may still hold the old Worker at this address (a host killed
                # behind a cut sends no FIN): it lets it go after spark.worker.timeout.
                if time.monotonic() > deadline or _RE_REGISTER not in log.read_text():
                    raise
                self.lab.signal(self.worker_procs[host]["pid"], 9)
                time.sleep(2.0)
        if self.driver is not None:
            self._spread_executors(time.monotonic() + timeout_s)

    def heal_host(self, host: str, timeout_s: float = 90.0) -> None:
        """Bring back a host that was cut off (its processes lived on): its link up, then wait
        until a barrier job runs on every host again (TCP retransmits at a backed-off pace, so
        the driver's links to it may take seconds to recover)."""
        self.lab.heal(host)
        if self.driver is None:
            return
        self.driver.check(
            f"""
            import socket
            from pyspark import BarrierTaskContext
            def where(_):
                BarrierTaskContext.get().barrier()
                yield socket.gethostname()
            rdd = spark.sparkContext.parallelize(range({len(self.workers)}), {len(self.workers)})
            result = sorted(rdd.barrier().mapPartitions(where).collect())
            assert len(set(result)) == len(result), result
            """,
            timeout_s=timeout_s,
        )

    def executor_hosts(self) -> list[str]:
        """The lab hosts of the driver's executors (a host twice when it runs two)."""
        assert self.driver is not None
        addresses = self.driver.check(
            """
            keys = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().keys().toList()
            result = [keys.apply(i).rsplit(":", 1)[0] for i in range(keys.size())]
            """
        )
        by_name = {h.hostname: h.name for h in self.lab.hosts.values()}
        by_address = {h.address: h.name for h in self.lab.hosts.values()}
        found = [by_address.get(a) or by_name.get(a, a) for a in addresses]
        return sorted(h for h in found if h != "driver")  # the driver's own block manager

    def _spread_executors(self, deadline: float) -> None:
        """Wait for one executor per Worker host. The master replaces a lost executor at once
        on a live Worker with a free core, so a host may run two until one of them goes; the
        master then starts its replacement on the Worker with the most free cores (the one
        that came back)."""
        while True:
            hosts = self.executor_hosts()
            if sorted(set(hosts)) == sorted(self.workers) and len(hosts) == len(self.workers):
                return
            if time.monotonic() > deadline:
                raise LabError(f"the driver's executors are on {hosts}, not one per host")
            twice = [h for h in set(hosts) if hosts.count(h) > 1]
            if twice:
                backends = [
                    p
                    for p in self.lab.processes(twice[0])
                    if any("CoarseGrainedExecutorBackend" in a for a in p["argv"])
                    and any(a == self.driver_app_id() for a in p["argv"])
                ]
                if backends:
                    self.lab.signal(max(p["pid"] for p in backends), 9)
            time.sleep(0.5)

    def driver_app_id(self) -> str:
        assert self.driver is not None
        return str(self.driver.check("result = spark.sparkContext.applicationId"))


def wait_for_executors(driver: DriverKernel, count: int, timeout_s: float = 90.0) -> None:
    """Wait until ``driver``'s application has ``count`` executors."""
    driver.check(
        f"""
        import time
        deadline = time.monotonic() + {timeout_s}
        while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1 < {count}:
            if time.monotonic() > deadline:
                raise TimeoutError("executors: " + str(spark.sparkContext._jsc.sc()
                                   .getExecutorMemoryStatus().size() - 1))
            time.sleep(0.1)
        """,
        timeout_s=timeout_s + 30,
    )


def start_lab_cluster(
    directory: Path,
    hosts: int = 3,
    *,
    cores: int = 2,
    resolution: NameResolution | list[NameResolution] = NameResolution.PEERS,
    timeout_s: float = 120.0,
) -> LabCluster:
    """A lab of ``hosts`` worker hosts plus the driver's, and a Spark cluster on it."""
    lab = Lab(directory, directory / "shared", mark=directory.name)
    try:
        made: list[Host] = lab.add_hosts(hosts, resolution)
        cluster = LabCluster(lab, [h.name for h in made[1:]], cores)
        return cluster.start(timeout_s)
    except BaseException:
        lab.close()
        raise
