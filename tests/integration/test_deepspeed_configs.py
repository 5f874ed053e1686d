"""The DeepSpeed configs in conf/deepspeed train for real on CPU, launched by the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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


@pytest.mark.parametrize(
    "name",
    [
        "zero2",
        "zero3",
        # DeepSpeedCPUAdam is compiled on first use (minutes on 2 cores), so not in the default run.
        pytest.param("zero3_offload", marks=pytest.mark.slow),
    ],
)
def test_config_trains_two_ranks_on_cpu(tmp_path, name):
    (tmp_path / "train.py").write_text(TRAIN)
    config = REPO / "conf" / "deepspeed" / f"{name}.json"
    done = subprocess.run(
        [sys.executable, "-m", "sparkdist", "run", "-n", "2", "--cpu",
         "--deepspeed-config", str(config), "train.py"],
        cwd=tmp_path, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}, capture_output=True,
        text=True, timeout=600, stdin=subprocess.DEVNULL, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stage = 2 if name == "zero2" else 3
    for rank in (0, 1):
        assert f"[rank {rank}] TRAINED stage={stage}" in done.stdout
    assert not run_processes()
