"""Supervising a started attempt: feed the run state machine, carry out its decisions, and turn
outcomes into a result (errors: ``failures``).

``RunMonitor`` adapts the channel to ``_core.run_state.RunState`` (messages become events,
decisions become actions); ``supervise`` ticks the machine at its deadlines until the agents'
side ended. The root cause comes from ``run_state.root_cause`` (the ranks' own timestamps).

Non-goals: placement and argument handling (``launch``), how agents start (``_backends``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sparkdist._backends.base import RunningAgents
from sparkdist._core.errors import (
    ClusterError,
    ConfigError,
    RankFailure,
)
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import Placement
from sparkdist._core.run.result import RunResult
from sparkdist._core.run.run_state import (
    CALLER_STOPS,
    CHANNEL_CLOSED,
    AbortAll,
    AgentsEnded,
    CancelRequested,
    CancelStage,
    Deadlines,
    Decision,
    DrainAll,
    Event,
    HoldRendezvous,
    NodeDone,
    NodeHello,
    NodeLost,
    NodeRefused,
    PreemptionNotice,
    RankFailed,
    RankJoined,
    ReleaseRendezvous,
    RowsCounted,
    RunState,
    SendRendezvous,
    StopCause,
    StoreReady,
    Tick,
)
from sparkdist._core.versions import Refusal, refusal_message, refusals_in
from sparkdist._engine.failures import caller_stop_error, failure_error, stage_failure
from sparkdist._engine.rank_lines import print_rank_line as _print_rank_line
from sparkdist._engine.rank_lines import warn_output_unconfirmed
from sparkdist._tracking.run_watch import spawn_timeline
from sparkdist._wire import protocol
from sparkdist._wire.channel.liveness import silence_limit_s
from sparkdist._wire.channel.server import ChannelServer, Peer
from sparkdist._wire.payload import Outcome, loads, release_values

logger = logging.getLogger("sparkdist")

#: After an abort, how long the driver waits for every agent to confirm its ranks are gone.
ABORT_GRACE_S = 60.0
#: After an abort, how long connected agents get to end their ranks and say bye before the
#: agents' side is cancelled (a Spark task cancelled first may be killed half-way).
AGENT_STOP_S = 5.0
#: How long the driver waits for the agents' last output lines after the run ends.
OUTPUT_DRAIN_S = 5.0

#: Stops the caller is owed promptly: the supervisor raises as soon as the agents are gone.
_CALLER_STOPS = CALLER_STOPS


class RunMonitor:
    """The driver's view of one attempt: channel messages in, ``RunState`` decisions out.

    Every method may be called from the channel's threads or the caller's; ``changed`` guards
    the state and wakes the supervisor.
    """

    def __init__(
        self,
        world_size: int,
        num_nodes: int,
        deadlines: Deadlines,
        *,
        detached: bool = False,
        expects_rows: bool = False,
    ) -> None:
        self.changed = threading.Condition()
        self.state = RunState(world_size, num_nodes, deadlines, time.monotonic(), detached)
        self.server: ChannelServer | None = None
        self.refusals: list[Refusal] = []
        self.failure_codes: dict[int, int] = {}
        self.stage_cancel_due = False
        # Set by the tracker: where reports and system samples go (on a channel thread: cheap),
        # and a context around each rank line printed (a live progress bar steps aside for it).
        self.on_report: Callable[[protocol.Report | protocol.Sample], None] | None = None
        self.output_guard: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        )
        if expects_rows:  # DataFrame input: the rendezvous waits for every rank's row count
            self.handle(HoldRendezvous())

    def open_channel(
        self, host: str, secret: str, heartbeat_timeout_s: float | None
    ) -> ChannelServer:
        """The attempt's control channel, its messages and lost agents fed to this monitor."""
        self.server = ChannelServer(
            host,
            secret,
            self.on_message,
            self.on_disconnect,
            silence_limit_s=silence_limit_s(heartbeat_timeout_s),
        )
        return self.server

    node_hosts = property(lambda self: self.state.node_hosts)
    dropped = property(lambda self: self.state.dropped_lines)

    # -- channel callbacks ----------------------------------------------------------------------

    def on_message(self, peer: Peer, message: protocol.Message) -> None:
        if isinstance(message, protocol.Log):
            with self.output_guard():
                _print_rank_line(message)
            return
        if isinstance(message, (protocol.Report, protocol.Sample)):
            if self.on_report is not None:
                self.on_report(message)
            return
        event = self._event_of(peer, message)
        if event is None:
            return
        with self.changed:
            self.handle(event)
            if isinstance(message, protocol.Hello) and self.state.stop_reason is not None:
                peer.send(protocol.Abort(self.state.stop_reason))  # a late node
            elif isinstance(message, protocol.Hello) and self.state.preempted:
                grace_s = self.state.deadlines.preemption_grace_s
                peer.send(protocol.Drain(self.state.preempted, grace_s))

    def on_disconnect(self, peer: Peer) -> None:
        """An agent's connection dropped, or went silent: before its "bye", its node is lost."""
        if peer.node is not None:
            self.handle(NodeLost(peer.node, peer.live.heard_wall, lost_how(peer.silent_for)))

    def _event_of(self, peer: Peer, message: protocol.Message) -> Event | None:
        """The run-state event an agent's message stands for (None: it changes nothing)."""
        match message:
            case protocol.Hello(node=node, host=host, gpus=gpus):
                peer.node = node
                return NodeHello(node, host, gpus)
            case protocol.Store(port=port):
                return StoreReady(port)
            case protocol.Ready(rank=rank):
                return RankJoined(rank)
            case protocol.Failed(rank=rank, exit_code=code, time=seen):
                if code is not None:
                    self.failure_codes[rank] = code
                hung = (message.last_beat or 0.0) if message.hung else None
                return RankFailed(rank, hung, seen)
            case protocol.Rows(counts=counts):
                return RowsCounted(dict(counts))
            case protocol.Refused(node=node, host=host, reason=reason, rows=rows):
                # An agent would not start its ranks (GPU type, package versions): nobody trains.
                refusal = Refusal(node, host, reason or None, tuple(rows))
                self.refusals.append(refusal)
                return NodeRefused(node, refusal.summary)
            case protocol.Bye(node=node, dropped=dropped):
                return NodeDone(node, dropped)
            case protocol.Preempted(why=why):
                return PreemptionNotice(why)
        return None

    # -- events from the driver's side ----------------------------------------------------------

    def hold_rendezvous(self) -> None:
        """Hold the rendezvous until a matching ``release_rendezvous``."""
        self.handle(HoldRendezvous())

    def release_rendezvous(self, env: dict[str, str]) -> None:
        """Release one hold, adding ``env`` to what every rank gets before user code runs."""
        self.handle(ReleaseRendezvous(env))

    def cancel(self, reason: str) -> None:
        self.handle(CancelRequested(reason))

    def preempt(self, why: str) -> None:
        """A preemption notice from the driver's side (SIGTERM to the driver): drain."""
        self.handle(PreemptionNotice(why))

    def tick(self) -> None:
        self.handle(Tick())

    def handle(self, event: Event) -> None:
        """Apply ``event`` now and carry out what the machine decides."""
        with self.changed:
            for decision in self.state.handle(event, time.monotonic()):
                self._carry_out(decision)
            self.changed.notify_all()

    def _carry_out(self, decision: Decision) -> None:
        if isinstance(decision, SendRendezvous):
            if decision.gpu_warning is not None:
                logger.warning("sparkdist: %s", decision.gpu_warning)
            self._broadcast(
                protocol.Rendezvous(
                    decision.master_port, dict(decision.env), dict(decision.task_gpus)
                )
            )
        elif isinstance(decision, AbortAll):
            self._broadcast(protocol.Abort(decision.reason))
        elif isinstance(decision, CancelStage):
            self.stage_cancel_due = True  # done by the supervisor thread: it may wait
        elif isinstance(decision, DrainAll):
            logger.warning(
                "sparkdist: preempted (%s): every rank is told to save and return; those still "
                "running in %g s are stopped",
                decision.reason,
                decision.grace_s,
            )
            self._broadcast(protocol.Drain(decision.reason, decision.grace_s))

    def _broadcast(self, message: protocol.Message) -> None:
        if self.server is not None:
            self.server.broadcast(message)


