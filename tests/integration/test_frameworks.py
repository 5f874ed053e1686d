"""The framework examples (Lightning, Hugging Face TRL, torchvision) run under sparkdist with
their own distributed support untouched.

Each example's ``main`` runs here with 2 CPU ranks in local mode, tiny, and returns every rank's
result; the tests check what matters: the framework saw the world sparkdist launched (world
size 2, torchrun's environment detected), it started no process of its own (the processes in
its world are exactly sparkdist's two ranks), the loss fell, and each rank's result came back.
The frameworks are the ``examples`` extra (``pip install -e ".[examples]"``); without it these
tests skip, so the core suite needs none of them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO

EXAMPLES = REPO / "examples"
RUN_TIMEOUT_S = 240


def load_example(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import ``examples/<name>.py`` as module ``name`` (its functions then ship by value)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, example)
    spec.loader.exec_module(example)
    return example


def assert_world_is_the_two_ranks(results: list[dict[str, Any]]) -> None:
    """Every rank's result is back, and the framework's world is exactly those two processes."""
    assert [r["rank"] for r in results] == [0, 1]
    rank_pids = sorted(r["pid"] for r in results)
    assert len(set(rank_pids)) == 2 and os.getpid() not in rank_pids
    for result in results:
        assert result["world_size"] == 2
        # Gathered inside the framework's process group: a second spawn would add processes
        # (or replace the ranks by children of theirs).
        assert result["world_pids"] == rank_pids


def test_lightning_two_tower_uses_lightnings_ddp_on_sparkdists_ranks(monkeypatch, capfd):
    pytest.importorskip("lightning")
    example = load_example("lightning_two_tower", monkeypatch)

    results = example.main(["--tiny", "--cpu", "--processes", "2"])

    assert_world_is_the_two_ranks(results)
    for result in results:
        assert result["lightning_world_size"] == 2 == result["process_group_size"]
        assert result["lightning_global_rank"] == result["rank"]
        assert result["strategy"] == "DDPStrategy"
        # torchrun's environment detected: the processes are "created externally" ...
        assert result["cluster_environment"] == "TorchElasticEnvironment"
        assert result["creates_processes_externally"] is True
        # ... so Lightning's launcher started none of its own.
        assert result["children_spawned_by_lightning"] == 0
        # Lightning's automatic DistributedSampler: each rank its own half, together all of it.
        assert result["shard_size"] * 2 == result["train_size"]
        assert result["interactions_seen_twice"] == 0
        assert result["interactions_covered"] == result["train_size"]
        losses, recalls = result["epoch_losses"], result["recall_at_10"]
        assert len(losses) == len(recalls) == example.TINY_PRESET.epochs
        assert losses[-1] < losses[0] - 0.3, losses  # ~4.3 -> ~3.5
        assert recalls[-1] > 3 * result["random_recall_at_10"], recalls  # ~0.4 vs 0.08
    # Losses and recall are reduced over ranks inside Lightning: one value everywhere.
    assert results[0]["epoch_losses"] == results[1]["epoch_losses"]
    assert results[0]["recall_at_10"] == results[1]["recall_at_10"]
    # Rank 0 alone prints the epoch lines, forwarded with their rank prefix.
    out = capfd.readouterr().out
    assert re.search(r"^\[rank 0\] epoch 0: loss [\d.]+, recall@10", out, re.MULTILINE)
    assert not re.search(r"^\[rank 1\] epoch", out, re.MULTILINE)
    assert re.search(
        r"^rank 1: Lightning saw world size 2 \(TorchElasticEnvironment, 0 "
        r"processes spawned by Lightning\)",
        out,
        re.MULTILINE,
    )


def check_sft_results(results: list[dict[str, Any]], *, steps: int) -> None:
    """What every SFT run must show, under DDP and DeepSpeed alike."""
    assert_world_is_the_two_ranks(results)
    for result in results:
        assert result["trainer"] == "SFTTrainer"
        assert result["trainer_world_size"] == 2 == result["accelerate_num_processes"]
        assert result["trainer_process_index"] == result["rank"]
        assert result["steps"] == steps
        losses = result["losses"]
        assert len(losses) >= 3 and losses[-1] < losses[0] - 0.3, losses  # ~4.25 -> ~3.6
    # The Trainer logs the loss gathered over ranks: the same history everywhere.
    assert results[0]["losses"] == results[1]["losses"]


def test_hf_sft_trainer_sees_sparkdists_world_under_ddp(monkeypatch, capfd):
    pytest.importorskip("trl")
    example = load_example("hf_trainer_sft", monkeypatch)

    results = example.main(["--tiny", "--cpu", "--processes", "2"])

    check_sft_results(results, steps=example.TINY_PRESET.steps)
    for result in results:
        assert result["distributed_type"] == "MULTI_CPU"
        assert result["wrapped_model"] == "DistributedDataParallel"
        assert result["zero_stage"] is None
        assert result["per_device_batch"] == example.TINY_PRESET.batch
    out = capfd.readouterr().out
    assert re.search(r"^\[rank 0\] \{'loss': ", out, re.MULTILINE)  # the Trainer logs on rank 0
    assert not re.search(r"^\[rank 1\] \{'loss': ", out, re.MULTILINE)
    assert re.search(
        r"^rank 1: SFTTrainer saw world size 2 \(MULTI_CPU, DistributedDataParallel\)",
        out,
        re.MULTILINE,
    )
    assert "{'mode': 'ddp'} on 2 ranks" in out


def sft_under_deepspeed(monkeypatch: pytest.MonkeyPatch, config_name: str) -> None:
    """Run the SFT example in mode "deepspeed" with a shipped config; check ZeRO took it."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("trl")
    config_path = REPO / "conf" / "deepspeed" / config_name
    config = json.loads(config_path.read_text())
    example = load_example("hf_trainer_sft", monkeypatch)

    results = example.main(
        [
            "--tiny",
            "--cpu",
            "--processes",
            "2",
            "--deepspeed",
            "--deepspeed-config",
            str(config_path),
        ]
    )

    check_sft_results(results, steps=example.TINY_PRESET.steps)
    for result in results:
        assert result["distributed_type"] == "DEEPSPEED"
        assert result["wrapped_model"] == "DeepSpeedEngine"
        assert result["zero_stage"] == config["zero_optimization"]["stage"]
        # The file's concrete values win over the example's flags (HF refuses a mismatch).
        assert result["per_device_batch"] == config["train_micro_batch_size_per_gpu"]
        assert result["learning_rate"] == config["optimizer"]["params"]["lr"]


