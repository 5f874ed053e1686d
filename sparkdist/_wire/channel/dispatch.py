"""The driver's dispatch thread: hands each agent's messages to the channel's handlers, in that
agent's order, off the I/O thread, with a bounded backlog.

The I/O thread ``put``s what one turn read; when the handlers fall ``DISPATCH_HIGH_WATER``
messages behind, ``put`` says so and the I/O thread stops reading from the agents that sent
them (TCP then holds their frames). Once the dispatch thread takes a backlog of at least
``DISPATCH_LOW_WATER``, it calls ``on_caught_up`` so the I/O thread reads again.

Non-goals: reading and writing sockets (``channel``), what the messages mean (the handlers).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from sparkdist._wire import protocol
from sparkdist._wire.channel.client import ChannelClosed
from sparkdist._wire.channel.peer import Peer

logger = logging.getLogger("sparkdist")

#: Messages waiting for the handlers before the I/O thread stops reading from agents.
DISPATCH_HIGH_WATER = 20_000
DISPATCH_LOW_WATER = 5_000

#: One agent's messages of one turn, or None: it went away (``on_disconnect``).
Item = tuple[Peer, list[protocol.Message] | None]


class Dispatcher:
    """The dispatch thread and its queue (see the module docstring).

    Args:
        on_message: called with (peer, message), in each agent's order.
        on_disconnect: called with a peer after its last message, once it went away.
        on_caught_up: called (from the dispatch thread) when a large backlog was taken.
    """

    def __init__(
        self,
        on_message: Callable[[Peer, protocol.Message], None],
        on_disconnect: Callable[[Peer], None],
        on_caught_up: Callable[[], None],
    ) -> None:
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self._on_caught_up = on_caught_up
        self.closing = False
        self._items: collections.deque[Item] = collections.deque()
        self._queued = 0  # messages in _items
        self._cond = threading.Condition()
        self.thread = threading.Thread(
            target=self._loop, name="sparkdist-channel-dispatch", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def put(self, items: list[Item]) -> bool:
        """Queue ``items`` for the handlers, with one wake-up for them all.

        Returns:
            True when the handlers are behind: the caller should stop reading from these
            agents until ``on_caught_up``.
        """
        with self._cond:
            if self.closing:
                return False
            self._items.extend(items)
            self._queued += sum(len(messages) for _, messages in items if messages)
            self._cond.notify()
            return self._queued >= DISPATCH_HIGH_WATER

    def close(self) -> None:
        """Drop what is queued and end the thread (after the handler running now, if any)."""
        with self._cond:
            self.closing = True
            self._items.clear()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self.closing:
                    self._cond.wait()
                if self.closing:
                    return
                items, self._items = self._items, collections.deque()
                behind = self._queued >= DISPATCH_LOW_WATER
                self._queued = 0
            if behind:  # the I/O thread may read again from the agents it paused
                self._on_caught_up()
            for peer, messages in items:
                try:
                    if messages is None:
                        self._on_disconnect(peer)
                        continue
                    for message in messages:
                        if self.closing:
                            return
                        self._on_message(peer, message)
                except ChannelClosed:
                    pass  # the handler answered a peer that is gone
                except Exception:  # a handler bug must not end the channel silently
                    logger.exception("sparkdist: control channel handler failed")
