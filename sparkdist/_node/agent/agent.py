"""The agent: runs the ranks of one node (a barrier task, or the driver in local mode) from
start to end and returns one ``Outcome`` per rank. The same ``run_agent`` runs in a Spark
barrier task and, in local mode, on a driver thread (DESIGN.md rule 7); it talks to the driver
only through its link (``driver_link``), and failures are data here, never exceptions, so the
driver learns every rank's fate through the same path.

This module is the orchestration; the room's other modules are the parts (``_node.agent``'s
docstring lists them). One watching thread takes events (a rank exited, an abort, the driver
gone, a preemption notice) off one queue and decides: a rank that fails on its own is reported
to the driver at once and its node-mates are ended without waiting for the driver's word; an
"abort" from the driver (another node failed, a timeout, Ctrl-C) ends every rank here. In local
mode the driver can also stop the agent directly (``Agent.stop``).

Non-goals: deciding placement or environment (``_core.placement``, ``_core.env``), touching
Spark.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sparkdist._core.files import (
    AGENT_RUN_KIND,
    agent_run_dir_prefix,
    sweep_dead_owners,
    write_private_file,
)
from sparkdist._core.versions import refusal_error
from sparkdist._node.agent.checkpoint_reach import ReachCheck
from sparkdist._node.agent.driver_link import DriverLink, tell_driver_once
from sparkdist._node.agent.network import decide_node_network
from sparkdist._node.agent.node_drain import NodeDrain, own_signals
from sparkdist._node.agent.outbox import Outbox
from sparkdist._node.agent.outcomes import detached_outcomes, outcome_of
from sparkdist._node.agent.output import finish_reading, pump_lines, pump_notes, stderr_noise
from sparkdist._node.agent.partition import partition_path, write_partition
from sparkdist._node.agent.preflight import refusal_of
from sparkdist._node.agent.ranks import (
    RankHandle,
    close_command_pipe,
    end_ranks,
    node_extra_env,
    spawn_rank,
    wait_for_exit,
)
from sparkdist._node.agent.sampler import sampling
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._node.agent.watchdog import (
    check_heartbeats,
    end_ranks_past_their_exit,
    next_check_in_s,
    next_exit_bound_in_s,
)
from sparkdist._node.host.interfaces import NodeNetwork
from sparkdist._node.pool.rank_process import StartStop, StartStopped
from sparkdist._shipping.code import unpack_code
from sparkdist._wire import protocol
from sparkdist._wire.payload import Outcome

__all__ = ["Agent", "run_agent"]

logger = logging.getLogger("sparkdist")

#: After the driver's channel closed mid-run, how long the ranks may go on without it (unless
#: ``heartbeat_timeout_s`` is set: then that long). Documented in docs/restarts.md.
DRIVER_LOSS_GRACE_S = 60.0


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
    with own_signals(agent.events, agent.node_drain.where):  # SIGTERM, SIGHUP: a drain
        return agent.run() if batches is None else _run_with_data(agent, batches)


def _run_with_data(agent: Agent, batches: Iterator[Any]) -> list[Outcome]:
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
        self.spawned = threading.Event()  # the ranks exist and the outbox is open
        self.run_dir = ""
        self.code_dir: str | None = None  # the shipped local code, once unpacked
        self.outbox: Outbox | None = None
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.link = DriverLink(
            spec,
            all_gather=all_gather,
            expects_data=expects_data,
            on_rendezvous=self._deliver_rendezvous,
            events=self.events,
        )
        self.network = NodeNetwork(spec.master_addr)  # decided in ``run``, before any spawn
        self.reach = ReachCheck.of(spec)  # every node sees the same checkpoint_dir?
        self.node_drain = NodeDrain(spec.node_rank, spec.host)
        self.workers: dict[int, RankHandle] = {}
        self.master_port: int | None = None
        self.aborting = False
        self.abort_reason = ""
        self.stop_reason: str | None = None  # set by ``stop``: spawn nothing more
        self.start_stop = StartStop()  # ``stop`` also wakes a start waiting on a zygote
        self.driver_lost_at: float | None = None  # monotonic; the channel closed mid-run
        self.lock = threading.Lock()

    def run(self) -> list[Outcome]:
        # A killed driver (local mode) or Python worker (Spark) left its run directory, with
        # the pickled job in it: gone at the next start on this host.
        sweep_dead_owners(AGENT_RUN_KIND)
        run_dir = self.run_dir = tempfile.mkdtemp(
            prefix=agent_run_dir_prefix(self.spec.run_id, self.spec.node_rank)
        )
        try:
            refusal = refusal_of(self.spec)
            problem = self.reach.before_hello() if self.reach and refusal is None else None
            if problem is not None:
                refusal = protocol.Refused(self.spec.node_rank, self.spec.host, problem, ())
            if refusal is not None:
                if not tell_driver_once(self.spec, refusal) and self.all_gather is not None:
                    # Detached: the task's error carries it.
                    raise refusal_error(protocol.to_wire(refusal))
                return []
            job_file = self.spec.job_file or os.path.join(run_dir, "job.pkl")
            if self.spec.job_file is None:
                write_private_file(job_file, self.spec.job_bytes)
            if self.spec.code_zip is not None:
                self.code_dir = unpack_code(run_dir, self.spec.code_zip)
            self.network = decide_node_network(self.spec)
            # Spawn first: the ranks' interpreter start-up overlaps with our handshake.
            self._spawn_all(run_dir, job_file)
            if self.stop_reason is not None:  # stopped while spawning: end what started
                end_ranks(list(self.workers.values()), self.spec)
            problem = self.link.connect()
            if problem is not None:
                self._abort(problem)  # no way to rendezvous: end every rank now, say why
            outbox = self.link.open_outbox()
            self._start_threads(outbox)
            self.outbox = outbox
            self.spawned.set()
            self.link.start()
            with sampling(self.spec, self.workers, outbox.line):  # system metrics, if asked
                self._watch(outbox)
            if not self.aborting:  # stopped ranks' strays go in ``finally``: no wait for them
                finish_reading(self.workers.values())
            outcomes = [self._outcome_of(w) for w in self.workers.values()]
            self.link.say_bye()  # after the last output line: the driver knows it is complete
            if self.link.detached is not None:
                return detached_outcomes(outcomes, outbox.kept)
            return outcomes
        finally:
            # Normally everything is gone already; this also catches strays of ranks that
            # ended on their own (a daemon a rank left in a session of its own).
            end_ranks(list(self.workers.values()), self.spec)
            for worker in self.workers.values():
                worker.proc.wait()
            self.link.close()
            if self.reach is not None:
                self.reach.close()
            shutil.rmtree(run_dir, ignore_errors=True)

    def write_partition(self, batches: Iterator[Any]) -> None:
        """Write this task's rows for its ranks and report the counts (see ``run_agent``)."""
        if not self.workers or self.outbox is None:
            for _ in batches:  # the agent failed before spawning: drain so Spark moves on
                pass
            return
        paths = {rank: partition_path(self.run_dir, rank) for rank in self.workers}
        try:
            counts = write_partition(batches, paths, self.spec)
        except BaseException as exc:
            self.events.put(("abort", f"reading the DataFrame failed: {exc!r}"))
            raise
        self.link.send_control(protocol.Rows(dict(counts)))

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
        self.start_stop.set(reason)
        self.events.put(("abort", reason))  # wakes the watching thread
        # Even when the agent is already aborting (on its own thread): return once all are gone.
        end_ranks(workers, self.spec)

    # -- starting -------------------------------------------------------------------------

    def _spawn_all(self, run_dir: str, job_file: str) -> None:
        spec = self.spec
        extra = node_extra_env(spec, run_dir)
        for seat in spec.seats():
            if self.stop_reason is not None:
                return  # ``stop`` came before this rank started
            try:
                worker = spawn_rank(
                    spec,
                    seat,
                    run_dir=run_dir,
                    job_file=job_file,
                    code_dir=self.code_dir,
                    extra_env=extra,
                    expects_data=self.expects_data,
                    network=self.network,
                    stop=self.start_stop,
                )
            except StartStopped:
                return  # ``stop`` came while this rank's start waited
            with self.lock:
                self.workers[seat.rank] = worker
                if self.stop_reason is not None:
                    return  # ``stop`` came: start no more ranks

    def _start_threads(self, outbox: Outbox) -> None:
        def exited(worker: RankHandle, code: int) -> None:
            self.events.put(("exit", (worker, code)))

        def done() -> None:  # a rank's outcome is in: its exit is bounded from now
            self.events.put(("done", None))

        # The ranks' own view of the setting: env= over this process's environment.
        noise = stderr_noise({**os.environ, **self.spec.extra_env})
        for worker in self.workers.values():
            targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
                (pump_lines, (worker, worker.proc.stdout, protocol.Stream.STDOUT, outbox)),
                (pump_lines, (worker, worker.proc.stderr, protocol.Stream.STDERR, outbox, noise)),
                (pump_notes, (worker, outbox, self.link.send_control, self._rank_preempted, done)),
                (wait_for_exit, (worker, self.spec, exited)),
            ]
            for target, args in targets:
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                worker.threads.append(thread)

    def _rank_preempted(self, why: str) -> None:
        self.events.put(("preempt", f"{self.node_drain.where}: {why}"))

    def _deliver_rendezvous(self, message: protocol.Rendezvous) -> None:
        problem = self.reach.at_rendezvous() if self.reach is not None else None
        for_ranks = self.spec.rendezvous_for_ranks(message) if problem is None else problem
        if isinstance(for_ranks, str):
            # Before any rank trains: the driver names every node that refuses, with the fix.
            refusal = protocol.Refused(self.spec.node_rank, self.spec.host, for_ranks, ())
            self.link.send_control(refusal)
            self.events.put(("abort", for_ranks))
            return
        with self.lock:
            self.master_port = for_ranks.master_port
            workers = list(self.workers.values())
        for worker in workers:
            worker.tell(for_ranks)

    # -- watching -------------------------------------------------------------------------

    def _watch(self, outbox: Outbox) -> None:
        running = set(self.workers)
        while running:
            try:
                kind, payload = self.events.get(timeout=self._until_next_check())
            except queue.Empty:
                self._check_hangs(outbox)
                end_ranks_past_their_exit(self.workers.values(), self.spec, outbox)
                self._check_driver_loss()
                if (late := self.node_drain.overdue(time.monotonic())) is not None:
                    self._abort(late)
                continue
            if kind == "exit":
                worker, code = payload
                running.discard(worker.seat.rank)
                close_command_pipe(worker.ctrl_in)
                if code != 0 and not self.aborting:
                    outbox.control(protocol.Failed(worker.seat.rank, code, time.time()))
                    self._abort(f"rank {worker.seat.rank} failed")
            elif kind == "abort":
                self._abort(str(payload))
            elif kind in ("preempt", "drain") and not self.aborting:
                self.node_drain.act(kind, payload, self.link.send_control, self.workers.values())
            elif kind == "driver_gone" and not self.link.detached:
                if payload is not None:
                    # Silent, not closed: this node is cut off from the driver (or the driver's
                    # host froze). The driver counts this node lost after the same silence and
                    # ends the run: whatever the ranks compute now is never collected.
                    self._abort(
                        f"the driver sent nothing for {payload:.1f} s (a partition, or its host "
                        "is gone): this node ends its ranks (heartbeat_timeout_s sets the limit)"
                    )
                elif self.master_port is None:
                    # Before the rendezvous the run cannot go on without the driver.
                    self._abort("the driver's control channel closed before the rendezvous")
                else:
                    # The ranks need the driver no more, but a driver that died never collects
                    # what they compute while they hold GPUs. Its own process's death ends its
                    # Spark tasks (and so the ranks, with their parents); for whatever else,
                    # the ranks get a grace to finish, then end.
                    self.driver_lost_at = time.monotonic()

    def _driver_loss_grace_s(self) -> float:
        return self.spec.heartbeat_timeout_s or DRIVER_LOSS_GRACE_S

    def _until_next_check(self) -> float | None:
        if self.aborting:
            return None
        waits = [
            next_check_in_s(self.workers.values(), self.spec.heartbeat_timeout_s),
            next_exit_bound_in_s(self.workers.values()),
        ]
        if self.driver_lost_at is not None:
            grace_ends = self.driver_lost_at + self._driver_loss_grace_s()
            waits.append(max(0.0, grace_ends - time.monotonic()))
        if self.node_drain.deadline is not None:
            waits.append(max(0.0, self.node_drain.deadline - time.monotonic()))
        return min((w for w in waits if w is not None), default=None)

    def _check_driver_loss(self) -> None:
        lost_at = self.driver_lost_at
        grace_s = self._driver_loss_grace_s()
        if not self.aborting and lost_at is not None and time.monotonic() - lost_at >= grace_s:
            self._abort(
                f"the driver's control channel closed {grace_s:g} s ago and the ranks still "
                "run: the driver is gone (heartbeat_timeout_s sets this grace)"
            )

    def _check_hangs(self, outbox: Outbox) -> None:
        if self.aborting:
            return
        hung = check_heartbeats(self.workers.values(), self.spec.heartbeat_timeout_s, outbox)
        if hung is not None:
            self._abort(hung)

    def _abort(self, reason: str) -> None:
        with self.lock:
            if self.aborting:
                return
            self.aborting = True
            self.abort_reason = reason
            workers = list(self.workers.values())
        end_ranks(workers, self.spec)

    def _outcome_of(self, worker: RankHandle) -> Outcome:
        return outcome_of(
            worker,
            self.run_dir,
            host=self.spec.host,
            heartbeat_timeout_s=self.spec.heartbeat_timeout_s,
            abort_reason=self.abort_reason if self.aborting else None,
        )