@pytest.mark.deepspeed
def test_hf_sft_trainer_trains_under_deepspeed_zero2(monkeypatch):
    sft_under_deepspeed(monkeypatch, "zero2.json")


@pytest.mark.deepspeed
@pytest.mark.slow
def test_hf_sft_trainer_trains_under_deepspeed_zero3(monkeypatch):
    sft_under_deepspeed(monkeypatch, "zero3.json")


@pytest.mark.spark
@pytest.mark.slow  # its own JVM, started by the example as a user runs it
def test_lightning_two_tower_runs_as_spark_barrier_tasks():
    pytest.importorskip("lightning")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "lightning_two_tower.py"),
            "--tiny",
            "--cpu",
            "--processes",
            "2",
            "--remote",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    ranks = re.findall(
        r"^rank (\d): Lightning saw world size 2 \(TorchElasticEnvironment, 0 "
        r"processes spawned by Lightning\), trained on ([\d,]+) of ([\d,]+) ",
        done.stdout,
        re.MULTILINE,
    )
    assert [r[0] for r in ranks] == ["0", "1"], done.stdout
    assert all(int(s.replace(",", "")) * 2 == int(t.replace(",", "")) for _, s, t in ranks)


def test_retinanet_trains_under_ddp(monkeypatch):
    # PyPI's torchvision does not import beside the CPU torch build CI uses; where a matching
    # torchvision is installed (a GPU cluster's image), this runs.
    pytest.importorskip("torchvision.models.detection")
    example = load_example("retinanet_ddp", monkeypatch)

    results = example.main(["--tiny", "--cpu", "--processes", "2"])

    assert_world_is_the_two_ranks(results)
    for result in results:
        assert result["process_group_size"] == 2
        assert result["wrapped_model"] == "DistributedDataParallel"
        assert len(result["losses"]) == example.TINY_PRESET.steps
        # Mean loss of the first and the last quarter of the steps: ~2.5 -> ~1.7.
        assert result["final_loss"] < result["first_loss"] - 0.2, result["losses"]
    assert results[0]["losses"] == results[1]["losses"]  # averaged over ranks
