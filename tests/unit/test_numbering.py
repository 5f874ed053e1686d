"""Ranks numbered host by host (torchrun's numbering), as a pure function of the task list."""

from __future__ import annotations

import pytest

from sparkdist._core.env import RankSeat, device_index, worker_env
from sparkdist._core.launch.numbering import (
    groups_across_hosts_warning,
    host_groups,
    host_visible_devices,
    isolated_gpu_hosts,
    isolated_gpus_warning,
    known_task_hosts,
    seats_by_task,
    seats_of_placeholder_hosts,
    shard_groups_across_hosts,
    task_of_rank,
)
from sparkdist._core.run.run_state import Deadlines, NodeHello, RunState, SendRendezvous, StoreReady
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._wire import protocol
from sparkdist._wire.protocol import Route
from tests._helpers.specs import agent_spec

# (task hosts by partition id, ranks per task) -> per task: (rank, local rank, node rank)
NUMBERING = [
    # Spark's offers interleave the tasks over two one-executor hosts: ranks follow the hosts.
    (["h1", "h2", "h1", "h2"], 1, [[(0, 0, 0)], [(2, 0, 1)], [(1, 1, 0)], [(3, 1, 1)]]),
    # Two 1-core executors per host, in random order: hosts in the order of their first task.
    (["h2", "h2", "h1", "h1"], 1, [[(0, 0, 0)], [(1, 1, 0)], [(2, 0, 1)], [(3, 1, 1)]]),
    (["h2", "h1", "h1", "h2"], 1, [[(0, 0, 0)], [(2, 0, 1)], [(3, 1, 1)], [(1, 1, 0)]]),
    # Several GPUs per task: inside a host by partition id, then by the task's GPU.
    (
        ["h1", "h2", "h1"],
        2,
        [[(0, 0, 0), (1, 1, 0)], [(4, 0, 1), (5, 1, 1)], [(2, 2, 0), (3, 3, 0)]],
    ),
    # One task per host: the old numbering (partition id = node rank).
    (["a", "b", "c"], 2, [[(0, 0, 0), (1, 1, 0)], [(2, 0, 1), (3, 1, 1)], [(4, 0, 2), (5, 1, 2)]]),
    # Unequal hosts.
    (["h1", "h1", "h2", "h3"], 1, [[(0, 0, 0)], [(1, 1, 0)], [(2, 0, 1)], [(3, 0, 2)]]),
    # One host (local[2], local-cluster): one node.
    (["localhost", "localhost"], 1, [[(0, 0, 0)], [(1, 1, 0)]]),
]


@pytest.mark.parametrize(("hosts", "per_task", "expected"), NUMBERING)
def test_ranks_are_numbered_host_by_host(hosts, per_task, expected):
    seats = seats_by_task(hosts, per_task)
    assert [[(s.rank, s.local_rank, s.node_rank) for s in task] for task in seats] == expected
    assert [[s.task for s in task] for task in seats] == [[t] * per_task for t in range(len(hosts))]
    every = [s for task in seats for s in task]
    assert sorted(s.rank for s in every) == list(range(len(hosts) * per_task))
    groups = host_groups(hosts)
    for seat in every:
        assert seat.world_size == len(hosts) * per_task
        assert seat.num_nodes == len(groups)
        assert seat.local_world_size == len(groups[seat.node_rank]) * per_task
        assert seat.host_sizes == tuple(len(g) * per_task for g in groups)
    # The ranks of one host are consecutive, and rank 0 is always partition 0's first rank
    # (the store's host: MASTER_ADDR stays the first task's address).
    for node in range(len(groups)):
        ranks = sorted(s.rank for s in every if s.node_rank == node)
        assert ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    assert seats[0][0].rank == 0


def test_task_of_rank_inverts_the_numbering():
    hosts = ["h1", "h2", "h1", "h2"]
    assert [task_of_rank(r, hosts, 2) for r in range(8)] == [
        (0, 0), (0, 1), (2, 0), (2, 1), (1, 0), (1, 1), (3, 0), (3, 1),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="rank 8 is outside a world of 4 task"):
        task_of_rank(8, hosts, 2)


