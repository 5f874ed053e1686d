"""Checkpoints through ``torch.distributed.checkpoint`` with real ranks (local mode, gloo):
written by one world size and read by another (DDP state and FSDP2 shards, compared exactly),
asynchronous saves (returning before the write, committed after it, the end of the run waiting
for it, a failed write raised by the next call), and ``keep_last`` across a run. Every test
checks that no process of the run survives (conftest's leak check).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from sparkdist import Distributor, runtime

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def launch(world_size: int, ckpt, fn, *args, mode: str = "ddp"):
    return Distributor(
        world_size,
        use_gpu=False,
        mode=mode,
        checkpoint_dir=str(ckpt),
        allow_oversubscribe=True,  # 4 CPU ranks on a 2-core box
        timeout_s=240,
    ).run_all(fn, *args)


def marker(ckpt, step: int) -> dict:
    return json.loads((ckpt / f"step-{step:09d}" / "COMMITTED").read_text())


def assert_equal(got, want, where: str = "") -> None:
    """Exactly equal: tensors bit for bit, containers element by element."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_equal(a, b, f"{where}[{index}]")
    else:
        assert got == want, where


# -- DDP: replicated state, written by 4 ranks, read by 2 (and back) ---------------------------


def ddp_state(seed: int) -> dict:
    """What a DDP run saves: the model and optimizer every rank holds alike, and one entry per
    rank of its own (a data-loader position, say)."""
    import torch.distributed as dist

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 8)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "table": torch.randn(256, 256),  # 256 KiB every rank holds alike
        f"rank{dist.get_rank()}": torch.full((3,), float(dist.get_rank())),
        "epoch": seed,
    }


