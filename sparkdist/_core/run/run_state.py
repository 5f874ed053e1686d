"""A run as a pure state machine: events in, decisions out.

The driver's view of one attempt of a run. The supervising thread turns what the control
channel and the agents' thread report into events (a node said hello, rank 0's store is up, a
rank failed, a node is gone, the clock moved...) and feeds them to ``RunState.handle``, which
returns what to do (send the rendezvous, abort every rank, cancel the Spark stage) and, once
the run must stop, why (``StopCause``). Nothing here touches a socket, a thread or a process,
so every fault of the fault matrix is a table-driven unit test (tests/unit/test_run_state.py).

The root cause of a failed run is chosen by ``root_cause`` from timestamps taken inside the
ranks (the moment the exception was caught), never from error text: when one rank dies, its
peers' "connection reset" errors in a collective come after it.

Non-goals: I/O (``_engine.supervisor`` executes the decisions), formatting errors
(``_core.errors``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sparkdist._core.env import ROWS_PER_RANK_VAR, RankSeat
from sparkdist._core.launch.config import DEFAULT_PREEMPTION_GRACE_S
from sparkdist._core.launch.numbering import isolated_gpus_warning, known_task_hosts, seats_by_task

#: A rank that died without raising (a signal, ``os._exit``) has no timestamp of its own; its
#: agent saw it exit a little after the fact, while a peer that lost it in a collective may
#: have raised in between. Crediting the abrupt death this much earlier keeps it the root
#: cause against such echoes (which follow within milliseconds).
ABRUPT_DEATH_SLACK_S = 0.5
#: After the first failure, how long the agents get to report before the stage is cancelled.
FAILURE_GRACE_S = 30.0
#: Why a run with an empty DataFrame is refused (however the empty input shows: no rows per
#: rank, or, on Spark 3.5, no barrier task at all).
NO_ROWS = (
    "the DataFrame has no rows: every rank would train on nothing; check its filters, or pass "
    "a DataFrame with data"
)


class StopCause(enum.Enum):
    """Why a run stopped before every rank finished on its own."""

    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    START_TIMED_OUT = "start_timed_out"
    RANK_FAILED = "rank_failed"
    NODE_LOST = "node_lost"
    REFUSED = "refused"
    BAD_DATA = "bad_data"
    PREEMPTED = "preempted"  # ranks still ran preemption_grace_s after a preemption notice


#: Stops the caller is owed (its own, its deadlines): a preemption notice does not outrank them.
CALLER_STOPS = (StopCause.CANCELLED, StopCause.TIMED_OUT, StopCause.START_TIMED_OUT)


class StartStage(enum.Enum):
    """How far start-up got: named in the error when ``start_timeout_s`` runs out."""

    NODES = "waiting for the nodes' agents (Spark executor slots, or the warm pool)"
    STORE = "waiting for rank 0 to open the rendezvous store"
    DRIVER_SETUP = "waiting for driver-side set-up (MLflow run, DataFrame row counts)"
    RANKS = "waiting for every rank to join"


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeHello:
    """A node's agent connected, passed its checks, and spawned its ranks (``gpus``: its
    task's GPUs, a comma list, empty on CPU)."""

    node: int
    host: str
    gpus: str = ""


@dataclass(frozen=True)
class StoreReady:
    """Rank 0 bound the rendezvous store on this port (and keeps it)."""

    port: int


@dataclass(frozen=True)
class RankJoined:
    """A rank received the rendezvous and is about to run the user's code."""

    rank: int


@dataclass(frozen=True)
class RankFailed:
    """A rank failed on its own (raised, exited non-zero, died, or stopped beating).

    Attributes:
        rank: the global rank.
        hung_since: for a hang, the wall-clock time of its last heartbeat.
        seen_at: wall-clock time its agent saw it fail (kept in case its details are lost).
    """

    rank: int
    hung_since: float | None = None
    seen_at: float | None = None


@dataclass(frozen=True)
class NodeRefused:
    """A node's agent would not start its ranks (GPU type, package versions)."""

    node: int
    summary: str


@dataclass(frozen=True)
class RowsCounted:
    """DataFrame input: rows that some ranks got, by global rank."""

    counts: Mapping[int, int]


@dataclass(frozen=True)
class HoldRendezvous:
    """Driver-side set-up (an MLflow run) must finish before any rank trains."""


