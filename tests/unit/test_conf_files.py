"""The files in conf/: they parse, they say what each line does, and the library accepts them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sparkdist._backends.session import read_properties
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import (
    TORCH_IGNORE_SSL_KEY,
    check_cluster_conf,
    place_on_cluster,
)

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_every_spark_default_is_commented_just_above_it():
    lines = (CONF / "spark-defaults.conf").read_text().splitlines()
    for number, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#"):
            above = lines[number - 1].strip()
            # A setting follows its own comment, or a sibling setting its comment covers.
            assert (
                above.startswith("#")
                or above.split()[0].rsplit(".", 1)[0] == line.split()[0].rsplit(".", 1)[0]
            ), f"line {number + 1} has no comment: {line}"


def test_spark_defaults_schedule_one_rank_per_gpu_in_a_barrier_stage():
    conf = read_properties(CONF / "spark-defaults.conf")
    assert check_cluster_conf(conf, TORCH_IGNORE_SSL_KEY) == []
    assert conf["spark.dynamicAllocation.enabled"] == "false"
    placement = place_on_cluster(LaunchConfig(num_processes=16, local_mode=False), conf)
    assert (placement.num_tasks, placement.processes_per_task, placement.use_gpu) == (16, 1, True)
    # GPUs, not cores, limit the slots of an executor.
    gpus = int(conf["spark.executor.resource.gpu.amount"])
    assert int(conf["spark.executor.cores"]) // int(conf["spark.task.cpus"]) >= gpus
    assert conf["spark.worker.resource.gpu.amount"] == conf["spark.executor.resource.gpu.amount"]


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_offload"])
def test_deepspeed_configs_are_concrete_and_cpu_friendly(name):
    text = (CONF / "deepspeed" / f"{name}.json").read_text()
    config = json.loads(text)
    assert '"auto"' not in text
    assert config["train_micro_batch_size_per_gpu"] >= 1
    assert config["gradient_accumulation_steps"] >= 1
    assert "train_batch_size" not in config  # DeepSpeed derives it from the world size
    assert config["optimizer"]["type"] == "AdamW"
    assert config["zero_optimization"]["stage"] == (2 if name == "zero2" else 3)
    assert not config["fp16"]["enabled"] and not config["bf16"]["enabled"]
    offload = "offload_optimizer" in config["zero_optimization"]
    assert offload == (name == "zero3_offload")


def test_log4j2_keeps_spark_at_warn():
    properties = read_properties(CONF / "log4j2.properties")
    assert properties["rootLogger.level"] == "warn"
    assert properties["appender.console.target"] == "SYSTEM_ERR"


def test_fake_discovery_script_prints_spark_resource_json():
    out = subprocess.run(
        [str(CONF / "fakeGpusResources.sh")],
        capture_output=True,
        text=True,
        check=True,
        env={"SPARKDIST_FAKE_GPUS": "3", "PATH": "/usr/bin:/bin"},
    ).stdout
    assert json.loads(out) == {"name": "gpu", "addresses": ["0", "1", "2"]}
