"""A control channel server's receiving end for tests: what it received, with waits on events
instead of sleeps."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sparkdist._wire import protocol


class Inbox:
    """What a ``ChannelServer`` received (its ``on_message``/``on_disconnect``), and waits."""

    def __init__(self, wait_s: float = 10.0) -> None:
        self.wait_s = wait_s
        self.messages: list[protocol.Message] = []
        self.disconnected: list[int | None] = []
        self.cond = threading.Condition()
        self.on_hello: Callable[[object], None] | None = None

    def on_message(self, peer, message) -> None:
        if isinstance(message, protocol.Hello):
            peer.node = message.node
            if self.on_hello is not None:
                self.on_hello(peer)
        with self.cond:
            self.messages.append(message)
            self.cond.notify_all()

    def on_disconnect(self, peer) -> None:
        with self.cond:
            self.disconnected.append(peer.node)
            self.cond.notify_all()

    def wait_for(self, predicate, timeout: float | None = None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout or self.wait_s)
