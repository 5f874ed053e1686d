"""Replica groups (torchft) in local mode: a lost group is relaunched and heals from a live
peer while the other groups go on; a group whose code fails the same way twice ends the run.

Real torchft (its Lighthouse on the driver, its Manager and gloo process group in every rank),
real processes. Every test checks that no process of the run survives (conftest's leak check).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from sparkdist import ClusterError, Distributor, WorkerFailedError

pytest.importorskip("torchft")

#: Steps every group must commit with all three groups in the quorum before it stops.
FULL_STEPS = 3
#: Steps every run takes at least (group 1 is lost at step 5).
MIN_STEPS = 10
#: The killed group's relaunch waits this long before it joins: more than the Lighthouse's join
#: timeout (1 s), so the survivors' quorums go on without it (a local relaunch is quicker).
RELAUNCH_DELAY_S = 2.0
#: A bound on the steps of a run, so a quorum that never comes back fails the test.
MAX_STEPS = 400


def _replica(min_replica_size: int) -> tuple[Any, Any, Any]:
    """This group's model (the same initial weights in every group), torchft's ``Manager`` over
    it, and the optimizer wrapped by torchft."""
    import torch
    import torchft

    from sparkdist import runtime

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    pg = torchft.ProcessGroupGloo()
    manager = torchft.Manager(
        pg=pg,
        min_replica_size=min_replica_size,
        load_state_dict=lambda state: model.load_state_dict(state["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        **runtime.torchft_manager_kwargs(pg),
    )
    optimizer = torchft.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.05))
    return model, manager, optimizer


def _step(model: Any, manager: Any, optimizer: Any, step: int) -> None:
    """One step on this group's batch for ``step``, gradients averaged over the quorum."""
    import torch

    from sparkdist import runtime

    optimizer.zero_grad()  # starts the step's quorum
    generator = torch.Generator().manual_seed(1000 * step + runtime.replica_group())
    x = torch.randn(8, 4, generator=generator)
    torch.nn.functional.mse_loss(model(x), x[:, :2]).backward()
    runtime.average_gradients(manager, model)
    optimizer.step()  # commits only when every group's allreduce went through


def train_in_groups(
    kill_at_step: int | None,
    raise_at_step: int | None,
    hang_at_step: int | None = None,
    relaunch_delay_s: float = 0.0,
    kill_every_attempt: bool = False,
    groups_at_the_end: int = 3,
    min_steps: int = MIN_STEPS,
) -> dict[str, object]:
    """DDP across replica groups with torchft: group 1 SIGKILLs itself (first attempt only),
    raises (every attempt) from the given step on, or hangs (first attempt only). Each group
    goes on until it has committed ``FULL_STEPS`` steps in a row with all three groups in the
    quorum, and ``min_steps``."""
    import time

    from sparkdist import runtime

    group = runtime.replica_group()
    for _ in range(int(relaunch_delay_s / 0.1) if runtime.restart_count() else 0):
        time.sleep(0.1)  # the survivors must take steps without this group
        runtime.heartbeat()  # alive meanwhile (heartbeat_timeout_s)
    model, manager, wrapped = _replica(min_replica_size=1)
    participants: list[int] = []
    first_step: int | None = None
    try:
        for _ in range(MAX_STEPS):
            step = manager.current_step()
            # ">=": a group that started late heals past a step, it may never be at that one
            first_attempt = runtime.restart_count() == 0
            killed = first_attempt or kill_every_attempt
            if group == 1 and killed and kill_at_step is not None and step >= kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if group == 1 and raise_at_step is not None and step >= raise_at_step:
                raise ValueError("a bad batch")
            if group == 1 and first_attempt and hang_at_step is not None and step >= hang_at_step:
                time.sleep(600)  # hung: torchft's Manager still heartbeats on its own thread
            _step(model, manager, wrapped, step)
            runtime.report(step=manager.current_step())  # a step: the group is not hung
            committed = manager.current_step() > step
            if first_step is None:
                first_step = manager.current_step()  # a healed group's is its peers' step
            if committed:
                participants.append(manager.num_participants())
                full = participants[-FULL_STEPS:] == [groups_at_the_end] * FULL_STEPS
                if full and manager.current_step() >= min_steps:  # the same step in every group
                    break
            time.sleep(0.02)  # the survivors must still be stepping when the relaunch joins
        return {
            "group": group,
            "restarts": runtime.restart_count(),
            "first_step": first_step,
            "participants": participants,
            "step": manager.current_step(),
            "weights": [p.detach().clone().tolist() for p in model.parameters()],
        }
    finally:
        manager.shutdown(wait=False)


