"""The FSDP and DeepSpeed examples, run as a user runs them: ``python examples/<name>.py --tiny``.

Each runs with 2 CPU ranks in local mode (no JVM, to stay fast) and must show the loss falling
and a result line for every rank. Correctness of the modes themselves (shards equal
single-process training) is tests/integration/test_modes.py's job; this file checks that the
examples work end to end and report what they claim.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

EXAMPLES = REPO / "examples"
RUN_TIMEOUT_S = 180

FSDP_RANK_LINE = re.compile(
    r"^rank (\d+): cpu \((\w+)\), holds ([\d,]+) of ([\d,]+) parameters, "
    r"loss ([\d.]+) -> ([\d.]+)$",
    re.MULTILINE,
)
DEEPSPEED_RANK_LINE = re.compile(
    r"^rank (\d+): cpu \((\w+)\), ZeRO stage (\d), holds ([\d,]+) of ([\d,]+) parameters, "
    r"loss ([\d.]+) -> ([\d.]+)$",
    re.MULTILINE,
)


def run_example(name: str, *args: str, **env_vars: str) -> str:
    """Run an example in a fresh interpreter, as a user would; return its stdout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        **env_vars,
    }
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_fsdp_transformer_example_shards_the_model_and_the_loss_falls():
    out = run_example("fsdp_transformer.py", "--tiny", "--processes", "2", "--cpu")

    ranks = FSDP_RANK_LINE.findall(out)
    assert [int(r[0]) for r in ranks] == [0, 1], out
    finals = set()
    for _, dtype, held, total, first, final in ranks:
        assert dtype == "float32"  # mixed precision is for GPUs only
        assert number(held) * 2 == number(total)  # each rank holds half: shards, not copies
        assert float(final) < float(first) - 1.0, out  # ~5.0 -> ~1.8 in 30 steps
        finals.add(final)
    assert len(finals) == 1  # the final loss is averaged over ranks: one value everywhere
    # Rank 0 alone logs the loss, its lines forwarded with their rank prefix.
    assert re.search(r"^\[rank 0\] step +0  loss", out, re.MULTILINE)
    assert not re.search(r"^\[rank 1\] step", out, re.MULTILINE)
    assert "{'mode': 'fsdp'} on 2 ranks" in out


@pytest.mark.deepspeed
# ZeRO-3 only: every shipped config (zero2 too) trains in test_deepspeed_configs.py.
@pytest.mark.parametrize("config_name", ["zero3.json"])
def test_deepspeed_zero_example_trains_with_the_shipped_config(config_name, tmp_path):
    config_path = REPO / "conf" / "deepspeed" / config_name
    zero = json.loads(config_path.read_text())["zero_optimization"]
    extensions = tmp_path / "torch_extensions"  # empty, as on a fresh machine

    out = run_example(
        "deepspeed_zero.py",
        "--tiny",
        "--processes",
        "2",
        "--cpu",
        "--config",
        str(config_path),
        TORCH_EXTENSIONS_DIR=str(extensions),
    )

    ranks = DEEPSPEED_RANK_LINE.findall(out)
    assert [int(r[0]) for r in ranks] == [0, 1], out
    for _, dtype, stage, held, total, first, final in ranks:
        assert dtype == "float32" and int(stage) == zero["stage"]
        assert float(final) < float(first) - 0.5, out  # ~5.0 -> ~3.5 in 30 steps
        if zero["stage"] < 3:
            assert number(held) == number(total)  # ZeRO-2 partitions optimizer state only
        elif zero.get("stage3_param_persistence_threshold") == 0:
            # Every parameter partitioned: each rank stores half of them.
            assert number(held) * 2 == pytest.approx(number(total), rel=0.01)
        else:  # parameters under the threshold stay whole on every rank
            assert number(held) <= number(total)
    assert re.search(r"^\[rank 0\] step +0  loss", out, re.MULTILINE)
    assert f"'zero_stage': {zero['stage']}, 'offload': False}} on 2 ranks" in out
    # Nothing was compiled on the way (DeepSpeed's CPU comm op, FusedAdam): no op folder.
    assert not extensions.exists() or not any(extensions.iterdir())


@pytest.mark.spark
@pytest.mark.slow  # its own JVM: ~30 s here, more than the rest of this file together
def test_fsdp_transformer_example_runs_as_spark_barrier_tasks():
    out = run_example("fsdp_transformer.py", "--tiny", "--processes", "2", "--cpu", "--remote")

    ranks = FSDP_RANK_LINE.findall(out)
    assert [int(r[0]) for r in ranks] == [0, 1], out
    assert all(float(final) < float(first) - 1.0 for *_, first, final in ranks), out
