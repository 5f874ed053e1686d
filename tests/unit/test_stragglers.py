"""Straggler detection as pure logic: simulated ranks stepping at scripted rates, a simulated
clock, and the episodes the watch names (no process, no sleep)."""

from __future__ import annotations

import math

import pytest

from sparkdist._core.run.stragglers import (
    DEFAULT_STRAGGLER_FRACTION,
    DEFAULT_STRAGGLER_WINDOW_S,
    Recovered,
    StragglerWatch,
    Straggling,
)

DT = 0.1  # seconds between two simulated reports


def simulate(
    schedule: dict[int, list[tuple[float, float]]],
    duration_s: float,
    *,
    fraction: float = 0.7,
    window_s: float = 4.0,
    restart_at: float | None = None,
) -> list[tuple[str, int, float]]:
    """Run ranks whose steps/s follow ``schedule`` (per rank: (until time, rate) pieces; a
    rate of 0 sends no report), checking whenever due; the named episodes as
    (kind, rank, time)."""
    watch = StragglerWatch(fraction, window_s)
    progress = {rank: 0.0 for rank in schedule}
    last_step: dict[int, int] = {}
    events: list[tuple[str, int, float]] = []
    restarted = False
    for tick in range(1, round(duration_s / DT) + 1):
        now = tick * DT
        if restart_at is not None and not restarted and now >= restart_at:
            progress = {rank: 0.0 for rank in schedule}  # a restart: every rank from step 0
            last_step.clear()
            restarted = True
        for rank, pieces in schedule.items():
            rate = next((r for until, r in pieces if now <= until), pieces[-1][1])
            progress[rank] += rate * DT
            step = math.floor(progress[rank])
            if rate > 0 and last_step.get(rank) != step:
                last_step[rank] = step
                watch.observe(rank, step, now)
        if watch.due(now):
            for event in watch.check(now):
                kind = "straggling" if isinstance(event, Straggling) else "recovered"
                events.append((kind, event.rank, round(now, 1)))
    return events


def kinds(events: list[tuple[str, int, float]]) -> list[tuple[str, int]]:
    return [(kind, rank) for kind, rank, _ in events]


FOREVER = 1e9

CASES = [
    # (id, schedule, duration, options, expected (kind, rank) in order)
    ("all ranks alike", {r: [(FOREVER, 10.0)] for r in range(4)}, 20, {}, []),
    (
        "one rank at half speed is named once",
        {0: [(FOREVER, 10.0)], 1: [(FOREVER, 10.0)], 2: [(FOREVER, 5.0)], 3: [(FOREVER, 10.0)]},
        20,
        {},
        [("straggling", 2)],
    ),
    (
        "at 80% of the median a rank is not behind",
        {0: [(FOREVER, 10.0)], 1: [(FOREVER, 8.0)], 2: [(FOREVER, 10.0)]},
        20,
        {},
        [],
    ),
    (
        "behind for less than the window: not named",
        {0: [(FOREVER, 10.0)], 1: [(5.0, 10.0), (7.0, 2.0), (FOREVER, 10.0)], 2: [(FOREVER, 10.0)]},
        20,
        {},
        [],
    ),
    (
        "two episodes, each named once, with the recovery between",
        {
            0: [(FOREVER, 10.0)],
            1: [(3.0, 10.0), (15.0, 3.0), (25.0, 10.0), (40.0, 3.0), (FOREVER, 10.0)],
            2: [(FOREVER, 10.0)],
        },
        50,
        {},
        [("straggling", 1), ("recovered", 1), ("straggling", 1), ("recovered", 1)],
    ),
    (
        "a rank that stops reporting decays to 0 steps/s and is named",
        {0: [(FOREVER, 10.0)], 1: [(6.0, 10.0), (FOREVER, 0.0)], 2: [(FOREVER, 10.0)]},
        20,
        {},
        [("straggling", 1)],
    ),
    ("one rank alone is never behind", {0: [(FOREVER, 1.0)]}, 20, {}, []),
    (
        "fraction 0 turns detection off",
        {0: [(FOREVER, 10.0)], 1: [(FOREVER, 1.0)], 2: [(FOREVER, 10.0)]},
        20,
        {"fraction": 0.0},
        [],
    ),
    (
        "a restart (steps start again from 0) is no straggler",
        {r: [(FOREVER, 10.0)] for r in range(3)},
        20,
        {"restart_at": 8.0},
        [],
    ),
    (
        "the slow half of two ranks is named",
        {0: [(FOREVER, 10.0)], 1: [(FOREVER, 4.0)]},
        20,
        {},
        [("straggling", 1)],
    ),
]


@pytest.mark.parametrize(
    ("schedule", "duration", "options", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_episodes(schedule, duration, options, expected):
    assert kinds(simulate(schedule, duration, **options)) == expected


def test_a_rank_is_named_once_it_stayed_behind_for_the_window():
    window = 4.0
    events = simulate(
        {0: [(FOREVER, 10.0)], 1: [(FOREVER, 2.0)], 2: [(FOREVER, 10.0)]}, 30, window_s=window
    )
    assert kinds(events) == [("straggling", 1)]
    # Judged once a whole horizon (half the window) of reports is in, named a window later.
    named_at = events[0][2]
    assert window + window / 2 <= named_at <= window + window / 2 + 1.0, named_at


def test_the_event_carries_the_rate_and_the_median():
    watch = StragglerWatch(0.7, 2.0)
    for tick in range(1, 101):
        now = tick * 0.1
        watch.observe(0, tick, now)  # 10 steps/s
        watch.observe(1, tick, now)
        watch.observe(2, tick // 5, now)  # 2 steps/s
        events = watch.check(now)
        if events:
            (event,) = events
            assert isinstance(event, Straggling) and event.rank == 2
            assert event.rate == pytest.approx(2.0, abs=0.3)
            assert event.median == pytest.approx(10.0, abs=0.5)
            assert now - event.since >= 2.0
            break
    else:
        pytest.fail("rank 2 was never named")
    spread = watch.spread
    assert spread is not None and spread.slowest_rank == 2 and spread.fastest_rank in (0, 1)
    assert spread.fastest_rate == pytest.approx(10.0, abs=0.5)


def test_rates_need_a_whole_horizon_of_reports():
    watch = StragglerWatch(0.7, 10.0)  # horizon 5 s
    watch.observe(0, 0, 100.0)
    watch.observe(0, 10, 104.0)
    assert watch.rate(0, 104.0) is None
    assert watch.rate(0, 105.0) == pytest.approx(2.0)
    assert watch.rate(7, 105.0) is None  # never reported
    assert watch.rates(105.0) == {0: pytest.approx(2.0)}


def test_checks_are_rate_limited():
    watch = StragglerWatch(0.7, 60.0)
    assert watch.due(0.0)
    watch.check(0.0)
    assert not watch.due(0.5)
    assert watch.due(1.0)
    assert StragglerWatch(0.7, 2.0).check_every_s == 0.5


def test_defaults():
    assert (DEFAULT_STRAGGLER_FRACTION, DEFAULT_STRAGGLER_WINDOW_S) == (0.7, 60.0)
    assert isinstance(Recovered(1, 2.0, 3.0), Recovered)
