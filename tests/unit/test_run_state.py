"""The run state machine and the root-cause rule, table-driven, with no process started."""

from __future__ import annotations

import json

import pytest

from sparkdist._core.env import ROWS_PER_RANK_VAR
from sparkdist._core.run.run_state import (
    ABRUPT_DEATH_SLACK_S,
    AbortAll,
    AgentsEnded,
    CancelRequested,
    CancelStage,
    Deadlines,
    DrainAll,
    FailureTiming,
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
    StartStage,
    StopCause,
    StoreReady,
    Tick,
    root_cause,
)

T0 = 1000.0


def new_state(world: int = 4, nodes: int = 2, start_s: float = 60.0, **kw) -> RunState:
    timeout_s = kw.pop("timeout_s", None)
    return RunState(world, nodes, Deadlines(start_s, timeout_s, failure_grace_s=30.0), T0, **kw)


def started(state: RunState, now: float = T0 + 1) -> list:
    """Every node says hello, the store comes up, every rank joins."""
    out = []
    for node in range(state.num_nodes):
        out += state.handle(NodeHello(node, f"host{node}"), now)
    out += state.handle(StoreReady(29500), now)
    for rank in range(state.world_size):
        out += state.handle(RankJoined(rank), now)
    return out


# -- rendezvous --------------------------------------------------------------------------------


def test_rendezvous_goes_out_once_every_node_said_hello_and_the_store_is_up():
    state = new_state()
    assert state.handle(StoreReady(29500), T0) == []
    assert state.handle(NodeHello(0, "a"), T0) == []
    assert state.handle(NodeHello(1, "b"), T0) == [SendRendezvous(29500, {})]
    assert state.handle(NodeHello(1, "b"), T0) == []  # never twice


@pytest.mark.parametrize("store_first", [True, False])
def test_a_hold_delays_the_rendezvous_and_its_env_travels_with_it(store_first):
    state = new_state(nodes=1)
    state.handle(HoldRendezvous(), T0)
    events = [StoreReady(1), NodeHello(0, "a")]
    for event in events if store_first else events[::-1]:
        assert state.handle(event, T0) == []
    assert state.start_stage() is StartStage.DRIVER_SETUP
    assert state.handle(ReleaseRendezvous({"MLFLOW_RUN_ID": "r"}), T0) == [
        SendRendezvous(1, {"MLFLOW_RUN_ID": "r"})
    ]


def test_rows_for_every_rank_release_the_rendezvous_with_the_counts():
    state = new_state(world=2, nodes=1)
    state.handle(HoldRendezvous(), T0)
    state.handle(NodeHello(0, "a"), T0)
    state.handle(StoreReady(7), T0)
    assert state.handle(RowsCounted({0: 5}), T0) == []
    [decision] = state.handle(RowsCounted({1: 3}), T0)
    assert isinstance(decision, SendRendezvous)
    assert json.loads(decision.env[ROWS_PER_RANK_VAR]) == [5, 3]


@pytest.mark.parametrize(
    ("counts", "needle"),
    [({0: 0, 1: 0}, "has no rows"), ({0: 4, 1: 0}, "rank(s) 1 got no rows")],
)
def test_empty_partitions_stop_the_run_before_anyone_trains(counts, needle):
    state = new_state(world=2, nodes=1)
    state.handle(HoldRendezvous(), T0)
    state.handle(NodeHello(0, "a"), T0)
    state.handle(StoreReady(7), T0)
    decisions = state.handle(RowsCounted(counts), T0)
    assert state.stop_cause is StopCause.BAD_DATA
    assert needle in (state.data_error or "")
    assert decisions == [AbortAll(state.data_error or "")]
    assert not state.rendezvous_sent


# -- the fault matrix --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "cause", "cancels_stage_now"),
    [
        (RankFailed(2), StopCause.RANK_FAILED, False),
        (RankFailed(1, hung_since=T0), StopCause.RANK_FAILED, False),
        (NodeLost(1), StopCause.NODE_LOST, False),
        (NodeRefused(0, "numpy 1.0 wanted, 2.0 found"), StopCause.REFUSED, False),
        (CancelRequested("Ctrl-C"), StopCause.CANCELLED, True),
    ],
)
def test_each_fault_aborts_every_rank_once(event, cause, cancels_stage_now):
    state = new_state()
    started(state)
    decisions = state.handle(event, T0 + 2)
    assert state.stop_cause is cause
    assert decisions[0] == AbortAll(state.stop_reason or "")
    assert (CancelStage() in decisions) is cancels_stage_now
    # A second fault adds no second abort.
    assert not any(isinstance(d, AbortAll) for d in state.handle(RankFailed(3), T0 + 3))


