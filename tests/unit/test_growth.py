"""When an elastic run below its world grows back (pure): a larger world must fit for
grow_after_s in a row, and the world grown to is the smallest that fitted all along."""

from __future__ import annotations

from sparkdist._core.run.growth import GrowthWatch


def test_a_larger_world_that_fits_long_enough_is_grown_to() -> None:
    watch = GrowthWatch(current=2, grow_after_s=10.0)
    assert watch.observe(0.0, 2) is None  # nothing larger fits
    assert watch.observe(1.0, 3) is None  # the streak starts
    assert watch.observe(10.9, 3) is None
    assert watch.observe(11.0, 3) == 3


def test_a_host_that_flaps_back_for_a_moment_starts_the_streak_again() -> None:
    watch = GrowthWatch(current=2, grow_after_s=10.0)
    assert watch.observe(0.0, 3) is None
    assert watch.observe(8.0, 2) is None  # gone again: the streak ends
    assert watch.observe(9.0, 3) is None  # a new streak
    assert watch.observe(18.0, 3) is None
    assert watch.observe(19.0, 3) == 3


def test_the_world_grown_to_is_the_smallest_that_fitted_all_along() -> None:
    watch = GrowthWatch(current=2, grow_after_s=5.0)
    assert watch.observe(0.0, 4) is None
    assert watch.observe(2.0, 3) is None
    assert watch.observe(5.0, 4) == 3
    assert "held 3 of the 4 ranks asked for (this attempt runs 2) for 5 s" in watch.why(3, 4)