@dataclass(frozen=True)
class ReleaseRendezvous:
    """One hold is released; ``env`` goes to every rank with the rendezvous."""

    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeDone:
    """A node's agent said goodbye: its ranks are gone and its output is flushed."""

    node: int
    dropped_lines: int = 0


#: What the driver saw of a node whose connection ended before its goodbye.
CHANNEL_CLOSED = "its control channel closed without a goodbye"


@dataclass(frozen=True)
class NodeLost:
    """A node's connection dropped before its goodbye, or went silent.

    Attributes:
        node: the node.
        last_heard: wall-clock time of its last word on the channel (a beat counts): the
            moment it is known to have gone wrong at the latest, compared with the ranks' own
            failure times for the root cause (0.0: unknown).
        how: what the driver saw ("its control channel closed without a goodbye", "it sent
            nothing for 10.0 s").
    """

    node: int
    last_heard: float = 0.0
    how: str = ""


@dataclass(frozen=True)
class CancelRequested:
    """The caller cancelled the run (Ctrl-C, ``cancel()``)."""

    reason: str


@dataclass(frozen=True)
class PreemptionNotice:
    """A preemption notice reached the run: SIGTERM to a rank or an agent (its node's word),
    or to the driver. Every rank is told to drain; ranks still running ``preemption_grace_s``
    later are stopped.

    Attributes:
        why: what and where ("node 1 (host 10.0.0.3): rank 1 got SIGTERM").
    """

    why: str


@dataclass(frozen=True)
class Tick:
    """Time passed, nothing else happened: only the deadlines are checked."""


@dataclass(frozen=True)
class AgentsEnded:
    """The agents' side ended: the local agent returned, or the Spark stage finished."""

    failed: bool = False


Event = (
    NodeHello
    | StoreReady
    | RankJoined
    | RankFailed
    | NodeRefused
    | RowsCounted
    | HoldRendezvous
    | ReleaseRendezvous
    | NodeDone
    | NodeLost
    | CancelRequested
    | PreemptionNotice
    | Tick
    | AgentsEnded
)

# -- decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendRendezvous:
    """Tell every node the store's port, the environment every rank gets and every task's
    GPUs (each node makes its host's visible to its ranks)."""

    master_port: int
    env: Mapping[str, str]
    task_gpus: Mapping[int, str] = field(default_factory=dict)
    gpu_warning: str | None = None  # some hosts' ranks cannot see each other's GPUs


@dataclass(frozen=True)
class AbortAll:
    """Tell every node to stop its ranks now (sent once per run)."""

    reason: str


@dataclass(frozen=True)
class CancelStage:
    """Cancel the Spark stage (agents did not stop their ranks in time)."""


@dataclass(frozen=True)
class DrainAll:
    """Tell every node the run is preempted: ranks save and return (sent once per attempt)."""

    reason: str
    grace_s: float


Decision = SendRendezvous | AbortAll | CancelStage | DrainAll


@dataclass(frozen=True)
class Deadlines:
    """The run's time limits, in seconds from submission."""

    start_timeout_s: float
    timeout_s: float | None = None
    failure_grace_s: float = FAILURE_GRACE_S
    preemption_grace_s: float = DEFAULT_PREEMPTION_GRACE_S