def test_after_a_failure_the_stage_is_cancelled_when_the_grace_runs_out():
    state = new_state()
    started(state)
    state.handle(RankFailed(0), T0 + 10)
    assert state.next_wakeup() == T0 + 40
    assert state.handle(Tick(), T0 + 39.9) == []
    assert state.handle(Tick(), T0 + 40) == [CancelStage()]
    assert state.handle(Tick(), T0 + 80) == []  # once


def test_a_goodbye_before_the_connection_drops_is_not_a_lost_node():
    state = new_state()
    started(state)
    state.handle(NodeDone(1, dropped_lines=3), T0 + 5)
    assert state.handle(NodeLost(1), T0 + 5) == []
    assert state.stop_cause is None and state.dropped_lines == 3


def test_the_run_deadline_stops_everything_and_cancels_the_stage():
    state = new_state(timeout_s=100.0)
    started(state)
    assert state.next_wakeup() == T0 + 100
    assert state.handle(Tick(), T0 + 99) == []
    decisions = state.handle(Tick(), T0 + 100)
    assert state.stop_cause is StopCause.TIMED_OUT
    assert decisions == [AbortAll(state.stop_reason or ""), CancelStage()]
    assert "timeout_s=100" in (state.stop_reason or "")


@pytest.mark.parametrize(
    ("setup", "stage"),
    [
        ([], StartStage.NODES),
        ([NodeHello(0, "a")], StartStage.NODES),
        ([NodeHello(0, "a"), NodeHello(1, "b")], StartStage.STORE),
        (
            [HoldRendezvous(), NodeHello(0, "a"), NodeHello(1, "b"), StoreReady(1)],
            StartStage.DRIVER_SETUP,
        ),
        ([NodeHello(0, "a"), NodeHello(1, "b"), StoreReady(1), RankJoined(0)], StartStage.RANKS),
    ],
)
def test_start_timeout_counts_from_submission_and_names_the_stuck_stage(setup, stage):
    state = new_state(start_s=30.0)
    for event in setup:
        state.handle(event, T0 + 1)
    assert state.start_stage() is stage
    assert state.next_wakeup() == T0 + 30
    decisions = state.handle(Tick(), T0 + 30)
    assert state.stop_cause is StopCause.START_TIMED_OUT
    assert stage.value in (state.stop_reason or "")
    assert decisions == [AbortAll(state.stop_reason or ""), CancelStage()]


def test_no_start_deadline_once_every_rank_joined():
    state = new_state(start_s=30.0)
    started(state)
    assert state.next_wakeup() is None
    assert state.handle(Tick(), T0 + 1000) == []


def test_detached_nodes_keep_the_start_deadline_themselves():
    state = new_state(start_s=30.0, detached=True)
    assert state.next_wakeup() is None
    assert state.handle(Tick(), T0 + 1000) == [] and state.stop_cause is None


def test_cancel_wins_over_an_earlier_failure():
    state = new_state()
    started(state)
    state.handle(RankFailed(1), T0 + 2)
    decisions = state.handle(CancelRequested("cancelled"), T0 + 3)
    assert state.stop_cause is StopCause.CANCELLED
    assert decisions == [CancelStage()]  # every rank was already told to stop


def test_goodbyes_expected_after_the_agents_ended():
    state = new_state(nodes=3)
    state.handle(NodeHello(0, "a"), T0)
    assert state.expected_goodbyes() == 1  # only nodes that reached the channel say bye
    state.handle(AgentsEnded(failed=True), T0)
    assert state.expected_goodbyes() == 3  # a failed stage: wait for every node's drain


def test_a_lost_node_says_no_goodbye():
    state = new_state(nodes=3)
    started(state)
    state.handle(NodeLost(2, T0, "it sent nothing for 10.0 s"), T0 + 12)
    state.handle(AgentsEnded(failed=True), T0 + 13)
    assert state.expected_goodbyes() == 2


def test_once_only_lost_nodes_remain_the_stage_goes_at_once():
    # A cut-off node's task never ends on its own: waiting out the failure grace would hold
    # the caller for nothing.
    state = new_state(nodes=3)
    started(state)
    decisions = state.handle(NodeLost(2, T0, "it sent nothing for 10.0 s"), T0 + 12)
    assert CancelStage() not in decisions  # nodes 0 and 1 still end their ranks
    assert state.handle(NodeDone(0), T0 + 12.1) == []
    assert state.handle(NodeDone(1), T0 + 12.2) == [CancelStage()]
    assert state.handle(Tick(), T0 + 60) == []  # once


