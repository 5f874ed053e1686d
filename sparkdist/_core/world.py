"""Where this process sits in the world, as a rank reads it: the launcher's variables when set
(sparkdist's and torchrun's), else ``torch.distributed`` when this process has a default group
up, else a world of one. Never imports torch (that costs seconds, and nothing can be up).

Non-goals: the public helpers (``sparkdist.runtime``), setting the variables (``env``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from sparkdist._core.env import USE_GPU_VAR


def int_env(name: str, default: int) -> int:
    """The integer in variable ``name``, or ``default`` when unset or not an integer."""
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def initialized_dist() -> Any:
    """``torch.distributed`` if this process already imported it and has a default process
    group up; else None (never imports torch: that costs seconds, and nothing can be up)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist


def env_or_torch(name: str, question: str, default: int) -> int:
    """The launcher's variable ``name`` when it is set (an integer); else
    ``torch.distributed.<question>()`` when a default process group is up; else ``default``."""
    value = int_env(name, -1)
    if value >= 0:
        return value
    dist = initialized_dist()
    return default if dist is None else int(getattr(dist, question)())


def global_rank() -> int:
    """This process's rank in the whole world (see ``env_or_torch``)."""
    return env_or_torch("RANK", "get_rank", 0)


def world_size() -> int:
    """Ranks in the world (see ``env_or_torch``)."""
    return env_or_torch("WORLD_SIZE", "get_world_size", 1)


def uses_cuda() -> bool:
    """Whether this rank computes on a GPU: CUDA is there and the launch did not hide it."""
    if os.environ.get(USE_GPU_VAR) == "0":
        return False
    import torch

    return bool(torch.cuda.is_available())
