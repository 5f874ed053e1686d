"""The control channel's frames and proofs: pure functions over bytes, no sockets, no threads.

A frame is a 4-byte big-endian length, then its body. During the handshake the body is one
message (``protocol.encode``), at most ``MAX_HANDSHAKE_BYTES``. After it, the body is a
32-byte tag and a payload (a batch of messages, ``protocol.encode_batch``); the tag is
HMAC-SHA256 under the connection's own key over (direction, sequence number, payload), so a
frame cannot be forged, altered, replayed, reordered, dropped unnoticed or reflected back.

The handshake (nobody answers a challenge before the other side proved it knows the secret):

    agent  -> driver   ClientHello(version, nonce_c)
    driver -> agent    ServerProof(nonce_s, mac = HMAC(secret, "server" | nonce_c | nonce_s))
    agent  -> driver   ClientProof(mac = HMAC(secret, "client" | nonce_s | nonce_c)),
                       sent only once the driver's proof checked out
    both               key = HMAC(secret, "key" | nonce_c | nonce_s)
    driver -> agent    its first tagged frame: [Welcome]

The driver's proof binds the agent's fresh nonce, so it cannot be replayed; the agent's binds
the driver's fresh nonce, and its role label keeps it from ever passing for a driver's proof.
A relay that passes the handshake through learns nothing it can use: every later frame needs
the key.

``ServerHandshake`` and ``ClientHandshake`` are the two sides as pure state machines.

Non-goals: sockets and deadlines (``channel``, ``client``), message contents (``protocol``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from sparkdist._wire import protocol
from sparkdist._wire.protocol import MAX_FRAME_BYTES, MAX_HANDSHAKE_BYTES, NONCE_BYTES

HEADER = struct.Struct(">I")
TAG_BYTES = 32
#: Largest body of a tagged frame.
MAX_SEALED_BYTES = TAG_BYTES + MAX_FRAME_BYTES
#: Directions, bound into every tag: a frame is only valid the way it was sent.
TO_DRIVER = b"C"
TO_AGENT = b"S"
_LABEL = b"sparkdist-channel/2 "


class FrameError(ValueError):
    """A frame that breaks the channel's rules (its size, its tag); the connection ends."""


class HandshakeRefused(ValueError):
    """The other side broke the handshake; the connection ends.

    Attributes:
        kind: ``"refused"`` (no proof of the secret), ``"version"`` (another protocol
            version) or ``"malformed"`` (out of turn).
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def new_secret() -> str:
    """A fresh per-run secret (hex)."""
    return os.urandom(32).hex()


def secret_key(secret: str) -> bytes:
    """The run's secret as a key; ``ValueError`` naming the problem for a malformed one."""
    try:
        key = bytes.fromhex(secret)
    except (TypeError, ValueError):
        raise ValueError(
            "the control channel's secret must be hex digits (new_secret() makes one)"
        ) from None
    return key


def new_nonce() -> str:
    return os.urandom(NONCE_BYTES).hex()


def proof(key: bytes, role: bytes, first: str, second: str) -> str:
    """HMAC(secret, role | first | second) in hex; ``role`` is b"server" or b"client"."""
    message = _LABEL + role + bytes.fromhex(first) + bytes.fromhex(second)
    return hmac.digest(key, message, "sha256").hex()


def proof_matches(expected: str, got: str) -> bool:
    return hmac.compare_digest(expected.encode(), got.encode())


def session_key(key: bytes, nonce_c: str, nonce_s: str) -> bytes:
    return hmac.digest(
        key, _LABEL + b"key" + bytes.fromhex(nonce_c) + bytes.fromhex(nonce_s), "sha256"
    )


def plain_frame(body: bytes) -> bytes:
    """A handshake frame."""
    if len(body) > MAX_HANDSHAKE_BYTES:
        raise FrameError(f"a handshake frame of {len(body)} bytes exceeds {MAX_HANDSHAKE_BYTES}")
    return HEADER.pack(len(body)) + body


def split_frame(buffer: bytearray, limit: int) -> bytes | None:
    """Take one whole frame's body off the front of ``buffer``; None until one is complete.

    Raises:
        FrameError: the frame announces more than ``limit`` bytes.
    """
    if len(buffer) < HEADER.size:
        return None
    (size,) = HEADER.unpack_from(buffer)
    if size > limit:
        raise FrameError(f"a frame of {size} bytes exceeds the limit of {limit}")
    end = HEADER.size + size
    if len(buffer) < end:
        return None
    body = bytes(buffer[HEADER.size : end])
    del buffer[:end]
    return body


