"""An agent's outgoing messages to the driver, sent by one thread.

Nothing else in the agent ever blocks on the driver's socket: control messages (rendezvous,
failures) are never dropped; output lines and progress reports are dropped, and counted, when
the driver falls behind or is gone, so a slow or vanished driver never stalls training.
"""

from __future__ import annotations

import collections
import threading

from sparkdist._wire.channel import ChannelClient, ChannelClosed, Message

#: Output lines buffered for the driver before new ones are dropped (and counted).
OUTBOX_CAPACITY = 10_000


class Outbox:
    """Messages for the driver; see the module docstring."""

    def __init__(self, client: ChannelClient | None, keep_lines: int = 0) -> None:
        self._client = client
        # Without a driver to send to (a detached node), up to keep_lines lines are kept here
        # and travel back with the outcomes instead.
        self.kept: collections.deque[Message] = collections.deque()
        self._keep_lines = keep_lines
        self._control: collections.deque[Message] = collections.deque()
        self._lines: collections.deque[Message] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._final: Message | None = None
        self.dropped = 0
        self._thread = threading.Thread(
            target=self._send_loop, name="sparkdist-outbox", daemon=True
        )
        self._thread.start()

    def control(self, message: Message) -> None:
        with self._cond:
            self._control.append(message)
            self._cond.notify()

    def line(self, message: Message) -> None:
        with self._cond:
            if self._client is None and self._keep_lines:
                if len(self.kept) >= self._keep_lines:
                    self.kept.popleft()  # keep the latest lines: the end is what explains
                    self.dropped += 1
                self.kept.append(message)
                return
            if len(self._lines) >= OUTBOX_CAPACITY or self._client is None:
                self.dropped += 1
                return
            self._lines.append(message)
            self._cond.notify()

    def close(self, timeout_s: float, final: Message | None = None) -> None:
        """Send what is queued (within ``timeout_s``), then ``final`` with the drop count."""
        with self._cond:
            if not self._closing and final is not None:
                self._final = final
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=timeout_s)

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not (self._control or self._lines or self._closing):
                    self._cond.wait()
                if self._control:
                    message = self._control.popleft()
                elif self._lines:
                    message = self._lines.popleft()
                elif self._final is not None:
                    message, self._final = {**self._final, "dropped": self.dropped}, None
                else:
                    return
            if self._client is None:
                continue
            try:
                self._client.send(message)
            except (ChannelClosed, OSError, ValueError):
                with self._cond:
                    self.dropped += len(self._lines) + (message.get("t") == "log")
                    self._lines.clear()
                    self._control.clear()
                    self._client = None
