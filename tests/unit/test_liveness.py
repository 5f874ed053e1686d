"""The control channel's liveness clocks (pure): when a beat is due, when silence counts."""

from __future__ import annotations

import pytest

from sparkdist._wire.channel.liveness import (
    BEAT_INTERVAL_S,
    MIN_SILENCE_LIMIT_S,
    SILENCE_LIMIT_S,
    Liveness,
    silence_limit_s,
)

T0 = 500.0


def test_the_default_limit_is_the_documented_bound_and_heartbeat_timeout_sets_it():
    assert silence_limit_s(None) == SILENCE_LIMIT_S == 10.0
    assert silence_limit_s(30.0) == 30.0
    assert silence_limit_s(0.1) == MIN_SILENCE_LIMIT_S  # never under two beats


def test_a_beat_is_due_only_after_an_interval_with_nothing_sent():
    live = Liveness.starting(10.0, T0, 1e9)
    assert not live.beat_due(T0 + BEAT_INTERVAL_S - 0.01)
    assert live.beat_due(T0 + BEAT_INTERVAL_S)
    live.sent(T0 + 0.9)  # a log line went: no beat needed yet
    assert not live.beat_due(T0 + 1.5)


def test_silence_counts_only_past_the_limit_and_hearing_resets_it():
    live = Liveness.starting(10.0, T0, 1e9)
    assert live.silent_for(T0 + 9.99) is None
    assert live.silent_for(T0 + 10.5) == pytest.approx(10.5)
    live.heard(T0 + 10.6, 1e9 + 10.6)
    assert live.silent_for(T0 + 15) is None
    assert live.heard_wall == 1e9 + 10.6


def test_without_a_limit_nothing_is_ever_silent():
    live = Liveness.starting(None, T0, 1e9)
    assert live.silent_for(T0 + 1e6) is None
    assert live.next_due(T0) == T0 + BEAT_INTERVAL_S


def test_the_next_wake_up_is_the_earlier_of_a_beat_and_the_limit():
    live = Liveness.starting(3.0, T0, 1e9)
    live.sent(T0 + 2.5)
    assert live.next_due(T0 + 2.6) == T0 + 3.0  # the limit comes before the next beat
    assert live.next_due(T0 + 5) == T0 + 5  # overdue: now


def test_a_pause_on_our_side_is_excused_but_the_last_word_keeps_its_time():
    live = Liveness.starting(10.0, T0, 1e9)
    live.excuse(T0 + 12)  # we stopped reading: not the other end's silence
    assert live.silent_for(T0 + 13) is None
    assert live.heard_wall == 1e9