class Sealer:
    """One connection's tagging, for one side: tags what it sends, checks what it receives.

    Args:
        key: the connection's key (``session_key``).
        sending: the direction this side sends (``TO_DRIVER`` for an agent).
    """

    def __init__(self, key: bytes, sending: bytes) -> None:
        # HMAC-SHA256 with its inner and outer hash states keyed once (RFC 2104): a frame's tag
        # then costs two hash copies, not a fresh OpenSSL context (over twice as fast).
        if len(key) > 64:
            key = hashlib.sha256(key).digest()
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key.ljust(64, b"\0")))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key.ljust(64, b"\0")))
        self._sending = sending
        self._receiving = TO_AGENT if sending == TO_DRIVER else TO_DRIVER
        self._sent = 0
        self._received = 0

    def seal(self, payload: bytes) -> bytes:
        """The whole frame for ``payload`` (the next in sequence)."""
        if len(payload) > MAX_FRAME_BYTES:
            raise FrameError(f"a frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
        tag = self._tag(self._sending, self._sent, payload)
        self._sent += 1
        return HEADER.pack(TAG_BYTES + len(payload)) + tag + payload

    def open(self, body: bytes) -> bytes:
        """The payload of the next frame received; ``FrameError`` if its tag is wrong."""
        if len(body) < TAG_BYTES:
            raise FrameError(f"a frame of {len(body)} bytes is too short to carry its tag")
        payload = body[TAG_BYTES:]
        expected = self._tag(self._receiving, self._received, payload)
        if not hmac.compare_digest(expected, body[:TAG_BYTES]):
            raise FrameError(
                f"frame {self._received} failed its integrity check (forged, altered, replayed "
                "or reordered on the way)"
            )
        self._received += 1
        return payload

    def _tag(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(direction + seq.to_bytes(8, "big"))
        inner.update(payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


class ServerHandshake:
    """The driver's side of one agent's handshake, fed the agent's messages in order."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._nonce_c: str | None = None
        self._nonce_s = ""

    def step(self, message: protocol.Message) -> bytes | Sealer:
        """The frame that answers ``message``; once the agent proved itself, the connection's
        ``Sealer`` instead.

        Raises:
            HandshakeRefused: a wrong proof, another version, or a message out of turn.
        """
        if self._nonce_c is None and isinstance(message, protocol.ClientHello):
            if message.version != protocol.PROTOCOL_VERSION:
                raise HandshakeRefused(
                    "version",
                    f"speaks control protocol {message.version}, the driver "
                    f"{protocol.PROTOCOL_VERSION}: the driver and the executors run different "
                    "sparkdist versions; install the same version on both",
                )
            self._nonce_c, self._nonce_s = message.nonce, new_nonce()
            mac = proof(self._key, b"server", message.nonce, self._nonce_s)
            return plain_frame(protocol.encode(protocol.ServerProof(self._nonce_s, mac)))
        if self._nonce_c is not None and isinstance(message, protocol.ClientProof):
            expected = proof(self._key, b"client", self._nonce_s, self._nonce_c)
            if not proof_matches(expected, message.mac):
                raise HandshakeRefused("refused", "did not prove it knows the run's secret")
            return Sealer(session_key(self._key, self._nonce_c, self._nonce_s), TO_AGENT)
        raise HandshakeRefused("malformed", f"sent a {message.kind!r} message out of turn")


class ClientHandshake:
    """An agent's side of the handshake: it answers only a driver that proved itself."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._nonce_c = new_nonce()

    def hello(self) -> bytes:
        """The first frame."""
        hello = protocol.ClientHello(protocol.PROTOCOL_VERSION, self._nonce_c)
        return plain_frame(protocol.encode(hello))

    def step(self, message: protocol.Message) -> tuple[bytes, Sealer]:
        """The agent's proof for the driver's ``message``, and the connection's ``Sealer``.

        Raises:
            HandshakeRefused: ``message`` is not a valid proof of the secret over our nonce.
        """
        if not isinstance(message, protocol.ServerProof) or not proof_matches(
            proof(self._key, b"server", self._nonce_c, message.nonce), message.mac
        ):
            raise HandshakeRefused(
                "refused",
                "did not prove it knows the run's secret (a stale driver's port reused, or a "
                "stranger)",
            )
        mine = proof(self._key, b"client", message.nonce, self._nonce_c)
        sealer = Sealer(session_key(self._key, self._nonce_c, message.nonce), TO_DRIVER)
        return plain_frame(protocol.encode(protocol.ClientProof(mine))), sealer
