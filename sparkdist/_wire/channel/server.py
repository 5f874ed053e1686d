"""The driver's control channel: rendezvous data, rank output, progress and failures, over one
TCP port.

One I/O thread serves every connection with non-blocking sockets (``selectors``), and one
dispatch thread hands the messages to ``on_message``: the driver's thread count does not grow
with the number of nodes. Until a connection finishes the mutual handshake it belongs to
``admission`` (deadline, cap, shedding, accept back-off: what a stranger can cost is bounded
there); this module is the loop over the authenticated agents. Every frame from an agent is
tagged under the connection's key and checked, and every message is checked by
``protocol.decode``: nothing received is ever unpickled. A frame that fails ends that
connection (its node is then lost). Results never travel here; they come back through
Spark's collect (or, in local mode, the agent's return value).

Back-pressure: when the handlers fall behind (``dispatch``), the I/O thread stops reading from
agents (TCP then holds their frames, and their droppable output queues fill and drop, counted);
sends to an agent never block the sender, and an agent that stops reading is dropped once its
backlog passes ``peer.MAX_PEER_BACKLOG_BYTES``. ``close`` returns within ``CLOSE_TIMEOUT_S``.

Liveness (``liveness``): the I/O thread sends each agent a beat when nothing else went to it
for a beat's interval, and, given a silence limit, drops an agent it heard nothing from for
that long (``Peer.silent_for`` says so; its node is then lost): a cut-off host closes nothing.

Non-goals: what the messages mean (the supervisor and the agent decide), reliability beyond
TCP. The agent's side is ``client.ChannelClient``.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from sparkdist._wire import frames, protocol
from sparkdist._wire.channel.admission import Admission, Pending, close_quietly, listen
from sparkdist._wire.channel.client import ChannelClient, ChannelClosed
from sparkdist._wire.channel.dispatch import Dispatcher, Item
from sparkdist._wire.channel.liveness import BEAT_INTERVAL_S
from sparkdist._wire.channel.peer import Peer
from sparkdist._wire.frames import new_secret
from sparkdist._wire.protocol import MAX_HANDSHAKE_BYTES, ProtocolError, Route

__all__ = [
    "ChannelClient",
    "ChannelClosed",
    "ChannelServer",
    "MAX_FRAME_BYTES",
    "MAX_HANDSHAKE_BYTES",
    "Peer",
    "new_secret",
]

logger = logging.getLogger("sparkdist")

MAX_FRAME_BYTES = protocol.MAX_FRAME_BYTES
#: ``close`` returns within this, whatever the agents do.
CLOSE_TIMEOUT_S = 0.5
#: Bytes read from one connection per turn (fairness between agents).
READ_CHUNK = 256 << 10
#: How often the I/O thread looks for silent agents and beats due.
PEER_CHECK_INTERVAL_S = BEAT_INTERVAL_S / 4


class ChannelServer:
    """Accepts agents on one address and hands each authenticated message to ``on_message``.

    Args:
        host: the one address to bind (the driver's; loopback in local mode).
        secret: the run's secret (``new_secret``).
        on_message: called on the dispatch thread with (peer, message), in each agent's order.
        on_disconnect: called on the dispatch thread when an authenticated agent goes away
            (after its last message), not for the connections ``close`` ends.
        silence_limit_s: drop an agent silent this long, beats included (None: never).

    Example:
        >>> server = ChannelServer("127.0.0.1", new_secret(), lambda peer, m: print(m))
        >>> server.broadcast(protocol.Abort("stop"))
        >>> server.close()
    """

    def __init__(
        self,
        host: str,
        secret: str,
        on_message: Callable[[Peer, protocol.Message], None],
        on_disconnect: Callable[[Peer], None] = lambda peer: None,
        silence_limit_s: float | None = None,
    ) -> None:
        self._key = frames.secret_key(secret)
        self._silence_limit_s = silence_limit_s
        self._secret = secret
        self._listener = listen(host)
        try:
            self._wake_r, self._wake_w = socket.socketpair()
        except BaseException:
            self._listener.close()
            raise
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        #: Counters of what the I/O thread saw (for logs, tests and benchmarks).
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._peers: list[Peer] = []
        self._wanted: set[Peer] = set()  # peers with bytes to send, or broken: I/O thread's turn
        self._wake_sent = False
        self._resume_reads = False
        self._closing = False
        self._dispatcher = Dispatcher(on_message, on_disconnect, self._resume)
        self._io = threading.Thread(target=self._io_loop, name="sparkdist-channel-io", daemon=True)
        self._io.start()
        self._dispatcher.start()

    # -- public ----------------------------------------------------------------------------

    @property
    def peers(self) -> list[Peer]:
        with self._lock:
            return list(self._peers)

    def broadcast(self, message: protocol.Message) -> None:
        """Send to every connected agent; never blocks; a peer that went away is skipped."""
        encoded = protocol.encode(message, Route.TO_AGENT)
        for peer in self.peers:
            try:
                peer.send_encoded(encoded)
            except ChannelClosed:
                continue

    def close(self) -> None:
        """Stop accepting and drop every connection; returns within ``CLOSE_TIMEOUT_S``.

        Messages not yet handed to ``on_message`` are dropped; ``on_disconnect`` is not called
        for the connections closed here.
        """
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        self._closing = True
        self._dispatcher.close()
        self._wake()
        for thread in (self._io, self._dispatcher.thread):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # -- called by senders -------------------------------------------------------------------

    def _resume(self) -> None:
        """The handlers caught up: read again from the agents paused for them."""
        with self._lock:
            self._resume_reads = True
        self._wake()

    def _want(self, peer: Peer) -> None:
        with self._lock:
            self._wanted.add(peer)
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._wake_sent:
                return
            self._wake_sent = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already closed, or a wake is in the pipe anyway

    # -- the I/O thread ----------------------------------------------------------------------

    def _io_loop(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._round: list[Item] = []
        self._next_peer_check = 0.0
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._admission = Admission(
            self._listener, self._selector, self._key, self._promote, self.stats
        )
        try:
            while not self._closing:
                events = self._selector.select(self._next_timeout())
                # The listener last: what came for the connections in the handshake is read
                # before an accept may shed one of them.
                events.sort(key=lambda event: event[0].data is self._admission)
                for key, mask in events:
                    try:
                        self._on_event(key.fileobj, key.data, mask)  # type: ignore[arg-type]
                    except Exception:  # one connection's trouble never ends the loop
                        logger.exception("sparkdist: control channel I/O failed")
                        if isinstance(key.data, Peer):
                            self._drop_peer(key.data, "an internal error")
                self._on_timers()
                self._hand_over()
        except Exception:
            logger.exception("sparkdist: the control channel's I/O thread failed")
        finally:
            self._shut_down()

    def _on_event(self, fileobj: socket.socket, data: Any, mask: int) -> None:
        if data is None:
            self._on_wake()
        elif data is self._admission:
            self._admission.accept_some()
        elif isinstance(data, Pending):
            self._admission.on_readable(data)
        elif isinstance(data, Peer):
            if mask & selectors.EVENT_WRITE:
                self._flush(data)
            if mask & selectors.EVENT_READ and not data.closed:
                self._on_peer_readable(data)

    def _next_timeout(self) -> float:
        now = time.monotonic()
        times = [now + 1.0, self._next_peer_check]
        if (admission_due := self._admission.next_due()) is not None:
            times.append(admission_due)
        return max(0.0, min(times) - now)

    def _on_timers(self) -> None:
        now = time.monotonic()
        self._admission.on_timers(now)
        if now >= self._next_peer_check:
            # A scan of every peer, a few times a beat: never per frame (thousands of agents).
            self._next_peer_check = now + PEER_CHECK_INTERVAL_S
            self._check_peers(now)

    def _check_peers(self, now: float) -> None:
        """Drop the agents silent past the limit; beat to those we sent nothing lately."""
        for peer in self.peers:
            if peer.closed or peer.broken:
                continue
            silent = None if peer.paused else peer.live.silent_for(now)
            if silent is not None:
                self.stats["silent_peers"] += 1
                peer.silent_for = silent
                self._drop_peer(peer, f"it sent nothing for {silent:.1f} s")
            elif peer.live.beat_due(now):
                try:
                    peer.send(protocol.Alive())
                except ChannelClosed:
                    continue

    def _on_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            self._wake_sent = False
            wanted, self._wanted = self._wanted, set()
            resume, self._resume_reads = self._resume_reads, False
        for peer in wanted:
            if peer.broken:
                self._drop_peer(peer, peer.broken)
            elif not peer.closed:
                self._flush(peer)
        if resume:
            now = time.monotonic()
            for peer in self.peers:
                if peer.paused:
                    peer.live.excuse(now)  # we stopped reading it: not its silence
                    peer.paused = False
                    self._set_interest(peer)

    # -- authenticated peers -----------------------------------------------------------------

    def _promote(self, sock: socket.socket, sealer: frames.Sealer) -> None:
        """An agent proved itself (``admission``): it is a peer from now on."""
        peer = Peer(self._want, sock, sealer, self._silence_limit_s)
        peer.events = selectors.EVENT_READ
        self._selector.modify(sock, selectors.EVENT_READ, peer)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        with self._lock:
            closing = self._closing
            if not closing:
                self._peers.append(peer)
        if closing:
            self._drop_peer(peer, None)
            return
        self.stats["authenticated"] += 1
        try:
            peer.send(protocol.Welcome())
        except ChannelClosed:
            self._drop_peer(peer, "it went away during the handshake")

    def _on_peer_readable(self, peer: Peer) -> None:
        try:
            data = peer.sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop_peer(peer, f"its connection failed ({exc})")
            return
        if not data:
            self._drop_peer(peer, None)
            return
        peer.live.heard(time.monotonic(), time.time())
        peer.inbox += data
        batches: list[protocol.Message] = []
        try:
            while True:
                body = frames.split_frame(peer.inbox, frames.MAX_SEALED_BYTES)
                if body is None:
                    break
                batches.extend(
                    m
                    for m in protocol.decode_batch(peer.open_frame(body), Route.TO_DRIVER)
                    if not isinstance(m, protocol.Alive)  # liveness only: heard above
                )
        except (ProtocolError, frames.FrameError) as exc:
            self.stats["bad_frames"] += 1
            self._enqueue(peer, batches)  # what came before the bad frame was genuine
            self._drop_peer(peer, f"it sent a frame the channel refuses: {exc}")
            return
        if batches:
            self._enqueue(peer, batches)

    def _enqueue(self, peer: Peer, messages: list[protocol.Message] | None) -> None:
        """Keep for the handlers (None: ``on_disconnect``); handed over once per turn."""
        self._round.append((peer, messages))

    def _hand_over(self) -> None:
        """Give this turn's messages to the dispatch thread, with one wake-up for them all;
        when the handlers are behind, stop reading from the agents that sent them."""
        if not self._round:
            return
        items, self._round = self._round, []
        if self._dispatcher.put(items):  # leave the rest in TCP for now
            for peer, _ in items:
                if not peer.closed and not peer.paused:
                    peer.paused = True
                    self._set_interest(peer)

    def _flush(self, peer: Peer) -> None:
        try:
            self._set_interest(peer, peer.flush())
        except OSError as exc:
            self._drop_peer(peer, f"sending to it failed ({exc})")

    def _set_interest(self, peer: Peer, writing: bool | None = None) -> None:
        if peer.closed:
            return
        if writing is None:
            writing = bool(peer.events & selectors.EVENT_WRITE)
        events = (0 if peer.paused else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if writing else 0
        )
        if events == peer.events:
            return
        if peer.events and events:
            self._selector.modify(peer.sock, events, peer)
        elif events:
            self._selector.register(peer.sock, events, peer)
        else:
            self._selector.unregister(peer.sock)
        peer.events = events

    def _drop_peer(self, peer: Peer, why: str | None) -> None:
        if peer.closed:
            return
        peer.mark_closed()
        with self._lock:
            known = peer in self._peers
            if known:
                self._peers.remove(peer)
        if peer.events:
            try:
                self._selector.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
        close_quietly(None, peer.sock)
        if why is not None:
            logger.warning("sparkdist: dropped node %s's control connection: %s", peer.node, why)
        if known:
            self._enqueue(peer, None)  # on_disconnect, after its last messages

    def _shut_down(self) -> None:
        with self._lock:
            peers, self._peers = self._peers, []
        for peer in peers:
            peer.mark_closed()
            close_quietly(None, peer.sock)
        self._admission.close()
        for sock in (self._wake_r, self._wake_w):
            close_quietly(None, sock)
        self._selector.close()