def test_unknown_hosts_count_as_hosts_of_their_own():
    assert known_task_hosts({0: "h1", 2: "h1"}, 3) == ["h1", "task 1, not heard of", "h1"]
    seats = seats_of_placeholder_hosts(3, 2)
    assert [[s.rank for s in task] for task in seats] == [[0, 1], [2, 3], [4, 5]]
    assert {s.local_world_size for task in seats for s in task} == {2}


@pytest.mark.parametrize(
    ("task", "hosts", "gpus", "visible"),
    [
        # Each rank sees its host's GPUs in local-rank order: cuda:LOCAL_RANK is its own.
        (0, ["h1", "h2", "h1", "h2"], ["3", "0", "1", "2"], "3,1"),
        (2, ["h1", "h2", "h1", "h2"], ["3", "0", "1", "2"], "3,1"),
        (3, ["h1", "h2", "h1", "h2"], ["3", "0", "1", "2"], "0,2"),
        (1, ["h1", "h1"], ["0,1", "2,3"], "0,1,2,3"),
        (0, ["h1", "h2"], ["0,1", "0,1"], "0,1"),  # one task per host: its own GPUs
    ],
)
def test_visible_devices_are_the_hosts_gpus_in_local_rank_order(task, hosts, gpus, visible):
    assert host_visible_devices(task, hosts, gpus) == visible
    seats = seats_by_task(hosts, len(gpus[task].split(",")))
    for seat, gpu in zip(seats[task], gpus[task].split(","), strict=True):
        assert visible.split(",")[seat.local_rank] == gpu


@pytest.mark.parametrize(
    ("host_sizes", "shard", "spanning"),
    [
        ([2, 2], 2, {}),  # a group per host
        ([4, 4], 2, {}),  # two groups inside each host
        ([2, 2, 2, 2], 4, {}),  # groups of two whole hosts, as asked
        ([2, 1, 1], 2, {1: [1, 2]}),
        ([3, 1], 2, {1: [0, 1]}),
        ([2, 2], 4, {}),
        ([3, 3], 2, {1: [0, 1]}),  # 2 divides neither way into 3
        ([1, 1, 1, 1], 2, {}),  # one rank per host: whole hosts
    ],
)
def test_shard_groups_that_cross_hosts(host_sizes, shard, spanning):
    assert shard_groups_across_hosts(host_sizes, shard) == spanning


def test_the_warning_names_the_groups_and_the_fix():
    warning = groups_across_hosts_warning([2, 1, 1], replicas=2)
    assert warning is not None
    assert "device_mesh(replicas=2): 1 of 2 shard group(s) of 2 rank(s) cross hosts" in warning
    assert "group 1 (ranks 2-3) spans nodes 1, 2" in warning
    assert "ranks per node: [2, 1, 1]" in warning
    assert groups_across_hosts_warning([2, 2], replicas=2) is None


def _env_of(seat: RankSeat, gpus: str | None = None) -> dict[str, str]:
    return worker_env(
        {},
        seat,
        master_addr="10.0.0.1",
        run_id="r",
        restart_count=0,
        max_restarts=0,
        cuda_visible_devices=gpus,
        mode="ddp",
        host="h1",
    )


