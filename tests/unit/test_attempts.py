"""The restart rules on top of max_restarts (pure): start failures retried once, the executors
of a host struck twice, or lost, given up, every attempt listed with its hosts."""

from __future__ import annotations

import dataclasses
import pickle

from sparkdist._core.errors import Attempt, ClusterError, RankFailure, WorkerFailedError
from sparkdist._core.run.attempts import (
    PREEMPTIONS_IN_A_ROW,
    attempt_of,
    failed_attempts,
    final_error,
    nodes_to_give_up,
    preemption_error,
    start_failures_stop,
)
from sparkdist._core.run.growth import GROW_NOTICE
from sparkdist._core.run.run_state import (
    Deadlines,
    NodeHello,
    PreemptionNotice,
    RankFailed,
    RankJoined,
    RunState,
)


def failure(rank: int = 1, host: str = "10.0.0.2", message: str = "boom") -> RankFailure:
    return RankFailure(rank=rank, host=host, exit_code=1, exc_type="ValueError", message=message)


def failed(root: RankFailure) -> WorkerFailedError:
    return WorkerFailedError({root.rank: root}, root)


def test_an_attempt_knows_its_hosts_and_whether_its_root_cause_ever_joined():
    state = RunState(4, 2, Deadlines(60.0), 0.0)
    state.handle(NodeHello(0, "10.0.0.1"), 1.0)
    state.handle(RankJoined(0), 1.0)
    early = attempt_of(state, 0, failure(rank=3))
    late = attempt_of(state, 0, failure(rank=0))
    assert early.hosts == ("10.0.0.1", "?")  # node 1 never reached the driver
    assert early.before_start and not late.before_start
    assert attempt_of(state, 1).failure is None


def test_two_start_failures_in_a_row_stop_the_restarts_one_does_not():
    start = Attempt(0, ("a",), failure(), before_start=True)
    running = Attempt(1, ("a",), failure(), before_start=False)
    assert start_failures_stop([start]) is None
    assert start_failures_stop([running, start]) is None
    assert "2 attempts in a row failed before every rank started" in (
        start_failures_stop([start, start]) or ""
    )


def test_the_budget_counts_restarts_of_the_whole_job():
    history = [Attempt(0, ("a", "b"), failure())]
    assert final_error(history, failed(failure()), max_restarts=1) is None
    history.append(Attempt(1, ("a", "c"), failure(message="again")))
    error = final_error(history, failed(failure(message="again")), max_restarts=1)
    assert error is not None and error.note == ""
    assert [a.message for a in error.attempts] == ["boom"]
    assert "attempt 0 (on a, b) failed first at rank 1 on 10.0.0.2" in str(error)


def test_a_start_failure_twice_ends_the_run_with_restarts_left_and_says_why():
    start = failure(rank=0, message="No module named 'mylib'")
    history = [Attempt(0, ("a",), start, True), Attempt(1, ("b",), start, True)]
    error = final_error(history, failed(start), max_restarts=5)
    assert error is not None
    assert "attempt 0 (on a) failed before every rank started, first at rank 0" in str(error)
    assert error.note.startswith("not restarted again")
    assert error.note in str(error)
    again = pickle.loads(pickle.dumps(error))  # crosses processes like every error
    assert again.history == error.history and again.note == error.note


def test_without_restarts_the_error_is_the_attempts_own():
    error = failed(failure())
    assert final_error([Attempt(0, ("a",), failure())], error, max_restarts=0) is error


def test_a_hosts_nodes_are_given_up_at_its_second_strike_and_each_strike_after():
    nodes = {0: "a", 1: "b", 2: "b", 3: "c"}
    history = [
        Attempt(0, ("a", "b"), failure(host="b")),
        Attempt(1, ("a", "c"), failure(host="c")),
    ]
    assert nodes_to_give_up(history, nodes, lost=()) == set()
    history.append(Attempt(2, ("b", "c"), failure(host="b")))
    assert nodes_to_give_up(history, nodes, lost=()) == {1, 2}  # every node of that attempt there
    # The next failure is elsewhere: b's new executors (if it got some) are not given up for
    # the old strikes; a third strike there gives those up too.
    history.append(Attempt(3, ("b", "c"), failure(host="c")))
    assert nodes_to_give_up(history, nodes, lost=()) == {3}
    history.append(Attempt(4, ("b", "c"), failure(host="b")))
    assert nodes_to_give_up(history, nodes, lost=()) == {1, 2}


