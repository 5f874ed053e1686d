"""The pure parts of the serverless runtime helpers and of the run handle: where a rank's
answers come from (launcher variables first, then torch.distributed, then a world of one), the
replica arithmetic of ``device_mesh``, and what each front door's handle returns.

A stand-in ``torch.distributed`` module is fine here (pure units); the real one, under torchrun
and under sparkdist, is in tests/integration/test_runtime_helpers.py.
"""

from __future__ import annotations

import sys
import types

import pytest

from sparkdist import ConfigError, Distributor, RunResult, runtime
from sparkdist._engine.handle import every_value, rank0_value
from sparkdist._node.rank import mesh

WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


class UpGroup:
    """A default process group that is up, as ``torch.distributed`` would describe it."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.module = types.SimpleNamespace(
            is_available=lambda: True,
            is_initialized=lambda: True,
            get_rank=lambda group=None: rank if group is None else 100 + rank,
            get_world_size=lambda: world_size,
            group=types.SimpleNamespace(WORLD=object()),
        )


@pytest.fixture
def no_world(monkeypatch):
    for name in WORLD_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mesh, "_mesh_replicas", None)
    # Not imported (or imported but with no group up): the helpers must not import torch.
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    return monkeypatch


def group_up(monkeypatch, rank: int, world_size: int) -> UpGroup:
    up = UpGroup(rank, world_size)
    monkeypatch.setitem(sys.modules, "torch.distributed", up.module)
    return up


@pytest.mark.parametrize(
    ("env", "torch_world", "expected"),
    [
        ({}, None, (0, 1)),  # outside any launcher: a world of one
        ({"RANK": "3", "WORLD_SIZE": "4"}, None, (3, 4)),  # torchrun's / sparkdist's variables
        ({}, (2, 8), (2, 8)),  # mp.spawn-style: a group is up, no variables
        ({"RANK": "5", "WORLD_SIZE": "6"}, (2, 8), (5, 6)),  # the launcher's variables win
        ({"RANK": "bad", "WORLD_SIZE": ""}, (2, 8), (2, 8)),  # unreadable: torch answers
        ({"RANK": "bad"}, None, (0, 1)),
    ],
)
def test_rank_and_world_size_come_from_the_launcher_first(no_world, env, torch_world, expected):
    for name, value in env.items():
        no_world.setenv(name, value)
    if torch_world is not None:
        group_up(no_world, *torch_world)
    assert (runtime.get_global_rank(), runtime.get_world_size()) == expected
    assert runtime.is_main_process() == (expected[0] == 0)


def test_rank_in_a_group_is_torch_distributeds_answer(no_world):
    group_up(no_world, rank=1, world_size=2)
    no_world.setenv("RANK", "1")
    assert runtime.get_global_rank(object()) == 101  # the group's own rank, not RANK


def test_rank_in_a_group_needs_a_process_group(no_world):
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group\(\)"):
        runtime.get_global_rank(object())


def test_rank_in_a_device_mesh_is_refused_with_the_fix(no_world):
    mesh = types.SimpleNamespace(get_group=lambda dim: None, mesh_dim_names=("shard",))
    with pytest.raises(TypeError, match=r'mesh.get_group\("shard"\)'):
        runtime.get_global_rank(mesh)


@pytest.mark.parametrize(
    ("world_size", "replicas", "replica_of_each_rank"),
    [
        (1, 1, [0]),
        (4, 1, [0, 0, 0, 0]),  # ("shard",): one replica sharded over every rank
        (4, 4, [0, 1, 2, 3]),  # (4, 1): every rank its own replica
        (8, 2, [0, 0, 0, 0, 1, 1, 1, 1]),  # (2, 4): two nodes of four
        (6, 3, [0, 0, 1, 1, 2, 2]),
    ],
)
def test_replica_of_each_rank_follows_init_device_mesh_layout(
    world_size, replicas, replica_of_each_rank
):
    assert [
        mesh._replica_rank_of(rank, world_size, replicas) for rank in range(world_size)
    ] == replica_of_each_rank
    assert mesh._shard_size(world_size, replicas) == world_size // replicas


@pytest.mark.parametrize(("world_size", "replicas"), [(4, 3), (4, 0), (4, -2), (2, 4), (4, True)])
def test_replicas_that_do_not_divide_the_world_are_refused(world_size, replicas):
    with pytest.raises(ValueError, match=r"replicas=\S+ must be|replicas must be an integer"):
        mesh._shard_size(world_size, replicas)


def test_replica_rank_is_the_global_rank_without_a_mesh(no_world):
    assert runtime.get_replica_rank() == 0
    no_world.setenv("RANK", "3")
    assert runtime.get_replica_rank() == 3


def test_replica_rank_follows_the_mesh_only_while_its_group_is_up(no_world):
    up = group_up(no_world, rank=5, world_size=8)
    no_world.setenv("RANK", "5")
    no_world.setattr(mesh, "_mesh_replicas", (up.module.group.WORLD, 1))
    assert runtime.get_replica_rank() == 1
    up.module.group.WORLD = object()  # the group was destroyed and a new one started
    assert runtime.get_replica_rank() == 5
    up.module.is_initialized = lambda: False
    assert runtime.get_replica_rank() == 5


def result_of(values: list[object]) -> RunResult:
    return RunResult(
        values=values,
        wall_times_s=[0.0] * len(values),
        hosts=["h"] * len(values),
        run_id="r",
        mode="ddp",
        use_gpu=False,
        local_mode=True,
        num_tasks=1,
    )


@pytest.mark.parametrize(
    ("values", "decorator_gets", "distributor_gets"),
    [
        ([10, 11], [10, 11], 10),
        ([None], [None], None),
        ([{"a": 1}, None, 3], [{"a": 1}, None, 3], {"a": 1}),
    ],
)
def test_each_front_door_handle_returns_what_its_blocking_call_returns(
    values, decorator_gets, distributor_gets
):
    assert every_value(result_of(values)) == decorator_gets
    assert rank0_value(result_of(values)) == distributor_gets


@pytest.mark.parametrize(
    ("target", "kwargs", "message"),
    [
        ("no-such-script.py", {}, "is not an existing file"),
        (42, {}, "must be a callable or the path of a Python script"),
    ],
)
def test_run_async_refuses_bad_input_before_anything_starts(target, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Distributor(2, use_gpu=False).run_async(target, **kwargs)
