"""An agent's link to the driver: the control channel client (or, for a barrier task that
cannot reach it, a detached rendezvous through Spark's ``allGather``), the outbox on top of it,
the hello and bye, and what the driver says back.

What arrives is turned into the agent's terms: a rendezvous goes to ``on_rendezvous`` (which
hands it to the ranks); an abort, a failed detached rendezvous and the channel closing become
events on the agent's queue ("abort", "drain" with the driver's ``Drain``, "driver_gone" with
the seconds of the driver's silence when that is what ended the link), so the agent's one
watching thread decides what they mean.

Non-goals: the channel itself (``_wire``); the detached exchange (``detached``); deciding what
to do when the driver is gone (``agent``).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from sparkdist._node.agent.detached import DetachedRendezvous
from sparkdist._node.agent.outbox import Outbox
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._wire import protocol
from sparkdist._wire.channel.liveness import silence_limit_s
from sparkdist._wire.channel.server import ChannelClient, ChannelClosed

logger = logging.getLogger("sparkdist")

#: How long a finished agent waits for its buffered output to reach the driver.
FLUSH_TIMEOUT_S = 5.0
#: Output lines a detached node keeps to return with its outcomes (the latest ones).
KEPT_LINES = 20_000


class DriverLink:
    """One agent's side of the driver link (see the module docstring).

    Args:
        spec: the agent's spec (the channel's address and secret, this node's rank).
        all_gather: a barrier task's ``allGather``: without the channel, rendezvous through
            it (detached) instead of failing.
        expects_data: the run reads a DataFrame (a detached rendezvous exchanges row counts).
        on_rendezvous: called with the rendezvous, from the delivering thread.
        events: the agent's event queue.
    """

    def __init__(
        self,
        spec: AgentSpec,
        *,
        all_gather: Callable[[str], list[str]] | None,
        expects_data: bool,
        on_rendezvous: Callable[[protocol.Rendezvous], None],
        events: queue.Queue[tuple[str, Any]],
    ) -> None:
        self._spec = spec
        self._all_gather = all_gather
        self._expects_data = expects_data
        self._on_rendezvous = on_rendezvous
        self._events = events
        self.client: ChannelClient | None = None
        self.detached: DetachedRendezvous | None = None
        self.outbox: Outbox | None = None

    def connect(self) -> str | None:
        """Open the driver's channel; failing that, a detached rendezvous (barrier tasks).

        Returns:
            Why this node cannot rendezvous at all (the agent must end its ranks), or None.
        """
        spec = self._spec
        address = spec.channel_address
        if address[1]:
            try:
                self.client = ChannelClient(
                    address,
                    spec.secret,
                    on_message=self._on_message,
                    on_close=lambda silent_for: self._events.put(("driver_gone", silent_for)),
                    silence_limit_s=silence_limit_s(spec.heartbeat_timeout_s),
                )
                return None
            except (OSError, ChannelClosed) as exc:
                problem = f"cannot reach the driver's control channel at {address}: {exc}"
        else:
            problem = "the control channel is turned off"
        if self._all_gather is None:
            return problem  # no other way to rendezvous
        logger.warning("sparkdist: %s; rendezvous through Spark's allGather instead", problem)
        self.detached = DetachedRendezvous(
            self._all_gather,
            spec.node_rank,
            spec.num_nodes * spec.processes_per_node,
            self._expects_data,
            gpus=spec.gpu_addresses or "",
            deliver=self._on_message,
            fail=lambda reason: self._events.put(("abort", reason)),
        )
        return None

    def open_outbox(self) -> Outbox:
        """The outbox for this node's messages, once ``connect`` ran; says hello through it."""
        outbox = self.outbox = Outbox(self.client, keep_lines=KEPT_LINES if self.detached else 0)
        spec = self._spec
        outbox.control(protocol.Hello(spec.node_rank, spec.host, spec.gpu_addresses or ""))
        return outbox

    def start(self) -> None:
        """Begin the detached rendezvous, if any (once the ranks exist)."""
        if self.detached is not None:
            self.detached.start()

    def send_control(self, message: protocol.Message) -> None:
        """To the driver; a detached node keeps what its rendezvous needs instead."""
        if self.detached is None:
            if self.outbox is not None:
                self.outbox.control(message)
        elif isinstance(message, protocol.Store):
            self.detached.on_store(message.port)
        elif isinstance(message, protocol.Rows):
            self.detached.on_rows(message.counts)

    def say_bye(self) -> None:
        """Send what is queued, then "bye": the driver then knows this node's output is complete."""
        if self.outbox is not None:
            self.outbox.close(FLUSH_TIMEOUT_S, final=protocol.Bye(self._spec.node_rank))

    def close(self) -> None:
        """Flush (bounded) and hang up; safe to call more than once."""
        if self.outbox is not None:
            self.outbox.close(FLUSH_TIMEOUT_S)
        if self.client is not None:
            self.client.close()
            self.client.join(FLUSH_TIMEOUT_S)

    def _on_message(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Rendezvous):
            self._on_rendezvous(message)
        elif isinstance(message, protocol.Abort):
            self._events.put(("abort", message.reason))
        elif isinstance(message, protocol.Drain):
            self._events.put(("drain", message))


def tell_driver_once(spec: AgentSpec, message: protocol.Message) -> bool:
    """Connect, send one message, and hang up (best effort: the driver may be gone).

    Returns:
        False when the driver's channel could not be reached.
    """
    if not spec.channel_address[1]:
        return False  # the channel is turned off: this node runs detached
    try:
        client = ChannelClient(spec.channel_address, spec.secret, on_message=lambda m: None)
    except (OSError, ChannelClosed):
        return False
    try:
        client.send(message)
    except (OSError, ChannelClosed):
        return False
    finally:
        client.close()
        client.join(FLUSH_TIMEOUT_S)
    return True