def test_the_first_node_to_lose_contact_is_kept_first_with_what_was_seen():
    state = new_state(nodes=3)
    started(state)
    state.handle(NodeLost(2, T0 + 1.0, "it sent nothing for 10.0 s"), T0 + 11)
    # The nodes the launcher then stopped are consequences, whatever they report.
    state.handle(NodeLost(0, T0 + 11.5, "its control channel closed without a goodbye"), T0 + 12)
    assert list(state.lost) == [2, 0]
    assert {node: lost.last_heard for node, lost in state.lost.items()} == {
        2: T0 + 1.0,
        0: T0 + 11.5,
    }
    assert state.stop_reason == "lost contact with node 2 (host2): it sent nothing for 10.0 s"
    state.handle(NodeLost(2, T0 + 1.0, "again"), T0 + 13)
    assert list(state.lost) == [2, 0]  # a node is lost once


def test_a_lost_node_is_the_root_cause_against_a_peer_that_failed_after_its_last_word():
    from sparkdist._engine.failures import stage_failure

    # Node 1 (ranks 2, 3) vanished; rank 0 on a healthy node then raised in gloo (a reset),
    # and the driver heard of that failure before it noticed the node was gone.
    wall = 1.7e9
    state = new_state()
    started(state)
    state.handle(RankFailed(0, seen_at=wall + 0.9), T0 + 2)
    state.handle(NodeLost(1, wall + 0.4, "its control channel closed without a goodbye"), T0 + 2)
    error = stage_failure(RuntimeError("Job 3 cancelled"), state, {0: 1})
    assert error.root_cause.rank == 2
    message = error.root_cause.message
    assert "lost with its node 1 (host host1, rank(s) 2-3)" in message
    assert "the driver saw that its control channel closed without a goodbye" in message
    assert "Spark had not yet seen its executor lost" in message


def test_spark_saying_the_executor_was_lost_is_passed_on():
    from sparkdist._engine.failures import spark_view

    text = (
        "An error occurred while calling o99.collectAndServe.\n: org.apache.spark.SparkException:"
        " Job aborted due to stage failure: Task 1 in stage 7.0 failed 1 times, most recent "
        "failure: Lost task 1.0 in stage 7.0 (TID 12) (198.18.0.13 executor 2): "
        "ExecutorLostFailure (executor 2 exited caused by one of the running tasks) Reason: "
        "Remote RPC client disassociated. Likely due to containers exceeding thresholds\n"
    )
    assert spark_view(text).startswith(
        "Spark saw its executor lost too (ExecutorLostFailure (executor 2 exited"
    )


# -- preemption --------------------------------------------------------------------------------


def drained(grace_s: float = 25.0) -> RunState:
    state = RunState(4, 2, Deadlines(60.0, None, 30.0, preemption_grace_s=grace_s), T0)
    started(state)
    return state


def test_a_preemption_notice_drains_every_node_once_and_stops_nothing_yet():
    state = drained()
    why = "node 1 (host host1): rank 3 got SIGTERM"
    assert state.handle(PreemptionNotice(why), T0 + 5) == [DrainAll(why, 25.0)]
    assert state.preempted == why and not state.aborted and state.was_preempted
    assert state.next_wakeup() == T0 + 30  # the grace's end
    # Another node's notice, or the driver's own, adds nothing: one drain per attempt.
    assert state.handle(PreemptionNotice("the driver got SIGTERM"), T0 + 6) == []
    assert state.preempted == why


def test_ranks_still_running_at_the_end_of_the_grace_are_stopped():
    state = drained(grace_s=2.0)
    state.handle(PreemptionNotice("node 0 (host host0): rank 1 got SIGTERM"), T0 + 5)
    assert state.handle(Tick(), T0 + 6.9) == []
    decisions = state.handle(Tick(), T0 + 7)
    assert state.stop_cause is StopCause.PREEMPTED and len(decisions) == 1
    assert isinstance(decisions[0], AbortAll)
    assert "preemption_grace_s=2" in decisions[0].reason and "should_stop()" in decisions[0].reason
    assert state.was_preempted  # stopped at the grace: still a preemption, not a failure


def test_the_grace_is_read_at_its_deadline_so_a_late_setting_counts():
    state = drained(grace_s=25.0)
    state.handle(PreemptionNotice("the driver got SIGTERM"), T0 + 5)
    state.deadlines = Deadlines(60.0, None, 30.0, preemption_grace_s=2.0)
    assert state.next_wakeup() == T0 + 7


