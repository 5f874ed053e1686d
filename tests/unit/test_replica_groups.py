"""Replica groups' pure parts: the options' checks, a group's identity and variables, its
checkpoint directory, the merged result, the rank's Manager arguments, the relaunch rule."""

from __future__ import annotations

import pytest

from sparkdist._core.env import check_user_env
from sparkdist._core.errors import (
    Attempt,
    ClusterError,
    ConfigError,
    RankFailure,
    WorkerFailedError,
)
from sparkdist._core.launch.config import build_config
from sparkdist._core.launch.replica_groups import (
    ReplicaGroup,
    group_checkpoint_dir,
    lost_for_good,
    manager_kwargs,
    merged_result,
    too_few_groups,
)
from sparkdist._core.run.attempts import final_error, repeated_failure_stop
from sparkdist._core.run.result import RankTimeline, RunResult
from sparkdist._engine.lighthouse import quiet_rust_log
from sparkdist._engine.replica_groups import group_config


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_processes": 4, "replica_groups": 3}, "num_processes=4 does not split into"),
        ({"num_processes": 3, "replica_groups": 3, "min_replica_groups": 4}, "between 1 and 3"),
        ({"num_processes": 4, "replica_groups": 2, "min_processes": 2}, "size is fixed"),
        ({"num_processes": 4, "replica_groups": 2, "mode": "DeepSpeed"}, "mode='deepspeed'"),
        ({"num_processes": 4, "replica_groups": 0}, "replica_groups must be a positive"),
    ],
)
def test_replica_group_options_that_cannot_work_are_refused(
    options: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(**options)


def test_a_group_gets_its_share_of_the_ranks_and_its_own_checkpoints() -> None:
    config = build_config(
        num_processes=6, replica_groups=3, min_replica_groups=2, checkpoint_dir="s3://b/run/"
    )
    group = group_config(config, 2)
    assert (group.num_processes, group.replica_groups, group.min_replica_groups) == (2, 1, 1)
    assert group.checkpoint_dir == "s3://b/run/replica_group_2"
    assert group_checkpoint_dir("/shared/ckpt", 0) == "/shared/ckpt/replica_group_0"


def test_a_group_is_told_torchfts_variables_and_users_may_not_set_them() -> None:
    group = ReplicaGroup(1, 3, "http://10.0.0.1:29510")
    assert group.env() == {
        "TORCHFT_LIGHTHOUSE": "http://10.0.0.1:29510",
        "REPLICA_GROUP_ID": "1",
        "NUM_REPLICA_GROUPS": "3",
    }
    assert group.name == "replica group 1 of 3"
    for name in group.env():
        with pytest.raises(ConfigError, match=name):
            check_user_env({name: "x"})


def test_the_managers_arguments_name_this_nodes_address_not_its_host_name() -> None:
    env = {
        "REPLICA_GROUP_ID": "2",
        "TORCHFT_LIGHTHOUSE": "http://10.0.0.1:29510",
        "SPARKDIST_HOST": "10.0.0.7",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "41000",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    assert manager_kwargs(env) == {
        "replica_id": "replica_group_2",  # torchft numbers ranks by its trailing digits
        "lighthouse_addr": "http://10.0.0.1:29510",
        "hostname": "10.0.0.7",
        "store_addr": "10.0.0.7",
        "store_port": 41000,
        "rank": 1,
        "world_size": 2,
    }
    with pytest.raises(RuntimeError, match="replica_groups=R"):
        manager_kwargs({"RANK": "0"})


def _result(values: list[int], group: int) -> RunResult:
    return RunResult(
        values=list(values),
        wall_times_s=[1.0] * len(values),
        hosts=[f"10.0.0.{group}"] * len(values),
        run_id=f"run{group}",
        mode="ddp",
        use_gpu=False,
        local_mode=False,
        num_tasks=1,
        timeline=[RankTimeline(r, 0, f"10.0.0.{group}", 0.0, 1.0) for r in range(len(values))],
        attempts=[Attempt(0, (f"10.0.0.{group}",), replica_group=group)],
    )


def test_the_runs_result_orders_every_rank_by_group_then_rank() -> None:
    merged = merged_result(
        "whole", [_result([10, 11], 0), _result([20, 21], 1), _result([30, 31], 2)]
    )
    assert merged.values == [10, 11, 20, 21, 30, 31]
    assert merged.hosts[2:4] == ["10.0.0.1", "10.0.0.1"]
    assert [t.rank for t in merged.timeline] == [0, 1, 2, 3, 4, 5]
    assert [a.replica_group for a in merged.attempts] == [0, 1, 2]
    assert (merged.run_id, merged.num_tasks) == ("whole", 3)  # the whole run's id


def _failed(number: int, exc_type: str, message: str) -> Attempt:
    failure = RankFailure(0, "10.0.0.2", 1 if exc_type else -9, exc_type, message)
    return Attempt(number, ("10.0.0.2",), failure, replica_group=1)


def test_a_group_failing_the_same_way_twice_is_not_relaunched_but_a_lost_host_is() -> None:
    bug = [
        _failed(0, "builtins.ValueError", "bad batch"),
        _failed(1, "builtins.ValueError", "bad batch"),
    ]
    assert "same builtins.ValueError" in (repeated_failure_stop(bug) or "")
    killed = [_failed(0, "", "killed by SIGKILL"), _failed(1, "", "killed by SIGKILL")]
    assert repeated_failure_stop(killed) is None
    other = [_failed(0, "builtins.ValueError", "bad batch"), _failed(1, "builtins.KeyError", "x")]
    assert repeated_failure_stop(other) is None
    assert repeated_failure_stop(bug[:1]) is None

    error = WorkerFailedError({0: bug[1].failure}, bug[1].failure)  # type: ignore[dict-item,arg-type]
    assert final_error(bug, error, max_restarts=5) is None  # a whole-world run: budget left
    stopped = final_error(bug, error, max_restarts=5, replica_group=True)
    assert stopped is not None and "not relaunched again" in stopped.note


def test_torchfts_log_is_quieted_unless_the_user_set_it() -> None:
    environ: dict[str, str] = {}
    with quiet_rust_log(environ):
        assert environ == {"RUST_LOG": "warn"}
    assert environ == {}
    mine = {"RUST_LOG": "debug"}
    with quiet_rust_log(mine):
        assert mine == {"RUST_LOG": "debug"}
    assert mine == {"RUST_LOG": "debug"}


def _ended(exc_type: str) -> WorkerFailedError:
    failure = RankFailure(0, "10.0.0.3", -9 if not exc_type else 1, exc_type, "gone")
    history = (
        Attempt(0, ("10.0.0.3",), failure, replica_group=1),
        Attempt(1, ("10.0.0.4",), failure, replica_group=1),
    )
    return WorkerFailedError({0: failure}, failure, (failure,), history)


def test_a_group_lost_to_host_faults_is_lost_for_good_and_a_bug_ends_the_run() -> None:
    assert lost_for_good(_ended(""))  # ranks that died with no exception of the user's
    assert not lost_for_good(_ended("builtins.ValueError"))
    assert not lost_for_good(ClusterError("the stage could not start"))


def test_too_few_groups_names_each_lost_group_and_its_hosts() -> None:
    lost = {1: _ended("")}
    assert too_few_groups(lost, count=3, min_replica_groups=2) is None
    error = too_few_groups(lost, count=3, min_replica_groups=3)
    assert error is not None
    assert "only 2 of 3 replica groups are left, fewer than min_replica_groups=3" in str(error)
    assert "replica group 1 (on 10.0.0.3, 10.0.0.4): rank 0 on 10.0.0.3" in str(error)


def test_the_lost_groups_attempts_join_the_result_in_group_order() -> None:
    lost = list(_ended("").history)
    merged = merged_result("whole", [_result([10], 0), _result([30], 2)], lost)
    assert merged.values == [10, 30]
    assert [(a.replica_group, a.number) for a in merged.attempts] == [
        (0, 0),
        (1, 0),
        (1, 1),
        (2, 0),
    ]
