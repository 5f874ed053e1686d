"""The control channel refuses strangers, caps frames and carries only JSON."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from sparkdist._wire.channel import (
    MAX_HANDSHAKE_BYTES,
    ChannelClient,
    ChannelClosed,
    ChannelServer,
    new_secret,
)


@pytest.fixture
def server():
    received = []
    arrived = threading.Event()

    def on_message(peer, message):
        received.append(message)
        arrived.set()

    srv = ChannelServer("127.0.0.1", new_secret(), on_message)
    srv.received, srv.arrived = received, arrived
    yield srv
    srv.close()


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def _read_frame(sock) -> dict:
    size = struct.unpack(">I", sock.recv(4))[0]
    return json.loads(sock.recv(size))


def test_authenticated_client_round_trip(server):
    got = []
    event = threading.Event()
    client = ChannelClient(("127.0.0.1", server.port), server._secret,
                           on_message=lambda m: (got.append(m), event.set()))
    client.send({"t": "hello", "node": 0})
    assert server.arrived.wait(5)
    assert server.received == [{"t": "hello", "node": 0}]
    server.broadcast({"t": "abort", "reason": "x"})
    assert event.wait(5) and got == [{"t": "abort", "reason": "x"}]
    client.close()


def test_wrong_secret_is_refused_by_both_sides(server):
    with pytest.raises(ChannelClosed):
        ChannelClient(("127.0.0.1", server.port), new_secret(), on_message=lambda m: None)
    assert server.received == []


def test_raw_socket_without_the_secret_gets_nothing_through(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        challenge = _read_frame(sock)
        assert challenge["t"] == "challenge"
        sock.sendall(_frame({"t": "auth", "mac": "00" * 32, "nonce": "00" * 16}))
        sock.sendall(_frame({"t": "failed", "rank": 0, "exit_code": 1}))
        assert sock.recv(1) == b""  # closed on us
    assert server.received == []


def test_oversized_handshake_frame_is_dropped(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        _read_frame(sock)
        sock.sendall(struct.pack(">I", MAX_HANDSHAKE_BYTES + 1) + b"x" * 16)
        assert sock.recv(1) == b""
    assert server.received == []


def test_pickle_bytes_are_never_accepted(server):
    import pickle

    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        _read_frame(sock)
        payload = pickle.dumps({"t": "auth"})
        sock.sendall(struct.pack(">I", len(payload)) + payload)
        assert sock.recv(1) == b""
    assert server.received == []
