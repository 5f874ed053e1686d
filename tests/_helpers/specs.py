"""An ``AgentSpec`` for unit tests: one node of a one-node CPU run on loopback, every field
given; a test passes only the fields it is about."""

from __future__ import annotations

from typing import Any

from sparkdist._node.agent.spec import AgentSpec


def agent_spec(**fields: Any) -> AgentSpec:
    """A plain spec with ``fields`` replacing its defaults."""
    base: dict[str, Any] = {
        "run_id": "r",
        "job_bytes": b"",
        "node_rank": 0,
        "num_nodes": 1,
        "processes_per_node": 1,
        "master_addr": "127.0.0.1",
        "host": "127.0.0.1",
        "channel_address": ("127.0.0.1", 1),
        "secret": "s",
        "gpu_addresses": None,
        "mode": "ddp",
        "start_timeout_s": 1.0,
    }
    return AgentSpec(**{**base, **fields})
