"""Placement rules, table-driven: no Spark, no torch."""

from __future__ import annotations

import re

import pytest

from sparkdist import ClusterError, ConfigError
from sparkdist._backends.capacity import usable_slots
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import (
    Placement,
    PysparkCount,
    check_barrier_slots,
    check_cluster_conf,
    check_ssl,
    count_like_pyspark,
    cuda_visible_devices,
    estimate_barrier_slots,
    place_local,
    place_on_cluster,
    shrink_to_slots,
)

GPU = "spark.task.resource.gpu.amount"


@pytest.mark.parametrize(
    ("n", "use_gpu", "driver_gpus", "expected"),
    [
        (2, False, [], Placement(1, 2, False)),
        (2, False, ["0", "1"], Placement(1, 2, False)),
        (2, None, [], Placement(1, 2, False)),
        (2, None, ["0", "1", "2"], Placement(1, 2, True, ("0", "1"))),
        (2, True, ["3", "5"], Placement(1, 2, True, ("3", "5"))),
    ],
)
def test_local_placement(n, use_gpu, driver_gpus, expected):
    assert place_local(LaunchConfig(num_processes=n, use_gpu=use_gpu), driver_gpus) == expected


def test_local_gpu_without_gpus_says_to_pass_use_gpu_false():
    with pytest.raises(ClusterError, match="use_gpu=False"):
        place_local(LaunchConfig(num_processes=2, use_gpu=True), [])


def test_local_more_processes_than_gpus_names_the_count():
    with pytest.raises(ClusterError, match="num_processes=3 but the driver has 2 GPU"):
        place_local(LaunchConfig(num_processes=3, use_gpu=True), ["0", "1"])


@pytest.mark.parametrize(
    ("n", "use_gpu", "conf", "expected"),
    [
        (4, False, {}, Placement(4, 1, False)),
        (4, False, {GPU: "1"}, Placement(4, 1, False)),
        (4, None, {}, Placement(4, 1, False)),
        (4, None, {GPU: "1"}, Placement(4, 1, True)),
        (4, True, {GPU: "1"}, Placement(4, 1, True)),
        (4, True, {GPU: "2"}, Placement(2, 2, True)),
        (8, True, {GPU: "4.0"}, Placement(2, 4, True)),
    ],
)
def test_cluster_placement(n, use_gpu, conf, expected):
    config = LaunchConfig(num_processes=n, local_mode=False, use_gpu=use_gpu)
    placement = place_on_cluster(config, conf)
    assert placement == expected
    assert placement.world_size == n


@pytest.mark.parametrize(
    ("n", "conf", "message"),
    [
        (2, {}, f"{GPU} is unset; set {GPU}=1"),
        (2, {GPU: ""}, f"{GPU} is unset"),
        (2, {GPU: "0.5"}, f"{GPU}=0.5 but each rank needs a whole GPU"),
        (2, {GPU: "0"}, f"{GPU}=0 but each rank needs a whole GPU"),
        (2, {GPU: "two"}, "is not a number"),
        (3, {GPU: "2"}, "num_processes=3 is not a multiple of"),
    ],
)
def test_cluster_gpu_conf_errors(n, conf, message):
    with pytest.raises(ConfigError, match=message):
        place_on_cluster(LaunchConfig(num_processes=n, local_mode=False, use_gpu=True), conf)


def test_dynamic_allocation_is_refused_with_the_fix():
    with pytest.raises(ClusterError, match="spark.dynamicAllocation.enabled=false"):
        check_cluster_conf({"spark.dynamicAllocation.enabled": "true"}, "x.ignoreSsl")


def test_ssl_is_refused_unless_opted_out():
    conf = {"spark.ssl.enabled": "true"}
    with pytest.raises(ClusterError, match="set pytorch.spark.distributor.ignoreSsl=true"):
        check_cluster_conf(conf, "pytorch.spark.distributor.ignoreSsl")
    conf["pytorch.spark.distributor.ignoreSsl"] = "TRUE"
    warnings = check_cluster_conf(conf, "pytorch.spark.distributor.ignoreSsl")
    assert len(warnings) == 1 and "unencrypted" in warnings[0]
    assert check_cluster_conf({}, "pytorch.spark.distributor.ignoreSsl") == []


def test_slots_check_names_found_and_needed():
    check_barrier_slots(2, 2, "local[2]")
    with pytest.raises(ClusterError, match="needs 4 task slots at once but the cluster"):
        check_barrier_slots(4, 2, "local[2]")


@pytest.mark.parametrize(
    ("addresses", "inherited", "expected"),
    [
        (["0", "1"], None, "0,1"),
        (["1"], None, "1"),
        (["0", "1"], "4,5,6", "4,5"),
        (["2"], "4, 5, 6", "6"),
    ],
)
def test_cuda_visible_devices(addresses, inherited, expected):
    assert cuda_visible_devices(addresses, inherited) == expected


