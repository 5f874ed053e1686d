"""LaunchPlan: a pure function of config and placement, printable, with no process started."""

from __future__ import annotations

import pytest

from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import Placement
from sparkdist._core.launch.plan import BackendKind, make_plan


def plan_for(config: LaunchConfig, placement: Placement, backend=BackendKind.LOCAL, **kw):
    kw.setdefault("job_name", "train")
    kw.setdefault("job_size_bytes", 2048)
    return make_plan(config, placement, backend=backend, **kw)


@pytest.mark.parametrize(
    ("backend", "placement", "ranks", "nodes", "gpus_of_rank_3"),
    [
        (BackendKind.LOCAL, Placement(1, 4, False), 4, [0, 0, 0, 0], "none (CPU)"),
        (
            BackendKind.LOCAL,
            Placement(1, 4, True, ("0", "1", "2", "3")),
            4,
            [0, 0, 0, 0],
            "0,1,2,3",
        ),
        (BackendKind.SPARK, Placement(4, 1, False), 4, [0, 1, 2, 3], "none (CPU)"),
        (
            BackendKind.SPARK,
            Placement(2, 2, True),
            4,
            [0, 0, 1, 1],
            "2 assigned by Spark to task 1",
        ),
    ],
)
def test_ranks_nodes_and_gpus(backend, placement, ranks, nodes, gpus_of_rank_3):
    config = LaunchConfig(num_processes=ranks, use_gpu=placement.use_gpu)
    plan = plan_for(config, placement, backend)
    assert plan.world_size == ranks
    assert [r.seat.rank for r in plan.ranks] == list(range(ranks))
    assert [r.seat.node_rank for r in plan.ranks] == nodes
    assert plan.ranks[3].gpus == gpus_of_rank_3
    for r in plan.ranks:
        assert r.env["RANK"] == str(r.seat.rank)
        assert r.env["WORLD_SIZE"] == str(ranks)
        assert r.env["LOCAL_RANK"] == str(r.seat.local_rank)
        assert "MASTER_PORT" not in r.env  # chosen by rank 0's store at start


def test_a_plan_is_pure_and_prints_what_matters(tmp_path):
    config = LaunchConfig(
        num_processes=2,
        mode="deepspeed",
        deepspeed_config={"zero_optimization": {"stage": 2}},
        timeout_s=600,
        env={"NCCL_DEBUG": "WARN"},
        checkpoint_dir=str(tmp_path),
    )
    a = plan_for(config, Placement(1, 2, False), requirements=("numpy==2.0",))
    b = plan_for(config, Placement(1, 2, False), requirements=("numpy==2.0",))
    assert a == b
    text = a.describe()
    for needle in (
        "train on 2 rank(s)",
        "mode=deepspeed",
        "zero_stage=2",
        "backend: local",
        "timeout_s=600",
        "start_timeout_s=300",
        "2.0 KB",
        "numpy==2.0",
        "NCCL_DEBUG",
        "rank 1: node 0, local rank 1",
    ):
        assert needle in text, needle
    assert all(r.env["SPARKDIST_CHECKPOINT_DIR"] == str(tmp_path) for r in a.ranks)
    assert all(r.env["DS_ACCELERATOR"] == "cpu" for r in a.ranks)


def test_a_large_job_says_it_travels_as_a_file():
    config = LaunchConfig(num_processes=2, local_mode=False)
    plan = plan_for(
        config,
        Placement(2, 1, False),
        BackendKind.SPARK,
        job_size_bytes=300 << 20,
        job_as_file=True,
    )
    assert "300.0 MB, shipped as a Spark file" in plan.describe()


def test_the_plan_says_which_interface_ranks_use():
    local = plan_for(LaunchConfig(num_processes=2), Placement(1, 2, False))
    assert "network: loopback" in local.describe()
    assert all("GLOO_SOCKET_IFNAME" not in r.env for r in local.ranks)

    spark = plan_for(
        LaunchConfig(num_processes=2, local_mode=False), Placement(2, 1, False), BackendKind.SPARK
    )
    assert "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name the interface" in spark.describe()
    assert spark.ranks[1].env["GLOO_SOCKET_IFNAME"] == "<the interface holding the node's address>"

    config = LaunchConfig(num_processes=2, local_mode=False, env={"GLOO_SOCKET_IFNAME": "ib0"})
    own = plan_for(config, Placement(2, 1, False), BackendKind.SPARK)
    text = own.describe()
    assert "GLOO_SOCKET_IFNAME='ib0' from env=" in text
    assert "NCCL_SOCKET_IFNAME name the interface" in text
    assert "GLOO_SOCKET_IFNAME" not in own.ranks[0].env  # the user's, shown in user_env
    assert own.ranks[0].env["NCCL_SOCKET_IFNAME"].startswith("=<")