def lost_how(silent_for: float | None) -> str:
    """What the driver saw of a node it lost (a node's agent never says this itself)."""
    if silent_for is None:
        return CHANNEL_CLOSED
    return (
        f"it sent nothing, not even a beat, for {silent_for:.1f} s (cut off by a partition, or "
        "its host froze; heartbeat_timeout_s sets the limit)"
    )


def supervise(config: LaunchConfig, agents: RunningAgents, monitor: RunMonitor) -> list[Outcome]:
    """Wait for the attempt to end, enforcing the deadlines; return every rank's Outcome.

    Raises:
        RunTimeoutError, RendezvousError, CancelledError: after every rank was stopped.
        WorkerFailedError, ClusterError, ConfigError: the attempt failed.
    """
    state = monitor.state
    with monitor.changed:
        while not agents.done:
            monitor.tick()
            if monitor.stage_cancel_due:
                monitor.stage_cancel_due = False
                _cancel_agents(agents, monitor, state.stop_reason or "the run is ending")
            if state.stop_cause in _CALLER_STOPS:
                monitor.changed.wait_for(lambda: agents.done, timeout=ABORT_GRACE_S)
                raise caller_stop_error(state.stop_cause, state.stop_reason or "")
            wakeup = state.next_wakeup()
            monitor.changed.wait(
                None if wakeup is None else max(0.0, wakeup - time.monotonic()) + 0.001
            )
        monitor.handle(AgentsEnded(failed=agents.error is not None))
        # Finished agents have reaped their ranks; only nodes that reached the channel say bye
        # (detached ones never connect). After a failed stage every node's agent gets the full
        # drain time: Spark stops the other tasks asynchronously.
        # A local agent that raised said no goodbye and never will.
        failed_here = agents.error is not None and agents.in_process
        expected = 0 if failed_here else state.expected_goodbyes()
        # Agents that ended without error, in a run nothing stopped, where a node never said
        # hello: that node refused to start, and its refusal may still be on its way (a local
        # agent returns as soon as it sent it).
        unheard = state.num_nodes - len(state.node_hosts)
        quiet_end = agents.error is None and not state.detached and state.stop_cause is None
        refusing = unheard if quiet_end else 0
        said_bye = monitor.changed.wait_for(
            lambda: len(state.done_nodes) >= expected and len(monitor.refusals) >= refusing,
            OUTPUT_DRAIN_S,
        )
        if not said_bye and agents.error is None:
            warn_output_unconfirmed(state.silent_nodes(), OUTPUT_DRAIN_S)
    if state.stop_cause is StopCause.CANCELLED:
        raise caller_stop_error(state.stop_cause, state.stop_reason or "")
    # Every node's refusal in one message (the wait for the byes above let them all arrive).
    refusals = monitor.refusals + refusals_in(agents.error)
    if refusals:
        raise ClusterError(refusal_message(refusals, state.num_nodes))
    if state.data_error is not None:
        raise ConfigError(state.data_error)
    if agents.error is not None:
        raise stage_failure(
            agents.error, state, monitor.failure_codes, in_process=agents.in_process
        )
    assert agents.outcomes is not None
    return agents.outcomes