@pytest.mark.parametrize(
    ("addresses", "inherited"), [(["01"], None), (["gpu0"], None), (["3"], "0,1")]
)
def test_cuda_visible_devices_refuses_bad_addresses(addresses, inherited):
    with pytest.raises(ClusterError):
        cuda_visible_devices(addresses, inherited)


def test_non_local_master_without_authentication_warns_once():
    key = "pytorch.spark.distributor.ignoreSsl"
    warnings = check_cluster_conf({"spark.master": "spark://10.0.0.1:7077"}, key)
    assert len(warnings) == 1 and "spark.authenticate=true" in warnings[0]
    assert check_cluster_conf({"spark.master": "yarn", "spark.authenticate": "true"}, key) == []
    assert check_cluster_conf({"spark.master": "local-cluster[2,1,1024]"}, key) == []


@pytest.mark.parametrize(
    ("conf", "slots"),
    [
        ({"spark.master": "local"}, 1),
        ({"spark.master": "local[4]"}, 4),
        ({"spark.master": "local[4]", "spark.task.cpus": "2"}, 2),
        ({"spark.master": "local[*]"}, None),
        ({"spark.master": "local-cluster[2,1,1024]"}, 2),
        ({"spark.master": "local-cluster[2, 4, 1024]", "spark.task.cpus": "2"}, 4),
        ({"spark.master": "yarn"}, None),
        (
            {
                "spark.master": "yarn",
                "spark.executor.instances": "3",
                "spark.executor.cores": "8",
                "spark.executor.resource.gpu.amount": "2",
                GPU: "1",
            },
            6,
        ),
    ],
)
def test_barrier_slots_estimated_from_conf(conf, slots):
    assert estimate_barrier_slots(conf) == slots


# -- pyspark's constructor-time reading (TorchDistributor._get_num_tasks, observed) ------------

DRIVER_GPU = "spark.driver.resource.gpu.amount"


@pytest.mark.parametrize(
    ("n", "local_mode", "use_gpu", "conf", "driver_gpus", "expected"),
    [
        # CPU: the world is the task count, whatever the conf says.
        (3, False, False, {GPU: "2"}, None, PysparkCount(3, 3)),
        (3, True, False, {}, None, PysparkCount(3, 3)),
        # Cluster GPUs: tasks are ranks over the task's GPU amount.
        (4, False, True, {GPU: "1"}, None, PysparkCount(4, 4)),
        (4, False, True, {GPU: "2"}, None, PysparkCount(4, 2)),
        (8, False, True, {GPU: "4"}, None, PysparkCount(8, 2)),
        # A bad num_processes passes through: the launch config refuses it next.
        ("4", False, True, {GPU: "2"}, None, PysparkCount("4", "4")),
        # Local GPUs: as many ranks as the driver's GPUs, at most.
        (2, True, True, {}, ["0", "1"], PysparkCount(2, 2)),
        (2, True, True, {DRIVER_GPU: "2"}, ["0", "1"], PysparkCount(2, 2)),
        (1, True, True, {DRIVER_GPU: "2"}, ["0", "1"], PysparkCount(1, 1)),
    ],
)
def test_count_like_pyspark(n, local_mode, use_gpu, conf, driver_gpus, expected):
    counted = count_like_pyspark(
        n, local_mode=local_mode, use_gpu=use_gpu, conf=conf, driver_gpus=driver_gpus
    )
    assert counted == expected


@pytest.mark.parametrize(
    ("n", "conf", "driver_gpus", "lowered_to", "listed"),
    [
        (4, {}, ["0", "1"], 2, "(0, 1)"),
        (3, {DRIVER_GPU: "1"}, ["0", "1"], 1, "(0)"),  # the runtime conf counts, as in pyspark
    ],
)
def test_count_like_pyspark_lowers_local_ranks_to_the_drivers_gpus(
    n, conf, driver_gpus, lowered_to, listed
):
    counted = count_like_pyspark(
        n, local_mode=True, use_gpu=True, conf=conf, driver_gpus=driver_gpus
    )
    assert (counted.num_processes, counted.num_tasks) == (lowered_to, lowered_to)
    assert counted.warning is not None
    assert f"num_processes={n} but the driver has {lowered_to} GPU(s) {listed}" in counted.warning
    assert f"lowered to {lowered_to}" in counted.warning


