"""GPUs the driver can see, found without importing torch (which costs a second per import).

``nvidia-smi`` lists the devices; ``CUDA_VISIBLE_DEVICES`` narrows them the way CUDA would.
No nvidia-smi means no NVIDIA GPU here.

Non-goals: GPUs of executors (Spark assigns those to each task).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """One visible device: its CUDA_VISIBLE_DEVICES token and its product name."""

    address: str
    name: str


def visible_gpus() -> list[Gpu]:
    """The NVIDIA GPUs this process may use, in CUDA order."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run(
            [smi, "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = {}
    for line in listing.splitlines():
        index, _, name = line.partition(",")
        if index.strip().isdigit():
            devices[index.strip()] = name.strip()
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return [Gpu(index, name) for index, name in devices.items()]
    return [Gpu(token, devices[token]) for token in _tokens(mask) if token in devices]


def _tokens(mask: str) -> list[str]:
    tokens = []
    for token in mask.split(","):
        token = token.strip()
        if not token.isdigit():
            break  # CUDA stops at the first token it cannot parse
        tokens.append(str(int(token)))
    return tokens
