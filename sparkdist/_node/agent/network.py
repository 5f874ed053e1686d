"""This node's address and interface, decided from its spec (``host.interfaces`` does the
lookups) and said in the node's log.

Non-goals: the lookups themselves (``_node.host.interfaces``), the ranks' environment
(``_core.env.with_socket_ifname``).
"""

from __future__ import annotations

import logging
import os

from sparkdist._core.addresses import is_loopback
from sparkdist._core.env import SOCKET_IFNAME_VARS
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._node.host.interfaces import NodeNetwork, node_network

logger = logging.getLogger("sparkdist")


def decide_node_network(spec: AgentSpec) -> NodeNetwork:
    """``node_network`` for the node ``spec`` describes, said in the node's log; a lookup that
    fails unexpectedly leaves the ranks as they were before (the spec's master, no interface),
    never the agent failed."""
    peers = [h for i, h in enumerate(spec.task_hosts) if i != spec.node_rank]
    try:
        network = node_network(
            spec.host,
            spec.master_addr,
            is_master_node=spec.node_rank == 0,
            peer_hosts=peers,
            driver_host=spec.channel_address[0],
        )
    except Exception as exc:  # noqa: BLE001 - a lookup's surprise must not fail the node
        logger.warning("sparkdist: node %d: could not tell its address: %r", spec.node_rank, exc)
        return NodeNetwork(spec.master_addr)
    if is_loopback(network.master_addr):
        return network  # one host: nothing to say
    users = {**os.environ, **spec.extra_env}
    own = [name for name in SOCKET_IFNAME_VARS if name in users]
    if network.interface is not None:
        logger.info(
            "sparkdist: node %d at %s, MASTER_ADDR %s; %s",
            spec.node_rank,
            network.describe(),
            network.master_addr,
            f"{', '.join(own)} as set by the user" if own else "gloo and NCCL use that interface",
        )
    elif len(own) < len(SOCKET_IFNAME_VARS):
        logger.warning(
            "sparkdist: node %d (%s): could not tell which interface holds the address its "
            "peers reach it at, so gloo and NCCL choose from the host name; if the run fails to "
            "connect, set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in env=",
            spec.node_rank,
            spec.host,
        )
    return network
