"""GPUs the driver can see, found without importing torch (which costs a second per import).

``nvidia-smi`` lists the devices; ``CUDA_VISIBLE_DEVICES`` narrows them the way CUDA would.
No nvidia-smi means no NVIDIA GPU here. The listing is read once per process (per nvidia-smi
found on ``PATH``) and kept: running nvidia-smi costs tens of milliseconds, and a launch asks
for the GPUs on every run. The mask is applied on every call, so a changed
``CUDA_VISIBLE_DEVICES`` is always seen.

Non-goals: GPUs of executors (Spark assigns those to each task); GPUs plugged in while a
process runs (``forget_listing`` reads them again).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """One visible device: its CUDA_VISIBLE_DEVICES token and its product name."""

    address: str
    name: str


#: nvidia-smi's path -> its listing, {index: product name}, in CUDA order.
_listings: dict[str, dict[str, str]] = {}
_listings_lock = threading.Lock()


def visible_gpus() -> list[Gpu]:
    """The NVIDIA GPUs this process may use, in CUDA order."""
    devices = _listing()
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return [Gpu(index, name) for index, name in devices.items()]
    return [Gpu(token, devices[token]) for token in _tokens(mask) if token in devices]


def forget_listing() -> None:
    """Drop the kept nvidia-smi listing: the next call runs nvidia-smi again."""
    with _listings_lock:
        _listings.clear()


def _listing() -> dict[str, str]:
    """Every NVIDIA device (unmasked): {index: name}; nvidia-smi runs once per process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    with _listings_lock:  # held while nvidia-smi runs: concurrent launches run it once
        devices = _listings.get(smi)
        if devices is None:
            devices = _run_nvidia_smi(smi)
            if devices is not None:  # a failure is not kept: the next launch tries again
                _listings[smi] = devices
    return dict(devices or {})


def _run_nvidia_smi(smi: str) -> dict[str, str] | None:
    try:
        listing = subprocess.run(
            [smi, "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    devices = {}
    for line in listing.splitlines():
        index, _, name = line.partition(",")
        if index.strip().isdigit():
            devices[index.strip()] = name.strip()
    return devices


def _tokens(mask: str) -> list[str]:
    tokens = []
    for token in mask.split(","):
        token = token.strip()
        if not token.isdigit():
            break  # CUDA stops at the first token it cannot parse
        tokens.append(str(int(token)))
    return tokens


def gpu_type_matches(requested: str, device_name: str) -> bool:
    """Whether ``device_name`` (as nvidia-smi prints it) is of the ``requested`` type.

    The type must appear in the name as a whole model token, case-insensitively: "H100"
    matches "NVIDIA H100 80GB HBM3" and "A10" matches "NVIDIA A10G" but not "NVIDIA A100".
    """
    pattern = rf"(?<![A-Z0-9]){re.escape(requested.upper())}(?![0-9])"
    return re.search(pattern, device_name.upper()) is not None


def gpu_type_mismatch(requested: str, gpus: Sequence[Gpu], where: str) -> str | None:
    """None when every GPU is of the requested type, otherwise what to tell the user."""
    if not gpus:
        return (
            f"gpu_type={requested!r} was requested but no NVIDIA GPU is visible on {where}; "
            "pass gpu_type=None to run without the check (on CPU where there is no GPU)"
        )
    wrong = sorted({gpu.name for gpu in gpus if not gpu_type_matches(requested, gpu.name)})
    if not wrong:
        return None
    return (
        f"gpu_type={requested!r} was requested but {where} has {', '.join(wrong)}; pass the "
        "type these GPUs are, gpu_type=None, or run where the requested GPUs are"
    )


def gpus_at(addresses: Sequence[str]) -> list[Gpu]:
    """The visible GPUs whose CUDA_VISIBLE_DEVICES tokens are ``addresses`` (unmasked view)."""
    devices = _listing()
    return [Gpu(a, devices[a]) for a in addresses if a in devices]
