"""The driver's control channel: rendezvous data, rank output and failures, over one TCP port.

Frames are a 4-byte big-endian length followed by a JSON object; nothing received is ever
unpickled. A connection is accepted only after a mutual HMAC challenge with the run's secret:
the server proves it knows the secret too, so an agent never takes an "abort" or a rendezvous
port from a stranger. Frames are capped (small until authenticated). Results never travel here;
they come back through Spark's collect (or, in local mode, the agent's return value).

Non-goals: what the messages mean (``_launcher`` and ``_agent`` decide), reliability beyond TCP.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("sparkdist")

Message = dict[str, Any]

#: Largest frame after authentication; a rank's line is capped at 64 KiB before it gets here.
MAX_FRAME_BYTES = 1 << 20
#: Largest frame before authentication: a challenge or its answer.
MAX_HANDSHAKE_BYTES = 1024
HANDSHAKE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0

_HEADER = struct.Struct(">I")


def _block_reads_bound_sends(sock: socket.socket) -> None:
    """Reads wait as long as it takes (a node may print nothing for an hour); a send to a
    peer that stopped reading gives up after SEND_TIMEOUT_S instead of blocking forever."""
    sock.settimeout(None)
    seconds = int(SEND_TIMEOUT_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, 0))


class ChannelClosed(ConnectionError):
    """The peer went away, or sent something that broke the protocol."""


def new_secret() -> str:
    """A fresh per-run secret (hex)."""
    return os.urandom(32).hex()


def _mac(secret: str, nonce: str) -> str:
    return hmac.new(bytes.fromhex(secret), bytes.fromhex(nonce), hashlib.sha256).hexdigest()


class _Framed:
    """One socket with length-prefixed JSON frames; sends are serialised by a lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, message: Message) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
        with self._send_lock:
            if self.closed:
                raise ChannelClosed("channel is closed")
            try:
                self.sock.sendall(_HEADER.pack(len(data)) + data)
            except OSError as exc:
                self.close()
                raise ChannelClosed(str(exc)) from exc

    def recv(self, max_bytes: int) -> Message:
        (size,) = _HEADER.unpack(self._recv_exact(_HEADER.size))
        if size > max_bytes:
            raise ChannelClosed(f"frame of {size} bytes exceeds the cap of {max_bytes}")
        try:
            message = json.loads(self._recv_exact(size))
        except ValueError as exc:
            raise ChannelClosed("frame is not JSON") from exc
        if not isinstance(message, dict) or not isinstance(message.get("t"), str):
            raise ChannelClosed("frame is not a message object")
        return message

    def _recv_exact(self, size: int) -> bytes:
        chunks = []
        while size:
            try:
                chunk = self.sock.recv(min(size, 1 << 16))
            except OSError as exc:
                raise ChannelClosed(str(exc)) from exc
            if not chunk:
                raise ChannelClosed("peer closed the connection")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Peer(_Framed):
    """The driver's end of one authenticated agent connection."""

    #: The node (barrier task) the agent said it runs, once it said so.
    node: int | None = None


class ChannelServer:
    """Accepts agents on one address and hands each authenticated message to ``on_message``.

    Args:
        host: the one address to bind (the driver's; loopback in local mode).
        secret: the run's secret.
        on_message: called from a connection's reader thread with (peer, message).
        on_disconnect: called when an authenticated peer goes away.
    """

    def __init__(
        self,
        host: str,
        secret: str,
        on_message: Callable[[Peer, Message], None],
        on_disconnect: Callable[[Peer], None] = lambda peer: None,
    ) -> None:
        self._secret = secret
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._peers: list[Peer] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="sparkdist-channel-accept", daemon=True
        )
        self._accept_thread.start()

    def broadcast(self, message: Message) -> None:
        """Send to every connected agent; a peer that went away is skipped."""
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            try:
                peer.send(message)
            except (ChannelClosed, OSError):
                continue

    def close(self) -> None:
        """Stop accepting, drop every connection and wait for the reader threads."""
        self._closing = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            peers, self._peers = self._peers, []
            threads = list(self._threads)
        for peer in peers:
            peer.close()
        self._accept_thread.join(timeout=5)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(
                target=self._serve, args=(sock,), name="sparkdist-channel-peer", daemon=True
            )
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        peer = Peer(sock)
        try:
            if not self._authenticate(peer):
                peer.close()
                return
            with self._lock:
                if self._closing:
                    peer.close()
                    return
                self._peers.append(peer)
            while True:
                self._on_message(peer, peer.recv(MAX_FRAME_BYTES))
        except ChannelClosed:
            pass
        except Exception:  # a handler bug must not kill the driver silently
            logger.exception("sparkdist: control channel handler failed")
        finally:
            with self._lock:
                was_peer = peer in self._peers
                if was_peer:
                    self._peers.remove(peer)
            peer.close()
            if was_peer:
                self._on_disconnect(peer)

    def _authenticate(self, peer: Peer) -> bool:
        nonce = os.urandom(16).hex()
        peer.sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            peer.send({"t": "challenge", "nonce": nonce})
            answer = peer.recv(MAX_HANDSHAKE_BYTES)
            mac, client_nonce = answer.get("mac"), answer.get("nonce")
            if (
                answer["t"] != "auth"
                or not isinstance(mac, str)
                or not isinstance(client_nonce, str)
                or not hmac.compare_digest(mac, _mac(self._secret, nonce))
            ):
                logger.warning("sparkdist: refused a control connection without the run secret")
                return False
            peer.send({"t": "welcome", "mac": _mac(self._secret, client_nonce)})
        except (ChannelClosed, OSError, ValueError):
            return False
        _block_reads_bound_sends(peer.sock)
        return True


class ChannelClient(_Framed):
    """An agent's connection to the driver.

    Args:
        address: (host, port) of the driver's channel.
        secret: the run's secret.
        on_message: called from the reader thread for every message from the driver.
        on_close: called once when the connection ends.
        timeout_s: connect and handshake deadline.
    """

    def __init__(
        self,
        address: tuple[str, int],
        secret: str,
        on_message: Callable[[Message], None],
        on_close: Callable[[], None] = lambda: None,
        timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        sock = socket.create_connection(address, timeout=timeout_s)
        super().__init__(sock)
        try:
            challenge = self.recv(MAX_HANDSHAKE_BYTES)
            nonce = os.urandom(16).hex()
            self.send(
                {"t": "auth", "mac": _mac(secret, str(challenge.get("nonce"))), "nonce": nonce}
            )
            welcome = self.recv(MAX_HANDSHAKE_BYTES)
            if welcome.get("t") != "welcome" or not hmac.compare_digest(
                str(welcome.get("mac")), _mac(secret, nonce)
            ):
                raise ChannelClosed("the driver did not prove it knows the run secret")
        except (ChannelClosed, ValueError, OSError):
            self.close()
            raise
        _block_reads_bound_sends(sock)
        self._on_message = on_message
        self._on_close = on_close
        self._reader = threading.Thread(
            target=self._read_loop, name="sparkdist-channel-client", daemon=True
        )
        self._reader.start()

    def _read_loop(self) -> None:
        try:
            while True:
                self._on_message(self.recv(MAX_FRAME_BYTES))
        except ChannelClosed:
            pass
        finally:
            self._on_close()

    def join(self, timeout_s: float) -> None:
        """Wait for the reader thread to finish (after close)."""
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=timeout_s)
