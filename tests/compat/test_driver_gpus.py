"""More local processes than the driver's GPUs, side by side with pyspark's class.

Without a GPU, the driver's GPUs are Spark's: a session whose driver runs the fake discovery
script (conf/fakeGpusResources.sh: GPUs "0" and "1") is what both libraries read. pyspark
warns and lowers ``num_processes``; so must we. Only construction is compared: a run would
need real GPUs. The session is this module's own (driver resources are fixed when Spark
starts) and is stopped at the end, so the shared sessions of other tests start as usual.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest

from tests import conftest
from tests.compat.side_by_side import assert_same, both

pytest.importorskip("pyspark")
pytestmark = pytest.mark.spark

DRIVER_GPU = "spark.driver.resource.gpu.amount"


@pytest.fixture(scope="module")
def spark_with_driver_gpus():
    from pyspark.sql import SparkSession

    conftest._stop_session()  # one SparkContext per process
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("sparkdist-compat-driver-gpus")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config(DRIVER_GPU, "2")
        .config("spark.driver.resource.gpu.discoveryScript", str(conftest.FAKE_GPU_SCRIPT))
        .getOrCreate()
    )
    yield spark
    spark.stop()


@contextmanager
def driver_gpu_amount(spark, value):
    """``spark.driver.resource.gpu.amount`` at runtime; the start-up value is put back."""
    started = spark.conf.get(DRIVER_GPU)
    spark.conf.set(DRIVER_GPU, value)
    try:
        yield
    finally:
        spark.conf.set(DRIVER_GPU, started)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("TorchDistributor", {"num_processes": 4}),  # warned, lowered to 2
        ("TorchDistributor", {"num_processes": 2}),
        ("TorchDistributor", {"num_processes": 1}),
        ("TorchDistributor", {"num_processes": 3, "local_mode": True, "use_gpu": True}),
        ("DeepspeedTorchDistributor", {"numGpus": 3}),
        ("DeepspeedTorchDistributor", {"numGpus": 2, "nnodes": 2}),
        ("DeepspeedTorchDistributor", {"numGpus": True}),
    ],
)
def test_more_local_processes_than_driver_gpus(spark_with_driver_gpus, name, kwargs):
    theirs, ours = both(name, kwargs)
    assert_same(theirs, ours)
    wanted = kwargs.get("num_processes", kwargs.get("numGpus", 1) * kwargs.get("nnodes", 1))
    assert theirs.attributes["num_processes"] == min(wanted, 2)
    assert len(ours.warnings) == (1 if wanted > 2 else 0)


@pytest.mark.parametrize(("amount", "lowered_to"), [("1", 1), ("0", None)])
def test_the_runtime_driver_gpu_amount_counts(spark_with_driver_gpus, amount, lowered_to):
    with driver_gpu_amount(spark_with_driver_gpus, amount):
        theirs, ours = both("TorchDistributor", {"num_processes": 2})
    assert_same(theirs, ours)
    if lowered_to is None:
        assert isinstance(theirs.error, RuntimeError)  # "not configured properly"
    else:
        assert theirs.attributes["num_processes"] == ours.attributes["num_processes"] == 1
