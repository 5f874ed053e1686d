"""The probe behind ``sparkdist doctor --master``: one barrier job, one task per executor slot.

The driver makes a random token and opens a TCP listener (``knock.TokenListener``) on the
address executors reach it at (``driver_host``: what the control channel binds). Each task
then, every wait bounded:

1. reads its address (the host part of its ``getTaskInfos()`` entry), the interface holding
   it (``_node.host.interfaces``) and what its own host name resolves to;
2. knocks on the driver's listener: sends the token and its task id, and counts as reached
   only when the listener answers with the token (a stray service on that port does not count,
   nor does a stray connection on the listener's side);
3. task 0 opens a test listener on its own address (port 0, kept until the others knocked or
   the deadline passed); its port reaches the others through ``allGather``;
4. every task knocks on task 0's listener the same way, and reports what it saw.

The job runs on a thread of the probe's process and is cancelled past its deadline; the
command line runs the probe in a child process (``ClusterProbe``) so a session that hangs on
an unreachable master cannot take the doctor with it.

Non-goals: judging what the tasks saw (``network``); the run's own barrier stage (``_backends.
stage``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from sparkdist._core.addresses import task_host
from sparkdist._doctor.knock import CONNECT_TIMEOUT_S, TokenListener, knock, observe_here
from sparkdist._doctor.network import (
    NetworkReport,
    NodeObservation,
    Reach,
    observation_from_dict,
    report_from_json,
    report_to_json,
)

#: How long the probe waits for executors to register their slots.
SLOT_WAIT_S = 30.0
_MARKER = "sparkdist-doctor-network "


@dataclass(frozen=True)
class TaskPlan:
    """What every barrier task of the probe is told."""

    token: str
    driver_host: str
    driver_port: int
    connect_timeout_s: float = CONNECT_TIMEOUT_S


def probe_partition(plan: TaskPlan, _: Iterator[Any]) -> Iterator[str]:
    """One barrier task of the probe (see the module docstring); yields its observation."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    task = context.partitionId()
    hosts = [task_host(info.address) for info in context.getTaskInfos()]
    timeout_s = plan.connect_timeout_s
    seen = observe_here(task, hosts[task], timeout_s)
    driver = knock(plan.driver_host, plan.driver_port, plan.token, task, timeout_s)
    listener = None
    offer: dict[str, object] = {}
    if task == 0:
        try:
            # Kept until every task knocked, or well past their own deadlines.
            listener = TokenListener(hosts[0], plan.token, len(hosts), 4 * timeout_s)
            offer = {"port": listener.port}
        except OSError as exc:
            offer = {"error": f"{hosts[0]}: {exc.strerror or exc}"}
    try:
        gathered = json.loads(context.allGather(json.dumps(offer))[0])
        if "port" in gathered:
            task0 = knock(hosts[0], int(gathered["port"]), plan.token, task, timeout_s)
        else:
            task0 = Reach("", False, str(gathered.get("error", "no port")))
        if listener is not None:
            listener.wait_for_all(2 * timeout_s)
    finally:
        if listener is not None:
            listener.close()
    observed = NodeObservation(**{**asdict(seen), "driver": driver, "task0": task0})
    yield json.dumps(asdict(observed))


def count_slots(session: Any, conf: Mapping[str, str], wait_s: float) -> int:
    """The cluster's barrier slots once its executors have registered (or ``wait_s`` passed).

    Executors register one by one: with a known count (local-cluster, YARN, Kubernetes) the
    probe waits for all of them; without one (standalone) until the count has held 2 s.
    """
    from sparkdist._backends.spark_driver import count_barrier_slots, expected_executors

    expected = expected_executors(conf)
    started = time.monotonic()
    last, since = -1, started
    while True:
        counted = count_barrier_slots(session)
        now = time.monotonic()
        if counted is None:
            return max(1, int(session.sparkContext.defaultParallelism))
        found, registered = counted
        if found != last:
            last, since = found, now
        settled = (expected is not None and registered >= expected) or (
            expected is None and found > 0 and now - since >= 2.0
        )
        if (settled and found > 0) or now - started >= wait_s:
            return found
        time.sleep(0.2)  # executors register asynchronously; Python sees no event for it


