"""GPU-only paths: NCCL, device binding, FSDP2 with bf16 mixed precision, DeepSpeed on GPU.

Skipped where torch sees no CUDA device (every test here is marked ``gpu``); the 2-GPU cases
also skip on a one-GPU machine. ``benchmarks/gpu_check.sh`` runs this file and the examples on a
GPU machine and writes a report.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from types import ModuleType
from typing import Any

import pytest

from sparkdist import DeepspeedTorchDistributor, Distributor
from tests.conftest import REPO


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _cuda_devices()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        GPUS == 0, reason="needs a CUDA device: torch.cuda.is_available() is False here"
    ),
]

#: One rank per GPU: world sizes 1 and 2, the latter only where there are 2 GPUs.
WORLD_SIZES = [
    pytest.param(1, id="1gpu"),
    pytest.param(
        2,
        id="2gpus",
        marks=pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices, this machine has {GPUS}"),
    ),
]


def load_example(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import examples/<name>.py as a module (its functions then ship to the ranks by value)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def nccl_probe() -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    from sparkdist import runtime

    bound = torch.cuda.current_device()  # before this function calls set_device (it never does)
    dist.init_process_group(runtime.backend())
    total = torch.tensor([float(dist.get_rank() + 1)], device=runtime.device())
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "bound": bound,
        "backend": runtime.backend(),
        "group_backend": dist.get_backend(),
        "device": str(runtime.device()),
        "tensor_device": str(total.device),
        "sum": total.item(),
        "gpu_uuid": str(torch.cuda.get_device_properties(bound).uuid),
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_nccl_all_reduce_with_each_rank_bound_to_its_gpu(world_size):
    result = Distributor(world_size, use_gpu=True).run_all(nccl_probe)

    assert result.use_gpu
    for rank, value in enumerate(result.values):
        assert value["rank"] == rank
        # Bound by sparkdist before user code ran: cuda:LOCAL_RANK is already current.
        assert value["bound"] == value["local_rank"]
        assert value["backend"] == value["group_backend"] == "nccl"
        assert value["device"] == value["tensor_device"] == f"cuda:{value['local_rank']}"
        assert value["sum"] == world_size * (world_size + 1) / 2
    assert len({value["gpu_uuid"] for value in result.values}) == world_size  # one GPU each


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp2_example_trains_in_bf16_on_gpus(world_size, monkeypatch):
    example = load_example("fsdp_transformer", monkeypatch)
    config = example.ModelConfig(
        layers=2, dim=128, heads=4, seq=128, vocab=512, steps=40, batch=16, lr=3e-3
    )

    result = Distributor(world_size, use_gpu=True, mode="fsdp").run_all(example.train, config)

    assert result.mode_settings == {"mode": "fsdp"}
    for rank, value in enumerate(result.values):
        assert value["device"] == f"cuda:{rank}"
        assert value["compute_dtype"] == "bfloat16"  # MixedPrecisionPolicy is on with CUDA
        assert value["held_params"] * world_size == value["total_params"]
        assert value["final_loss"] < value["first_loss"] - 1.0


@pytest.mark.deepspeed
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_deepspeed_zero2_example_trains_in_bf16_on_gpus(world_size, monkeypatch):
    example = load_example("deepspeed_zero", monkeypatch)
    config = json.loads((REPO / "conf" / "deepspeed" / "zero2.json").read_text())
    config["bf16"] = {"enabled": True}
    # torch's AdamW, not DeepSpeed's FusedAdam: that one is compiled on first use (nvcc).
    config["optimizer"]["params"]["torch_adam"] = True
    model = example.ModelConfig(layers=2, dim=128, heads=4, seq=128, vocab=512, steps=40)

    result = DeepspeedTorchDistributor(
        numGpus=world_size, useGpu=True, deepspeedConfig=config
    ).run_all(example.train, model)

    assert result.mode_settings == {"mode": "deepspeed", "zero_stage": 2, "offload": False}
    for rank, value in enumerate(result.values):
        assert value["device"] == f"cuda:{rank}" and value["zero_stage"] == 2
        assert value["compute_dtype"] == "bfloat16"
        assert value["final_loss"] < value["first_loss"] - 0.5


def local_rank_probe() -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    from sparkdist import runtime

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # what code written for torchrun does
    dist.init_process_group("nccl")
    total = torch.tensor([1.0], device=f"cuda:{local_rank}")
    dist.all_reduce(total)
    return {
        "local_rank": local_rank,
        "visible": os.environ["CUDA_VISIBLE_DEVICES"].split(","),
        "own": os.environ["SPARKDIST_GPU"],
        "runtime_device": str(runtime.device()),
        "uuid": str(torch.cuda.get_device_properties(local_rank).uuid),
        "sum": total.item(),
    }


@pytest.mark.spark
@pytest.mark.cluster
def test_in_spark_mode_cuda_local_rank_is_each_ranks_own_gpu(no_spark, monkeypatch):
    # One executor with every GPU, one GPU per task: the tasks share a host, so their ranks
    # count LOCAL_RANK across them and see the host's GPUs in local-rank order.
    from pyspark.sql import SparkSession

    from tests.conftest import FAKE_GPU_SCRIPT, FAST_JVM_OPTIONS

    monkeypatch.setenv("SPARKDIST_FAKE_GPUS", str(GPUS))  # it lists the ordinals 0..GPUS-1
    spark = (
        SparkSession.builder.master(f"local-cluster[1,{GPUS},2048]")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.extraJavaOptions", FAST_JVM_OPTIONS)
        .config("spark.executor.extraJavaOptions", FAST_JVM_OPTIONS)
        .config("spark.worker.resource.gpu.amount", str(GPUS))
        .config("spark.worker.resource.gpu.discoveryScript", str(FAKE_GPU_SCRIPT))
        .config("spark.executor.resource.gpu.amount", str(GPUS))
        .config("spark.executor.resource.gpu.discoveryScript", str(FAKE_GPU_SCRIPT))
        .config("spark.task.resource.gpu.amount", "1")
        .getOrCreate()
    )
    try:
        values = Distributor(GPUS, local_mode=False, use_gpu=True).run_all(local_rank_probe).values
    finally:
        spark.stop()
    for rank, value in enumerate(values):
        assert value["local_rank"] == rank  # one host: one node
        assert value["visible"][value["local_rank"]] == value["own"]  # the GPU Spark gave it
        assert value["runtime_device"] == f"cuda:{value['local_rank']}"
        assert value["sum"] == GPUS
    assert len({value["uuid"] for value in values}) == GPUS  # one GPU each
