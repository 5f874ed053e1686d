"""Launch modes with real machinery: FSDP2 and DDP on gloo, DeepSpeed on its CPU accelerator.

Correctness, not just "it ran": after a few steps the sharded (FSDP) or replicated (DDP) model
equals single-process training on the union of the ranks' data.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from sparkdist import ConfigError, DeepspeedTorchDistributor, Distributor, WorkerFailedError

STEPS = 5
LR = 0.1


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def rank_batch(rank):
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)


def train_steps(model, x, y):
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def single_process_reference(world_size):
    import torch

    model = make_model()
    batches = [rank_batch(r) for r in range(world_size)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    train_steps(model, x, y)  # equal batch sizes: the mean loss matches the ranks' average
    return {k: v.detach() for k, v in model.state_dict().items()}


def fsdp_train():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from sparkdist import runtime

    dist.init_process_group(runtime.backend())
    model = make_model()
    total = sum(p.numel() for p in model.parameters())
    mesh = runtime.device_mesh()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    held = sum(p.to_local().numel() for p in model.parameters())
    train_steps(model, *rank_batch(dist.get_rank()))
    state = {k: v.full_tensor().detach() for k, v in model.state_dict().items()}
    return {"held": held, "total": total, "state": state, "mode": runtime.mode()}


def ddp_train():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkdist import runtime

    dist.init_process_group(runtime.backend())
    model = DistributedDataParallel(make_model())
    train_steps(model, *rank_batch(dist.get_rank()))
    return {k: v.detach() for k, v in model.module.state_dict().items()}


def _assert_states_close(got, expected):
    import torch

    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)


def test_fsdp2_shards_parameters_and_matches_single_process_training():
    result = Distributor(2, use_gpu=False, mode="fsdp").run_all(fsdp_train)
    reference = single_process_reference(2)
    for value in result.values:
        assert value["mode"] == "fsdp"
        assert value["held"] * 2 == value["total"]  # shards, not copies
        _assert_states_close(value["state"], reference)
    assert result.mode == "fsdp" and result.mode_settings == {"mode": "fsdp"}


def test_ddp_matches_single_process_training():
    result = Distributor(2, use_gpu=False, mode="ddp").run_all(ddp_train)
    reference = single_process_reference(2)
    for state in result.values:
        _assert_states_close(state, reference)


def test_device_mesh_rejects_a_replica_count_that_does_not_divide_the_world():
    def bad_mesh():
        import torch.distributed as dist

        from sparkdist import runtime

        dist.init_process_group("gloo")
        runtime.device_mesh(replicas=3)

    with pytest.raises(WorkerFailedError, match="replicas=3 must be a positive divisor"):
        Distributor(2, use_gpu=False, mode="fsdp").run(bad_mesh)


def test_runtime_backend_and_device_on_cpu():
    def where():
        from sparkdist import runtime

        return runtime.backend(), str(runtime.device())

    assert Distributor(1, use_gpu=False).run(where) == ("gloo", "cpu")


# -- DeepSpeed ---------------------------------------------------------------------------


def deepspeed_train(steps):
    import deepspeed
    import torch

    from sparkdist import runtime

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=runtime.deepspeed_config()
    )
    generator = torch.Generator().manual_seed(runtime.get_global_rank())
    x = torch.randn(64, 16, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "first": losses[0],
        "last": losses[-1],
        "stage": engine.zero_optimization_stage(),
        "config_path": runtime.deepspeed_config_path(),
    }


def zero_config(stage):
    return {
        "train_micro_batch_size_per_gpu": 64,
        "gradient_accumulation_steps": 1,
        # torch's AdamW: DeepSpeed's default (FusedAdam) is compiled on first use (minutes).
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }


@pytest.mark.deepspeed
# Stage 2 here (a dict config); stage 3 and offload train in test_deepspeed_configs.py.
@pytest.mark.parametrize("stage", [2])
def test_deepspeed_zero_loss_falls_on_every_rank(stage):
    result = Distributor(
        2, use_gpu=False, mode="deepspeed", deepspeed_config=zero_config(stage)
    ).run_all(deepspeed_train, 20)
    assert len(result.values) == 2
    for value in result.values:
        assert value["stage"] == stage
        assert value["last"] < 0.5 * value["first"]
    assert result.mode_settings == {"mode": "deepspeed", "zero_stage": stage, "offload": False}
    # The shipped config file lived in the run directory and is gone with it.
    assert not os.path.exists(result.values[0]["config_path"])


@pytest.mark.deepspeed
def test_deepspeed_torch_distributor_function_with_config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(zero_config(2)))
    value = DeepspeedTorchDistributor(numGpus=2, useGpu=False, deepspeedConfig=str(path)).run(
        deepspeed_train, 10
    )
    assert value["stage"] == 2 and value["last"] < value["first"]


@pytest.mark.deepspeed
def test_deepspeed_torch_distributor_script_gets_pysparks_arguments(tmp_path, capfd):
    script = tmp_path / "ds_script.py"
    script.write_text(
        textwrap.dedent("""
        import argparse, json, os, sys
        parser = argparse.ArgumentParser()
        parser.add_argument("--epochs", type=int)
        parser.add_argument("--deepspeed", action="store_true")
        parser.add_argument("--deepspeed_config")
        args = parser.parse_args()
        with open(args.deepspeed_config) as f:
            stage = json.load(f)["zero_optimization"]["stage"]
        print("args", args.epochs, args.deepspeed, "stage", stage, "rank", os.environ["RANK"],
              "accelerator", os.environ.get("DS_ACCELERATOR"))
        if os.environ["RANK"] == "1" and args.epochs == 99:
            sys.exit(4)
    """)
    )
    distributor = DeepspeedTorchDistributor(
        numGpus=1, nnodes=2, useGpu=False, deepspeedConfig=zero_config(3)
    )
    assert distributor.num_processes == 2
    assert distributor.run(str(script), "--epochs", "2") is None
    out, _ = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] args 2 True stage 3 rank {rank} accelerator cpu" in out
    with pytest.raises(WorkerFailedError) as info:
        distributor.run(str(script), "--epochs", "99")
    assert info.value.root_cause.rank == 1 and info.value.root_cause.exit_code == 4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("/no/such/ds.json", "cannot read the DeepSpeed config"),
        ({"bad": {1, 2}}, "must hold only JSON values"),
        (42, "must be a dict or the path of a JSON file"),
    ],
)
def test_bad_deepspeed_config_fails_before_launch(config, message):
    with pytest.raises(ConfigError, match=message):
        DeepspeedTorchDistributor(numGpus=2, useGpu=False, deepspeedConfig=config)


def test_deepspeed_config_that_is_not_json_or_not_an_object(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        Distributor(2, mode="deepspeed", deepspeed_config=broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object, not list"):
        Distributor(2, mode="deepspeed", deepspeed_config=listed)


def test_deepspeed_config_needs_deepspeed_mode():
    with pytest.raises(ConfigError, match="pass mode='deepspeed'"):
        Distributor(2, mode="ddp", deepspeed_config=zero_config(2))


@pytest.mark.parametrize(("num_gpus", "nnodes"), [(0, 1), (1, 0), (2.0, 1), (1, "2")])
def test_deepspeed_torch_distributor_counts_must_be_positive(num_gpus, nnodes):
    with pytest.raises(ConfigError, match="must be a positive integer"):
        DeepspeedTorchDistributor(numGpus=num_gpus, nnodes=nnodes, useGpu=False)


def test_deepspeed_torch_distributor_counts_true_as_one_as_pyspark_does():
    assert DeepspeedTorchDistributor(numGpus=True, nnodes=2, useGpu=False).num_processes == 2