def test_the_rank_knows_its_task_and_every_hosts_size():
    env = _env_of(seats_by_task(["h1", "h2", "h1"], 1)[2][0])
    assert (env["RANK"], env["LOCAL_RANK"], env["NODE_RANK"], env["GROUP_RANK"]) == (
        "1", "1", "0", "0",
    )  # fmt: skip
    assert (env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"], env["WORLD_SIZE"]) == ("2", "2", "3")
    assert env["SPARKDIST_TASK"] == "2"
    assert env["SPARKDIST_RANKS_PER_HOST"] == "2,1"


def _spec(task: int, hosts: list[str], gpus: str | None) -> AgentSpec:
    return agent_spec(
        node_rank=task,
        num_nodes=len(hosts),
        master_addr=hosts[0],
        host=hosts[task],
        gpu_addresses=gpus,
        task_hosts=tuple(hosts),
    )


def test_an_agent_numbers_its_ranks_by_host_and_shows_them_the_hosts_gpus():
    hosts = ["h1", "h2", "h1", "h2"]
    spec = _spec(2, hosts, "5")
    assert [(s.rank, s.local_rank, s.node_rank) for s in spec.seats()] == [(1, 1, 0)]
    # The driver's rendezvous carries every task's GPUs (their hellos); this host's, in
    # local-rank order, become the ranks' CUDA_VISIBLE_DEVICES.
    message = protocol.Rendezvous(29500, {}, {0: "3", 1: "0", 2: "5", 3: "1"})
    for_ranks = spec.rendezvous_for_ranks(message)
    assert isinstance(for_ranks, protocol.Rendezvous)
    assert for_ranks.visible_devices == "3,5"
    assert protocol.decode(protocol.encode(for_ranks, Route.WORKER), Route.WORKER) == for_ranks
    problem = spec.rendezvous_for_ranks(protocol.Rendezvous(29500, {}, {1: "0", 2: "5"}))
    assert problem == (
        "task(s) [0] on h1 named no GPUs, so the GPUs of this host cannot be made visible in "
        "local-rank order; every task of a GPU run needs spark.task.resource.gpu.amount GPUs"
    )
    # CPU runs and local mode (no task hosts) pass the rendezvous on as it is.
    assert _spec(2, hosts, None).rendezvous_for_ranks(message) is message


def test_the_driver_shares_every_nodes_gpus_and_maps_ranks_back_to_nodes():
    state = RunState(4, 4, Deadlines(start_timeout_s=60.0), started_at=0.0)
    decisions: list[object] = []
    for node, (host, gpus) in enumerate([("h1", "0"), ("h2", "0"), ("h1", "1"), ("h2", "1")]):
        decisions += state.handle(NodeHello(node, host, gpus), now=1.0)
    decisions += state.handle(StoreReady(29500), now=1.0)
    (rendezvous,) = [d for d in decisions if isinstance(d, SendRendezvous)]
    assert rendezvous.task_gpus == {0: "0", 1: "0", 2: "1", 3: "1"}
    assert [[s.rank for s in seats] for seats in state.seats_by_node()] == [[0], [2], [1], [3]]


def test_executors_that_each_see_gpus_of_their_own_keep_their_tasks_gpus():
    # Two containers on one host, each numbering its GPUs from 0: no list names them all.
    hosts, gpus = ["h1", "h1", "h2"], ["0", "0", "0"]
    assert host_visible_devices(0, hosts, gpus) is None
    assert host_visible_devices(2, hosts, gpus) == "0"
    assert isolated_gpu_hosts(hosts, gpus) == ["h1"]
    warning = isolated_gpus_warning(hosts, gpus)
    assert warning is not None and warning.startswith("on h1 the executors name the same GPUs")
    assert "torch.cuda.set_device(LOCAL_RANK) is not" in warning
    assert isolated_gpus_warning(hosts, ["0", "1", "0"]) is None
    spec = _spec(1, hosts, "0")
    message = protocol.Rendezvous(29500, {}, {0: "0", 1: "0", 2: "0"})
    assert spec.rendezvous_for_ranks(message) is message  # CUDA_VISIBLE_DEVICES stays "0"
    state = RunState(3, 3, Deadlines(start_timeout_s=60.0), started_at=0.0)
    for node, host in enumerate(hosts):
        state.handle(NodeHello(node, host, "0"), now=1.0)
    (rendezvous,) = state.handle(StoreReady(29500), now=1.0)
    assert isinstance(rendezvous, SendRendezvous) and rendezvous.gpu_warning == warning


@pytest.mark.parametrize(
    ("env", "index"),
    [
        ({"CUDA_VISIBLE_DEVICES": "3,5", "SPARKDIST_GPU": "5", "LOCAL_RANK": "1"}, 1),
        # Isolated executors: LOCAL_RANK 1 counts the host's ranks, the rank sees one GPU.
        ({"CUDA_VISIBLE_DEVICES": "0", "SPARKDIST_GPU": "0", "LOCAL_RANK": "1"}, 0),
        ({"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "1"}, 1),  # not launched by sparkdist
        ({}, 0),
    ],
)
def test_a_ranks_device_index_is_its_own_gpus_place_among_the_visible_ones(env, index):
    assert device_index(env) == index


def test_each_rank_is_told_its_own_gpu():
    seats = seats_by_task(["h1", "h1"], 2)
    own = [
        _env_of(seat, gpus)["SPARKDIST_GPU"]
        for seat, gpus in zip([*seats[0], *seats[1]], ["0,1", "0,1", "2,3", "2,3"], strict=True)
    ]
    assert own == ["0", "1", "2", "3"]
