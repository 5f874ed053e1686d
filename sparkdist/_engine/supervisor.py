"""Supervising a started run: the driver's view of it, deadlines, and turning outcomes into a
result or an error.

``RunMonitor`` is fed by the control channel's reader threads; ``Submission`` runs the agents'
side (a local agent thread or a Spark barrier stage) on a thread; ``supervise`` waits for either
to end while enforcing the run and start-up deadlines.

Non-goals: placement and argument handling (``_launcher``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from sparkdist._backends.stage import BarrierStage
from sparkdist._core.config import LaunchConfig
from sparkdist._core.env import ROWS_PER_RANK_VAR
from sparkdist._core.errors import (
    ClusterError,
    ConfigError,
    RankFailure,
    RendezvousError,
    RunTimeoutError,
    WorkerFailedError,
)
from sparkdist._core.placement import Placement
from sparkdist._core.result import RunResult
from sparkdist._core.versions import Refusal, refusal_message, refusals_in
from sparkdist._engine.rank_lines import print_rank_line as _print_rank_line
from sparkdist._node.agent import Agent, AgentSpec
from sparkdist._node.detached import failures_in
from sparkdist._wire.channel import ChannelServer, Message, Peer
from sparkdist._wire.payload import Outcome, loads

logger = logging.getLogger("sparkdist")

#: After the first failure, how long agents get to report before the stage is cancelled.
FAILURE_GRACE_S = 30.0
#: After an abort, how long the driver waits for every agent to confirm its ranks are gone.
ABORT_GRACE_S = 60.0
#: Spark mode, after an abort: how long the agents that reached the channel get to end their
#: ranks and say bye before the stage is cancelled (cancelling first lets Spark kill an agent
#: mid-way, its Python worker SIGKILLed after spark.python.task.killTimeout, and its ranks then
#: end themselves, less thoroughly).
AGENT_STOP_S = 5.0
#: How long the driver waits for the agents' last output lines after the run ends.
OUTPUT_DRAIN_S = 5.0


class RunMonitor:
    """The driver's view of a run, fed by the control channel's reader threads."""

    def __init__(self, world_size: int, num_nodes: int) -> None:
        self.world_size = world_size
        self.num_nodes = num_nodes
        self.server: ChannelServer | None = None
        self.changed = threading.Condition()
        self.store_port: int | None = None
        # Environment every rank gets with the rendezvous (after spawn): lets driver-side
        # set-up that is slow (an MLflow run, the DataFrame's row counts) overlap with the
        # workers' start-up. The rendezvous waits until every hold is released.
        self.rank_env: dict[str, str] = {}
        self.holds = 0
        self.rendezvous_sent = False
        # DataFrame input: rows each rank got, reported by the agents after writing them.
        self.rows: dict[int, int] = {}
        self.expects_rows = False
        self.data_error: str | None = None
        self.joined: set[int] = set()
        self.failure_order: list[int] = []
        self.failure_codes: dict[int, int] = {}
        self.byes: set[int] = set()
        self.dropped = 0
        self.abort_reason: str | None = None
        self.cancelled = False
        self.refusals: list[Refusal] = []
        self.hung_since: dict[int, float] = {}  # rank -> wall time of its last heartbeat
        self.node_hosts: dict[int, str] = {}
        self.lost_nodes: list[int] = []
        # Set by the launcher's tracker: where runtime.report() messages go (called on a
        # reader thread, so it must be cheap), and a context around each rank line printed
        # (a live progress bar steps aside for it).
        self.on_report: Callable[[Message], None] | None = None
        self.output_guard: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        )

    def on_message(self, peer: Peer, message: Message) -> None:
        kind = message["t"]
        if kind == "log":
            with self.output_guard():
                _print_rank_line(message)
            return
        if kind == "report":
            if self.on_report is not None:
                self.on_report(message)
            return
        with self.changed:
            if kind == "hello":
                peer.node = int(message["node"])
                self.node_hosts[peer.node] = str(message.get("host", ""))
                self._broadcast_rendezvous()  # goes out once the last node said hello
                if self.abort_reason is not None:
                    peer.send({"t": "abort", "reason": self.abort_reason})
            elif kind == "store":
                self.store_port = int(message["port"])
                self._broadcast_rendezvous()
            elif kind == "ready":
                self.joined.add(int(message["rank"]))
            elif kind == "failed":
                rank = int(message["rank"])
                self.failure_order.append(rank)
                if message.get("exit_code") is not None:
                    self.failure_codes[rank] = int(message["exit_code"])
                if message.get("hung"):
                    self.hung_since[rank] = float(message.get("last_beat", 0.0))
                self._abort_locked(f"rank {rank} failed")
            elif kind == "rows":
                self._record_rows(message.get("counts", {}))
            elif kind == "refused":
                # An agent would not start its ranks (wrong GPU type, package versions):
                # nobody may train.
                refusal = Refusal.of(message)
                self.refusals.append(refusal)
                self.byes.add(int(message["node"]))
                self._abort_locked(refusal.summary)
            elif kind == "bye":
                self.byes.add(int(message["node"]))
                self.dropped += int(message.get("dropped", 0))
            self.changed.notify_all()

    def hold_rendezvous(self) -> None:
        """Hold the rendezvous until a matching ``release_rendezvous``."""
        with self.changed:
            self.holds += 1

    def release_rendezvous(self, env: dict[str, str]) -> None:
        """Release one hold, adding ``env`` to what every rank gets before user code runs;
        the rendezvous goes out when no hold is left."""
        with self.changed:
            self.rank_env.update(env)
            self.holds = max(0, self.holds - 1)
            self._broadcast_rendezvous()
            self.changed.notify_all()

    def expect_rows(self) -> None:
        """DataFrame input: hold the rendezvous until every rank's row count is in."""
        self.expects_rows = True
        self.hold_rendezvous()

    def _record_rows(self, counts: dict[str, Any]) -> None:
        self.rows.update({int(rank): int(n) for rank, n in counts.items()})
        if len(self.rows) < self.world_size:
            return
        ordered = [self.rows[r] for r in range(self.world_size)]
        if sum(ordered) == 0:
            self.data_error = (
                "the DataFrame has no rows: every rank would train on nothing; check its "
                "filters, or pass a DataFrame with data"
            )
            self._abort_locked(self.data_error)
            return
        empty = [rank for rank, n in enumerate(ordered) if n == 0]
        if empty:
            self.data_error = (
                f"rank(s) {_ranks(empty)} got no rows of the DataFrame (rows per rank: "
                f"{ordered}); it is too small to give every rank some: use more rows or "
                "fewer processes"
            )
            self._abort_locked(self.data_error)
            return
        self.rank_env[ROWS_PER_RANK_VAR] = json.dumps(ordered)
        self.holds = max(0, self.holds - 1)
        self._broadcast_rendezvous()

    def _rendezvous(self) -> Message | None:
        # Every node must have said hello (an agent does so only after its checks passed):
        # no rank may start training while another node could still refuse the run.
        if self.store_port is None or self.holds or len(self.node_hosts) < self.num_nodes:
            return None
        return {"t": "rendezvous", "master_port": self.store_port, "env": self.rank_env}

    def _broadcast_rendezvous(self) -> None:
        message = self._rendezvous()
        if message is not None and not self.rendezvous_sent:
            self.rendezvous_sent = True
            self._broadcast(message)

    def on_disconnect(self, peer: Peer) -> None:
        """An agent's connection dropped: before its "bye", its node is lost."""
        node = peer.node
        with self.changed:
            if node is not None and node not in self.byes:
                self.lost_nodes.append(node)
                self._abort_locked(f"lost contact with node {node}")
            self.changed.notify_all()

    def root_cause_order(self, candidates: set[int]) -> list[int]:
        """Failed ranks, likeliest root cause first.

        The first failure the driver heard of comes first, except for hangs: every rank of a
        hung collective goes silent, so the one silent longest is the likeliest culprit.
        """
        heard = [rank for rank in dict.fromkeys(self.failure_order) if rank in candidates]
        if heard and all(rank in self.hung_since for rank in heard):
            heard.sort(key=lambda rank: self.hung_since[rank])
        return heard

    def abort(self, reason: str) -> None:
        with self.changed:
            self._abort_locked(reason)
            self.changed.notify_all()

    def _abort_locked(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
            self._broadcast({"t": "abort", "reason": reason})

    def _broadcast(self, message: Message) -> None:
        if self.server is not None:
            self.server.broadcast(message)


class Submission:
    """The agents' side of the run, started on a thread: one local agent or a barrier stage."""

    def __init__(
        self,
        session: Any,
        template: AgentSpec,
        placement: Placement,
        local_mode: bool,
        monitor: RunMonitor,
        dataframe: Any | None = None,
    ) -> None:
        self.outcomes: list[Outcome] | None = None
        self.error: BaseException | None = None
        self.done = False
        self._monitor = monitor
        self._stage = None
        self._agent: Agent | None = None
        work: Callable[[], list[Outcome]]
        if local_mode:
            self._agent = Agent(template)
            work = self._agent.run
        else:
            if dataframe is not None:
                monitor.expect_rows()
            self._stage = BarrierStage(
                session, template, placement.num_tasks, placement.use_gpu, dataframe
            )
            stage = self._stage
            work = lambda: [loads(row) for row in stage.collect()]
        self._thread = threading.Thread(
            target=self._run, args=(work,), name=f"sparkdist-run-{template.run_id}", daemon=True
        )
        self._thread.start()

    def _run(self, work: Callable[[], list[Outcome]]) -> None:
        try:
            self.outcomes = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the supervising thread
            self.error = exc
        finally:
            with self._monitor.changed:
                self.done = True
                self._monitor.changed.notify_all()

    @property
    def local(self) -> bool:
        return self._agent is not None

    def stop_local(self, reason: str) -> None:
        """Local mode: end every rank now, on this thread, and return once they are gone (no
        round trip through the control channel). Spark mode: nothing (see ``cancel``)."""
        if self._agent is not None:
            self._agent.stop(reason)

    def cancel(self, reason: str = "the run was cancelled") -> None:
        """End the agents' side: local mode as ``stop_local``; Spark mode cancels the stage."""
        self.stop_local(reason)
        if self._stage is not None:
            try:
                self._stage.cancel()
            except Exception:
                logger.debug("sparkdist: cancelling the Spark job failed", exc_info=True)


def supervise(config: LaunchConfig, submission: Submission, monitor: RunMonitor) -> list[Outcome]:
    """Wait for the run to end, enforcing the deadlines; return every rank's Outcome.

    Raises:
        RunTimeoutError, RendezvousError, CancelledError: after every rank was stopped.
        WorkerFailedError, ClusterError: when the Spark stage itself failed.
    """
    started = time.monotonic()
    run_deadline = started + config.timeout_s if config.timeout_s else None
    start_deadline = started + config.start_timeout_s
    failure_deadline: float | None = None
    with monitor.changed:
        while not submission.done:
            if monitor.cancelled:
                raise _stop(
                    submission,
                    monitor,
                    concurrent.futures.CancelledError(
                        "the run was cancelled; every rank was stopped"
                    ),
                )
            now = time.monotonic()
            if run_deadline is not None and now >= run_deadline:
                raise _stop(
                    submission,
                    monitor,
                    RunTimeoutError(
                        f"the run exceeded timeout_s={config.timeout_s}; every rank was "
                        "stopped. Raise timeout_s, or pass timeout_s=None for no limit"
                    ),
                )
            # Only nodes that reached the channel can be waited for: detached nodes (no hello)
            # enforce the start-up deadline in their ranks themselves.
            if (
                monitor.node_hosts
                and len(monitor.joined) < monitor.world_size
                and now >= start_deadline
            ):
                missing = sorted(set(range(monitor.world_size)) - monitor.joined)
                raise _stop(
                    submission,
                    monitor,
                    RendezvousError(
                        f"rank(s) {_ranks(missing)} did not join the run within "
                        f"start_timeout_s={config.start_timeout_s}; check that the executors "
                        "can start Python with torch, or raise start_timeout_s"
                    ),
                )
            if monitor.failure_order and failure_deadline is None:
                failure_deadline = now + FAILURE_GRACE_S
            if failure_deadline is not None and now >= failure_deadline:
                submission.cancel()
                failure_deadline = now + ABORT_GRACE_S
            deadlines = [d for d in (run_deadline, failure_deadline) if d is not None]
            if monitor.node_hosts and len(monitor.joined) < monitor.world_size:
                deadlines.append(start_deadline)
            monitor.changed.wait(max(0.0, min(deadlines) - now) if deadlines else None)
    with monitor.changed:
        # A finished stage's agents have reaped their ranks; only nodes that reached the
        # channel say bye (detached ones never connect). After a failed stage, give every
        # node's agent the full drain time: Spark stops the other tasks asynchronously.
        expected = monitor.num_nodes if submission.error is not None else len(monitor.node_hosts)
        monitor.changed.wait_for(lambda: len(monitor.byes) >= expected, timeout=OUTPUT_DRAIN_S)
    # Every node's refusal in one message (the wait for the byes above let them all arrive).
    refusals = monitor.refusals + refusals_in(submission.error)
    if refusals:
        raise ClusterError(refusal_message(refusals, monitor.num_nodes))
    if monitor.data_error is not None:
        raise ConfigError(monitor.data_error)
    if submission.error is not None:
        raise _stage_failure(submission.error, monitor)
    assert submission.outcomes is not None
    return submission.outcomes


def _stop(submission: Submission, monitor: RunMonitor, error: BaseException) -> BaseException:
    """Abort every rank, cancel the stage, and wait until the agents are done."""
    monitor.abort(str(error))
    # The condition's lock is reentrant and fully released while waiting, so the channel's
    # threads keep delivering messages even when the caller holds it.
    if not submission.local:
        # The agents that reached the channel end their ranks on the abort and say bye; only
        # then is the stage cancelled (for the agents the abort cannot reach). A stage that is
        # over is no sign their ranks are gone: pyspark's own Ctrl-C handler cancels every job
        # first, and a cancelled task's agent goes on until Spark kills its Python worker.
        with monitor.changed:
            monitor.changed.wait_for(
                lambda: set(monitor.node_hosts) <= monitor.byes | set(monitor.lost_nodes),
                timeout=AGENT_STOP_S,
            )
    submission.cancel(str(error))
    with monitor.changed:
        monitor.changed.wait_for(lambda: submission.done, timeout=ABORT_GRACE_S)
    return error


def request_cancel(monitor: RunMonitor, reason: str, submission: Submission | None = None) -> None:
    """Ask the supervising thread to stop the run (it raises CancelledError); in local mode,
    also end every rank on this thread, returning once they are gone."""
    with monitor.changed:
        monitor.cancelled = True
        monitor.changed.notify_all()
    monitor.abort(reason)
    if submission is not None:
        submission.stop_local(reason)


def _stage_failure(error: BaseException, monitor: RunMonitor) -> BaseException:
    """The Spark stage itself failed (an executor died, a task raised before its agent ran)."""
    if isinstance(error, (ClusterError, WorkerFailedError)):
        return error
    detached = {f.rank: f for f in failures_in(str(error))}
    if detached:  # ranks of a node cut off from the channel failed; their task said how
        root = detached[next(iter(detached))]
        causes = [f for f in detached.values() if not _is_peer_loss(f)]
        failed = WorkerFailedError(detached, causes[0] if causes else root)
        failed.__cause__ = error
        return failed
    summary = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    failures = {
        rank: RankFailure(
            rank=rank,
            host="",
            exit_code=monitor.failure_codes.get(rank),
            exc_type="",
            message=f"failed; its details were lost with the Spark stage ({summary})",
        )
        for rank in monitor.failure_order
    }
    per_node = monitor.world_size // max(monitor.num_nodes, 1)
    for node in monitor.lost_nodes:
        host = monitor.node_hosts.get(node, "")
        for rank in range(node * per_node, (node + 1) * per_node):
            failures.setdefault(
                rank,
                RankFailure(
                    rank=rank,
                    host=host,
                    exit_code=None,
                    exc_type="",
                    message=f"lost with its node {node} (the executor or its Python worker died): "
                    f"{summary}",
                ),
            )
    if failures:
        order = monitor.root_cause_order(set(failures)) or sorted(failures)
        failed = WorkerFailedError(failures, failures[order[0]])
        failed.__cause__ = error
        return failed
    cluster = ClusterError(
        f"the Spark barrier stage failed before the ranks reported: {summary}; see the "
        "executor logs for the cause"
    )
    cluster.__cause__ = error
    return cluster


def result_of(
    outcomes: list[Outcome],
    monitor: RunMonitor,
    run_id: str,
    config: LaunchConfig,
    placement: Placement,
) -> RunResult:
    by_rank = {o.rank: o for o in outcomes}
    failures = {o.rank: o.failure for o in outcomes if o.failure and not o.aborted}
    if not failures:
        # Nobody failed on their own, yet some rank has no value: report the stopped ones.
        failures = {o.rank: o.failure for o in outcomes if o.failure}
    missing = sorted(set(range(placement.world_size)) - set(by_rank))
    if failures or missing:
        for rank in missing:
            failures[rank] = RankFailure(
                rank=rank, host="", exit_code=None, exc_type="", message="never reported back"
            )
        raise _failure_error(failures, monitor, by_rank)
    ordered = [by_rank[r] for r in range(placement.world_size)]
    for outcome in ordered:  # output a detached node kept: now, in rank order
        for stream, line in outcome.output:
            _print_rank_line({"rank": outcome.rank, "stream": stream, "line": line})
    return RunResult(
        values=[loads(o.value_bytes) if o.value_bytes is not None else None for o in ordered],
        wall_times_s=[o.wall_time_s for o in ordered],
        hosts=[o.host for o in ordered],
        run_id=run_id,
        mode=config.mode.value,
        use_gpu=placement.use_gpu,
        local_mode=config.local_mode,
        num_tasks=placement.num_tasks,
        dropped_lines=monitor.dropped,
        mode_settings=config.mode_settings(),
    )


def _failure_error(
    failures: dict[int, RankFailure], monitor: RunMonitor, by_rank: dict[int, Outcome]
) -> WorkerFailedError:
    # First failure the driver heard of; failing that, the earliest exit its agent saw. A
    # rank that merely lost its peer in a collective is a symptom: when one rank dies, its
    # peers' "connection reset" can reach the driver first.
    heard = monitor.root_cause_order(set(failures))
    by_time = sorted(
        failures, key=lambda r: (by_rank[r].ended_at if r in by_rank else float("inf"), r)
    )
    order = heard + [r for r in by_time if r not in heard]
    causes = [r for r in order if not _is_peer_loss(failures[r])]
    root_rank = (causes or order)[0]
    error = WorkerFailedError(failures, failures[root_rank])
    original = failures[root_rank].exception_bytes
    if original is not None:
        try:
            cause = loads(original)
        except Exception:
            cause = None
        if isinstance(cause, BaseException):
            error.__cause__ = cause
    return error


_PEER_LOSS = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|remote worker|communicator was aborted|"
    r"DistNetworkError|DistBackendError|Socket Timeout|Connection refused|"
    r"gloo/transport|ProcessGroupGloo|ProcessGroupNCCL|NCCL error|recvBytes|sendBytes",
    re.IGNORECASE,
)


def _is_peer_loss(failure: RankFailure) -> bool:
    """Whether a failure reads like the echo of another rank's death in a collective."""
    return bool(_PEER_LOSS.search(f"{failure.exc_type} {failure.message}"))


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
