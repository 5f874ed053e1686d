"""The doctor's pure checks, table-driven: versions, GPU lists and Spark conf in, verdicts out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sparkdist._backends.session import read_properties, spark_defaults_path
from sparkdist._doctor.checks import TorchInfo, check_gpus, check_optional, check_torch
from sparkdist._doctor.spark import (
    check_gpu_conf,
    check_java,
    check_preemption_conf,
    find_java,
    java_major,
    judge_probe,
    spark_seconds,
    version_line,
)
from sparkdist._doctor.table import Check, Status, format_checks, has_problem
from sparkdist._node.host.gpus import Gpu

REPO = Path(__file__).resolve().parents[2]
FAKE_SCRIPT = str(REPO / "conf" / "fakeGpusResources.sh")


@pytest.mark.parametrize(
    ("text", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_392"', 8),
        ('openjdk version "11.0.2" 2019-01-15', 11),
        ("bash: java: not found", None),
    ],
)
def test_java_major(text, major):
    assert java_major(text) == major


@pytest.mark.parametrize(
    ("java", "text", "pyspark", "status", "fix"),
    [
        ("/usr/bin/java", 'openjdk version "17.0.1"', "4.3.0", Status.OK, ""),
        ("/usr/bin/java", 'openjdk version "11.0.2"', "4.3.0", Status.PROBLEM, "Java 17"),
        ("/usr/bin/java", 'openjdk version "11.0.2"', "3.5.3", Status.OK, ""),
        ("/usr/bin/java", 'java version "1.8.0_1"', "3.5.3", Status.OK, ""),
        ("/usr/bin/java", "", "4.3.0", Status.PROBLEM, "Java 17"),
        (None, "", "4.3.0", Status.PROBLEM, "set JAVA_HOME"),
    ],
)
def test_check_java(java, text, pyspark, status, fix):
    check = check_java(java, text, pyspark)
    assert check.status is status and fix in check.fix


def test_version_line_skips_picked_up_notes():
    output = (
        "NOTE: Picked up JDK_JAVA_OPTIONS: -XX:+UseSerialGC\n"
        'openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment\n'
    )
    assert java_major(version_line(output)) == 17
    assert version_line("") == ""


def test_find_java_prefers_java_home(tmp_path):
    java = tmp_path / "bin" / "java"
    java.parent.mkdir()
    java.write_text("#!/bin/sh\n")
    java.chmod(0o755)
    assert find_java({"JAVA_HOME": str(tmp_path), "PATH": ""}) == str(java)
    assert find_java({"JAVA_HOME": str(tmp_path / "nothing")}) is None


H100 = [Gpu("0", "NVIDIA H100 80GB HBM3"), Gpu("1", "NVIDIA H100 80GB HBM3")]
CUDA_TORCH = TorchInfo(
    version="2.13.0+cu128",
    cuda="12.8",
    cuda_available=True,
    device_count=2,
    distributed=True,
    nccl=True,
)
CPU_TORCH = TorchInfo(version="2.13.0+cpu", distributed=True)


@pytest.mark.parametrize(
    ("gpus", "torch", "status", "words"),
    [
        ([], CPU_TORCH, Status.NOTE, "no GPU visible (nvidia-smi not found)"),
        (H100, CUDA_TORCH, Status.OK, "2 GPU(s): 0 NVIDIA H100 80GB HBM3, 1 NVIDIA H100"),
        (H100, CPU_TORCH, Status.PROBLEM, "is a CPU build"),
        (
            H100,
            TorchInfo(version="2.13.0+cu128", cuda="12.8", distributed=True),
            Status.PROBLEM,
            "cannot use them",
        ),
    ],
)
def test_check_gpus(gpus, torch, status, words):
    check = check_gpus(gpus, torch, nvidia_smi=bool(gpus))
    assert check.status is status and words in check.detail


@pytest.mark.parametrize(
    ("info", "status", "words"),
    [
        (CPU_TORCH, Status.OK, "CPU build (no CUDA); backends: gloo"),
        (CUDA_TORCH, Status.OK, "CUDA 12.8 build; backends: gloo, nccl"),
        (
            TorchInfo(error="ModuleNotFoundError: No module named 'torch'"),
            Status.PROBLEM,
            "does not import",
        ),
        (TorchInfo(version="2.13.0"), Status.PROBLEM, "without torch.distributed"),
    ],
)
def test_check_torch(info, status, words):
    check = check_torch(info)
    assert check.status is status and words in check.detail


GPU_CONF = {
    "spark.executor.resource.gpu.amount": "2",
    "spark.task.resource.gpu.amount": "1",
    "spark.executor.resource.gpu.discoveryScript": FAKE_SCRIPT,
}


@pytest.mark.parametrize(
    ("conf", "gpus_here", "status", "words"),
    [
        ({}, False, Status.OK, "GPU scheduling off"),
        ({}, True, Status.NOTE, "would train on CPU"),
        (GPU_CONF, False, Status.OK, "2 GPU(s) per executor, 1 per task (1 rank(s) per"),
        (
            {**GPU_CONF, "spark.task.resource.gpu.amount": "2"},
            True,
            Status.OK,
            "(2 rank(s) per barrier task)",
        ),
        (
            {**GPU_CONF, "spark.task.resource.gpu.amount": "0.5"},
            True,
            Status.PROBLEM,
            "needs a whole GPU",
        ),
        ({"spark.task.resource.gpu.amount": "1"}, True, Status.PROBLEM, "is unset"),
        ({"spark.executor.resource.gpu.amount": "8"}, True, Status.NOTE, "tasks ask for none"),
        (
            {**GPU_CONF, "spark.dynamicAllocation.enabled": "true"},
            True,
            Status.PROBLEM,
            "fixed set of executors",
        ),
        ({**GPU_CONF, "spark.ssl.enabled": "true"}, True, Status.PROBLEM, "not encrypted"),
        (
            {**GPU_CONF, "spark.executor.resource.gpu.discoveryScript": "/no/such.sh"},
            True,
            Status.NOTE,
            "2 GPU(s) per executor",
        ),
    ],
)
def test_check_gpu_conf(conf, gpus_here, status, words):
    check = check_gpu_conf(conf, "test.conf", gpus_here=gpus_here)
    assert check.status is status, check
    assert words in check.detail, check
    if status is not Status.OK:
        assert check.fix


def test_gpu_conf_problem_splits_what_from_fix():
    check = check_gpu_conf({"spark.dynamicAllocation.enabled": "true"}, "x", gpus_here=False)
    assert check.fix == "start the session with spark.dynamicAllocation.enabled=false"
    assert "start the session" not in check.detail


def test_missing_discovery_script_is_a_note_naming_it():
    conf = {**GPU_CONF, "spark.executor.resource.gpu.discoveryScript": "/no/such.sh"}
    assert "/no/such.sh" in check_gpu_conf(conf, "x", gpus_here=True).fix


def test_judge_probe():
    report = json.dumps({"spark_version": "4.3.0", "python": "/py", "seconds": 6.25})
    ok = judge_probe(0, f"noise\nsparkdist-doctor-probe {report}\n", "WARN x")
    assert ok.status is Status.OK and "Spark 4.3.0" in ok.detail and "6.2 s" in ok.detail
    failed = judge_probe(
        1,
        "",
        "Traceback...\n  File x\nPySparkRuntimeError: [JAVA_GATEWAY_"
        "EXITED] Java gateway process exited\n",
    )
    assert failed.status is Status.PROBLEM and "JAVA_GATEWAY_EXITED" in failed.detail
    assert judge_probe(-9, "", "").detail.endswith("exit code -9")


def test_optional_packages_are_notes():
    assert check_optional("mlflow", None, "pip install mlflow").status is Status.NOTE
    assert check_optional("mlflow", "3.1", "pip install mlflow").status is Status.OK


def test_format_checks_and_verdict():
    checks = [
        Check("java", Status.OK, "Java 17"),
        Check("gpus", Status.NOTE, "no GPU visible " + "x " * 80, "nothing to do"),
    ]
    table = format_checks(checks, width=80)
    assert all(len(line) <= 80 for line in table.splitlines())
    assert "fix: nothing to do" in table
    assert table.endswith("\n\ndoctor: ready: 1 OK, 1 note(s) (optional: gpus), 0 problem(s)")
    assert not has_problem(checks)
    bad = [*checks, Check("torch", Status.PROBLEM, "missing", "pip install torch")]
    assert has_problem(bad) and "not ready" in format_checks(bad)


def test_read_properties_accepts_spark_separators(tmp_path):
    path = tmp_path / "spark-defaults.conf"
    path.write_text(
        "# comment\n! also a comment\n\n"
        "spark.a   1\nspark.b=2\nspark.c : three words\n\tspark.d\tx y\nspark.e\n"
    )
    assert read_properties(path) == {
        "spark.a": "1",
        "spark.b": "2",
        "spark.c": "three words",
        "spark.d": "x y",
        "spark.e": "",
    }


def test_spark_defaults_path_follows_spark_conf_dir(tmp_path):
    assert spark_defaults_path({"SPARK_CONF_DIR": str(tmp_path)}) is None
    (tmp_path / "spark-defaults.conf").write_text("spark.a 1\n")
    expected = tmp_path / "spark-defaults.conf"
    assert spark_defaults_path({"SPARK_CONF_DIR": str(tmp_path)}) == expected
    home = tmp_path / "home"
    (home / "conf").mkdir(parents=True)
    (home / "conf" / "spark-defaults.conf").write_text("")
    assert spark_defaults_path({"SPARK_HOME": str(home)}) == home / "conf" / "spark-defaults.conf"
    assert os.path.isabs(str(spark_defaults_path({"SPARK_HOME": str(home)})))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2s", 2.0), ("500ms", 0.5), ("1min", 60.0), ("2m", 120.0), ("30", 30.0), ("x", None)],
)
def test_spark_time_values_read_as_seconds(text, seconds):
    assert spark_seconds(text) == seconds


@pytest.mark.parametrize(
    ("conf", "status", "words"),
    [
        ({}, Status.NOTE, ["spark.python.task.killTimeout=2s", "killed 2 s after"]),
        ({"spark.python.task.killTimeout": "10s"}, Status.NOTE, ["killed 10 s after"]),
        ({"spark.python.task.killTimeout": "30s"}, Status.OK, ["killTimeout=30s"]),
        ({"spark.python.task.killTimeout": "soon"}, Status.NOTE, ["soon is unreadable"]),
    ],
)
def test_the_preemption_conf_note_says_when_a_drain_has_no_time_on_the_other_hosts(
    conf, status, words
):
    check = check_preemption_conf(conf, "test.conf")
    assert check.status is status, check
    for word in words:
        assert word in check.detail, check.detail
    if status is Status.NOTE:
        assert "spark.python.task.killTimeout=25s" in check.fix
