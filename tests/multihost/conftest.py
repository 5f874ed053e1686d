"""The multi-host lab's shared cluster: three hosts plus the driver's, with host names that
resolve badly (two to 127.0.1.1, one to a NIC on a network no peer shares), as on the clusters
people actually have. One lab serves every test that does not break it; a test that kills a
host brings it back.

After every test, no process of any run is left on any host (checked through the lab's own
view of every host's processes).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkdist._lab.lab import NameResolution
from sparkdist._lab.spark import DriverKernel, LabCluster
from tests._helpers.s3_server import LabS3Server, start_lab_s3_server
from tests.conftest import REPO

#: host1 and host3 as Debian writes /etc/hosts; host2's name on a NIC its peers cannot reach.
MIXED_NAMES = [NameResolution.LOOPBACK, NameResolution.SIDE, NameResolution.LOOPBACK]
#: How long a run's last processes may take to go, on any host, once run() has returned.
LEFTOVER_GRACE_S = 10.0


@pytest.fixture(scope="session")
def lab_cluster(sparkdist_cluster: Any) -> LabCluster:
    return sparkdist_cluster(hosts=3, resolution=MIXED_NAMES)  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def lab_driver(lab_cluster: LabCluster) -> DriverKernel:
    return lab_cluster.start_driver(SPARKDIST_MLFLOW="0")


@pytest.fixture(scope="session")
def lab_store(lab_cluster: LabCluster) -> Iterator[LabS3Server]:
    """A real S3 server (SeaweedFS) on the driver's host, at its lab address: the object store
    of a cluster that has no shared directory. Reached only from inside the lab."""
    lab = lab_cluster.lab
    server = start_lab_s3_server(lab, "driver", lab.directory / "logs" / "weed.log", REPO)
    yield server
    lab.signal(server.pid, 9)


@pytest.fixture
def keys_on_every_host(lab_driver: DriverKernel, lab_store: LabS3Server) -> Iterator[None]:
    """The store's keys in the lab driver's environment and its executors' (the Python side of
    ``spark.executorEnv``), for the test: each host's own, never the job's."""
    names = sorted(lab_store.env())
    lab_driver.check(
        f"""
import os
for name, value in {lab_store.env()!r}.items():
    os.environ[name] = value                        # the driver host's own keys
    spark.sparkContext.environment[name] = value    # each executor's (spark.executorEnv.*)
"""
    )
    yield
    lab_driver.check(
        f"""
for name in {names!r}:
    os.environ.pop(name, None)
    spark.sparkContext.environment.pop(name, None)
"""
    )


@pytest.fixture
def shared(lab_cluster: LabCluster) -> Iterator[Path]:
    """A fresh directory every host sees at the same path."""
    directory = lab_cluster.lab.shared / f"run-{time.monotonic_ns()}"
    directory.mkdir()
    yield directory


#: The fixtures that give a test a lab (the shared one, and labs of other shapes of a module).
LAB_FIXTURES = ("lab_cluster", "two_host_lab", "three_host_lab")


@pytest.fixture(autouse=True)
def no_rank_left_on_any_host(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in LAB_FIXTURES:
        if name in request.fixturenames:
            _check_no_rank_left(request.getfixturevalue(name))


def _check_no_rank_left(cluster: LabCluster) -> None:
    left = cluster.lab.wait_until_no_ranks(LEFTOVER_GRACE_S)
    if left:
        for proc in left:
            cluster.lab.signal(proc["pid"], 9)
        listing = "\n".join(
            f"  {p['host']} pid {p['pid']}: {' '.join(p['argv'])[:150]}" for p in left
        )
        pytest.fail(
            f"{len(left)} process(es) of a run outlived the test:\n{listing}", pytrace=False
        )