@pytest.mark.parametrize(
    ("n", "local_mode", "conf", "driver_gpus", "error", "message"),
    [
        (2, False, {}, None, ClusterError, f"{GPU} is unset, so no task gets a GPU; set {GPU}=1"),
        (2, False, {GPU: "0"}, None, ClusterError, f"{GPU} is unset"),
        (2, False, {GPU: "-1"}, None, ClusterError, f"{GPU} is -1"),
        (3, False, {GPU: "2"}, None, ClusterError, f"num_processes=3 is not a multiple of {GPU}=2"),
        (-1, False, {GPU: "2"}, None, ClusterError, "num_processes=-1 is not a multiple"),
        (2, False, {GPU: "1.5"}, None, ConfigError, f"{GPU}='1.5' is not a whole number"),
        (2, False, {GPU: "1.0"}, None, ConfigError, "pyspark reads it as an int"),
        (2, True, {}, None, ClusterError, "no GPU is visible on the driver"),
        (2, True, {}, [], ClusterError, "pass use_gpu=False"),
        (2, True, {DRIVER_GPU: "0"}, ["0"], ClusterError, f"{DRIVER_GPU}=0: the driver's GPUs"),
        (2, True, {DRIVER_GPU: "x"}, ["0"], ConfigError, f"{DRIVER_GPU}='x' is not a whole"),
    ],
)
def test_count_like_pyspark_refuses_what_pyspark_refuses(
    n, local_mode, conf, driver_gpus, error, message
):
    with pytest.raises(error, match=re.escape(message)) as info:
        count_like_pyspark(
            n, local_mode=local_mode, use_gpu=True, conf=conf, driver_gpus=driver_gpus
        )
    # pyspark raises RuntimeError where the conf misses GPUs, ValueError where int() fails.
    assert isinstance(info.value, RuntimeError if error is ClusterError else ValueError)


@pytest.mark.parametrize(
    ("conf", "warned"),
    [
        ({}, False),
        ({"spark.ssl.enabled": "false"}, False),
        ({"spark.ssl.enabled": "true", "my.key": "true"}, True),
        ({"spark.ssl.enabled": "TRUE", "my.key": "True"}, True),
    ],
)
def test_check_ssl_warns_when_opted_out(conf, warned):
    warning = check_ssl(conf, "my.key")
    assert (warning is not None) == warned
    if warned:
        assert "my.key=true" in warning and "unencrypted" in warning


@pytest.mark.parametrize("opt_out", [None, "false"])
def test_check_ssl_refuses_without_the_opt_out_and_names_it(opt_out):
    conf = {"spark.ssl.enabled": "true"}
    if opt_out is not None:
        conf["my.key"] = opt_out
    with pytest.raises(ClusterError, match=r'spark.conf.set\("my.key", "true"\)'):
        check_ssl(conf, "my.key")


# -- elastic worlds: a restart on the capacity left ------------------------------------------


@pytest.mark.parametrize(
    ("num", "fewest", "per_task", "slots", "expected_world"),  # slots: barrier task slots
    [
        (3, 2, 1, 3, 3),  # all there: the whole world
        (3, 2, 1, 9, 3),  # more slots than asked for: never more than asked
        (3, 2, 1, 2, 2),  # a host lost: shrink to what is left
        (3, 2, 1, 1, None),  # below min_processes: no world (the caller waits or fails)
        (3, None, 1, 2, None),  # not elastic: the whole world or nothing
        (8, 4, 4, 1, 4),  # 4 GPUs per task: a slot is a task of 4 ranks
        (8, 3, 4, 1, 4),  # min 3 with 4 per task: one task of 4 is the smallest world
        (8, 5, 4, 1, None),  # min 5 needs two tasks of 4
        (4, 1, 1, 0, None),
    ],
)
def test_an_elastic_world_is_the_most_whole_tasks_the_slots_hold_within_the_bounds(
    num, fewest, per_task, slots, expected_world
):
    config = LaunchConfig(
        num_processes=num, min_processes=fewest, grow_after_s=None, local_mode=False
    )
    full = Placement(num // per_task, per_task, per_task > 1)
    shrunk = shrink_to_slots(config, full, slots)
    assert (None if shrunk is None else shrunk.world_size) == expected_world
    if shrunk is not None:
        assert shrunk.processes_per_task == per_task and shrunk.use_gpu == full.use_gpu


@pytest.mark.parametrize(
    ("total", "by_executor", "lost", "expected"),
    [
        (3, {"1": 1, "2": 1, "3": 1}, {"3"}, 2),  # still listed
        (2, {"1": 1, "2": 1}, {"3"}, 2),  # Spark dropped it already
        (8, {"a": 4, "b": 4}, {"a", "b"}, 0),
        (5, None, {"a"}, 5),  # a Spark that lists no executors: its own count
    ],
)
def test_a_restart_leaves_out_the_slots_of_the_executors_it_lost(
    total, by_executor, lost, expected
):
    assert usable_slots(total, by_executor, lost) == expected
