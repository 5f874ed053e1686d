"""Front doors that bring their own driver, across hosts: a ``spark-submit`` job submitted on
the driver's host, and a Spark Connect client on the driver's host talking to a Connect server
on another host. Each is a second application beside the shared driver's (the cluster's
Workers keep a core per host for it)."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from sparkdist._lab.lab import DRIVER_ADDRESS
from sparkdist._lab.spark import MASTER_URL, LabCluster
from tests._helpers.spark import SMALL_APP_CONF

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(400)]

JOB = """
import json, sys
sys.path.insert(0, "/tmp/job")
import lab_helper
import sparkdist

def where(x):
    import os, socket
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    return [socket.gethostname(), ifname, t.item(), lab_helper.scale(x)]

{session}
values = sparkdist.Distributor({ranks}, local_mode=False, use_gpu=False).run_all(where, 2).values
print("RESULT " + json.dumps(values), flush=True)
"""

HELPER = "def scale(x):\n    return 7 * x\n"


def _quiet(output: str) -> str:
    """Output less Spark's INFO chatter, for an assertion message."""
    return "\n".join(line for line in output.splitlines() if " INFO " not in line)[-5000:]


def _result(stdout: str) -> list[list]:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]


def test_a_spark_submit_job_on_the_driver_host(lab_cluster: LabCluster) -> None:
    lab = lab_cluster.lab
    lab.write_file("driver", "/tmp/job/lab_helper.py", HELPER)
    lab.write_file(
        "driver",
        "/tmp/job/submit_job.py",
        JOB.format(
            session=(
                "from pyspark.sql import SparkSession\nspark = SparkSession.builder.getOrCreate()"
            ),
            ranks=3,
        ),
    )
    spark_submit = str(
        Path(os.path.dirname(__import__("pyspark").__file__)) / "bin" / "spark-submit"
    )
    done = lab.run(
        "driver",
        [
            spark_submit,
            "--master",
            MASTER_URL,
            "--conf",
            "spark.cores.max=3",
            "--conf",
            "spark.executor.cores=1",
            *SMALL_APP_CONF,
            "/tmp/job/submit_job.py",
        ],
        env=lab.env("driver", SPARKDIST_MLFLOW="0"),
        timeout_s=240,
    )
    assert done.rc == 0, _quiet(done.stdout + done.stderr)
    values = _result(done.stdout)
    assert sorted(v[0] for v in values) == ["lab-host1", "lab-host2", "lab-host3"]
    assert all(v[1:] == ["eth0", 3.0, 14] for v in values)


def test_a_connect_client_on_one_host_and_its_server_on_another(lab_cluster: LabCluster) -> None:
    lab = lab_cluster.lab
    spark_submit = str(
        Path(os.path.dirname(__import__("pyspark").__file__)) / "bin" / "spark-submit"
    )
    log = lab.directory / "logs" / "connect-server.log"
    server = lab.spawn(
        "host1",
        [
            spark_submit,
            "--master",
            MASTER_URL,
            "--class",
            "org.apache.spark.sql.connect.service.SparkConnectServer",
            "--conf",
            "spark.connect.grpc.binding.port=15002",
            "--conf",
            "spark.cores.max=2",
            "--conf",
            "spark.executor.cores=1",
            *SMALL_APP_CONF,
            "spark-internal",
        ],
        log,
        env=lab.env("host1"),
    )
    try:
        deadline = time.monotonic() + 120
        while "Spark Connect server started" not in (
            log.read_text(errors="replace") if log.exists() else ""
        ):
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)  # the server's log is its only readiness signal
        lab.write_file("driver", "/tmp/job/lab_helper.py", HELPER)
        lab.write_file(
            "driver",
            "/tmp/job/connect_job.py",
            JOB.format(
                session=textwrap.dedent("""
                from pyspark.sql import SparkSession
                spark = SparkSession.builder.remote("sc://198.18.0.11:15002").getOrCreate()
            """),
                ranks=2,
            ),
        )
        done = lab.run(
            "driver",
            [lab_cluster.lab.env("driver")["PYSPARK_PYTHON"], "/tmp/job/connect_job.py"],
            env=lab.env("driver", SPARKDIST_MLFLOW="0"),
            timeout_s=240,
        )
        assert done.rc == 0, _quiet(done.stdout + done.stderr)
        values = _result(done.stdout)
        assert len({v[0] for v in values}) == 2 and all(v[0].startswith("lab-host") for v in values)
        assert all(v[1:] == ["eth0", 2.0, 14] for v in values)
        # The ranks reached this client's channel on the driver's host, not Spark's allGather.
        assert DRIVER_ADDRESS in lab.env("driver")["SPARK_LOCAL_IP"]
    finally:
        lab.signal(server["pid"], 9)
        lab.call("wait", proc=server["proc"], timeout_s=30)
        # Its executors go when the master sees their application end.
        deadline = time.monotonic() + 30
        while (
            any(
                "CoarseGrainedExecutorBackend" in " ".join(p["argv"])
                and "Connect" in " ".join(p["argv"])
                for p in lab.processes()
            )
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
