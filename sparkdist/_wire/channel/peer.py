"""The driver's end of one authenticated agent connection: what it knows of the agent, and
its outgoing bytes.

A send never blocks: it goes straight to the socket when nothing waits before it, else the
bytes wait here for the server's I/O thread (``channel``). An agent that reads nothing of the
last ``MAX_PEER_BACKLOG_BYTES`` sent to it counts as gone.

Non-goals: reading (the server's I/O thread reads every connection), the handshake
(``frames``, ``channel``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from sparkdist._wire import frames, protocol
from sparkdist._wire.channel.client import ChannelClosed
from sparkdist._wire.channel.liveness import Liveness
from sparkdist._wire.protocol import Route

#: Bytes waiting to be sent to one agent before it counts as gone (it stopped reading).
MAX_PEER_BACKLOG_BYTES = 8 << 20


class Peer:
    """The driver's end of one authenticated agent connection.

    Attributes:
        node: the node (barrier task) the agent said it runs, once it said so.
        address: the agent's (host, port).
        live: when it was last heard from and last sent to (``liveness``).
        silent_for: set when its silence ended the connection: how long it had lasted.
    """

    node: int | None = None

    def __init__(
        self,
        want: Callable[[Peer], None],
        sock: socket.socket,
        sealer: frames.Sealer,
        silence_limit_s: float | None = None,
    ) -> None:
        self._want = want  # the server's I/O thread takes over what a sender cannot finish
        self.sock = sock
        self.address: Any = _peer_name(sock)
        self._sealer = sealer
        self._lock = threading.Lock()
        self._out = bytearray()
        self.closed = False
        self.broken: str | None = None  # why a sender gave up on it; the I/O thread drops it
        self.paused = False
        self.events = 0
        self.inbox = bytearray()
        self.live = Liveness.starting(silence_limit_s, time.monotonic(), time.time())
        self.silent_for: float | None = None

    def send(self, message: protocol.Message) -> None:
        """Queue ``message`` for this agent; never blocks.

        Raises:
            ChannelClosed: the connection is gone, or the agent stopped reading.
            ProtocolError: ``message`` is not one the driver may send.
        """
        self.send_encoded(protocol.encode(message, Route.TO_AGENT))

    def send_encoded(self, encoded: bytes) -> None:
        with self._lock:
            if self.closed or self.broken:
                raise ChannelClosed(f"the connection to node {self.node} is closed")
            frame = self._sealer.seal(protocol.encode_batch([encoded]))
            self.live.sent(time.monotonic())
            if len(self._out) + len(frame) > MAX_PEER_BACKLOG_BYTES:
                self.broken = (
                    f"node {self.node} read nothing of the last {len(self._out)} bytes sent to it"
                )
                self._want(self)
                raise ChannelClosed(self.broken)
            if not self._out:  # send now when nothing waits: no trip through the I/O thread
                try:
                    sent = self.sock.send(frame)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    self.broken = f"sending to node {self.node} failed: {exc}"
                    self._want(self)
                    raise ChannelClosed(self.broken) from exc
                frame = frame[sent:]
            if frame:
                self._out += frame
                self._want(self)

    def flush(self) -> bool:
        """Send what the socket takes (I/O thread); True while bytes remain."""
        with self._lock:
            if self._out and not self.closed:
                try:
                    sent = self.sock.send(self._out)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                del self._out[:sent]
            return bool(self._out)

    def mark_closed(self) -> None:
        with self._lock:
            self.closed = True
            self._out.clear()

    def open_frame(self, body: bytes) -> bytes:
        return self._sealer.open(body)

    def __repr__(self) -> str:
        return f"Peer(node={self.node}, address={self.address})"


def _peer_name(sock: socket.socket) -> Any:
    try:
        return sock.getpeername()
    except OSError:
        return None
