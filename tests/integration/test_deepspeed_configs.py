"""The DeepSpeed configs in conf/deepspeed train for real on CPU, launched by the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparkdist._node.rank.torch_extensions import build_root, op_is_built, torch_build_tag
from tests.conftest import REPO, run_processes

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

TRAIN = textwrap.dedent("""
    import deepspeed, torch
    from sparkdist import runtime

    config = runtime.deepspeed_config()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(4, 8)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True))
        engine.backward(loss)
        engine.step()
    stage = engine.zero_optimization_stage()
    print(f"TRAINED stage={stage} loss={loss.item():.4f}", flush=True)
""")


CPU_ADAM = "cpu_adam"  # DeepSpeedCPUAdam's op, which ZeRO-Offload uses unless torch_adam is set
BUILD_CPU_ADAM = (
    'DS_ACCELERATOR=cpu python -c "from deepspeed.accelerator import get_accelerator; '
    "get_accelerator().create_op_builder('CPUAdamBuilder').load()\""
)


def cpu_adam_is_built() -> bool:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return op_is_built(build_root(env, torch_build_tag()), CPU_ADAM)


def train_with_config(tmp_path, config: Path, extensions: Path | None) -> str:
    """Run TRAIN on 2 CPU ranks through the CLI with ``config``; return its stdout."""
    (tmp_path / "train.py").write_text(TRAIN)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkdist",
            "run",
            "-n",
            "2",
            "--cpu",
            "--deepspeed-config",
            str(config),
            "train.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not run_processes()
    return done.stdout


# zero3 as shipped also trains in test_examples_modes (the ZeRO example, nothing compiled):
# here it is slow, not repeated in the default run.
@pytest.mark.parametrize(
    "name", ["zero2", pytest.param("zero3", marks=pytest.mark.slow), "zero3_offload"]
)
def test_config_trains_two_ranks_on_cpu_without_compiling_anything(tmp_path, name):
    config = REPO / "conf" / "deepspeed" / f"{name}.json"
    if name == "zero3_offload":
        # As shipped it asks for DeepSpeedCPUAdam (the fast optimizer for offload on GPU
        # nodes), which is compiled on first use; torch's AdamW runs the same offload on CPU.
        settings = json.loads(config.read_text())
        settings["optimizer"]["params"]["torch_adam"] = True
        config = tmp_path / config.name
        config.write_text(json.dumps(settings))
    extensions = tmp_path / "torch_extensions"  # empty, as on a fresh machine

    out = train_with_config(tmp_path, config, extensions)

    stage = 2 if name == "zero2" else 3
    for rank in (0, 1):
        assert f"[rank {rank}] TRAINED stage={stage}" in out
    # Nothing was compiled (DeepSpeed's CPU comm op, FusedAdam, CPU Adam): no op folder.
    assert not extensions.exists() or not any(extensions.iterdir())


@pytest.mark.skipif(
    not cpu_adam_is_built(),
    reason=f"DeepSpeed's CPU Adam op is not built here (minutes to compile, too long for a "
    f"test's timeout); build it once with: {BUILD_CPU_ADAM}",
)
def test_offload_config_as_shipped_trains_with_deepspeeds_cpu_adam(tmp_path):
    out = train_with_config(tmp_path, REPO / "conf" / "deepspeed" / "zero3_offload.json", None)
    for rank in (0, 1):
        assert f"[rank {rank}] TRAINED stage=3" in out
