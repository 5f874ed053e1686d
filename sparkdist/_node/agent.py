"""The agent: spawns and watches the workers of one node (a barrier task, or the driver in local
mode), forwards their output, and relays the rendezvous.

The same ``run_agent`` runs inside a Spark barrier task and, in local mode, on a thread of the
driver (DESIGN.md rule 7). It talks to the driver only through the control channel, and returns
one ``Outcome`` per rank; failures are data here, never exceptions, so the driver always learns
every rank's fate through the same path.

Watching: a worker that fails on its own is reported to the driver at once and its node-mates
are killed without waiting for the driver's word; an "abort" from the driver (another node
failed, a timeout, Ctrl-C) kills every worker here. Each worker leads its own process group;
ending a rank ends its group, every descendant (one that called setsid included) and every
process that inherited the rank's environment (``reaper``): SIGTERM, then SIGKILL after a short
grace. In local mode the driver can also stop the agent directly (``Agent.stop``).

Non-goals: deciding placement or environment (``_placement``, ``_env``), touching Spark.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from sparkdist._core.env import (
    DEEPSPEED_CONFIG_VAR,
    PARTITION_FILE_VAR,
    RUN_ID_VAR,
    RankSeat,
    seats_of_node,
    worker_env,
)
from sparkdist._core.errors import RankFailure
from sparkdist._core.lines import read_lines
from sparkdist._core.versions import Requirement, refusal_error, unmet_requirements
from sparkdist._node import worker as _worker
from sparkdist._node.detached import DetachedFailure, DetachedRendezvous
from sparkdist._node.gpus import gpu_type_mismatch, gpus_at
from sparkdist._node.outbox import Outbox
from sparkdist._node.partition import partition_path, write_partition
from sparkdist._node.pool import RankProcess, start_rank
from sparkdist._node.reaper import end_processes, start_time
from sparkdist._shipping.code import put_code_first, unpack_code
from sparkdist._wire.channel import ChannelClient, ChannelClosed, Message
from sparkdist._wire.payload import Outcome

logger = logging.getLogger("sparkdist")

#: Lines kept per rank for the failure report.
LAST_LINES = 30
#: How long a finished agent waits for its buffered output to reach the driver.
FLUSH_TIMEOUT_S = 5.0
#: Output lines a detached node keeps to return with its outcomes (the latest ones).
KEPT_LINES = 20_000
#: How long an exited rank's output may still be drained.
OUTPUT_DRAIN_S = 1.0
#: How long a hung rank gets to print its stack dump before it is killed.
STACK_DUMP_GRACE_S = 0.5


@dataclass(frozen=True)
class AgentSpec:
    """Everything one agent needs; pickled into the Spark task (or passed in local mode).

    Attributes:
        run_id: the run's id.
        job_bytes: the pickled Job.
        node_rank: this node's index; its ranks are node_rank * processes_per_node + i.
        num_nodes: nodes in the run.
        processes_per_node: ranks this node runs.
        master_addr: host of rank 0, where the store lives.
        host: this node's host, for messages.
        channel_address: (host, port) of the driver's control channel.
        secret: the run's channel secret.
        gpu_addresses: CUDA_VISIBLE_DEVICES for the ranks, or None for CPU.
        mode: the launch mode's name.
        start_timeout_s: how long workers wait for the rendezvous.
        extra_env: variables to add to every rank's environment.
        restart_count: how many times the run restarted so far.
        max_restarts: how many restarts the run allows.
        gpu_type: when set, the GPUs of this node must be of this type, or no rank starts.
        deepspeed_config_json: the DeepSpeed config, written into the run directory for the
            ranks (and removed with it).
        heartbeat_timeout_s: a joined rank silent (no report, no beat) for this long is hung.
        requirements: package versions this node must have, or no rank starts (``_versions``).
        code_zip: the sources of the local modules the job uses (``_shipping``), unpacked into
            the run directory and put first on the ranks' ``PYTHONPATH``.
        job_file: a file on this node holding the pickled Job, used instead of ``job_bytes``
            (a large job, shipped with ``SparkContext.addFile``; see ``_captures``).
    """

    run_id: str
    job_bytes: bytes
    node_rank: int
    num_nodes: int
    processes_per_node: int
    master_addr: str
    host: str
    channel_address: tuple[str, int]
    secret: str
    gpu_addresses: str | None
    mode: str
    start_timeout_s: float
    extra_env: Mapping[str, str] = field(default_factory=dict)
    restart_count: int = 0
    max_restarts: int = 0
    gpu_type: str | None = None
    deepspeed_config_json: str | None = None
    heartbeat_timeout_s: float | None = None
    requirements: tuple[Requirement, ...] = ()
    code_zip: bytes | None = None
    job_file: str | None = None


class _Worker:
    """One spawned rank and the threads that serve it."""

    def __init__(
        self, seat: RankSeat, proc: RankProcess, ctrl_in: IO[bytes], notes: IO[bytes]
    ) -> None:
        self.seat = seat
        self.proc = proc
        # With the pid, names the process: a pid reused after it ended is never signalled.
        self.proc_started = start_time(proc.pid)
        self.ctrl_in = ctrl_in  # our write end of its command pipe; open until it exits
        self.notes = notes  # the read end of its notes pipe
        self.started = time.monotonic()
        self.ended: float | None = None
        self.ended_at = 0.0
        self.last_lines: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.threads: list[threading.Thread] = []
        self.killed = False
        self.last_beat: float | None = None  # monotonic; set when it joins, then per beat
        self.last_beat_wall = 0.0
        self.hung_for_s: float | None = None

    def tell(self, message: Message) -> None:
        try:
            self.ctrl_in.write(json.dumps(message).encode() + b"\n")
            self.ctrl_in.flush()
        except (OSError, ValueError):
            pass  # it already exited; its waiter reports that

    def was_stopped(self, code: int | None) -> bool:
        """Whether ``code`` is our stop (SIGTERM, or the SIGKILL after it), not its own death."""
        return self.killed and code in (-signal.SIGTERM, -signal.SIGKILL)


def run_agent(
    spec: AgentSpec,
    batches: Iterator[Any] | None = None,
    all_gather: Callable[[str], list[str]] | None = None,
) -> list[Outcome]:
    """Run this node's ranks to the end and return one Outcome per rank, in rank order.

    With ``batches`` (this task's share of a DataFrame, as Arrow record batches), they are
    written to one file per rank on this thread, while the ranks start, and the row counts
    go to the driver, which holds the rendezvous until every rank's count is in.

    With ``all_gather`` (a barrier task's), a node that cannot reach the driver's control
    channel runs detached (see ``_detached``) instead of failing.
    """
    agent = Agent(spec, expects_data=batches is not None, all_gather=all_gather)
    if batches is None:
        return agent.run()
    result: list[list[Outcome]] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(agent.run())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)
        finally:
            agent.spawned.set()  # a refusal returns without spawning: stop waiting for it

    thread = threading.Thread(target=run, name="sparkdist-agent", daemon=True)
    thread.start()
    agent.spawned.wait()
    agent.write_partition(batches)
    thread.join()
    if error:
        raise error[0]
    return result[0]


class Agent:
    """One node's agent (see ``run_agent``); ``stop`` may be called from any thread."""

    def __init__(
        self,
        spec: AgentSpec,
        expects_data: bool = False,
        all_gather: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.spec = spec
        self.expects_data = expects_data
        self.all_gather = all_gather
        self.detached: DetachedRendezvous | None = None
        self.spawned = threading.Event()  # the workers exist and the outbox is open
        self.run_dir = ""
        self.code_dir: str | None = None  # the shipped local code, once unpacked
        self.outbox: Outbox | None = None
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.workers: dict[int, _Worker] = {}
        self.master_port: int | None = None
        self.aborting = False
        self.abort_reason = ""
        self.stop_reason: str | None = None  # set by ``stop``: spawn nothing more
        self.lock = threading.Lock()

    def run(self) -> list[Outcome]:
        run_dir = self.run_dir = tempfile.mkdtemp(
            prefix=f"sparkdist-{self.spec.run_id}-{self.spec.node_rank}-"
        )
        client: ChannelClient | None = None
        outbox: Outbox | None = None
        try:
            refusal = self._check_gpu_type()
            unmet = unmet_requirements(self.spec.requirements, self.spec.host)
            if refusal is not None or unmet:
                message = {
                    "t": "refused",
                    "node": self.spec.node_rank,
                    "host": self.spec.host,
                    "reason": refusal,
                    "rows": unmet,
                }
                if not _tell_driver_once(self.spec, message) and self.all_gather is not None:
                    raise refusal_error(message)  # detached: the task's error carries it
                return []
            job_file = self.spec.job_file or os.path.join(run_dir, "job.pkl")
            if self.spec.job_file is None:
                with open(job_file, "wb") as f:
                    f.write(self.spec.job_bytes)
            if self.spec.code_zip is not None:
                self.code_dir = unpack_code(run_dir, self.spec.code_zip)
            # Spawn first: the workers' interpreter start-up overlaps with our handshake.
            self._spawn_all(run_dir, job_file)
            if self.stop_reason is not None:  # stopped while spawning: end what started
                self._end(list(self.workers.values()))
            client = self._connect()
            outbox = Outbox(client, keep_lines=KEPT_LINES if self.detached else 0)
            outbox.control({"t": "hello", "node": self.spec.node_rank, "host": self.spec.host})
            self._start_threads(outbox)
            self.outbox = outbox
            self.spawned.set()
            if self.detached is not None:
                self.detached.start()
            self._watch(outbox)
            outcomes = [self._outcome_of(w, run_dir) for w in self.workers.values()]
            # "bye" goes after the last output line: the driver knows the output is complete.
            outbox.close(FLUSH_TIMEOUT_S, final={"t": "bye", "node": self.spec.node_rank})
            if self.detached is not None:
                return self._detached_outcomes(outcomes, outbox)
            return outcomes
        finally:
            # Normally everything is gone already; this also catches strays of ranks that
            # ended on their own (a daemon a rank left in a session of its own).
            self._end(list(self.workers.values()))
            for worker in self.workers.values():
                worker.proc.wait()
            if outbox is not None:
                outbox.close(FLUSH_TIMEOUT_S)
            if client is not None:
                client.close()
                client.join(FLUSH_TIMEOUT_S)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _connect(self) -> ChannelClient | None:
        """The driver's channel; failing that, detached mode (barrier tasks) or an abort."""
        address = self.spec.channel_address
        if address[1]:
            try:
                return ChannelClient(
                    address,
                    self.spec.secret,
                    on_message=self._on_driver_message,
                    on_close=lambda: self.events.put(("driver_gone", None)),
                )
            except (OSError, ChannelClosed) as exc:
                problem = f"cannot reach the driver's control channel at {address}: {exc}"
        else:
            problem = "the control channel is turned off"
        if self.all_gather is None:
            self._abort(problem)  # no other way to rendezvous: end every rank now, say why
            return None
        logger.warning("sparkdist: %s; rendezvous through Spark's allGather instead", problem)
        self.detached = DetachedRendezvous(
            self.all_gather,
            self.spec.node_rank,
            self.spec.num_nodes * self.spec.processes_per_node,
            self.expects_data,
            deliver=self._on_driver_message,
            fail=lambda reason: self.events.put(("abort", reason)),
        )
        return None

    def _send_control(self, outbox: Outbox, message: Message) -> None:
        """To the driver; a detached node keeps what its rendezvous needs instead."""
        if self.detached is None:
            outbox.control(message)
        elif message["t"] == "store":
            self.detached.on_store(int(message["port"]))
        elif message["t"] == "rows":
            self.detached.on_rows(message["counts"])

    def _detached_outcomes(self, outcomes: list[Outcome], outbox: Outbox) -> list[Outcome]:
        """Attach the kept output; raise the ranks' own failures so Spark stops the stage."""
        kept: dict[int, list[tuple[str, str]]] = {}
        for message in outbox.kept:
            kept.setdefault(int(message["rank"]), []).append(
                (str(message["stream"]), str(message["line"]))
            )
        failures = sorted(
            (o for o in outcomes if o.failure is not None and not o.aborted),
            key=lambda o: o.ended_at,
        )
        if failures:
            raise DetachedFailure([o.failure for o in failures if o.failure is not None])
        return [dataclasses.replace(o, output=tuple(kept.get(o.rank, ()))) for o in outcomes]

    def _check_gpu_type(self) -> str | None:
        if self.spec.gpu_type is None:
            return None
        addresses = (self.spec.gpu_addresses or "").split(",") if self.spec.gpu_addresses else []
        return gpu_type_mismatch(
            self.spec.gpu_type,
            gpus_at(addresses),
            f"host {self.spec.host} (GPU addresses {addresses or 'none'})",
        )

    def write_partition(self, batches: Iterator[Any]) -> None:
        """Write this task's rows for its ranks and report the counts (see ``run_agent``)."""
        if not self.workers or self.outbox is None:
            for _ in batches:  # the agent failed before spawning: drain so Spark moves on
                pass
            return
        paths = {rank: partition_path(self.run_dir, rank) for rank in self.workers}
        try:
            counts = write_partition(batches, paths)
        except BaseException as exc:
            self.events.put(("abort", f"reading the DataFrame failed: {exc!r}"))
            raise
        self._send_control(
            self.outbox, {"t": "rows", "counts": {str(r): n for r, n in counts.items()}}
        )

    # -- spawning -------------------------------------------------------------------------

    def _spawn_all(self, run_dir: str, job_file: str) -> None:
        spec = self.spec
        extra = dict(spec.extra_env)
        if spec.deepspeed_config_json is not None:
            config_path = os.path.join(run_dir, "deepspeed_config.json")
            with open(config_path, "w", encoding="utf-8") as f:
                f.write(spec.deepspeed_config_json)
            extra[DEEPSPEED_CONFIG_VAR] = config_path
        for seat in seats_of_node(spec.node_rank, spec.processes_per_node, spec.num_nodes):
            if self.stop_reason is not None:
                return  # ``stop`` came before this rank started
            env = worker_env(
                os.environ,
                seat,
                master_addr=spec.master_addr,
                run_id=spec.run_id,
                restart_count=spec.restart_count,
                max_restarts=spec.max_restarts,
                cuda_visible_devices=spec.gpu_addresses,
                mode=spec.mode,
                host=spec.host,
                extra=extra,
            )
            cmd_read, cmd_write = os.pipe()
            note_read, note_write = os.pipe()
            env[_worker.CTRL_IN_VAR] = str(cmd_read)
            env[_worker.CTRL_OUT_VAR] = str(note_write)
            env[_worker.JOB_FILE_VAR] = job_file
            env[_worker.RESULT_DIR_VAR] = run_dir
            env[_worker.START_TIMEOUT_VAR] = str(spec.start_timeout_s)
            put_code_first(env, self.code_dir)
            if self.expects_data:
                env[PARTITION_FILE_VAR] = partition_path(run_dir, seat.rank)
            try:
                proc = start_rank(env, (cmd_read, note_write))
            except BaseException:
                for fd in (cmd_write, note_read):
                    os.close(fd)
                raise
            finally:
                os.close(cmd_read)
                os.close(note_write)
            worker = _Worker(seat, proc, os.fdopen(cmd_write, "wb"), os.fdopen(note_read, "rb"))
            with self.lock:
                self.workers[seat.rank] = worker
                if self.stop_reason is not None:
                    return  # ``stop`` came: start no more ranks

    def _start_threads(self, outbox: Outbox) -> None:
        for worker in self.workers.values():
            targets: list[tuple[Any, tuple[Any, ...]]] = [
                (self._forward, (worker, worker.proc.stdout, "stdout", outbox)),
                (self._forward, (worker, worker.proc.stderr, "stderr", outbox)),
                (self._read_notes, (worker, outbox)),
                (self._wait, (worker,)),
            ]
            for target, args in targets:
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                worker.threads.append(thread)

    # -- threads --------------------------------------------------------------------------

    def _forward(self, worker: _Worker, pipe: IO[bytes], stream: str, outbox: Outbox) -> None:
        rank = worker.seat.rank
        for text in read_lines(pipe):
            worker.last_lines.append(text)
            outbox.line({"t": "log", "rank": rank, "stream": stream, "line": text})

    def _read_notes(self, worker: _Worker, outbox: Outbox) -> None:
        notes = worker.notes
        rank = worker.seat.rank
        for raw in notes:
            try:
                note = json.loads(raw)
            except ValueError:
                continue
            kind = note.get("t")
            if kind == "store":
                self._send_control(outbox, {"t": "store", "port": int(note["port"])})
            elif kind in ("ready", "beat", "report"):
                worker.last_beat, worker.last_beat_wall = time.monotonic(), time.time()
                if kind == "ready":
                    outbox.control({"t": "ready", "rank": rank})
                elif kind == "report":
                    # Progress is droppable like output: it must never stall training.
                    outbox.line({**note, "rank": rank})
        notes.close()

    def _wait(self, worker: _Worker) -> None:
        code = worker.proc.wait()
        worker.ended = time.monotonic()
        worker.ended_at = time.time()
        self.events.put(("exit", (worker, code)))
        # Strays the rank left behind (its children, daemons it started) go with it; here,
        # not on the watching thread, so their grace never delays a failure report.
        end_processes({worker.proc.pid: worker.proc_started}, tag=self._tag(worker.seat.rank))

    def _on_driver_message(self, message: Message) -> None:
        kind = message.get("t")
        if kind == "rendezvous":
            with self.lock:
                self.master_port = int(message["master_port"])
                workers = list(self.workers.values())
            for worker in workers:
                worker.tell(message)
        elif kind == "abort":
            self.events.put(("abort", str(message.get("reason", "the driver aborted the run"))))

    # -- watching -------------------------------------------------------------------------

    def _watch(self, outbox: Outbox) -> None:
        running = set(self.workers)
        while running:
            try:
                kind, payload = self.events.get(timeout=self._until_next_hang_check())
            except queue.Empty:
                self._check_heartbeats(outbox)
                continue
            if kind == "exit":
                worker, code = payload
                running.discard(worker.seat.rank)
                worker.ctrl_in.close()
                if code != 0 and not self.aborting:
                    outbox.control(
                        {
                            "t": "failed",
                            "rank": worker.seat.rank,
                            "exit_code": code,
                            "time": time.time(),
                        }
                    )
                    self._abort(f"rank {worker.seat.rank} failed")
            elif kind == "abort":
                self._abort(str(payload))
            elif kind == "driver_gone" and self.master_port is None and not self.detached:
                # Before the rendezvous the run cannot go on without the driver.
                self._abort("the driver's control channel closed before the rendezvous")

    # -- hang watchdog --------------------------------------------------------------------

    def _until_next_hang_check(self) -> float | None:
        timeout = self.spec.heartbeat_timeout_s
        if timeout is None or self.aborting:
            return None
        beats = [
            w.last_beat
            for w in self.workers.values()
            if w.last_beat is not None and w.ended is None
        ]
        if not beats:
            return min(timeout, 1.0)  # nobody joined yet: look again soon
        return max(0.0, min(beats) + timeout - time.monotonic())

    def _check_heartbeats(self, outbox: Outbox) -> None:
        """Declare silent ranks hung: dump their stacks into their output, report, stop."""
        timeout = self.spec.heartbeat_timeout_s
        if timeout is None or self.aborting:
            return
        now = time.monotonic()
        silent = [
            w
            for w in self.workers.values()
            if w.ended is None and w.last_beat is not None and now - w.last_beat >= timeout
        ]
        if not silent:
            return
        for worker in silent:
            worker.hung_for_s = now - (worker.last_beat or now)
            try:
                os.kill(worker.proc.pid, _worker.STACK_DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        # Give the dumps a moment to reach the output before the ranks are killed; the
        # oldest silence is the likeliest culprit (the others wait for it in a collective).
        time.sleep(STACK_DUMP_GRACE_S)
        for worker in sorted(silent, key=lambda w: w.last_beat_wall):
            outbox.control(
                {
                    "t": "failed",
                    "rank": worker.seat.rank,
                    "exit_code": None,
                    "time": time.time(),
                    "hung": True,
                    "last_beat": worker.last_beat_wall,
                }
            )
        names = ", ".join(str(w.seat.rank) for w in silent)
        self._abort(f"rank(s) {names} sent no heartbeat for {timeout} s")

    def _abort(self, reason: str) -> None:
        with self.lock:
            if self.aborting:
                return
            self.aborting = True
            self.abort_reason = reason
            workers = list(self.workers.values())
        self._end(workers)

    def stop(self, reason: str) -> None:
        """End every rank of this node now, from any thread; return once they are gone.

        Local mode calls it on the driver's cancelling thread: the ranks end without a round
        trip through the control channel, and a stop that comes while ranks are still being
        spawned starts no more of them.
        """
        with self.lock:
            self.stop_reason = reason
            if not self.aborting:
                self.aborting = True
                self.abort_reason = reason
            workers = list(self.workers.values())
        self.events.put(("abort", reason))  # wakes the watching thread
        # Even when the agent is already aborting (on its own thread): return only once
        # every rank is gone.
        self._end(workers)

    def _end(self, workers: list[_Worker]) -> None:
        """End ``workers`` and everything they started (``reaper``); return once gone."""
        for worker in workers:
            if worker.ended is None:
                worker.killed = True
        if workers:
            survivors = end_processes(
                {w.proc.pid: w.proc_started for w in workers}, tag=self._tag()
            )
            if survivors:
                logger.warning(
                    "sparkdist: process(es) %s of run %s outlived SIGKILL (stuck in the kernel?)",
                    survivors,
                    self.spec.run_id,
                )

    def _tag(self, rank: int | None = None) -> dict[str, str]:
        """What this node's (or one rank's) processes carry in their environment."""
        tag = {
            RUN_ID_VAR: self.spec.run_id,
            "GROUP_RANK": str(self.spec.node_rank),
            "TORCHELASTIC_RESTART_COUNT": str(self.spec.restart_count),
        }
        if rank is not None:
            tag["RANK"] = str(rank)
        return tag

    # -- outcomes -------------------------------------------------------------------------

    def _outcome_of(self, worker: _Worker, run_dir: str) -> Outcome:
        # The rank is gone; its output pipes reach end of file unless something it started in
        # another session still holds them: drain briefly, never wait on such a stray.
        deadline = time.monotonic() + OUTPUT_DRAIN_S
        for thread in worker.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        seat, code = worker.seat, worker.proc.returncode
        wall = (worker.ended or time.monotonic()) - worker.started
        value_file = _worker.value_path(run_dir, seat.rank)
        failure_file = _worker.failure_path(run_dir, seat.rank)
        # Our stop shows as SIGTERM or SIGKILL; a rank that died of something else (a
        # segfault) just before we reached it failed on its own.
        killed_by_us = worker.was_stopped(code) and worker.hung_for_s is None
        if code == 0 and os.path.exists(value_file):
            with open(value_file, "rb") as f:
                return Outcome(
                    seat.rank,
                    self.spec.host,
                    code,
                    wall,
                    value_bytes=f.read(),
                    ended_at=worker.ended_at,
                )
        failure = self._failure_of(worker, failure_file, code)
        return Outcome(
            seat.rank,
            self.spec.host,
            code,
            wall,
            failure=failure,
            aborted=killed_by_us,
            ended_at=worker.ended_at,
        )

    def _failure_of(self, worker: _Worker, failure_file: str, code: int | None) -> RankFailure:
        last = tuple(worker.last_lines)
        if os.path.exists(failure_file):
            import cloudpickle

            with open(failure_file, "rb") as f:
                recorded: RankFailure = cloudpickle.load(f)
            return RankFailure(
                rank=recorded.rank,
                host=self.spec.host,
                exit_code=code,
                exc_type=recorded.exc_type,
                message=recorded.message,
                traceback=recorded.traceback,
                last_lines=last,
                exception_bytes=recorded.exception_bytes,
            )
        message = _describe_exit(code)
        if worker.hung_for_s is not None:
            message = (
                f"hung: no heartbeat or report for {worker.hung_for_s:.1f} s "
                f"(heartbeat_timeout_s={self.spec.heartbeat_timeout_s}); its stack is in its "
                "last output lines"
            )
        elif worker.was_stopped(code) and self.aborting:
            # Our signal, not its own death (it may have exited just before we sent it).
            message = f"stopped by sparkdist: {self.abort_reason}"
        return RankFailure(
            rank=worker.seat.rank,
            host=self.spec.host,
            exit_code=code,
            exc_type="",
            message=message,
            last_lines=last,
        )


def _tell_driver_once(spec: AgentSpec, message: Message) -> bool:
    """Connect, send one message, and hang up (best effort: the driver may be gone);
    False when the driver's channel could not be reached."""
    if not spec.channel_address[1]:
        return False  # the channel is turned off: this node runs detached
    try:
        client = ChannelClient(spec.channel_address, spec.secret, on_message=lambda m: None)
    except (OSError, ChannelClosed):
        return False
    try:
        client.send(message)
    except (OSError, ChannelClosed):
        return False
    finally:
        client.close()
        client.join(FLUSH_TIMEOUT_S)
    return True


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process was killed by {name}"
    if code == 0:
        return "process exited with code 0 but wrote no result"
    return f"process exited with code {code} without raising a Python exception"