def _groups(**options: object) -> Distributor:
    settings: dict[str, object] = {
        "num_processes": 3,
        "replica_groups": 3,
        "local_mode": True,
        "use_gpu": False,
        "max_restarts": 2,
        "timeout_s": 120,
        **options,
    }
    return Distributor(**settings)  # type: ignore[arg-type]


def test_a_killed_group_is_relaunched_and_heals_while_the_others_go_on() -> None:
    result = _groups().run_all(train_in_groups, 5, None, None, RELAUNCH_DELAY_S)

    by_group = {v["group"]: v for v in result.values}
    assert sorted(by_group) == [0, 1, 2]
    # The survivors were never restarted: one process each, from first step to last.
    assert by_group[0]["restarts"] == by_group[2]["restarts"] == 0
    assert by_group[1]["restarts"] == 1
    for survivor in (by_group[0], by_group[2]):
        assert 2 in survivor["participants"], survivor["participants"]  # went on without 1
        assert survivor["participants"][-1] == 3  # and with it again once it healed
    # The relaunched group joined at the survivors' step, not 0, and healed from a peer.
    relaunched = by_group[1]
    assert relaunched["first_step"] > 6, relaunched
    # Every group ends on one step with identical weights.
    assert {v["step"] for v in result.values} == {by_group[0]["step"]}
    assert by_group[0]["weights"] == by_group[1]["weights"] == by_group[2]["weights"]
    # The history names the lost group's attempts; the others had one each.
    groups_attempts = [(a.replica_group, a.number) for a in result.attempts]
    assert groups_attempts == [(0, 0), (1, 0), (1, 1), (2, 0)], groups_attempts
    lost = next(a for a in result.attempts if a.replica_group == 1 and a.number == 0)
    assert lost.failure is not None and lost.failure.exit_code == -signal.SIGKILL


def test_a_group_that_fails_the_same_way_twice_ends_the_run_with_its_traceback() -> None:
    with pytest.raises(WorkerFailedError) as caught:
        _groups().run_all(train_in_groups, None, 2)

    error = caught.value
    assert error.root_cause.exc_type.endswith("ValueError")
    assert "a bad batch" in error.root_cause.traceback
    # Relaunched once, then not again (max_restarts=2 would allow two more).
    assert [a.number for a in error.history] == [0, 1]
    assert {a.replica_group for a in error.history} == {1}
    assert "same builtins.ValueError" in str(error) or "same ValueError" in str(error)
    assert "replica group 1 of 3 failed" in str(error)


def test_a_hung_group_is_ended_whole_and_relaunched_while_the_others_go_on() -> None:
    # Group 1 stops stepping at step 5 while its process lives (and torchft's Manager thread
    # heartbeats): heartbeat_timeout_s ends it, and it is relaunched like a lost group.
    result = _groups(heartbeat_timeout_s=5.0).run_all(train_in_groups, None, None, 5)

    by_group = {v["group"]: v for v in result.values}
    assert [by_group[g]["restarts"] for g in (0, 1, 2)] == [0, 1, 0]
    hung = next(a for a in result.attempts if a.replica_group == 1 and a.number == 0)
    assert hung.failure is not None and "hung" in hung.failure.message, hung
    for survivor in (by_group[0], by_group[2]):
        assert 2 in survivor["participants"], survivor["participants"]
    assert by_group[1]["first_step"] > 6
    assert by_group[0]["weights"] == by_group[1]["weights"] == by_group[2]["weights"]


def test_a_group_lost_for_good_to_host_faults_leaves_the_others_going() -> None:
    # Group 1's rank is killed in every attempt (a host that keeps dying): after its one
    # relaunch it is lost for good, and the two others finish without it (they go on long
    # enough for the relaunch to come and die: no group is relaunched once one finished).
    result = _groups(max_restarts=1).run_all(
        train_in_groups, 5, None, kill_every_attempt=True, groups_at_the_end=2, min_steps=200
    )

    assert sorted(v["group"] for v in result.values) == [0, 2]  # the finished groups' values
    assert all(v["restarts"] == 0 for v in result.values)
    lost = [a for a in result.attempts if a.replica_group == 1]
    assert [a.number for a in lost] == [0, 1] and all(a.failure is not None for a in lost)
    assert result.values[0]["weights"] == result.values[1]["weights"]


