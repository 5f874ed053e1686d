"""The network preflight and the rendezvous diagnosis, on the lab's badly named hosts:
``sparkdist doctor --master`` run on the driver's host prints one row per node with what is
wrong and the fix, and a run whose ranks cannot connect names the node, the address and port it
could not reach, and the setting that fixes it."""

from __future__ import annotations

import re
import sys

import pytest

from sparkdist._lab.spark import MASTER_URL, DriverKernel, LabCluster

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(400)]


def _node_lines(table: str) -> dict[str, str]:
    """The node table's rows by the node's address."""
    rows = {}
    for line in table.splitlines():
        found = re.match(r"^\d+\s+[\d, ]+\s+(198\.18\.0\.\d+)\s", line)
        if found:
            rows[found.group(1)] = line
    return rows


def test_the_doctor_names_each_node_its_interface_its_name_and_the_fix(
    lab_cluster: LabCluster, lab_driver: DriverKernel
) -> None:
    lab = lab_cluster.lab
    done = lab.run(
        "driver",
        # A second application beside the shared driver's: the core and memory left per host.
        [
            sys.executable,
            "-m",
            "sparkdist",
            "doctor",
            "--master",
            MASTER_URL,
            "--conf",
            "spark.cores.max=3",
            "--conf",
            "spark.executor.cores=1",
            "--conf",
            "spark.executor.memory=512m",
        ],
        timeout_s=240,
    )
    assert done.rc == 0, done.stdout + done.stderr[-3000:]
    rows = _node_lines(done.stdout)
    addresses = {lab.hosts[h].address: lab.hosts[h] for h in lab_cluster.workers}
    assert set(rows) == set(addresses), done.stdout
    for address, row in rows.items():
        host = addresses[address]
        # Every node reaches the driver's listener and task 0's test port, on its eth0.
        assert re.search(r"\beth0\b.*\bok\s+ok\s+NOTE$", row), row
        assert host.hostname in row, row
    host1, host2 = lab.hosts["host1"], lab.hosts["host2"]
    assert f"{host1.hostname} -> 127.0.1.1 (loopback)" in rows[host1.address]
    assert f"{host2.hostname} -> {host2.side_address}" in rows[host2.address]
    # One verdict line per node, with the fix: the name to map, and to which address (the
    # table wraps long lines, after a hyphen too).
    verdicts = " ".join(re.sub(r"-\n\s+", "-", done.stdout).split())
    assert f"map {host1.hostname} to {host1.address}" in verdicts
    assert f"map {host2.hostname} to {host2.address}" in verdicts
    assert "cluster network  NOTE" in done.stdout


def test_ranks_that_cannot_connect_name_the_node_the_address_and_the_setting(
    lab_driver: DriverKernel,
) -> None:
    # A setting copied from a single-machine config: gloo listens on loopback on every node.
    message = lab_driver.check(
        """
import datetime
import sparkdist

def join():
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    dist.barrier()

try:
    sparkdist.Distributor(
        3, local_mode=False, use_gpu=False, env={"GLOO_SOCKET_IFNAME": "lo"}
    ).run(join)
    result = "no error"
except sparkdist.WorkerFailedError as error:
    result = str(error)
"""
    )
    found = re.search(
        r"rendezvous failed on node (\d) \(host (198\.18\.0\.\d+)\): gloo could not connect to "
        r"a peer rank at 127\.0\.0\.1:(\d+) \(GLOO_SOCKET_IFNAME=lo\)\n\s*fix: (.*)",
        message,
    )
    assert found, message
    assert "GLOO_SOCKET_IFNAME=lo" in found.group(4), found.group(4)
    assert "unset it" in found.group(4), found.group(4)
