"""Placement rules, table-driven: no Spark, no torch."""

from __future__ import annotations

import pytest

from sparkdist import ClusterError, ConfigError
from sparkdist._core.config import LaunchConfig
from sparkdist._core.placement import (
    Placement,
    check_barrier_slots,
    check_cluster_conf,
    cuda_visible_devices,
    estimate_barrier_slots,
    place_local,
    place_on_cluster,
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
    assert check_cluster_conf(
        {"spark.master": "yarn", "spark.authenticate": "true"}, key) == []
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
        ({"spark.master": "yarn", "spark.executor.instances": "3",
          "spark.executor.cores": "8", "spark.executor.resource.gpu.amount": "2",
          GPU: "1"}, 6),
    ],
)
def test_barrier_slots_estimated_from_conf(conf, slots):
    assert estimate_barrier_slots(conf) == slots
