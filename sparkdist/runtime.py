"""Helpers to call inside a rank: where am I in the world?

The names are those of Databricks' serverless GPU API, so code written for it runs unchanged.
They read torchrun's environment, so they also answer correctly under plain torchrun; outside
any launcher they describe a world of one (rank 0, size 1, main process).

Example:
    >>> from sparkdist import runtime
    >>> runtime.get_world_size()  # outside a rank
    1
"""

from __future__ import annotations

import os

__all__ = [
    "get_global_rank",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_world_size",
    "is_main_process",
]


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def get_global_rank() -> int:
    """This process's rank in the whole world (0 outside a rank)."""
    return _int_env("RANK", 0)


def get_local_rank() -> int:
    """This process's rank on its node; also the index of its GPU (0 outside a rank)."""
    return _int_env("LOCAL_RANK", 0)


def get_world_size() -> int:
    """Number of ranks in the run (1 outside a rank)."""
    return _int_env("WORLD_SIZE", 1)


def get_local_world_size() -> int:
    """Number of ranks on this node (1 outside a rank)."""
    return _int_env("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node (Spark barrier task) in the run (0 outside a rank)."""
    return _int_env("NODE_RANK", _int_env("GROUP_RANK", 0))


def is_main_process() -> bool:
    """True on global rank 0 (and outside a rank): the process that should log and save."""
    return get_global_rank() == 0
