"""Too few barrier slots: how many executors to wait for, and the error that says why."""

from __future__ import annotations

import pytest

from sparkdist import ClusterError
from sparkdist._backends.spark_driver import (
    barrier_slots_error,
    expected_executors,
    spark_conf,
    wait_for_barrier_slots,
)


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({"spark.master": "local"}, 0),
        ({"spark.master": "local[2]"}, 0),
        ({"spark.master": "local[*]"}, 0),
        ({"spark.master": "local[4, 2]", "spark.executor.instances": "3"}, 0),
        ({"spark.master": "local-cluster[2,1,1024]"}, 2),
        ({"spark.master": "local-cluster[ 3 , 2, 512]", "spark.executor.instances": "9"}, 3),
        ({"spark.master": "yarn", "spark.executor.instances": "4"}, 4),
        ({"spark.master": "k8s://https://api:443", "spark.executor.instances": "2"}, 2),
        ({"spark.master": "spark://head:7077"}, None),  # standalone: what the Workers hold
        ({"spark.master": "yarn", "spark.executor.instances": "0"}, None),
        ({"spark.master": "yarn", "spark.executor.instances": "many"}, None),
        ({}, None),
    ],
)
def test_expected_executors(conf, expected):
    assert expected_executors(conf) == expected


GPU_CLUSTER = {
    "spark.master": "yarn",
    "spark.executor.instances": "2",
    "spark.executor.cores": "8",
    "spark.executor.resource.gpu.amount": "8",
    "spark.task.resource.gpu.amount": "1",
}


@pytest.mark.parametrize(
    ("args", "conf", "says", "fix"),
    [
        # Executors still missing when the wait ran out: say so, and how to wait longer.
        (
            (16, 8, 1, 2, 300.04),
            GPU_CLUSTER,
            [
                "needs 16 task slots at once but the cluster offers 8",
                "1 of 2 executors registered after 300.0 s",
                "master 'yarn'",
                "spark.executor.instances=2, spark.executor.cores=8, spark.task.cpus=unset, "
                "spark.executor.resource.gpu.amount=8, spark.task.resource.gpu.amount=1",
            ],
            "raise start_timeout_s",
        ),
        # Every executor is there and the cluster is still too small: a bigger cluster.
        (
            (3, 2, 2, 2, 0.5),
            {"spark.master": "local-cluster[2,1,1024]"},
            [
                "offers 2: 2 of 2 executors registered after 0.5 s",
                "master 'local-cluster[2,1,1024]'",
            ],
            "add executors or cores (spark.executor.instances, spark.executor.cores, GPU amounts)",
        ),
        # A standalone master does not say how many executors will come.
        (
            (3, 1, 1, None, 20.0),
            {"spark.master": "spark://head:7077"},
            ["1 executor(s) registered after 20.0 s", "master 'spark://head:7077'"],
            "or lower num_processes",
        ),
        # local[N]: the driver's threads are the slots.
        (
            (3, 1, 0, 0, 0.0),
            {"spark.master": "local[2]", "spark.task.cpus": "2"},
            [
                "needs 3 task slots at once but master 'local[2]' runs 1 task(s) at once",
                "spark.task.cpus=2",
            ],
            "use a master with more threads (local[6] or more) or lower num_processes",
        ),
    ],
)
def test_barrier_slots_error_names_counts_settings_and_fix(args, conf, says, fix):
    error = barrier_slots_error(*args, conf=conf)
    assert isinstance(error, ClusterError) and isinstance(error, RuntimeError)
    for part in [*says, fix]:
        assert part in str(error), (part, str(error))


class FakeCluster:
    """A SparkSession stand-in whose executors register one per ``every`` slot queries."""

    def __init__(self, master: str, executors: int, slots_each: int, every: int = 3) -> None:
        self.conf = {"spark.master": master}
        self.executors, self.slots_each, self.every = executors, slots_each, every
        self.queries = 0
        self.sparkContext = self
        self._jsc = self

    # SparkSession.sparkContext.getConf().getAll() and ._jsc.sc()
    def getConf(self):
        return self

    def getAll(self):
        return list(self.conf.items())

    def sc(self):
        return self

    def resourceProfileManager(self):
        return self

    def defaultResourceProfile(self):
        return None

    def registered(self) -> int:
        return min(self.executors, self.queries // self.every)

    def maxNumConcurrentTasks(self, profile):
        self.queries += 1
        return self.registered() * self.slots_each

    def statusTracker(self):
        return self

    def getExecutorInfos(self):
        return ["driver"] + ["executor"] * self.registered()


def test_slots_are_waited_for_while_executors_register():
    cluster = FakeCluster("local-cluster[2,1,1024]", executors=2, slots_each=1)
    assert wait_for_barrier_slots(cluster, 2, wait_s=60) == 2
    assert cluster.queries > 2  # it polled until the second executor came


def test_a_cluster_whose_executors_do_not_all_come_fails_after_the_wait():
    cluster = FakeCluster("yarn", executors=1, slots_each=1)
    cluster.conf["spark.executor.instances"] = "2"
    with pytest.raises(ClusterError, match=r"offers 1: 1 of 2 executors registered after 0\.\d s"):
        wait_for_barrier_slots(cluster, 2, wait_s=0.5)


class CountingSession:
    """A classic session stand-in that counts reads of its context's start-up conf."""

    def __init__(self, startup: dict[str, str], runtime: dict[str, str]) -> None:
        self.startup, self.conf, self.reads = startup, runtime, 0
        self.sparkContext = self

    def getConf(self):  # noqa: N802 - pyspark's name
        self.reads += 1
        return self

    def getAll(self):  # noqa: N802 - pyspark's name
        return list(self.startup.items())


def test_the_startup_conf_is_read_once_per_context_and_the_runtime_conf_every_time():
    session = CountingSession({"spark.master": "local[2]", "spark.task.cpus": "1"}, {})
    assert spark_conf(session)["spark.task.cpus"] == "1"
    session.conf["spark.task.cpus"] = "2"  # spark.conf.set after start: it counts
    assert spark_conf(session)["spark.task.cpus"] == "2"
    assert spark_conf(session)["spark.master"] == "local[2]"
    assert session.reads == 1  # hundreds of Py4J round trips on a real context, once
    other = CountingSession({"spark.master": "local[4]"}, {})  # a new context: read again
    assert spark_conf(other)["spark.master"] == "local[4]" and other.reads == 1
