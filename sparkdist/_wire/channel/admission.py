"""Admission to the driver's control channel: the listening socket, and each connection from
its accept until it finishes the mutual handshake (``frames``) or is cut.

What strangers can cost is bounded, and no number of them keeps an agent out:

- A connection must finish the handshake within ``HANDSHAKE_DEADLINE_S`` of its accept,
  whatever it sends (a byte every few seconds included).
- At most ``MAX_PENDING`` connections wait in the handshake. At the cap the accept sheds one
  and goes on; it never waits for room. A listen backlog left to fill makes the kernel drop
  new SYNs: a newcomer then waits out TCP's SYN retries (1 s, 3 s, 7 s...), and, once in,
  queues behind thousands. Drained at once, the backlog (``LISTEN_BACKLOG``) holds a flood
  of a few thousand without dropping anyone's SYN.
- What goes: the oldest connection that has not sent a whole hello yet (a drip), else the
  oldest of all. An agent sends its hello as it connects and answers the challenge within a
  round trip, so age is the best evidence of a stranger; and every connection is read as it
  is accepted, so an agent arriving amid a flood is challenged before anything can shed it.
  (OpenSSH's ``MaxStartups`` drops at random instead: its clients are people typing
  passwords, slow; ours are programs, fast.)
- Out of file descriptors (EMFILE), the accept sheds the same way to free one, or, when
  nothing is waiting, backs off for ``ACCEPT_BACKOFF_S``; it never stops.

Nothing received is unpickled: the handshake's messages go through ``protocol.decode``.

Non-goals: authenticated connections (``channel`` takes them over as ``peer.Peer``), the
handshake's cryptography (``frames``).
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

from sparkdist._wire import frames, protocol
from sparkdist._wire.protocol import MAX_HANDSHAKE_BYTES, ProtocolError, Route

logger = logging.getLogger("sparkdist")

#: A connection that has not finished the handshake this long after its accept is dropped.
HANDSHAKE_DEADLINE_S = 2.0
#: Most connections in the handshake at once.
MAX_PENDING = 256
#: Connections the kernel holds for the accept (it caps this at ``net.core.somaxconn``).
LISTEN_BACKLOG = 4096
#: How long the accept pauses when it fails with nothing to shed (out of descriptors).
ACCEPT_BACKOFF_S = 0.05
#: Connections accepted per turn of the I/O loop (the agents' reads go in between).
ACCEPT_BATCH = 64
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

#: ``admit(sock, sealer)``: a connection that proved itself, for the channel to take over.
Admit = Callable[[socket.socket, frames.Sealer], None]


class Pending:
    """A connection in the handshake (the selector's tag for its socket)."""

    __slots__ = ("sock", "accepted", "buffer", "handshake")

    def __init__(self, sock: socket.socket, accepted: float, key: bytes) -> None:
        self.sock = sock
        self.accepted = accepted
        self.buffer = bytearray()
        self.handshake = frames.ServerHandshake(key)


def listen(host: str) -> socket.socket:
    """A non-blocking socket listening on ``host``, on a port the OS chose."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


class Admission:
    """The listener and the connections in the handshake; the server's I/O thread only.

    Args:
        listener: from ``listen``; registered here, tagged with this object.
        selector: the I/O thread's selector (connections in the handshake are tagged with
            their ``Pending``).
        key: the run's key (``frames.secret_key``).
        admit: takes each connection that proved itself (its socket is still registered,
            tagged with its ``Pending``: re-tag it).
        stats: the server's counters, added to here.
    """

    def __init__(
        self,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        key: bytes,
        admit: Admit,
        stats: collections.Counter[str],
    ) -> None:
        self._listener = listener
        self._selector = selector
        self._key = key
        self._admit = admit
        self.stats = stats
        # Both in accept order: every connection in the handshake, and those among them
        # without a whole hello yet (the first to go).
        self._pending: collections.OrderedDict[socket.socket, Pending] = collections.OrderedDict()
        self._unheard: collections.OrderedDict[socket.socket, Pending] = collections.OrderedDict()
        self._listening = False
        self._accept_again_at = 0.0
        self._warned: set[str] = set()
        self._listen(True)

    def next_due(self) -> float | None:
        """The next monotonic time ``on_timers`` has work (None: nothing waits on a clock)."""
        times = []
        if self._pending:
            times.append(next(iter(self._pending.values())).accepted + HANDSHAKE_DEADLINE_S)
        if not self._listening:
            times.append(self._accept_again_at)
        return min(times, default=None)

    def on_timers(self, now: float) -> None:
        """Cut the connections past the deadline; listen again after a back-off."""
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if now - oldest.accepted < HANDSHAKE_DEADLINE_S:
                break
            self.stats["handshake_timeouts"] += 1
            self._note_stranger("did not finish the handshake in time")
            self._drop(oldest)
        if not self._listening and now >= self._accept_again_at:
            self._listen(True)

    def close(self) -> None:
        for pending in list(self._pending.values()):
            close_quietly(None, pending.sock)
        self._pending.clear()
        self._unheard.clear()
        close_quietly(None, self._listener)

    # -- accepting ---------------------------------------------------------------------------

    def _listen(self, on: bool) -> None:
        if on and not self._listening:
            self._selector.register(self._listener, selectors.EVENT_READ, self)
        elif not on and self._listening:
            self._selector.unregister(self._listener)
        self._listening = on

    def _pause_accept(self, seconds: float) -> None:
        self._listen(False)
        self._accept_again_at = time.monotonic() + seconds

    def _shed(self) -> bool:
        """Cut one connection in the handshake to make room (see the module docstring);
        False when none is waiting."""
        queue = self._unheard or self._pending
        if not queue:
            return False
        self.stats["shed"] += 1
        self._drop(next(iter(queue.values())))
        return True

    def accept_some(self) -> None:
        """Accept what the backlog holds, up to ``ACCEPT_BATCH``: the listener is readable."""
        for _ in range(ACCEPT_BATCH):
            if len(self._pending) >= MAX_PENDING:
                self._shed()
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self.stats["accept_backoffs"] += 1
                    self._warn_once(
                        "fds",
                        "sparkdist: the control channel ran out of file descriptors (%s); it "
                        "drops the oldest unauthenticated connections and backs off. Raise the "
                        "limit (ulimit -n) if this is not an attack",
                        exc,
                    )
                    if self._shed():
                        continue
                    self._pause_accept(ACCEPT_BACKOFF_S)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # the client gave up before we got to it
                logger.warning("sparkdist: control channel accept failed: %s", exc)
                self._pause_accept(ACCEPT_BACKOFF_S)
                return
            self.stats["accepted"] += 1
            try:
                sock.setblocking(False)
                pending = Pending(sock, time.monotonic(), self._key)
                self._selector.register(sock, selectors.EVENT_READ, pending)
            except (OSError, ValueError):
                sock.close()
                continue
            self._pending[sock] = self._unheard[sock] = pending
            self.stats["peak_pending"] = max(self.stats["peak_pending"], len(self._pending))
            # An agent's hello comes with its connection: answer it before anything can
            # shed it (nothing there yet costs one recv).
            self.on_readable(pending)

    # -- the handshake -----------------------------------------------------------------------

    def on_readable(self, pending: Pending) -> None:
        """Read what ``pending`` sent and take the handshake as far as it goes."""
        try:
            data = pending.sock.recv(frames.HEADER.size + MAX_HANDSHAKE_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(pending)
            return
        if not data:
            self._drop(pending)
            return
        pending.buffer += data
        try:
            while (body := frames.split_frame(pending.buffer, MAX_HANDSHAKE_BYTES)) is not None:
                outcome = pending.handshake.step(protocol.decode(body, Route.HANDSHAKE))
                if isinstance(outcome, frames.Sealer):
                    if pending.buffer:  # nothing may come before the welcome
                        raise frames.HandshakeRefused("malformed", "sent too much too early")
                    del self._pending[pending.sock]
                    self._admit(pending.sock, outcome)
                    return
                if not _send_small(pending.sock, outcome):
                    self._drop(pending)
                    return
                self._unheard.pop(pending.sock, None)  # challenged: an agent answers next
        except frames.HandshakeRefused as exc:
            self.stats[exc.kind] += 1
            if exc.kind == "version":
                self._warn_once("version", "sparkdist: an agent %s", exc)
            else:
                self._note_stranger(str(exc))
            self._drop(pending)
        except (ProtocolError, frames.FrameError) as exc:
            self.stats["malformed"] += 1
            self._note_stranger(f"sent a malformed handshake ({exc})")
            self._drop(pending)

    def _drop(self, pending: Pending) -> None:
        self._pending.pop(pending.sock, None)
        self._unheard.pop(pending.sock, None)
        close_quietly(self._selector, pending.sock)

    def _note_stranger(self, what: str) -> None:
        self._warn_once(
            "stranger",
            "sparkdist: refused a control connection that %s; later ones are counted in "
            "ChannelServer.stats, not logged",
            what,
        )

    def _warn_once(self, key: str, text: str, *args: Any) -> None:
        if key in self._warned:
            logger.debug(text, *args)
        else:
            self._warned.add(key)
            logger.warning(text, *args)


def _send_small(sock: socket.socket, data: bytes) -> bool:
    # A fresh connection's send buffer takes a handshake frame whole; one that does not is
    # not worth waiting for.
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


def close_quietly(selector: selectors.BaseSelector | None, sock: socket.socket) -> None:
    """Unregister (when ``selector``) and close, whatever state ``sock`` is in."""
    if selector is not None:
        try:
            selector.unregister(sock)
        except (KeyError, ValueError):
            pass
    try:
        sock.close()
    except OSError:
        pass
