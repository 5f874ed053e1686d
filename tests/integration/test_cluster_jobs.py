"""Batch jobs on real clusters: spark-submit on local-cluster, and the CLI on a standalone
cluster (a Master and two Workers from pyspark's bin/spark-class, 2 fake GPUs per Worker).

Each driver is a child process: one SparkContext per process, and the test session may hold
its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from tests._helpers.spark import SMALL_APP_CONF
from tests.conftest import FAKE_GPU_SCRIPT, REPO, run_processes
from tests.integration.standalone_cluster import (
    CLUSTER_MARK_VAR,
    FAST_JVM_OPTIONS,
    WORKER_NAME_VAR,
    StandaloneCluster,
    spark_home,
)

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

PLACEMENT_SCRIPT = textwrap.dedent(f"""
    import json, os
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    keys = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "CUDA_VISIBLE_DEVICES", "{WORKER_NAME_VAR}")
    seen = {{key: os.environ.get(key) for key in keys}}
    print("PLACEMENT " + json.dumps({{**seen, "sum": total.item()}}), flush=True)
""")


def driver_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable, **extra}
    env.pop(CLUSTER_MARK_VAR, None)
    return env


def test_spark_submit_runs_the_example_job_on_local_cluster(tmp_path):
    log4j = REPO / "conf" / "log4j2.properties"
    done = subprocess.run(
        [
            str(spark_home() / "bin" / "spark-submit"),
            "--master",
            "local-cluster[1,2,1024]",
            "--conf",
            "spark.executor.memory=512m",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            f"spark.executor.extraJavaOptions={FAST_JVM_OPTIONS}",
            "--driver-java-options",
            f"-Dlog4j2.configurationFile=file:{log4j} {FAST_JVM_OPTIONS}",
            str(REPO / "examples" / "submit_job.py"),
            "--processes",
            "2",
            "--steps",
            "30",
        ],
        cwd=tmp_path,
        env=driver_env(),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    assert "[rank 0] rank 0/2" in done.stdout and "[rank 1] rank 1/2" in done.stdout
    assert "trained on 2 rank(s) in 2 barrier task(s) (CPU)" in done.stdout
    # conf/log4j2.properties was used: Spark's default profile would announce itself and log
    # the native-library warning that the file silences.
    assert "Using Spark's default log4j profile" not in done.stderr
    assert "NativeCodeLoader" not in done.stderr
    assert not run_processes()


def test_standalone_cluster_gives_every_rank_its_own_worker_gpu(tmp_path):
    (tmp_path / "placement.py").write_text(PLACEMENT_SCRIPT)
    cluster = StandaloneCluster(tmp_path / "cluster")
    cluster.directory.mkdir()
    try:
        cluster.start(num_workers=2, cores=2, gpus=2, fake_gpu_script=FAKE_GPU_SCRIPT)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "sparkdist",
                "run",
                "-n",
                "4",
                "--master",
                cluster.master_url,
                "--conf",
                "spark.executor.resource.gpu.amount=2",
                "--conf",
                "spark.task.resource.gpu.amount=1",
                "--conf",
                "spark.executor.cores=2",
                *SMALL_APP_CONF,
                "placement.py",
            ],
            cwd=tmp_path,
            env=driver_env(),
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    finally:
        survivors = cluster.stop()
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    seen = [
        json.loads(line.split("PLACEMENT ", 1)[1])
        for line in done.stdout.splitlines()
        if "PLACEMENT " in line
    ]
    assert sorted(int(s["RANK"]) for s in seen) == [0, 1, 2, 3]
    for s in seen:
        # One GPU per task, four tasks, every worker on this host: one node of four ranks, as
        # torchrun numbers one machine.
        assert s["WORLD_SIZE"] == "4" and s["LOCAL_WORLD_SIZE"] == "4"
        assert s["LOCAL_RANK"] == s["RANK"] and s["NODE_RANK"] == "0"
        assert s["sum"] == 4.0  # the four ranks formed one real process group
    # Both workers' executors name GPUs "0" and "1" (each its own), so each rank keeps its
    # task's GPU, and the driver says that LOCAL_RANK is no device index there.
    assert "the executors name the same GPUs" in done.stdout + done.stderr
    pairs = {(s[WORKER_NAME_VAR], s["CUDA_VISIBLE_DEVICES"]) for s in seen}
    assert len(pairs) == 4, f"two ranks shared a GPU: {seen}"
    assert Counter(worker for worker, _ in pairs) == {"worker-0": 2, "worker-1": 2}
    assert {gpu for _, gpu in pairs} == {"0", "1"}
    assert not survivors, f"cluster processes outlived stop(): {survivors}"
    assert not cluster.processes() and not run_processes()
