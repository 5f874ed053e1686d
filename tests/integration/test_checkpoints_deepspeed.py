"""DeepSpeed's own checkpoints through ``runtime.save_checkpoint(engine, step)`` and
``runtime.load_checkpoint(engine)`` with real ranks (CPU accelerator, gloo, torch's AdamW:
nothing compiled): saved under the same layout and commit rule as DCP's (the marker last, no
``latest`` file, ``keep_last``, private files), loaded exactly into a fresh engine, resharded
through DeepSpeed's universal checkpoint at another world size, and refused where it cannot
load. Every test checks that no process of the run survives (and conftest's leak check too).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from sparkdist import Distributor, runtime
from tests._helpers.files import mode_of
from tests.conftest import run_processes
from tests.integration.test_checkpoints_dcp import assert_equal

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.deepspeed, pytest.mark.filterwarnings("ignore::UserWarning")]


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        # torch's AdamW: DeepSpeed's own Adam ops are compiled on first use (minutes).
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }


def launch(world_size: int, ckpt, stage: int, fn, *args) -> list:
    values = (
        Distributor(
            world_size,
            use_gpu=False,
            mode="deepspeed",
            deepspeed_config=ds_config(stage),
            checkpoint_dir=str(ckpt),
            allow_oversubscribe=True,
            timeout_s=240,
        )
        .run_all(fn, *args)
        .values
    )
    assert not run_processes()
    return values


def make_engine(seed: int, stage: int | None = None):
    import deepspeed

    config = runtime.deepspeed_config()
    if stage is not None:
        config = {**config, "zero_optimization": {"stage": stage}}
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def train(engine, steps: int) -> None:
    seed = 1000 * engine.global_steps + runtime.get_global_rank()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = engine(torch.randn(4, 8, generator=generator)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def whole_state(engine) -> dict:
    """Every parameter's fp32 master value and Adam's moments, whole (gathered under ZeRO):
    what must survive a save and load at any world size. Collective under ZeRO-3."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed links the moments to the parameters at the first step; a loaded engine has not
    # stepped yet (ZeRO 1 and 2).
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    return {
        name: [
            safe_get_full_fp32_param(p).clone(),
            safe_get_full_optimizer_state(p, "exp_avg").clone(),
            safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
        ]
        for name, p in engine.module.named_parameters()
    }


def rank_state(engine) -> dict:
    """The step counts: DeepSpeed's, and Adam's on this rank's partitions."""
    adam = engine.optimizer.optimizer  # torch's AdamW over this rank's fp32 partitions
    steps = sorted({float(state["step"]) for state in adam.state.values()})
    return {"global_steps": engine.global_steps, "adam_steps": steps}


# -- save, keep_last, load into a fresh engine ---------------------------------------------------


def save_twice():
    engine = make_engine(seed=0)
    train(engine, 2)
    first = runtime.save_checkpoint({"engine": engine, "epoch": 1}, 1)
    train(engine, 2)
    second = runtime.save_checkpoint({"engine": engine, "epoch": 2}, 2, keep_last=1)
    return {"paths": [first, second], "whole": whole_state(engine), "rank": rank_state(engine)}


def load_fresh():
    engine = make_engine(seed=7)  # another init: the load must overwrite it
    state = {"engine": engine, "epoch": -1}
    loaded = runtime.load_checkpoint(state)
    return {
        "loaded": (loaded.step, loaded.path, loaded.state is state, state["epoch"]),
        "whole": whole_state(engine),
        "rank": rank_state(engine),
    }


# ZeRO-2: one model-states file (rank 0's); ZeRO-3: one per rank, each rank loading its own.
MODEL_STATES = {
    2: ["mp_rank_00_model_states.pt"],
    3: [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)],
}


