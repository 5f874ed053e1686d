"""``_node.host.gpus``: nvidia-smi runs once per process; the mask applies on every call."""

from __future__ import annotations

import os

import pytest

from sparkdist._node.host import gpus
from sparkdist._node.host.gpus import Gpu, gpus_at, visible_gpus


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An nvidia-smi listing two GPUs that counts its calls (one line each in ``calls``)."""
    calls = tmp_path / "calls"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\necho x >> {calls}\necho '0, NVIDIA H100'\necho '1, NVIDIA A10G'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus.forget_listing()
    yield lambda: len(calls.read_text().splitlines()) if calls.exists() else 0
    gpus.forget_listing()


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        (None, [Gpu("0", "NVIDIA H100"), Gpu("1", "NVIDIA A10G")]),
        ("1", [Gpu("1", "NVIDIA A10G")]),
        ("1,0", [Gpu("1", "NVIDIA A10G"), Gpu("0", "NVIDIA H100")]),
        ("0,x,1", [Gpu("0", "NVIDIA H100")]),  # CUDA stops at the first token it cannot parse
        ("", []),
        ("7", []),
    ],
)
def test_the_mask_narrows_the_kept_listing_on_every_call(fake_smi, monkeypatch, mask, expected):
    assert len(visible_gpus()) == 2  # listed once, unmasked
    if mask is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    assert visible_gpus() == expected
    assert gpus_at(["1", "5"]) == [Gpu("1", "NVIDIA A10G")]  # addresses are unmasked
    assert fake_smi() == 1


def test_nvidia_smi_runs_again_only_when_forgotten_or_another_is_on_the_path(
    fake_smi, tmp_path, monkeypatch
):
    for _ in range(3):
        visible_gpus()
    assert fake_smi() == 1
    gpus.forget_listing()
    visible_gpus()
    assert fake_smi() == 2
    other = tmp_path / "other" / "nvidia-smi"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\necho '0, NVIDIA L4'\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{other.parent}{os.pathsep}{os.environ['PATH']}")
    assert visible_gpus() == [Gpu("0", "NVIDIA L4")]


def test_a_failing_nvidia_smi_means_no_gpu_and_is_asked_again(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpus.forget_listing()
    assert visible_gpus() == []
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H100'\n")
    assert visible_gpus() == [Gpu("0", "NVIDIA H100")]
    gpus.forget_listing()
