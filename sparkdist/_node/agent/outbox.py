"""An agent's outgoing messages to the driver.

Nothing in the agent ever blocks on the driver's socket: the channel client queues and sends
on its own thread. Control messages (rendezvous, failures) are never dropped; output lines,
progress reports and system samples are dropped, and counted, when the driver falls behind or
is gone, so a slow or vanished driver never stalls training. Reports and samples travel in a
lane of their own (``client.METRIC_KINDS``), so a rank flooding its output drops its lines,
never the node's metrics. A message that cannot travel (a report over the channel's limits)
is dropped and counted too, with a warning naming the limit: it never cuts the node off. An
output line longer than a message allows goes as several.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

from sparkdist._wire import protocol
from sparkdist._wire.channel.client import POST_QUEUE, ChannelClient, ChannelClosed

logger = logging.getLogger("sparkdist")

#: Output lines buffered for the driver before new ones are dropped (and counted).
OUTBOX_CAPACITY = POST_QUEUE


class Outbox:
    """Messages for the driver; see the module docstring.

    Args:
        client: the channel to the driver, or None (a detached node, or no driver).
        keep_lines: without a client, keep up to this many of the latest lines in ``kept``
            (they travel back with the outcomes instead).
    """

    def __init__(self, client: ChannelClient | None, keep_lines: int = 0) -> None:
        self._client = client
        self.kept: collections.deque[protocol.Message] = collections.deque()
        self._keep_lines = keep_lines
        self._lock = threading.Lock()
        self._closed = False
        self._dropped = 0
        self._warned = False

    @property
    def dropped(self) -> int:
        """Lines, reports and samples that never reached the driver."""
        return self._dropped + (self._client.dropped if self._client is not None else 0)

    def control(self, message: protocol.Message) -> None:
        """Send a control message (never dropped while the channel lives)."""
        if self._client is None:
            return
        try:
            self._client.send(message)
        except ChannelClosed:
            pass  # the driver is gone; the agent hears of it through the client's on_close
        except protocol.ProtocolError as exc:  # a bug: say so, keep the node connected
            logger.error("sparkdist: a control message could not be sent: %s", exc)

    def line(self, message: protocol.Message) -> None:
        """Send an output line, a progress report or a system sample (dropped, and counted,
        when it cannot go)."""
        if self._client is None:
            with self._lock:
                # Only lines travel back with the outcomes: a report per step or a sample per
                # interval must not push out the lines that explain a failure.
                if not self._keep_lines or not isinstance(message, protocol.Log):
                    self._dropped += 1
                    return
                if len(self.kept) >= self._keep_lines:
                    self.kept.popleft()  # keep the latest lines: the end is what explains
                    self._dropped += 1
                self.kept.append(message)
            return
        for part in _fitting(message):
            try:
                self._client.post(part)
            except protocol.ProtocolError as exc:
                with self._lock:
                    self._dropped += 1
                    warn, self._warned = not self._warned, True
                if warn:
                    logger.warning(
                        "sparkdist: a message was dropped, it cannot travel to the driver: %s "
                        "(later ones are only counted)",
                        exc,
                    )

    def close(self, timeout_s: float, final: protocol.Bye | None = None) -> None:
        """Send what is queued (within ``timeout_s``), then ``final`` with the drop count.

        Only the first call does anything.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        client = self._client
        if client is None:
            return
        deadline = time.monotonic() + timeout_s
        client.flush(timeout_s)
        if final is None:
            return
        final = dataclasses.replace(final, dropped=self.dropped)
        try:
            client.send(final, after_posted=True)  # the flush may have timed out: stay behind
        except (ChannelClosed, protocol.ProtocolError):
            return
        client.flush(max(0.0, deadline - time.monotonic()))


def _fitting(message: protocol.Message) -> list[protocol.Message]:
    """``message``, or an over-long output line as several lines that each fit."""
    if isinstance(message, protocol.Log):
        return list(protocol.log_chunks(message.rank, message.stream, message.line))
    return [message]