def _cancel_agents(agents: RunningAgents, monitor: RunMonitor, reason: str) -> None:
    """Every rank was told to stop; make sure the agents' side ends (called holding
    ``monitor.changed``, whose waits release it so channel threads keep delivering)."""
    state = monitor.state
    if agents.goodbye_before_cancel:
        # The agents that reached the channel end their ranks on the abort and say bye; only
        # then is the stage cancelled (for the agents the abort cannot reach). A stage that is
        # over is no sign their ranks are gone: pyspark's own Ctrl-C handler cancels every job
        # first, and a cancelled task's agent goes on until Spark kills its Python worker.
        monitor.changed.wait_for(
            lambda: set(state.node_hosts) <= state.done_nodes | set(state.lost),
            timeout=AGENT_STOP_S,
        )
    agents.cancel(reason)


def request_cancel(monitor: RunMonitor, reason: str, agents: RunningAgents | None = None) -> None:
    """Stop the run (the supervisor then raises CancelledError); where the backend can, also
    end every rank on this thread, returning once they are gone."""
    monitor.cancel(reason)
    if agents is not None:
        agents.stop_now(reason)


def result_of(
    outcomes: list[Outcome],
    monitor: RunMonitor,
    run_id: str,
    config: LaunchConfig,
    placement: Placement,
) -> RunResult:
    by_rank = {o.rank: o for o in outcomes}
    failures = {o.rank: o.failure for o in outcomes if o.failure}
    missing = sorted(set(range(placement.world_size)) - set(by_rank))
    if failures or missing:
        # The stage ended without these ranks' outcomes and without an error (an agent's own
        # error fails the stage, and says why): Spark ran fewer tasks than the run has nodes.
        why = (
            f"never reported back: the Spark stage ended with the outcomes of {len(by_rank)} of "
            f"{placement.world_size} ranks and no error; Spark ran no task for this rank's node"
        )
        for rank in missing:
            failures[rank] = RankFailure(
                rank=rank, host="", exit_code=None, exc_type="", message=why
            )
        release_values(outcomes)  # the ranks that did finish: their values go unread
        raise failure_error(failures, monitor.state, by_rank)
    ordered = [by_rank[r] for r in range(placement.world_size)]
    for outcome in ordered:  # output a detached node kept: now, in rank order
        for stream, line in outcome.output:
            _print_rank_line(protocol.Log(outcome.rank, protocol.Stream(stream), line))
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
        timeline=spawn_timeline(ordered, _node_of_rank(monitor.state)),  # + steps: the tracker
    )


def _node_of_rank(state: RunState) -> dict[int, int]:
    return {seat.rank: node for node, seats in enumerate(state.seats_by_node()) for seat in seats}
