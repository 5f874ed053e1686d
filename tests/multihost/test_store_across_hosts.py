"""Checkpoints on an object store across hosts with no shared directory at all (issue 33): the
lab's hosts each have only their private /tmp, and the checkpoints live on a real S3 server
(SeaweedFS) on the driver's host. A host killed mid-run: the restart on the hosts left resumes
from the store, with an uninterrupted run's weights, bit for bit.

The keys reach the driver and every executor as each host's own environment (the executors'
through ``spark.executorEnv``'s Python side), never through the job.
"""

from __future__ import annotations

import time

import pytest

from sparkdist._lab.spark import DriverKernel, LabCluster
from tests._helpers.s3_server import LabS3Server
from tests.multihost.test_host_faults import (
    TRAIN,
    kill_a_busy_host_and_check_the_restart,
    start_in_background,
)

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(400)]


def wait_for_commit(driver: DriverKernel, store: LabS3Server, url: str, timeout_s: float) -> None:
    """Inside the lab (the driver's host): wait until the step ``url``'s marker is on the store."""
    driver.check(
        f"""
import time, s3fs
fs = s3fs.S3FileSystem(endpoint_url={store.endpoint_url!r}, skip_instance_cache=True)
deadline = time.monotonic() + {timeout_s}
while not fs.exists({url + "/COMMITTED"!r}):
    assert time.monotonic() < deadline, "no commit of " + {url!r}
    time.sleep(0.1)
    fs.invalidate_cache()
""",
        timeout_s=timeout_s + 30,
    )


@pytest.mark.usefixtures("keys_on_every_host")
def test_a_restart_without_shared_storage_resumes_from_the_store(
    lab_cluster: LabCluster, lab_driver: DriverKernel, lab_store: LabS3Server
) -> None:
    lab = lab_cluster.lab
    steps = 30
    prefix = f"s3://{lab_store.bucket}/run-{time.monotonic_ns()}"
    options = lab_store.storage_options()
    lab_driver.check(TRAIN)
    whole = lab_driver.check(
        f"""
result = sparkdist.Distributor(2, local_mode=False, use_gpu=False,
    checkpoint_dir={prefix + "/whole"!r}, storage_options={options!r}).run(train, {steps}, 0.0)
"""
    )
    restarted = prefix + "/restarted"
    start_in_background(
        lab_driver,
        f"""sparkdist.Distributor(2, local_mode=False, use_gpu=False, max_restarts=1,
    checkpoint_dir={restarted!r}, storage_options={options!r}).run_async(train, {steps}, 0.3)""",
    )
    wait_for_commit(lab_driver, lab_store, f"{restarted}/step-{10:09d}", 120)
    kill_a_busy_host_and_check_the_restart(lab_cluster, lab_driver, whole["weights"])
    for host in lab_cluster.workers:  # the URL never became a local folder on any host
        assert "s3:" not in (lab.list_dir(host, "/tmp") or []), host