def probe_cluster(
    session: Any, timeout_s: float, slot_wait_s: float = SLOT_WAIT_S
) -> NetworkReport:
    """Run the probe's barrier job on ``session`` (a classic SparkSession) and report.

    Every wait is bounded: the slot count by ``slot_wait_s``, the job by what is left of
    ``timeout_s`` (then it is cancelled), each connection by ``CONNECT_TIMEOUT_S``.
    """
    from sparkdist._backends.spark_driver import driver_host, spark_conf

    started = time.monotonic()
    conf = spark_conf(session)
    master = conf.get("spark.master", "?")
    tasks = count_slots(session, conf, min(slot_wait_s, timeout_s / 2))
    if tasks < 1:
        return NetworkReport(
            master,
            error=f"no executor registered within {slot_wait_s:g} s",
            fix="check that the master URL is right and the cluster has free cores for this "
            "application (the master's UI), or raise --spark-timeout",
        )
    host = driver_host(session, conf)
    token = secrets.token_hex(16)
    job_s = max(10.0, timeout_s - (time.monotonic() - started))
    try:
        listener = TokenListener(host, token, tasks, job_s + 5.0)
    except OSError as exc:
        return NetworkReport(
            master,
            tasks=tasks,
            error=f"the driver cannot listen on {host} ({exc.strerror or exc})",
            fix="set spark.driver.host to an address of this machine the executors reach",
        )
    target = f"[{host}]:{listener.port}" if ":" in host else f"{host}:{listener.port}"
    plan = TaskPlan(token, host, listener.port)
    try:
        rows, error, seconds = _run_job(session, plan, tasks, job_s)
    finally:
        listener.close()
    nodes = tuple(sorted((observation_from_dict(json.loads(r)) for r in rows), key=_task))
    fix = ""
    if error:
        fix = (
            f"check that the cluster can run {tasks} tasks at once for this application, and "
            "the executors' logs"
        )
    return NetworkReport(master, target, tasks, nodes, seconds, error, fix)


def _task(seen: NodeObservation) -> int:
    return seen.task


def _run_job(
    session: Any, plan: TaskPlan, tasks: int, timeout_s: float
) -> tuple[list[str], str, float]:
    """The barrier job on a thread: its rows, what went wrong ("" if nothing), its seconds."""
    context = session.sparkContext
    group = f"sparkdist-doctor-{plan.token[:8]}"
    outcome: dict[str, Any] = {}

    def job() -> None:
        context.setJobGroup(group, "sparkdist doctor: network probe", True)
        try:
            rdd = context.parallelize(range(tasks), tasks).barrier()
            outcome["rows"] = rdd.mapPartitions(lambda it: probe_partition(plan, it)).collect()
        except Exception as exc:  # noqa: BLE001 - reported as the probe's error
            outcome["error"] = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)

    started = time.monotonic()
    runner = threading.Thread(target=job, name="sparkdist-doctor-job", daemon=True)
    runner.start()
    runner.join(timeout_s)
    if runner.is_alive():
        context.cancelJobGroup(group)
        runner.join(10.0)
        return [], f"the barrier job did not finish within {timeout_s:.0f} s", timeout_s
    return list(outcome.get("rows", [])), outcome.get("error", ""), time.monotonic() - started


class ClusterProbe:
    """``probe_cluster`` on a session of ``master`` in a child process, bounded by its timeout."""

    def __init__(self, master: str, conf: Mapping[str, str], timeout_s: float) -> None:
        self._master = master
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        request = json.dumps({"master": master, "conf": dict(conf), "timeout_s": timeout_s})
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from sparkdist._doctor.network_probe import probe_main; probe_main()",
                request,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # its own group: on timeout the JVM is killed with it
        )

    def report(self) -> NetworkReport:
        """Wait for the child (up to the timeout) and return what it found."""
        try:
            out, err = self._process.communicate(
                timeout=max(0.0, self._deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            self.kill()
            return NetworkReport(
                self._master,
                error=f"no session on it ran the probe within {self._timeout_s:.0f} s",
                fix="check the master URL and that this machine reaches it (spark-shell "
                "--master URL shows why it hangs), or raise --spark-timeout",
            )
        return judge_child(self._master, self._process.returncode, out, err)

    def running(self) -> bool:
        """Whether the child has not ended yet."""
        return self._process.poll() is None

    def kill(self) -> None:
        """End the child and its JVM if they still run."""
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


def judge_child(master: str, returncode: int, out: str, err: str) -> NetworkReport:
    """The child's report line, or what its failure said."""
    for line in out.splitlines():
        if line.startswith(_MARKER):
            with contextlib.suppress(ValueError):
                return report_from_json(line[len(_MARKER) :])
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    last = (errors or lines or [f"exit code {returncode}"])[-1]
    return NetworkReport(
        master,
        error=f"no session on it ran the probe: {last[:300]}",
        fix="check the master URL and that this machine reaches it (run with -v, or "
        "spark-shell --master URL, to see Spark's whole error)",
    )


def probe_main() -> None:
    """The child's body: a session on the master, the probe, one report line, stop."""
    from sparkdist._backends.session import create_session

    request = json.loads(sys.argv[1])
    started = time.monotonic()
    conf = {k: v for k, v in request["conf"].items() if k != "spark.master"}
    session = create_session(
        request["master"], {"spark.ui.enabled": "false", **conf}, app_name="sparkdist-doctor"
    )
    try:
        left = float(request["timeout_s"]) - (time.monotonic() - started) - 5.0
        report = probe_cluster(session, max(10.0, left))
    finally:
        session.stop()
    # The parent parses this one line; the JVM's own chatter goes to stderr.
    sys.stdout.write(_MARKER + report_to_json(report) + "\n")