def test_fewer_groups_than_min_replica_groups_fails_the_run_naming_the_lost_ones() -> None:
    with pytest.raises(ClusterError) as caught:
        _groups(max_restarts=1, min_replica_groups=3).run_all(
            train_in_groups, 5, None, kill_every_attempt=True
        )

    message = str(caught.value)
    assert "only 2 of 3 replica groups are left, fewer than min_replica_groups=3" in message
    assert "replica group 1 (on 127.0.0.1): rank 0 on 127.0.0.1" in message, message


def train_with_checkpoints(steps: int, save_at: int | None) -> dict[str, object]:
    """Two replica groups train ``steps`` committed steps, each group saving its own checkpoint
    (the model and torchft's step) at step ``save_at``; a run that finds a checkpoint resumes
    from it: the durable tier beside torchft, for when every group is lost."""
    from sparkdist import runtime

    # Both groups in every step, so each run's steps are alike.
    model, manager, wrapped = _replica(min_replica_size=2)
    found = runtime.load_checkpoint()
    if found is not None:
        model.load_state_dict(found.state["model"])
        manager.load_state_dict(found.state["torchft"])
    resumed_at = manager.current_step()
    try:
        for _ in range(MAX_STEPS):
            step = manager.current_step()
            if step >= steps:
                break
            _step(model, manager, wrapped, step)
            if manager.current_step() > step and manager.current_step() == save_at:
                state = {"model": model.state_dict(), "torchft": manager.state_dict()}
                runtime.save_checkpoint(state, manager.current_step())
        return {
            "group": runtime.replica_group(),
            "resumed_at": resumed_at,
            "step": manager.current_step(),
            "weights": [p.detach().clone().tolist() for p in model.parameters()],
        }
    finally:
        manager.shutdown(wait=False)


def test_each_group_checkpoints_on_its_own_and_a_new_run_resumes_from_them(
    tmp_path: Path,
) -> None:
    checkpoints = tmp_path / "ckpt"
    options = {"num_processes": 2, "replica_groups": 2, "checkpoint_dir": str(checkpoints)}
    whole = _groups(**options).run_all(train_with_checkpoints, 10, 6).values

    # Each group wrote its own checkpoint of step 6, under its own directory.
    for group in (0, 1):
        assert (checkpoints / f"replica_group_{group}" / "step-000000006" / "COMMITTED").is_file()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["replica_group_0", "replica_group_1"]
    # Every group lost (a new run, as after the run failed): each group resumes from its own
    # checkpoint, at step 6 with torchft's step, and ends where the uninterrupted run ended.
    resumed = _groups(**options).run_all(train_with_checkpoints, 10, None).values
    assert [v["resumed_at"] for v in resumed] == [6, 6]
    assert [v["step"] for v in resumed] == [v["step"] for v in whole] == [10, 10]
    assert resumed[0]["weights"] == resumed[1]["weights"] == whole[0]["weights"]


def finish_or_die_after_the_others(shared: str) -> int:
    """Group 0 returns at once; group 1's first attempt dies (no exception of its own: a lost
    host) once group 0's process has ended, its second attempt would return."""
    import time

    from sparkdist import runtime

    pid_file = os.path.join(shared, "group-0")
    if runtime.replica_group() == 0:
        with open(pid_file + ".tmp", "w") as out:
            out.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        return 0
    if runtime.restart_count() == 0:
        while not os.path.exists(pid_file):
            time.sleep(0.05)
        with open(pid_file) as written:
            pid = int(written.read())
        while os.path.exists(f"/proc/{pid}"):
            time.sleep(0.05)
        time.sleep(2.0)  # the driver has seen group 0 finish
        os.kill(os.getpid(), signal.SIGKILL)
    return 1


def test_a_group_lost_after_another_finished_is_not_relaunched(tmp_path: Path) -> None:
    # The groups take their last step together: a relaunch after one finished would find no
    # peer to heal from and train alone from the start, so the run ends with the finished ones.
    result = _groups(num_processes=2, replica_groups=2).run_all(
        finish_or_die_after_the_others, str(tmp_path)
    )

    assert result.values == [0]  # group 0's: group 1 never finished
    lost = [a for a in result.attempts if a.replica_group == 1]
    assert [a.number for a in lost] == [0], result.attempts  # not relaunched
    assert lost[0].failure is not None and lost[0].failure.exit_code == -signal.SIGKILL