class RunState:
    """The driver's view of one attempt: fed events, it answers with decisions.

    Args:
        world_size: number of ranks.
        num_nodes: number of agents (Spark tasks; 1 in local mode).
        deadlines: the run's limits.
        started_at: monotonic time of submission (deadlines count from here).
        detached: nodes rendezvous through Spark and never say hello; their ranks enforce the
            start-up deadline themselves.
    """

    def __init__(
        self,
        world_size: int,
        num_nodes: int,
        deadlines: Deadlines,
        started_at: float,
        detached: bool = False,
    ) -> None:
        self.world_size = world_size
        self.num_nodes = num_nodes
        self.deadlines = deadlines
        self.started_at = started_at
        self.detached = detached
        self.node_hosts: dict[int, str] = {}
        self.node_gpus: dict[int, str] = {}  # by node, the GPUs its hello named
        self.store_port: int | None = None
        self.joined: set[int] = set()
        self.holds = 0
        self.rank_env: dict[str, str] = {}
        self.rows: dict[int, int] = {}
        self.rendezvous_sent = False
        self.failed_ranks: list[int] = []  # in the order the driver heard of them
        self.hung_since: dict[int, float] = {}
        self.failure_seen_at: dict[int, float] = {}
        self.refusals: list[str] = []
        #: Every node lost before its goodbye, in the order contact was lost: when and how.
        self.lost: dict[int, NodeLost] = {}
        self.done_nodes: set[int] = set()
        self.dropped_lines = 0
        self.data_error: str | None = None
        self.stop_cause: StopCause | None = None
        self.stop_reason: str | None = None
        self.stage_cancelled = False
        self.agents_ended = False
        self.agents_failed = False
        self.preempted = ""  # the first preemption notice's why
        self._drain_started: float | None = None  # monotonic
        self._failure_deadline: float | None = None
        self._now = started_at

    # -- reading ------------------------------------------------------------------------------

    @property
    def aborted(self) -> bool:
        """Whether every rank has been told to stop."""
        return self.stop_cause is not None

    @property
    def was_preempted(self) -> bool:
        """Whether a preemption notice ended this attempt (its ranks drained, were stopped at
        the grace, or failed meanwhile), rather than the caller's stop or its deadlines."""
        return bool(self.preempted) and self.stop_cause not in CALLER_STOPS

    def start_stage(self) -> StartStage | None:
        """Where start-up is, or None once every rank has joined."""
        if len(self.joined) >= self.world_size:
            return None
        if len(self.node_hosts) < self.num_nodes:
            return StartStage.NODES
        if self.store_port is None:
            return StartStage.STORE
        if not self.rendezvous_sent:
            return StartStage.DRIVER_SETUP
        return StartStage.RANKS

    def next_wakeup(self) -> float | None:
        """The next monotonic time at which a deadline may fire (None: only events matter)."""
        times = []
        if self.deadlines.timeout_s is not None:
            times.append(self.started_at + self.deadlines.timeout_s)
        if self._start_deadline_applies():
            times.append(self.started_at + self.deadlines.start_timeout_s)
        if self._failure_deadline is not None and not self.stage_cancelled:
            times.append(self._failure_deadline)
        drain_ends = self._drain_ends()
        if drain_ends is not None:
            times.append(drain_ends)
        return min(times) if times else None

    def expected_goodbyes(self) -> int:
        """How many nodes' goodbyes to wait for once the agents ended (a lost node says
        none)."""
        expected = self.num_nodes if self.agents_failed else len(self.node_hosts)
        return max(0, expected - len(self.lost))

    def seats_by_node(self) -> list[list[RankSeat]]:
        """Every node's ranks, numbered host by host as its agent numbered them."""
        hosts = known_task_hosts(self.node_hosts, self.num_nodes)
        return seats_by_task(hosts, self.world_size // max(self.num_nodes, 1))

    def silent_nodes(self) -> list[int]:
        """Nodes that reached the channel and have not said bye (their output may be partial)."""
        return sorted(set(self.node_hosts) - self.done_nodes)

    # -- events -------------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply one event that happened at ``now`` (monotonic); return what the driver must do
        now, in order. Deadlines are checked on every event."""
        decisions: list[Decision] = []
        self._now = now
        if isinstance(event, NodeHello):
            self.node_hosts[event.node] = event.host
            if event.gpus:
                self.node_gpus[event.node] = event.gpus
            self._maybe_rendezvous(decisions)
        elif isinstance(event, StoreReady):
            self.store_port = event.port
            self._maybe_rendezvous(decisions)
        elif isinstance(event, RankJoined):
            self.joined.add(event.rank)
        elif isinstance(event, RankFailed):
            self._on_failure(event, decisions)
        elif isinstance(event, NodeRefused):
            self.refusals.append(event.summary)
            self.done_nodes.add(event.node)  # a refusing agent starts nothing and says no bye
            self._stop(StopCause.REFUSED, event.summary, decisions)
        elif isinstance(event, RowsCounted):
            self._on_rows(event.counts, decisions)
        elif isinstance(event, HoldRendezvous):
            self.holds += 1
        elif isinstance(event, ReleaseRendezvous):
            self.rank_env.update(event.env)
            self.holds = max(0, self.holds - 1)
            self._maybe_rendezvous(decisions)
        elif isinstance(event, NodeDone):
            self.done_nodes.add(event.node)
            self.dropped_lines += event.dropped_lines
            self._cancel_once_only_lost_remain(decisions)
        elif isinstance(event, NodeLost):
            if event.node not in self.done_nodes and event.node not in self.lost:
                self.lost[event.node] = event
                host = self.node_hosts.get(event.node)
                self._stop(
                    StopCause.NODE_LOST,
                    f"lost contact with node {event.node}"
                    + (f" ({host})" if host else "")
                    + (f": {event.how}" if event.how else ""),
                    decisions,
                )
                self._cancel_once_only_lost_remain(decisions)
        elif isinstance(event, CancelRequested):
            self._stop(StopCause.CANCELLED, event.reason, decisions, override=True)
        elif isinstance(event, PreemptionNotice):
            self._on_preemption(event.why, decisions)
        elif isinstance(event, AgentsEnded):
            self.agents_ended = True
            self.agents_failed = event.failed
        self._check_deadlines(now, decisions)
        return decisions

    # -- internals ----------------------------------------------------------------------------

    def _cancel_once_only_lost_remain(self, decisions: list[Decision]) -> None:
        """With a node lost, once every other node that reached the channel said bye, nothing
        more can come: the lost node's task never ends on its own (a cut-off executor stays
        "running" until Spark's own timeouts, minutes), so the stage goes now."""
        if not self.lost or self.stage_cancelled:
            return
        if set(self.node_hosts) <= self.done_nodes | set(self.lost):
            self.stage_cancelled = True
            decisions.append(CancelStage())

    def _start_deadline_applies(self) -> bool:
        stage = self.start_stage()
        if stage is None or self.aborted:
            return False
        # Detached nodes never say hello; their ranks keep the deadline themselves.
        return not (self.detached and not self.node_hosts)

    def _maybe_rendezvous(self, decisions: list[Decision]) -> None:
        # Every node must have said hello (an agent does so only after its checks passed): no
        # rank may start training while another node could still refuse the run.
        if (
            self.rendezvous_sent
            or self.store_port is None
            or self.holds
            or len(self.node_hosts) < self.num_nodes
        ):
            return
        self.rendezvous_sent = True
        hosts = known_task_hosts(self.node_hosts, self.num_nodes)
        gpus = [self.node_gpus.get(node, "") for node in range(self.num_nodes)]
        decisions.append(
            SendRendezvous(
                self.store_port,
                dict(self.rank_env),
                dict(self.node_gpus),
                isolated_gpus_warning(hosts, gpus) if self.node_gpus else None,
            )
        )

    def _on_failure(self, event: RankFailed, decisions: list[Decision]) -> None:
        if event.rank not in self.failed_ranks:
            self.failed_ranks.append(event.rank)
        if event.hung_since is not None:
            self.hung_since[event.rank] = event.hung_since
        if event.seen_at is not None:
            self.failure_seen_at.setdefault(event.rank, event.seen_at)
        self._stop(StopCause.RANK_FAILED, f"rank {event.rank} failed", decisions)

    def _on_preemption(self, why: str, decisions: list[Decision]) -> None:
        # Once the attempt ends for another reason (a failure, a timeout), or has ended, a
        # notice changes nothing: that is what the attempt is, and what the caller hears.
        if self.preempted or self.aborted or self.agents_ended:
            return
        self.preempted = why
        self._drain_started = self._now
        decisions.append(DrainAll(why, self.deadlines.preemption_grace_s))

    def _drain_ends(self) -> float | None:
        """When ranks still running are stopped (None: no drain, or the ranks are gone)."""
        if self._drain_started is None or self.aborted or self.agents_ended:
            return None
        # Read from the deadlines now, not at the notice: they hold the run's grace.
        return self._drain_started + self.deadlines.preemption_grace_s

    def _on_rows(self, counts: Mapping[int, int], decisions: list[Decision]) -> None:
        self.rows.update(counts)
        if len(self.rows) < self.world_size or self.data_error is not None:
            return
        ordered = [self.rows.get(rank, 0) for rank in range(self.world_size)]
        if sum(ordered) == 0:
            self.data_error = NO_ROWS
        elif 0 in ordered:
            empty = [rank for rank, n in enumerate(ordered) if n == 0]
            self.data_error = (
                f"rank(s) {_ranks(empty)} got no rows of the DataFrame (rows per rank: "
                f"{ordered}); it is too small to give every rank some: use more rows or "
                "fewer processes"
            )
        if self.data_error is not None:
            self._stop(StopCause.BAD_DATA, self.data_error, decisions)
            return
        self.rank_env[ROWS_PER_RANK_VAR] = json.dumps(ordered)
        self.holds = max(0, self.holds - 1)
        self._maybe_rendezvous(decisions)

    def _check_deadlines(self, now: float, decisions: list[Decision]) -> None:
        timeout_s = self.deadlines.timeout_s
        if timeout_s is not None and now >= self.started_at + timeout_s:
            self._stop(
                StopCause.TIMED_OUT,
                f"the run exceeded timeout_s={timeout_s:g}; every rank was stopped. Raise "
                "timeout_s, or pass timeout_s=None for no limit",
                decisions,
            )
        if self._start_deadline_applies() and (
            now >= self.started_at + self.deadlines.start_timeout_s
        ):
            stage = self.start_stage()
            assert stage is not None  # _start_deadline_applies checked it
            missing = sorted(set(range(self.world_size)) - self.joined)
            self._stop(
                StopCause.START_TIMED_OUT,
                f"rank(s) {_ranks(missing)} did not join the run within "
                f"start_timeout_s={self.deadlines.start_timeout_s:g} (stuck {stage.value}; "
                f"{len(self.node_hosts)} of {self.num_nodes} node(s) started); check that the "
                "executors can start Python with torch, or raise start_timeout_s",
                decisions,
            )
        drain_ends = self._drain_ends()
        if drain_ends is not None and now >= drain_ends:
            grace_s = self.deadlines.preemption_grace_s
            self._stop(
                StopCause.PREEMPTED,
                f"preempted ({self.preempted}): ranks still running preemption_grace_s="
                f"{grace_s:g} after the notice were stopped; call runtime.should_stop() every "
                "step, and save and return when it says True",
                decisions,
            )
        if (
            self._failure_deadline is not None
            and not self.stage_cancelled
            and now >= self._failure_deadline
        ):
            self.stage_cancelled = True
            decisions.append(CancelStage())

    def _stop(
        self,
        cause: StopCause,
        reason: str,
        decisions: list[Decision],
        override: bool = False,
    ) -> None:
        if self.stop_cause is None or override and self.stop_cause is not StopCause.CANCELLED:
            first = self.stop_cause is None
            self.stop_cause, self.stop_reason = cause, reason
            if first:
                decisions.append(AbortAll(reason))
        if cause in (StopCause.CANCELLED, StopCause.TIMED_OUT, StopCause.START_TIMED_OUT):
            # The caller is owed a prompt end: the stage goes now, not after a grace period.
            if not self.stage_cancelled:
                self.stage_cancelled = True
                decisions.append(CancelStage())
        elif self._failure_deadline is None:
            self._failure_deadline = self._now + self.deadlines.failure_grace_s


# -- root cause --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailureTiming:
    """When one rank failed, as far as anyone knows.

    Attributes:
        rank: the global rank.
        failed_at: wall-clock time taken inside the rank when it caught its exception, or None
            when it died without raising.
        ended_at: wall-clock time its agent saw it exit (0.0: unknown, e.g. its node was lost).
        aborted: sparkdist stopped it because the run was ending (a consequence, not a cause).
        hung_since: for a hang, the wall-clock time of its last heartbeat.
    """

    rank: int
    failed_at: float | None = None
    ended_at: float = 0.0
    aborted: bool = False
    hung_since: float | None = None

    def moment(self) -> float:
        """The earliest moment this rank is known to have gone wrong."""
        if self.hung_since is not None:
            return self.hung_since
        if self.failed_at is not None:
            return self.failed_at
        if self.ended_at > 0:
            return self.ended_at - ABRUPT_DEATH_SLACK_S
        return float("inf")


def root_cause(failures: Sequence[FailureTiming]) -> int:
    """The rank whose failure came first; ranks stopped by sparkdist only if nobody else failed.

    Raises:
        ValueError: ``failures`` is empty.
    """
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    own = [f for f in failures if not f.aborted] or list(failures)
    return min(own, key=lambda f: (f.moment(), f.rank)).rank


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
