"""Which executors the pool warmer warms, and for which runs (pure; the local-cluster test in
tests/integration/test_pool_warmer.py runs it against real executors)."""

from __future__ import annotations

import dataclasses

from sparkdist._backends.pool_warmer import idle_executors, may_restart
from sparkdist._core.env import CHECKPOINT_DIR_VAR
from tests._helpers.specs import agent_spec


def test_an_executor_with_a_free_slot_and_no_task_of_the_attempt_is_warmed() -> None:
    executors = {"1": (1, 0), "2": (1, 1), "3": (2, 1), "4": (4, 0)}
    assert idle_executors(executors, busy={"4"}, task_cpus=1) == ["1", "3"]


def test_slots_are_counted_in_task_cpus() -> None:
    executors = {"1": (4, 1), "2": (3, 1), "3": (2, 0)}
    assert idle_executors(executors, busy=(), task_cpus=2) == ["1", "3"]  # "2": 1 core left


def test_only_runs_that_may_restart_are_warmed_for() -> None:
    plain = agent_spec()
    assert not may_restart(plain)
    assert may_restart(dataclasses.replace(plain, max_restarts=1))
    checkpoints = dataclasses.replace(plain, extra_env={CHECKPOINT_DIR_VAR: "/ckpt"})
    assert may_restart(checkpoints)  # a preemption or a grow restarts it from there