def ddp_save(step: int, seed: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    state = ddp_state(seed)
    path = runtime.save_checkpoint(state, step)
    return {"path": path, "state": state}


def ddp_load_both_ways(step: int, seed: int, save_step: int | None, save_seed: int):
    """Load the checkpoint whole and into a template; then, maybe, save one of this world."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    whole = runtime.load_checkpoint()
    template = ddp_state(seed + 1000)  # other values, same shapes: the load must fill them
    model_template = template["model"]
    into = {"model": template["model"], "optimizer": template["optimizer"], "epoch": -1}
    loaded = runtime.load_checkpoint(into)
    result = {
        "whole": (whole.step, whole.state, whole.path),
        "into": (loaded.step, loaded.state is into, into),
        "in_place": loaded.state["model"] is model_template,
    }
    if save_step is not None:
        state = ddp_state(save_seed)
        runtime.save_checkpoint(state, save_step)
        result["saved"] = state
    return result


def test_ddp_state_written_by_4_ranks_is_read_by_2_and_back(tmp_path):
    ckpt = tmp_path / "ckpt"
    written = launch(4, ckpt, ddp_save, 1, 11).values
    path = ckpt / "step-000000001"
    assert sorted(os.listdir(ckpt)) == ["step-000000001"]
    assert {".metadata", "COMMITTED"} <= set(os.listdir(path))
    shards = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(4)]  # every rank wrote its own
    assert marker(ckpt, 1)["world_size"] == 4 and marker(ckpt, 1)["format"] == "dcp"
    saved = {**written[0]["state"]}
    for rank in range(1, 4):  # the per-rank entries, each from its own rank
        saved[f"rank{rank}"] = written[rank]["state"][f"rank{rank}"]
    # What every rank holds alike is written once, not four times: DCP deduplicates it.
    assert sum(os.path.getsize(path / s) for s in shards) < 2 * 256 * 256 * 4

    read = launch(2, ckpt, ddp_load_both_ways, 1, 11, 2, 22).values
    for value in read:
        step, state, got_path = value["whole"]
        assert (step, got_path) == (1, str(path))
        assert_equal(state, saved, "whole")
        step, is_into, into = value["into"]
        assert step == 1 and is_into and value["in_place"]
        assert_equal(into["model"], saved["model"], "into.model")
        assert_equal(into["optimizer"], saved["optimizer"], "into.optimizer")
        assert into["epoch"] == 11
    assert marker(ckpt, 2)["world_size"] == 2

    saved_by_2 = {**read[0]["saved"], "rank1": read[1]["saved"]["rank1"]}
    back = launch(4, ckpt, ddp_load_both_ways, 2, 33, None, 0).values
    for value in back:
        assert value["whole"][0] == 2
        assert_equal(value["whole"][1], saved_by_2, "whole")
        assert_equal(value["into"][2]["model"], saved_by_2["model"], "into.model")
        assert_equal(value["into"][2]["optimizer"], saved_by_2["optimizer"], "into.optimizer")


# -- FSDP2: sharded parameters and optimizer state, resharded on load --------------------------


def fsdp_model_and_optimizer(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))
    mesh = runtime.device_mesh()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def fsdp_train(model, optimizer, steps: int) -> None:
    import torch.distributed as dist

    for step in range(steps):
        generator = torch.Generator().manual_seed(step * 100 + dist.get_rank())
        optimizer.zero_grad()
        model(torch.randn(4, 8, generator=generator)).pow(2).mean().backward()
        optimizer.step()


def full_state(model, optimizer):
    """Model and optimizer state gathered whole (what must survive any resharding), on global
    rank 0 (empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    # A copy: tensors already on the CPU (Adam's step counts) are the optimizer's own.
    return copy.deepcopy({"model": model_state, "optimizer": optimizer_state})


def fsdp_round(load_step: int | None, save_step: int | None, seed: int):
    """Build the sharded model (its own random init), load into it if asked, train, save."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo")
    model, optimizer = fsdp_model_and_optimizer(seed)
    result = {}
    if load_step is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)  # sharded templates
        into = {"model": model_state, "optimizer": optimizer_state}
        loaded = runtime.load_checkpoint(into)
        assert loaded is not None and loaded.step == load_step and loaded.state is into
        set_state_dict(
            model, optimizer, model_state_dict=into["model"], optim_state_dict=into["optimizer"]
        )
        result["loaded"] = full_state(model, optimizer)
        whole = runtime.load_checkpoint()  # without a template: every shard, whole
        result["whole"] = whole.state
    if save_step is not None:
        fsdp_train(model, optimizer, 2)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        runtime.save_checkpoint({"model": model_state, "optimizer": optimizer_state}, save_step)
        result["saved"] = full_state(model, optimizer)
        result["held"] = sum(p.to_local().numel() for p in model.parameters())
    return result


def test_fsdp2_shards_written_by_4_ranks_load_resharded_on_2_and_back(tmp_path):
    ckpt = tmp_path / "ckpt"
    written = launch(4, ckpt, fsdp_round, None, 1, 1, mode="fsdp").values
    saved = written[0]["saved"]
    total = sum(t.numel() for t in saved["model"].values())
    assert all(value["held"] < total for value in written)  # shards, not copies
    assert marker(ckpt, 1)["world_size"] == 4

    read = launch(2, ckpt, fsdp_round, 1, 2, 2, mode="fsdp").values
    assert_equal(read[0]["loaded"], saved, "4 -> 2")
    for value in read:  # without a template, each rank has every shard, whole
        assert_equal(value["whole"], saved, "whole")
    saved_by_2 = read[0]["saved"]
    assert marker(ckpt, 2)["world_size"] == 2

    back = launch(4, ckpt, fsdp_round, 2, None, 3, mode="fsdp").values
    assert_equal(back[0]["loaded"], saved_by_2, "2 -> 4")


# -- an unreadable newest checkpoint, loaded into a template by every rank together ------------


def fall_back_together():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in (1, 2):
        runtime.save_checkpoint({f"rank{rank}": torch.full((64,), float(step))}, step)
    if rank == 0:  # rank 1's shard of step 2 cut short: only rank 1 meets the damage
        shard = os.path.join(runtime.checkpoint_dir(), "step-000000002", "__1_0.distcp")
        with open(shard, "r+b") as f:
            f.truncate(100)
    dist.barrier()
    into = {f"rank{r}": torch.zeros(64) for r in range(2)}
    latest = runtime.load_checkpoint(into)
    return latest.step, [float(into[f"rank{r}"][0]) for r in range(2)]


def test_an_unreadable_newest_checkpoint_is_skipped_by_every_rank_together(tmp_path, capfd):
    values = launch(2, tmp_path / "ckpt", fall_back_together).values
    assert values == [(1, [1.0, 1.0]), (1, [1.0, 1.0])]  # both ranks, the same checkpoint
    captured = capfd.readouterr()
    warnings = [
        line for line in (captured.out + captured.err).splitlines() if "cannot be read" in line
    ]
    assert sorted(line.split("]")[0] for line in warnings) == ["[rank 0", "[rank 1"]
    assert all("step-000000002" in line for line in warnings)


# -- asynchronous saves ------------------------------------------------------------------------

BIG = 8 * 1024 * 1024  # floats per rank: 32 MiB each, a write that takes a while


def async_save_then_train():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {f"rank{rank}": torch.full((BIG,), float(rank)), "step": torch.tensor(1)}
    path = runtime.save_checkpoint(state, 1, async_=True)
    committed_at_return = os.path.exists(os.path.join(path, "COMMITTED"))
    state[f"rank{rank}"].fill_(-1.0)  # training goes on: what was staged is what is written
    dist.all_reduce(torch.ones(1))  # training collectives while the save's own run
    latest = runtime.load_checkpoint()  # waits for the pending save: its marker is there
    mine = latest.state[f"rank{rank}"]
    return {
        "committed_at_return": committed_at_return,
        "loaded_step": latest.step,
        "intact": bool((mine == float(rank)).all()),
        "committed_after": os.path.exists(os.path.join(path, "COMMITTED")),
    }


def test_an_async_save_returns_before_the_write_and_commits_after_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    values = launch(2, ckpt, async_save_then_train).values
    assert values[0]["committed_at_return"] is False  # the marker comes when the write is done
    for value in values:
        assert value["loaded_step"] == 1 and value["intact"] and value["committed_after"]


def async_save_and_return(steps: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for step in range(1, steps + 1):
        state = {f"rank{dist.get_rank()}": torch.full((BIG,), float(step))}
        runtime.save_checkpoint(state, step, async_=True, keep_last=2)
    return dist.get_rank()  # returns with the last save still being written


def test_the_end_of_the_run_waits_for_an_async_save(tmp_path, monkeypatch):
    # Needs the worker to call sparkdist._checkpoint.api.wait_for_pending_saves() after the
    # function returns, before it destroys the process group.
    ckpt = tmp_path / "ckpt"
    assert launch(2, ckpt, async_save_and_return, 3).values == [0, 1]
    assert sorted(os.listdir(ckpt)) == ["step-000000002", "step-000000003"]
    assert marker(ckpt, 3)["step"] == 3
    monkeypatch.setenv("SPARKDIST_CHECKPOINT_DIR", str(ckpt))
    latest = runtime.load_checkpoint()  # here: no process group, the whole state
    assert latest.step == 3 and set(latest.state) == {"rank0", "rank1"}
    assert all(bool((t == 3.0).all()) for t in latest.state.values())


def saves_then_ends_as_torch_examples_do(async_: bool):
    """Three saves of a Linear(512, 512), then the ending of nearly every torch example."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.Linear(512, 512)
    for step in range(1, 4):
        with torch.no_grad():
            model.weight.fill_(float(step))
        runtime.save_checkpoint({"model": model.state_dict()}, step, async_=async_)
    dist.barrier()
    dist.destroy_process_group()
    return dist.is_initialized()


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_a_save_then_barrier_and_destroy_process_group_commits_the_last_step(
    tmp_path, monkeypatch, async_
):
    # Before the fix, the async save's thread met on its group after the function destroyed
    # every group: "Group ... is not registered" failed the run.
    ckpt = tmp_path / "ckpt"
    assert launch(2, ckpt, saves_then_ends_as_torch_examples_do, async_).values == [False, False]
    assert marker(ckpt, 3)["step"] == 3
    monkeypatch.setenv("SPARKDIST_CHECKPOINT_DIR", str(ckpt))
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 3
    assert bool((latest.state["model"]["weight"] == 3.0).all())


def failed_async_write():
    """Rank 1 may write files of at most 1 MiB (RLIMIT_FSIZE: the kernel refuses the rest with
    EFBIG, as a full disk would), so its shard of the first asynchronous save fails."""
    import resource
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024 * 1024, limit[1]))
    state = {f"rank{rank}": torch.ones(1024 * 1024)}  # 4 MiB each
    runtime.save_checkpoint(state, 1, async_=True)
    try:
        runtime.save_checkpoint(state, 2)
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    runtime.save_checkpoint(state, 3)  # raised once: saving goes on
    return {"raised": raised, "latest": runtime.load_checkpoint().step}