def test_ranks_that_all_returned_end_the_drain_without_a_stop():
    state = drained(grace_s=2.0)
    state.handle(PreemptionNotice("node 0 (host host0) got SIGHUP"), T0 + 5)
    state.handle(AgentsEnded(), T0 + 6)
    assert state.handle(Tick(), T0 + 60) == [] and state.stop_cause is None
    assert state.was_preempted and state.next_wakeup() is None


@pytest.mark.parametrize(
    "first", [RankFailed(2), CancelRequested("Ctrl-C"), NodeLost(1)], ids=lambda e: type(e).__name__
)
def test_a_notice_after_the_attempt_began_to_end_changes_nothing(first):
    state = drained()
    state.handle(first, T0 + 2)
    assert state.handle(PreemptionNotice("node 0 (host host0): rank 0 got SIGTERM"), T0 + 3) == []
    assert not state.preempted and not state.was_preempted


@pytest.mark.parametrize(
    ("then", "preempted"),
    [
        (RankFailed(2), True),  # a peer gone mid-collective during the drain: still preempted
        (NodeLost(1), True),  # the preempted host went (its SIGKILL came)
        (CancelRequested("Ctrl-C"), False),  # the caller's stop outranks it
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, bool) else str(x),
)
def test_what_ends_a_drain_decides_whether_the_attempt_was_preempted(then, preempted):
    state = drained()
    state.handle(PreemptionNotice("node 1 (host host1): rank 3 got SIGTERM"), T0 + 2)
    state.handle(then, T0 + 3)
    assert state.was_preempted is preempted


# -- root cause --------------------------------------------------------------------------------

RAISED, PEER = T0, T0 + 0.002  # a peer's collective error follows within milliseconds


@pytest.mark.parametrize(
    ("case", "failures", "expected"),
    [
        ("one rank raised", [FailureTiming(1, failed_at=RAISED)], 1),
        (
            "a raise, then the peer's connection reset heard first by the driver",
            [FailureTiming(0, failed_at=PEER), FailureTiming(1, failed_at=RAISED)],
            1,
        ),
        (
            "segfault seen by its agent after the peer's echo was raised",
            [FailureTiming(0, failed_at=PEER), FailureTiming(1, ended_at=PEER + 0.003)],
            1,
        ),
        (
            "SIGKILL of a rank, peers killed by the abort",
            [FailureTiming(0, ended_at=T0 + 1, aborted=True), FailureTiming(1, ended_at=T0)],
            1,
        ),
        (
            "a raise, everyone else stopped by sparkdist later",
            [
                FailureTiming(0, failed_at=T0 + 5),
                FailureTiming(1, ended_at=T0, aborted=True),
                FailureTiming(2, ended_at=T0, aborted=True),
            ],
            0,
        ),
        (
            "only stopped ranks (e.g. after a node was lost): the earliest",
            [
                FailureTiming(3, ended_at=T0 + 2, aborted=True),
                FailureTiming(2, ended_at=T0 + 1, aborted=True),
            ],
            2,
        ),
        (
            "hangs: the rank silent longest",
            [
                FailureTiming(0, hung_since=T0 + 3),
                FailureTiming(1, hung_since=T0 + 1),
                FailureTiming(2, hung_since=T0 + 2),
            ],
            1,
        ),
        (
            "a hang long before a later raise",
            [FailureTiming(0, failed_at=T0 + 60), FailureTiming(1, hung_since=T0)],
            1,
        ),
        (
            "a lost node's ranks (no timing) lose to a rank with one",
            [FailureTiming(4), FailureTiming(2, failed_at=T0)],
            2,
        ),
        ("nothing known: the lowest rank", [FailureTiming(3), FailureTiming(1)], 1),
        (
            "the same moment: the lowest rank",
            [FailureTiming(3, failed_at=T0), FailureTiming(2, failed_at=T0)],
            2,
        ),
        (
            "an abrupt death well after a raise is not the cause",
            [
                FailureTiming(0, failed_at=T0),
                FailureTiming(1, ended_at=T0 + 2 * ABRUPT_DEATH_SLACK_S),
            ],
            0,
        ),
    ],
)
def test_root_cause(case, failures, expected):
    assert root_cause(failures) == expected, case


def test_root_cause_needs_a_failure():
    with pytest.raises(ValueError, match="at least one"):
        root_cause([])