def test_the_nodes_an_attempt_lost_contact_with_are_given_up_at_once():
    history = [Attempt(0, ("a", "b", "c"), failure(host="a"))]
    assert nodes_to_give_up(history, {0: "a", 1: "b", 2: "c"}, lost={1}) == {1}
    preempted_one = [Attempt(0, ("a", "b"), preempted="node 1 (host b) got SIGTERM")]
    assert nodes_to_give_up(preempted_one, {0: "a", 1: "b"}, lost={1}) == {1}
    assert nodes_to_give_up([], {}, lost=()) == set()


# -- grows ---------------------------------------------------------------------------------------


def test_a_drain_to_grow_is_a_grow_not_a_preemption_and_uses_no_restart():
    state = RunState(2, 2, Deadlines(60.0), 0.0)
    state.handle(NodeHello(0, "a"), 1.0)
    state.handle(NodeHello(1, "b"), 1.0)
    notice = GROW_NOTICE + "the cluster has held 3 of the 3 ranks asked for"
    state.handle(PreemptionNotice(notice), 1.0)
    grown = attempt_of(state, 1, grow=notice)
    assert grown.grew == "the cluster has held 3 of the 3 ranks asked for"
    assert not grown.preempted and grown.world_size == 2
    assert grown.summary() == f"attempt 1 (on a, b) drained to grow: {grown.grew}"
    # A preemption notice that came first stays a preemption, whatever the watch then tried.
    assert attempt_of(state, 1, grow=GROW_NOTICE + "other").preempted == notice
    history = [Attempt(0, ("a", "b", "c"), failure()), grown]
    assert failed_attempts(history) == 1  # the grow is not counted in max_restarts


# -- preemptions -------------------------------------------------------------------------------

PREEMPTED = "node 1 (host b): rank 1 got SIGTERM"


def preempted(number: int) -> Attempt:
    return Attempt(number, ("a", "b"), preempted=PREEMPTED)


def test_a_preempted_attempt_says_so_and_has_no_root_cause():
    state = RunState(2, 2, Deadlines(60.0), 0.0)
    state.handle(NodeHello(0, "a"), 1.0)
    state.handle(NodeHello(1, "b"), 1.0)
    state.handle(PreemptionNotice(PREEMPTED), 2.0)
    state.handle(RankFailed(0), 3.0)  # a peer lost during the drain: its consequence
    attempt = attempt_of(state, 0, failure(rank=0))
    assert attempt == Attempt(0, ("a", "b"), preempted=PREEMPTED, world_size=2)
    assert attempt.summary() == f"attempt 0 (on a, b) was preempted: {PREEMPTED}"
    assert pickle.loads(pickle.dumps(attempt)) == attempt


def test_preemptions_do_not_use_max_restarts():
    history = [preempted(0), preempted(1), Attempt(2, ("a", "b"), failure())]
    assert failed_attempts(history) == 1
    assert final_error(history, failed(failure()), max_restarts=1) is None
    error = final_error(history, failed(failure()), max_restarts=0)
    assert error is not None and f"attempt 0 (on a, b) was preempted: {PREEMPTED}" in str(error)
    assert error.attempts == ()  # earlier root causes: a preemption has none


def test_preemptions_in_a_row_end_the_run_at_the_documented_bound():
    assert PREEMPTIONS_IN_A_ROW == 3
    history = [preempted(n) for n in range(PREEMPTIONS_IN_A_ROW - 1)]
    assert preemption_error(history) is None
    broken = [*history[:1], Attempt(1, ("a",), failure()), preempted(2)]
    assert preemption_error(broken) is None  # not in a row
    history.append(preempted(PREEMPTIONS_IN_A_ROW - 1))
    error = preemption_error(history)
    assert isinstance(error, ClusterError)
    assert str(error).startswith("the run was preempted 3 times in a row without")
    assert str(error).count("was preempted: node 1 (host b)") == 3


def test_a_run_that_checkpoints_between_preemptions_goes_on_however_often_it_is_preempted():
    # Preempted every hour, a checkpoint each time: never "stuck".
    hourly = [dataclasses.replace(preempted(n), progressed=True) for n in range(10)]
    assert preemption_error(hourly) is None
    # One attempt of the last three made progress: still not stuck.
    mixed = [*hourly[:1], preempted(1), dataclasses.replace(preempted(2), progressed=True)]
    assert preemption_error([*mixed, preempted(3)]) is None
    # Three in a row with no newer checkpoint: the cluster takes it back before any progress.
    stuck = [*hourly, preempted(10), preempted(11), preempted(12)]
    error = preemption_error(stuck)
    assert isinstance(error, ClusterError)
    assert "3 times in a row without committing a newer checkpoint" in str(error)
