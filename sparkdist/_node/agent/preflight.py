"""What a node checks before it starts any rank: its GPUs are of the requested type, and its
packages meet the run's version requirements (``_core.versions``). A node that fails either
starts nothing and says why (a "refused" message for the driver).

Non-goals: sending the refusal (``driver_link``); finding GPUs (``gpus``); the driver-side
checks done before any task starts.
"""

from __future__ import annotations

from sparkdist._core.versions import unmet_requirements
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._node.host.gpus import gpu_type_mismatch, gpus_at
from sparkdist._wire import protocol


def refusal_of(spec: AgentSpec) -> protocol.Refused | None:
    """The refusal for the driver when this node cannot run ``spec``, else None."""
    reason = _gpu_type_problem(spec)
    unmet = unmet_requirements(spec.requirements, spec.host)
    if reason is None and not unmet:
        return None
    return protocol.Refused(spec.node_rank, spec.host, reason, tuple(unmet))


def _gpu_type_problem(spec: AgentSpec) -> str | None:
    if spec.gpu_type is None:
        return None
    addresses = (spec.gpu_addresses or "").split(",") if spec.gpu_addresses else []
    return gpu_type_mismatch(
        spec.gpu_type,
        gpus_at(addresses),
        f"host {spec.host} (GPU addresses {addresses or 'none'})",
    )
