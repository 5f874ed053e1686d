"""An agent's end of the control channel: one connection to the driver, one I/O thread.

The constructor connects and runs the handshake (``frames``) within ``timeout_s`` in all,
retrying while the driver drops the connection before answering (it evicts the oldest
strangers when flooded); a driver that fails to prove it knows the secret is refused at once.
Then one thread owns the socket: it hands the driver's messages to ``on_message`` and sends
what the agent queued, control messages first, many messages per frame.

Liveness (``liveness``): the I/O thread sends a beat when it sent nothing for a beat's
interval, and, given a silence limit, ends the connection once the driver was silent that
long (``on_close`` then gets the seconds of silence): a driver host cut off sends no FIN.

Three queues, all bounded, sent in this order: ``send`` (control: never dropped; it waits
for room, up to ``SEND_TIMEOUT_S``, if the driver stopped reading), then ``post``'s two lanes,
which never wait: samples and progress reports (``METRIC_KINDS``: few, and what the driver's
panels are drawn from; when full, the oldest go), then output lines (dropped, and counted,
when full: a rank can print faster than any driver reads, and that must never push the
metrics out). Nothing here blocks on the network.

Non-goals: what to send (the agent's outbox decides), the driver's side (``channel``).
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from sparkdist._wire import frames, protocol
from sparkdist._wire.channel.liveness import Liveness
from sparkdist._wire.protocol import MAX_HANDSHAKE_BYTES, ProtocolError, Route

logger = logging.getLogger("sparkdist")

#: Connect and handshake, retries included.
CONNECT_TIMEOUT_S = 10.0
HANDSHAKE_TIMEOUT_S = CONNECT_TIMEOUT_S
#: How long ``send`` waits for room in a full control queue before giving the driver up.
SEND_TIMEOUT_S = 30.0
#: TCP keepalive on the agent's connection, for the connections that set no silence limit:
#: idle seconds before the first probe, seconds between probes, unanswered probes before the
#: connection counts as dead.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
#: How long ``close`` keeps sending what is queued.
CLOSE_FLUSH_S = 2.0
#: Control messages queued at most (they are few: hello, store, ready, failed, rows, bye).
CONTROL_QUEUE = 4096
#: Output lines queued at most, and their bytes.
POST_QUEUE = 10_000
POST_QUEUE_BYTES = 4 << 20
#: What ``post`` queues in a lane of its own, ahead of the lines.
METRIC_KINDS = (protocol.Sample, protocol.Report)
#: Samples and reports queued at most, and their bytes (more than a message's limit, so the
#: newest always fits).
METRIC_QUEUE = 512
METRIC_QUEUE_BYTES = 2 << 20
#: A frame is filled up to this many bytes of messages (one larger message goes alone).
BATCH_BYTES = 256 << 10
#: Droppable messages wait up to this long for company, so that a busy agent sends a few
#: frames of many lines rather than a frame (and a wake-up on both ends) per line. Control
#: messages never wait, and take the waiting lines with them.
LINGER_S = 0.02


class ChannelClosed(ConnectionError):
    """The peer went away, or sent something that broke the protocol."""


class _Retry(Exception):
    """The driver dropped the connection before the handshake was over: try again."""


class ChannelClient:
    """An agent's connection to the driver.

    Args:
        address: (host, port) of the driver's channel.
        secret: the run's secret.
        on_message: called on the I/O thread with every message from the driver.
        on_close: called once, on the I/O thread, when the connection ends, with how long
            the driver had been silent when that ended it (None: it closed, or we did).
        timeout_s: deadline for the connection and the handshake, retries included.
        silence_limit_s: end the connection once the driver sent nothing, not even a beat,
            for this long (None: only TCP notices a vanished driver).

    Raises:
        OSError: the driver's address cannot be reached.
        ChannelClosed: no handshake within ``timeout_s``, or the other end did not prove it
            knows the secret.
    """

    def __init__(
        self,
        address: tuple[str, int],
        secret: str,
        on_message: Callable[[protocol.Message], None],
        on_close: Callable[[float | None], None] = lambda silent_for: None,
        timeout_s: float = CONNECT_TIMEOUT_S,
        silence_limit_s: float | None = None,
    ) -> None:
        self.address = address
        self._on_message = on_message
        self._on_close = on_close
        self._sock, self._sealer, self._inbox = _connect(
            address, frames.secret_key(secret), time.monotonic() + timeout_s
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._cond = threading.Condition()
        self._control: collections.deque[bytes] = collections.deque()
        self._posted: collections.deque[bytes] = collections.deque()
        self._posted_bytes = 0
        self._metrics: collections.deque[tuple[bytes, bool]] = collections.deque()  # is a sample
        self._metric_bytes = 0
        self._out = bytearray()
        self._idle = False  # the I/O thread waits with nothing to send: wake it on new work
        self._wake_pending = False
        self._posted_since = 0.0  # when the droppable lanes last became non-empty
        self._closing_at: float | None = None  # set by close: send what is queued until then
        self._live = Liveness.starting(silence_limit_s, time.monotonic(), time.time())
        #: Set when the driver's silence ended the connection: how long it had lasted.
        self.silent_for: float | None = None
        self.closed = False
        #: Droppable messages dropped because their lane was full or the connection gone.
        self.dropped = 0
        self._thread = threading.Thread(
            target=self._run, name="sparkdist-channel-client", daemon=True
        )
        self._thread.start()

    # -- called by the agent -------------------------------------------------------------------

    def send(self, message: protocol.Message, after_posted: bool = False) -> None:
        """Queue a control message (never dropped while the connection lives).

        Control messages go ahead of the droppable ones already queued, unless
        ``after_posted``: then it goes behind them (a goodbye that says the output is complete
        must never overtake the output).

        Raises:
            ProtocolError: ``message`` is not one an agent may send (the error says why).
            ChannelClosed: the connection is gone, or the driver read nothing for
                ``SEND_TIMEOUT_S`` while the queue was full.
        """
        data = protocol.encode(message, Route.TO_DRIVER)
        deadline = time.monotonic() + SEND_TIMEOUT_S
        with self._cond:
            while len(self._control) >= CONTROL_QUEUE and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelClosed(
                        f"the driver at {self.address} took none of {CONTROL_QUEUE} queued "
                        f"control messages for {SEND_TIMEOUT_S} s"
                    )
                self._cond.wait(left)
            if self.closed or self._closing_at is not None:
                raise ChannelClosed(f"the channel to the driver at {self.address} is closed")
            if after_posted and self._droppable():
                # Behind the lines (which go after the metrics), never dropped: the lanes'
                # limits do not apply.
                self._posted.append(data)
                self._posted_bytes += len(data)
                self._posted_since = 0.0  # due now: nothing lingers behind a last message
            else:
                self._control.append(data)
            self._kick(urgent=True)

    def post(self, message: protocol.Message) -> bool:
        """Queue a droppable message: an output line, or (in their own lane, ``METRIC_KINDS``)
        a sample or a report. False when it was dropped (lines: their lane full; any: the
        connection gone), counted in ``dropped``, as are the metrics it pushed out. Never waits.

        Raises:
            ProtocolError: ``message`` is not one an agent may send.
        """
        data = protocol.encode(message, Route.TO_DRIVER)
        metric = isinstance(message, METRIC_KINDS)
        with self._cond:
            full = not metric and (  # the metrics' lane makes room for the newest instead
                len(self._posted) >= POST_QUEUE or self._posted_bytes + len(data) > POST_QUEUE_BYTES
            )
            if self.closed or self._closing_at is not None or full:
                self.dropped += 1
                return False
            if not self._droppable():
                self._posted_since = time.monotonic()
            if metric:
                self._queue_metric(data, isinstance(message, protocol.Sample))
            else:
                self._posted.append(data)
                self._posted_bytes += len(data)
            self._kick()
            return True

    def _queue_metric(self, data: bytes, sample: bool) -> None:
        """Queue a sample or report, pushing out the oldest report, else the oldest sample,
        until it fits (caller holds the lock). The newest wins: both say how things are now,
        and the oldest says least of that. Samples outlast reports: one comes per interval
        (a missing one is a hole in the node's system panel), reports come per step (the
        next one says what a lost one did)."""
        metrics = self._metrics
        while metrics and (
            len(metrics) >= METRIC_QUEUE or self._metric_bytes + len(data) > METRIC_QUEUE_BYTES
        ):
            victim = next((i for i, (_, is_sample) in enumerate(metrics) if not is_sample), 0)
            self._metric_bytes -= len(metrics[victim][0])
            del metrics[victim]
            self.dropped += 1
        metrics.append((data, sample))
        self._metric_bytes += len(data)

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued was handed to the network; False on timeout or when
        the connection ended first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._control or self._droppable() or self._out:
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    return False
                self._cond.wait(left)
            return not self.closed

    def close(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Send what is queued (for up to ``flush_s``), then end the connection."""
        with self._cond:
            if self._closing_at is None:
                self._closing_at = time.monotonic() + flush_s
            self._kick(urgent=True)
        if self._thread is not threading.current_thread():
            self._thread.join(flush_s + 1.0)

    def join(self, timeout_s: float) -> None:
        """Wait for the I/O thread to finish (after close)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    def _kick(self, urgent: bool = False) -> None:
        """Wake the I/O thread when it sleeps with nothing to send, or, ``urgent``, when it
        lingers too (caller holds the lock)."""
        if (self._idle or urgent) and not self._wake_pending:
            self._idle = False
            self._wake_pending = True
            try:
                self._wake_w.send(b"\0")
            except OSError:
                pass

    def _droppable(self) -> bool:
        """Whether lines, samples or reports wait (caller holds the lock)."""
        return bool(self._posted or self._metrics)

    def _due(self, now: float) -> bool:
        """Whether queued messages should go now rather than linger (caller holds the lock)."""
        return bool(
            self._control
            or self._closing_at is not None
            or (
                self._droppable()
                and (
                    now - self._posted_since >= LINGER_S
                    or self._posted_bytes + self._metric_bytes >= BATCH_BYTES
                )
            )
        )

    # -- the I/O thread ------------------------------------------------------------------------

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        selector.register(self._sock, selectors.EVENT_READ, self._sock)
        writing = False
        try:
            if self._inbox:  # frames that came right behind the welcome
                self._read(b"")
            while True:
                if self._check_liveness():
                    return
                self._fill()
                if self._out:
                    self._write()
                with self._cond:
                    now = time.monotonic()
                    if self._closing_at is not None and (
                        not (self._control or self._droppable() or self._out)
                        or now >= self._closing_at
                    ):
                        return
                    want_write = bool(self._out)
                    if self._due(now) and not want_write:
                        continue  # the socket took it all: fill the next frame now
                    self._idle = not (want_write or self._control or self._droppable())
                    timeout = None
                    if self._droppable() and not want_write:  # linger until the oldest is due
                        timeout = max(0.0, self._posted_since + LINGER_S - now)
                    if self._closing_at is not None:
                        timeout = min(timeout or LINGER_S, max(0.0, self._closing_at - now))
                    due = self._live.next_due(now) - now  # a beat, or the silence limit
                    timeout = due if timeout is None else min(timeout, due)
                if want_write != writing:
                    writing = want_write
                    events = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
                    selector.modify(self._sock, events, self._sock)
                for key, mask in selector.select(timeout):
                    if key.data is None:
                        # Drain first, then clear: a kick in between must not lose its byte
                        # (cleared first, the drain would eat it and leave the flag set, and
                        # every later kick, a goodbye's included, would be skipped). A kick
                        # before the clear is seen anyway: the loop reads the queues next.
                        _drain(self._wake_r)
                        with self._cond:
                            self._wake_pending = False
                    elif mask & selectors.EVENT_READ:
                        try:
                            data = self._sock.recv(1 << 18)
                        except (BlockingIOError, InterruptedError):
                            continue
                        if not data:
                            return  # the driver closed the channel
                        self._live.heard(time.monotonic(), time.time())
                        self._read(data)
        except (OSError, ChannelClosed):
            pass
        except (ProtocolError, frames.FrameError) as exc:
            logger.warning(
                "sparkdist: the driver's control channel at %s sent a frame this agent refuses "
                "(%s); closing it",
                self.address,
                exc,
            )
        finally:
            selector.close()
            self._finish()

    def _read(self, data: bytes) -> None:
        self._inbox += data
        while True:
            body = frames.split_frame(self._inbox, frames.MAX_SEALED_BYTES)
            if body is None:
                return
            for message in protocol.decode_batch(self._sealer.open(body), Route.TO_AGENT):
                if isinstance(message, (protocol.Welcome, protocol.Alive)):
                    continue
                try:
                    self._on_message(message)
                except Exception:  # the agent's bug must not cut it off from the driver
                    logger.exception("sparkdist: control channel handler failed")

    def _fill(self) -> None:
        """Move queued messages into the next frame(s), control first, while the socket keeps
        up (at most one frame waits in ``_out``)."""
        if len(self._out) >= BATCH_BYTES:
            return
        batch: list[bytes] = []
        size = 0
        with self._cond:
            if not self._due(time.monotonic()):
                return
            while self._control and (not batch or size + len(self._control[0]) + 1 <= BATCH_BYTES):
                batch.append(data := self._control.popleft())
                size += len(data) + 1
            # Metrics before lines: every frame takes what waits in the small lane first.
            while self._metrics and (
                not batch or size + len(self._metrics[0][0]) + 1 <= BATCH_BYTES
            ):
                data, _ = self._metrics.popleft()
                self._metric_bytes -= len(data)
                batch.append(data)
                size += len(data) + 1
            while self._posted and (not batch or size + len(self._posted[0]) + 1 <= BATCH_BYTES):
                batch.append(data := self._posted.popleft())
                self._posted_bytes -= len(data)
                size += len(data) + 1
            if batch:
                # Under the lock: ``flush`` must never see the batch in neither place.
                self._out += self._sealer.seal(protocol.encode_batch(batch))
                self._cond.notify_all()  # room for a waiting ``send``

    def _check_liveness(self) -> bool:
        """Queue a beat when one is due; True when the driver's silence ends the connection."""
        now = time.monotonic()
        silent = self._live.silent_for(now)
        if silent is not None:
            self.silent_for = silent
            logger.warning(
                "sparkdist: the driver's control channel at %s sent nothing for %.1f s: "
                "counting the driver as gone",
                self.address,
                silent,
            )
            return True
        if self._live.beat_due(now):
            with self._cond:
                if not (self._control or self._droppable() or self._out):
                    self._control.append(protocol.encode(protocol.Alive(), Route.TO_DRIVER))
            self._live.sent(now)  # queued now: sent on this turn
        return False

    def _write(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        self._live.sent(time.monotonic())
        with self._cond:
            del self._out[:sent]
            if not self._out:
                self._cond.notify_all()  # for ``flush``

    def _finish(self) -> None:
        with self._cond:
            self.closed = True
            self.dropped += len(self._posted) + len(self._metrics)
            self._posted.clear()
            self._metrics.clear()
            self._control.clear()
            self._out.clear()
            self._cond.notify_all()
        for sock in (self._sock, self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        try:
            self._on_close(self.silent_for)
        except Exception:
            logger.exception("sparkdist: control channel close handler failed")


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass


# -- connecting ----------------------------------------------------------------------------------


def _connect(
    address: tuple[str, int], key: bytes, deadline: float
) -> tuple[socket.socket, frames.Sealer, bytearray]:
    """Connect and shake hands, retrying while the driver drops us mid-way, until
    ``deadline``."""
    delay = 0.02
    while True:
        try:
            return _handshake(address, key, deadline)
        except _Retry as exc:
            if time.monotonic() + delay >= deadline:
                raise ChannelClosed(
                    f"no handshake with the driver's control channel at {address} in time: "
                    f"{exc} (is the driver overloaded, or running another sparkdist version?)"
                ) from None
            time.sleep(delay)
            delay = min(2 * delay, 0.5)


def _handshake(
    address: tuple[str, int], key: bytes, deadline: float
) -> tuple[socket.socket, frames.Sealer, bytearray]:
    sock = socket.create_connection(address, timeout=max(0.001, deadline - time.monotonic()))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keep_alive(sock)
        buffer = bytearray()
        handshake = frames.ClientHandshake(key)
        _send_before(sock, handshake.hello(), deadline)
        body = _read_frame(sock, buffer, MAX_HANDSHAKE_BYTES, deadline)
        try:
            mine, sealer = handshake.step(protocol.decode(body, Route.HANDSHAKE))
        except frames.HandshakeRefused as exc:
            raise ChannelClosed(f"the process at {address} {exc}: refused") from None
        _send_before(sock, mine, deadline)
        body = _read_frame(sock, buffer, frames.MAX_SEALED_BYTES, deadline)
        welcome = protocol.decode_batch(sealer.open(body), Route.TO_AGENT)
        if welcome[:1] != [protocol.Welcome()]:
            raise ChannelClosed(f"the driver at {address} did not welcome this agent")
        sock.setblocking(False)
        return sock, sealer, buffer
    except (ProtocolError, frames.FrameError) as exc:
        sock.close()
        raise ChannelClosed(f"the driver's handshake at {address} is malformed: {exc}") from None
    except BaseException:
        sock.close()
        raise


def _keep_alive(sock: socket.socket) -> None:
    """Let TCP, too, notice a driver whose host vanished (no FIN ever comes), within about
    40 s, for a connection without a silence limit (a dead driver *process* closes the
    connection at once)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    settings = (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    )
    for option, value in settings:
        if hasattr(socket, option):  # Linux and macOS (12+) name them; elsewhere OS defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _send_before(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise ChannelClosed("the driver took no handshake bytes in time") from None
    except OSError as exc:
        raise _Retry(f"the connection failed mid-handshake ({exc})") from None


def _read_frame(sock: socket.socket, buffer: bytearray, limit: int, deadline: float) -> bytes:
    while True:
        body = frames.split_frame(buffer, limit)
        if body is not None:
            return body
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Retry("the driver did not answer the handshake in time")
        sock.settimeout(left)
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            raise _Retry("the driver did not answer the handshake in time") from None
        except OSError as exc:
            raise _Retry(f"the connection failed mid-handshake ({exc})") from None
        if not data:
            raise _Retry("the driver closed the connection mid-handshake")
        buffer += data