@pytest.mark.parametrize(
    "stage", [pytest.param(2, marks=pytest.mark.slow), 3]
)  # 3: the harder case
def test_an_engine_saved_twice_keeps_the_last_and_loads_exactly_into_a_fresh_one(tmp_path, stage):
    ckpt = tmp_path / "ckpt"
    saved = launch(2, ckpt, stage, save_twice)
    step2 = ckpt / "step-000000002"
    assert saved[0]["paths"] == [str(ckpt / "step-000000001"), str(step2)]
    # keep_last=1: only step 2; no DeepSpeed "latest" file (the marker decides what loads).
    assert sorted(os.listdir(ckpt)) == ["step-000000002", "zero_to_fp32.py", "zero_to_torch.py"]
    marker = json.loads((step2 / "COMMITTED").read_text())
    assert marker["format"] == "deepspeed" and marker["step"] == 2
    assert (marker["world_size"], marker["dp_world_size"], marker["zero_stage"]) == (2, 2, stage)
    assert marker["client_keys"] == ["epoch"]
    files = sorted(os.listdir(step2))
    optim_states = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert files == sorted(["COMMITTED", *MODEL_STATES[stage], *optim_states])
    # Written last, and private: DeepSpeed wrote with the umask, sparkdist fixed the modes.
    written = [os.stat(step2 / name).st_mtime_ns for name in files if name != "COMMITTED"]
    assert os.stat(step2 / "COMMITTED").st_mtime_ns >= max(written)
    assert mode_of(ckpt) == mode_of(step2) == 0o700
    assert all(mode_of(step2 / name) == 0o600 for name in files)
    assert mode_of(ckpt / "zero_to_fp32.py") == 0o700
    # A step directory without its marker (a save cut short) is never loaded.
    shutil.copytree(step2, ckpt / "step-000000003")
    (ckpt / "step-000000003" / "COMMITTED").unlink()

    loaded = launch(2, ckpt, stage, load_fresh)
    for rank, value in enumerate(loaded):
        assert value["loaded"] == (2, str(step2), True, 2)
        assert_equal(value["whole"], saved[rank]["whole"], "whole")
        assert_equal(value["rank"], saved[rank]["rank"], "rank")


# -- another world size: resharded through DeepSpeed's universal checkpoint ----------------------


def save_at(step: int):
    engine = make_engine(seed=0)
    train(engine, 3)
    runtime.save_checkpoint({"engine": engine, "epoch": 3}, step)
    return whole_state(engine)


def load_and_save(step: int | None):
    engine = make_engine(seed=7)
    state = {"engine": engine, "epoch": -1}
    loaded = runtime.load_checkpoint(state)
    result = {"step": loaded.step, "epoch": state["epoch"], "whole": whole_state(engine)}
    if step is not None:
        train(engine, 1)  # it trains on from there, and saves at this world size
        runtime.save_checkpoint({"engine": engine, "epoch": 4}, step)
        result["saved"] = whole_state(engine)
    return result


@pytest.mark.parametrize(
    ("stage", "and_back"), [pytest.param(1, False, marks=pytest.mark.slow), (2, False), (3, True)]
)
def test_a_checkpoint_of_2_ranks_loads_resharded_on_1(tmp_path, stage, and_back, capfd):
    ckpt = tmp_path / "ckpt"
    saved = launch(2, ckpt, stage, save_at, 5)

    [loaded] = launch(1, ckpt, stage, load_and_save, 6)

    assert (loaded["step"], loaded["epoch"]) == (5, 3)
    assert_equal(loaded["whole"], saved[0], "whole")
    if and_back:  # saved by 1, read by 2
        for value in launch(2, ckpt, stage, load_and_save, None):
            assert (value["step"], value["epoch"]) == (6, 4)
            assert_equal(value["whole"], loaded["saved"], "whole")
    out, err = capfd.readouterr()
    assert "converting it to DeepSpeed's universal checkpoint" in out + err
    universal = ckpt / "step-000000005.universal"
    source = json.loads((universal / "CONVERTED_FROM").read_text())
    assert source == json.loads((ckpt / "step-000000005" / "COMMITTED").read_text())
    assert mode_of(universal) == 0o700
    assert json.loads((ckpt / "step-000000006" / "COMMITTED").read_text())["world_size"] == 1
    assert not any(name.endswith(".tmp") for name in os.listdir(ckpt))


