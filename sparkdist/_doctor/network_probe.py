"""The probe behind ``sparkdist doctor --master``: one barrier job, one task per executor slot.

The driver opens a TCP listener on the address executors reach it at (``driver_host``: what
the control channel binds) and makes a random token. Each task then, every wait bounded:

1. reads its address (the host part of its ``getTaskInfos()`` entry), the interface holding
   it (``_node.interfaces``) and what its own host name resolves to;
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
import queue
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from sparkdist._core.addresses import ip_literal, pick_address, task_host
from sparkdist._doctor.network import (
    NetworkReport,
    NodeObservation,
    Reach,
    observation_from_dict,
    report_from_json,
    report_to_json,
)
from sparkdist._node.interfaces import interface_of

#: Each connection attempt, and each name lookup, gets this long.
CONNECT_TIMEOUT_S = 5.0
#: How long the probe waits for executors to register their slots.
SLOT_WAIT_S = 30.0
_WORD = "sparkdist-doctor-probe"
_MAX_LINE_BYTES = 256
_MARKER = "sparkdist-doctor-network "
T = TypeVar("T")


@dataclass(frozen=True)
class TaskPlan:
    """What every barrier task of the probe is told."""

    token: str
    driver_host: str
    driver_port: int
    connect_timeout_s: float = CONNECT_TIMEOUT_S


class TokenListener:
    """A TCP listener on one address that counts the tasks presenting the token.

    A knock is one line, ``<word> <token> <task>``; the answer ``<word> ok <token>``. Anything
    else is closed unanswered. Pending connections, line sizes and the listener's life are
    bounded; it serves on its own thread until ``close`` or ``timeout_s``.
    """

    def __init__(self, host: str, token: str, expected: int, timeout_s: float) -> None:
        family = socket.AF_INET6 if (ip := ip_literal(host)) and ip.version == 6 else 0
        infos = socket.getaddrinfo(host, 0, family, socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        self._socket = socket.socket(family, kind, proto)
        try:
            self._socket.bind(address)
            self._socket.listen(min(expected + 16, 1024))
        except OSError:
            self._socket.close()
            raise
        self._socket.setblocking(False)
        self.port = int(self._socket.getsockname()[1])
        self._token = token
        self._expected = expected
        self._deadline = time.monotonic() + timeout_s
        self._closing = threading.Event()
        self.seen: set[int] = set()
        self._all_seen = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sparkdist-doctor", daemon=True)
        self._thread.start()

    def wait_for_all(self, timeout_s: float) -> bool:
        """Wait until every expected task knocked; False when ``timeout_s`` passed first."""
        return self._all_seen.wait(timeout_s)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._closing.set()
        self._thread.join(2.0)

    def _serve(self) -> None:
        pending: dict[socket.socket, tuple[bytearray, float]] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(self._socket, selectors.EVENT_READ)
            while not self._closing.is_set() and time.monotonic() < self._deadline:
                for key, _ in selector.select(timeout=0.1):
                    if key.fileobj is self._socket:
                        self._accept(selector, pending)
                    else:
                        self._read(selector, pending, key.fileobj)  # type: ignore[arg-type]
                stale = time.monotonic() - CONNECT_TIMEOUT_S
                for conn in [c for c, (_, at) in pending.items() if at < stale]:
                    self._drop(selector, pending, conn)
            for conn in list(pending):
                self._drop(selector, pending, conn)
        self._socket.close()

    def _accept(self, selector: selectors.BaseSelector, pending: dict[Any, Any]) -> None:
        try:
            conn, _ = self._socket.accept()
        except OSError:
            return
        if len(pending) >= self._expected + 16:
            conn.close()
            return
        conn.setblocking(False)
        pending[conn] = (bytearray(), time.monotonic())
        selector.register(conn, selectors.EVENT_READ)

    def _read(
        self, selector: selectors.BaseSelector, pending: dict[Any, Any], conn: socket.socket
    ) -> None:
        buffer, _ = pending[conn]
        try:
            data = conn.recv(_MAX_LINE_BYTES)
        except OSError:
            data = b""
        buffer.extend(data)
        if not data or len(buffer) > _MAX_LINE_BYTES:
            self._drop(selector, pending, conn)
            return
        if b"\n" not in buffer:
            return
        words = buffer.split(b"\n", 1)[0].decode("ascii", "replace").split()
        if len(words) == 3 and words[0] == _WORD and secrets.compare_digest(words[1], self._token):
            with contextlib.suppress(OSError, ValueError):
                conn.setblocking(True)
                conn.settimeout(1.0)
                conn.sendall(f"{_WORD} ok {self._token}\n".encode())
                self.seen.add(int(words[2]))
                if len(self.seen) >= self._expected:
                    self._all_seen.set()
        self._drop(selector, pending, conn)

    @staticmethod
    def _drop(selector: selectors.BaseSelector, pending: dict[Any, Any], conn: Any) -> None:
        pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn)
        conn.close()


def knock(host: str, port: int, token: str, task: int, timeout_s: float) -> Reach:
    """Knock on a ``TokenListener``: reached only when it answers with the token."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    started = time.monotonic()
    deadline = started + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(f"{_WORD} {token} {task}\n".encode())
            answer = b""
            while b"\n" not in answer and len(answer) <= _MAX_LINE_BYTES:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                data = conn.recv(_MAX_LINE_BYTES)
                if not data:
                    break
                answer += data
    except ConnectionRefusedError:
        return Reach(target, False, "connection refused", time.monotonic() - started)
    except TimeoutError:
        return Reach(target, False, f"no answer within {timeout_s:g} s", time.monotonic() - started)
    except OSError as exc:
        return Reach(target, False, exc.strerror or str(exc), time.monotonic() - started)
    took = time.monotonic() - started
    if answer.split(b"\n", 1)[0] != f"{_WORD} ok {token}".encode():
        return Reach(target, False, "answered without the token (another service?)", took)
    return Reach(target, True, "", took)


def bounded(call: Callable[[], T], timeout_s: float) -> T:
    """``call()`` on a daemon thread, given up after ``timeout_s`` (a slow DNS lookup).

    Raises:
        TimeoutError: it took longer.
        Exception: what ``call`` raised.
    """
    answers: queue.Queue[tuple[bool, Any]] = queue.Queue(1)

    def run() -> None:
        try:
            answers.put((True, call()))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            answers.put((False, exc))

    threading.Thread(target=run, name="sparkdist-doctor-lookup", daemon=True).start()
    try:
        ok, value = answers.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def resolve(name: str) -> list[str]:
    """``name``'s addresses, in the resolver's order."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def observe_here(task: int, address: str, timeout_s: float) -> NodeObservation:
    """This host's part of a task's observation (nothing connected yet)."""
    name = socket.gethostname()
    addresses: tuple[str, ...] = ()
    error = ""
    try:
        addresses = tuple(bounded(lambda: resolve(name), timeout_s))
    except (OSError, UnicodeError, TimeoutError) as exc:
        error = str(exc)
    held = address
    if ip_literal(address) is None:  # Spark named the executor by name: its address
        with contextlib.suppress(OSError, UnicodeError, TimeoutError):
            held = pick_address(bounded(lambda: resolve(address), timeout_s)) or address
    return NodeObservation(
        task=task,
        address=address,
        interface=interface_of(held) or "",
        host_name=name,
        name_addresses=addresses,
        name_error=error,
    )


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