def test_a_failed_async_write_raises_on_the_next_call_naming_the_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    values = launch(2, ckpt, failed_async_write).values
    for value in values:  # every rank learns of it, not just the one whose write failed
        assert "asynchronous save of checkpoint step 1" in value["raised"]
        assert value["raised"].endswith("(on rank 1)")  # torch's writer's words, then the rank
        assert value["latest"] == 3
    assert not (ckpt / "step-000000001" / "COMMITTED").exists()
    assert not (ckpt / "step-000000002").exists()  # the call that raised saved nothing


# -- keep_last ---------------------------------------------------------------------------------


def save_steps_keeping(steps: int, keep_last: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for step in range(1, steps + 1):
        runtime.save_checkpoint({"w": torch.full((4,), float(step))}, step, keep_last=keep_last)
        directory = runtime.checkpoint_dir()
        committed = [
            n for n in os.listdir(directory) if os.path.exists(f"{directory}/{n}/COMMITTED")
        ]
        # Pruned before any rank returns (rank 0 may already be making the next step's room).
        assert len(committed) <= keep_last, committed
    return runtime.load_checkpoint().step


def test_keep_last_across_a_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert launch(2, ckpt, save_steps_keeping, 5, 2).values == [5, 5]
    assert sorted(os.listdir(ckpt)) == ["step-000000004", "step-000000005"]
