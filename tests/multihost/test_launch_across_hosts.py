"""Launches across hosts whose names resolve badly: DDP, FSDP2, DeepSpeed, the decorator and a
DataFrame, each from the driver's own host in the lab.

Every run here crosses the lab's bridge: three hosts, one rank each, one of them (host2) with
its name on a NIC its peers cannot reach and two with their names on 127.0.1.1. Before sparkdist
told gloo which interface to use, every one of these failed in ``connectFullMesh``.
"""

from __future__ import annotations

import ipaddress

import pytest

from sparkdist._lab.lab import DRIVER_ADDRESS
from sparkdist._lab.spark import DriverKernel, LabCluster

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(400)]

WHERE_AM_I = """
def where_am_i(x):
    import os, socket
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {
        "rank": int(os.environ["RANK"]),
        "hostname": socket.gethostname(),
        "master_addr": os.environ["MASTER_ADDR"],
        "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
        "nccl": os.environ.get("NCCL_SOCKET_IFNAME"),
        "sum": total.item(),
        "scaled": lab_helper.scale(x),
    }
"""


def _run_values(driver: DriverKernel, body: str, call: str) -> list[dict]:
    return driver.check(  # type: ignore[no-any-return]
        f"""
import sys
sys.path.insert(0, "/tmp/job")
import lab_helper
import sparkdist
{body}
result = {call}
"""
    )


@pytest.fixture(scope="module")
def driver_only_module(lab_cluster: LabCluster, lab_driver: DriverKernel) -> None:
    # A module in the driver's private /tmp: no other host has it, so it must travel.
    lab_cluster.lab.write_file(
        "driver", "/tmp/job/lab_helper.py", "def scale(x):\n    return 3 * x\n"
    )
    for host in lab_cluster.workers:
        assert lab_cluster.lab.list_dir(host, "/tmp/job") is None


def _check_world(
    values: list[dict], cluster: LabCluster, *, gloo: str = "eth0", nccl: str = "=eth0"
) -> None:
    # NCCL reads a bare name as a prefix ("eth0" would match "eth01"): "=" asks for exactly it.
    assert [v["rank"] for v in values] == [0, 1, 2]
    assert sorted(v["hostname"] for v in values) == ["lab-host1", "lab-host2", "lab-host3"]
    assert all(v["sum"] == 6.0 for v in values)
    master = values[0]["master_addr"]
    ipaddress.ip_address(master)  # an address, never a name that may resolve to loopback
    assert {v["master_addr"] for v in values} == {master}
    rank0_host = next(h for h in cluster.lab.hosts.values() if h.hostname == values[0]["hostname"])
    assert master == rank0_host.address
    assert all((v["gloo"], v["nccl"]) == (gloo, nccl) for v in values), values


def test_ddp_on_hosts_whose_names_resolve_to_loopback_or_a_foreign_network(
    lab_cluster: LabCluster, lab_driver: DriverKernel, driver_only_module: None
) -> None:
    values = _run_values(
        lab_driver,
        WHERE_AM_I,
        "sparkdist.Distributor(3, local_mode=False, use_gpu=False).run_all(where_am_i, 5).values",
    )
    _check_world(values, lab_cluster)
    assert all(v["scaled"] == 15 for v in values)


def test_an_interface_the_user_set_is_left_as_it_is(
    lab_cluster: LabCluster, lab_driver: DriverKernel, driver_only_module: None
) -> None:
    values = _run_values(
        lab_driver,
        WHERE_AM_I,
        "sparkdist.Distributor(3, local_mode=False, use_gpu=False, env={'GLOO_SOCKET_IFNAME': "
        "'eth0,eth0', 'NCCL_SOCKET_IFNAME': 'eth'}).run_all(where_am_i, 1).values",
    )
    _check_world(values, lab_cluster, gloo="eth0,eth0", nccl="eth")


def test_the_decorator_runs_remote_across_hosts(
    lab_cluster: LabCluster, lab_driver: DriverKernel, driver_only_module: None
) -> None:
    values = _run_values(
        lab_driver,
        WHERE_AM_I,
        "sparkdist.distributed(gpus=3, remote=True, use_gpu=False)(where_am_i).distributed(2)",
    )
    _check_world(values, lab_cluster)
    assert all(v["scaled"] == 6 for v in values)


FSDP = """
def fsdp_train():
    import socket
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from sparkdist import runtime
    dist.init_process_group(runtime.backend())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    total = sum(p.numel() for p in model.parameters())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=runtime.device_mesh())
    fully_shard(model, mesh=runtime.device_mesh())
    held = sum(p.to_local().numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    state = {k: v.full_tensor().sum().item() for k, v in model.state_dict().items()}
    return {"host": socket.gethostname(), "held": held, "total": total, "state": state}
"""


def test_fsdp2_shards_across_hosts(lab_driver: DriverKernel, driver_only_module: None) -> None:
    values = _run_values(
        lab_driver,
        FSDP,
        "sparkdist.Distributor(3, local_mode=False, use_gpu=False, mode='fsdp')"
        ".run_all(fsdp_train).values",
    )
    assert len({v["host"] for v in values}) == 3
    assert sum(v["held"] for v in values) >= values[0]["total"] > values[0]["held"]
    assert values[0]["state"] == values[1]["state"] == values[2]["state"]


DEEPSPEED = """
import json
CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}
def deepspeed_train(steps):
    import socket
    import deepspeed
    import torch
    from sparkdist import runtime
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=runtime.deepspeed_config())
    g = torch.Generator().manual_seed(runtime.get_global_rank())
    x = torch.randn(16, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"host": socket.gethostname(), "first": losses[0], "last": losses[-1]}
"""


@pytest.mark.deepspeed
def test_deepspeed_both_ways_across_hosts(
    lab_driver: DriverKernel, driver_only_module: None
) -> None:
    both = _run_values(
        lab_driver,
        DEEPSPEED,
        "[sparkdist.Distributor(2, local_mode=False, use_gpu=False, mode='deepspeed', "
        "deepspeed_config=CONFIG).run_all(deepspeed_train, 8).values, "
        "sparkdist.DeepspeedTorchDistributor(numGpus=1, nnodes=2, localMode=False, useGpu=False, "
        "deepspeedConfig=CONFIG).run(deepspeed_train, 8)]",
    )
    mode_values, drop_in = both
    assert len({v["host"] for v in mode_values}) == 2
    assert all(v["last"] < v["first"] for v in mode_values)
    assert drop_in["last"] < drop_in["first"]


def test_each_rank_reads_only_its_own_rows(
    lab_driver: DriverKernel, driver_only_module: None
) -> None:
    values = lab_driver.check(
        """
import sparkdist
def my_rows():
    import socket
    from sparkdist import data
    return {"host": socket.gethostname(),
            "ids": sorted(data.partition_table().column("id").to_pylist())}
result = sparkdist.Distributor(3, local_mode=False, use_gpu=False).run_all(
    my_rows, spark_dataframe=spark.range(3000)).values
"""
    )
    ids = [set(v["ids"]) for v in values]
    assert len({v["host"] for v in values}) == 3
    assert all(ids) and sum(len(i) for i in ids) == 3000
    assert set().union(*ids) == set(range(3000))


def test_the_driver_is_on_a_host_of_its_own(lab_cluster: LabCluster) -> None:
    assert lab_cluster.lab.hosts["driver"].address == DRIVER_ADDRESS
    assert "driver" not in lab_cluster.workers