# -- refusals: the other format, another ZeRO stage, missing client state, unsafe pickles ---------


def refusals():
    import fractions
    import pickle

    engine = make_engine(seed=0)
    train(engine, 1)
    before = [p.detach().clone() for p in engine.module.parameters()]
    messages = {}

    def refused(key, call, kind=RuntimeError):
        try:
            call()
        except kind as exc:
            messages[key] = str(exc)

    runtime.save_checkpoint({"w": torch.ones(3)}, 1)  # a state dict: DCP's format
    refused("dcp into engine", lambda: runtime.load_checkpoint(engine))
    runtime.save_checkpoint({"engine": engine, "epoch": 1}, 2)
    refused("deepspeed into dict", lambda: runtime.load_checkpoint({"w": torch.zeros(3)}))
    refused("deepspeed whole", lambda: runtime.load_checkpoint())
    refused("no such client key", lambda: runtime.load_checkpoint({"e": engine, "lr": 0.1}))
    other = make_engine(seed=1, stage=1)
    other_before = [p.detach().clone() for p in other.module.parameters()]
    refused("another stage", lambda: runtime.load_checkpoint(other))
    untouched = all(
        torch.equal(a, b) for a, b in zip(other_before, other.module.parameters(), strict=True)
    )
    runtime.save_checkpoint({"engine": engine, "ratio": fractions.Fraction(1, 3)}, 3)
    refused("unsafe", lambda: runtime.load_checkpoint(engine), pickle.UnpicklingError)
    state = {"engine": engine, "ratio": None}
    loaded = runtime.load_checkpoint(state, weights_only=False)
    refused("async", lambda: runtime.save_checkpoint(engine, 4, async_=True), ValueError)
    refused(
        "reserved key", lambda: runtime.save_checkpoint({"e": engine, "module": 1}, 4), ValueError
    )
    refused("two engines", lambda: runtime.save_checkpoint({"a": engine, "b": other}, 4), TypeError)
    after = [p.detach() for p in engine.module.parameters()]
    return {
        "messages": messages,
        "untouched": untouched,
        "trusted": (loaded.step, state["ratio"]),
        "same": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
    }


def test_what_cannot_load_is_refused_clearly_before_the_engine_is_touched(tmp_path):
    ckpt = tmp_path / "ckpt"
    values = launch(2, ckpt, 2, refusals)
    import fractions

    for value in values:
        messages = value["messages"]
        step = lambda n: str(ckpt / f"step-{n:09d}")  # noqa: E731
        assert f"checkpoint {step(1)} holds state dicts" in messages["dcp into engine"]
        assert "load it with load_checkpoint(state_dict)" in messages["dcp into engine"]
        for key in ("deepspeed into dict", "deepspeed whole"):
            assert f"checkpoint {step(2)} is DeepSpeed's" in messages[key]
            assert "load_checkpoint(engine)" in messages[key]
        assert "holds no client state 'lr' (it holds 'epoch')" in messages["no such client key"]
        assert "ZeRO stage 2; this run has 2 ranks and ZeRO stage 1" in messages["another stage"]
        assert '"zero_optimization": {"stage": 2}' in messages["another stage"]
        assert value["untouched"]
        assert "fractions.Fraction" in messages["unsafe"]
        assert "weights_only=False" in messages["unsafe"]
        assert value["trusted"] == (3, fractions.Fraction(1, 3))
        assert "drop async_=True" in messages["async"]
        assert "'module' are names DeepSpeed uses" in messages["reserved key"]
        assert "2 DeepSpeed engines" in messages["two engines"]
        assert value["same"]
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("step")) == [
        "step-000000001",
        "step-000000002",
        "step-000000003",
    ]
