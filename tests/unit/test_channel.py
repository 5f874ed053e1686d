"""The control channel: mutual authentication, tagged frames, bounded queues, two threads.

Raw-socket attacks (floods, relays, slow drips) are in tests/integration/test_channel_attacks.py.
"""

from __future__ import annotations

import json
import pickle
import socket
import struct
import threading
import time

import pytest

from sparkdist._node.agent.outbox import Outbox
from sparkdist._wire import frames, protocol
from sparkdist._wire.channel import client as client_module
from sparkdist._wire.channel import dispatch as dispatch_module
from sparkdist._wire.channel.server import (
    CLOSE_TIMEOUT_S,
    MAX_HANDSHAKE_BYTES,
    ChannelClient,
    ChannelClosed,
    ChannelServer,
    new_secret,
)
from tests._helpers.channel import Inbox

WAIT_S = 10.0


@pytest.fixture
def served():
    inbox = Inbox(WAIT_S)
    secret = new_secret()
    server = ChannelServer("127.0.0.1", secret, inbox.on_message, inbox.on_disconnect)
    yield server, secret, inbox
    server.close()


def _client(server, secret, **kwargs) -> ChannelClient:
    kwargs.setdefault("on_message", lambda m: None)
    return ChannelClient(("127.0.0.1", server.port), secret, **kwargs)


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def test_typed_round_trip_both_ways(served):
    server, secret, inbox = served
    got, arrived = [], threading.Event()
    client = _client(server, secret, on_message=lambda m: (got.append(m), arrived.set()))
    client.send(protocol.Hello(node=0, host="h"))
    assert inbox.wait_for(lambda i: i.messages == [protocol.Hello(0, "h")])
    server.broadcast(protocol.Abort("x"))
    assert arrived.wait(WAIT_S) and got == [protocol.Abort("x")]
    client.close()
    assert inbox.wait_for(lambda i: i.disconnected == [0])


def test_only_typed_records_travel_and_each_only_its_way(served):
    server, secret, inbox = served
    client = _client(server, secret)
    client.send(protocol.Rows({0: 5}))
    assert inbox.wait_for(lambda i: i.messages == [protocol.Rows({0: 5})])
    with pytest.raises(protocol.ProtocolError, match="not a message of the control channel"):
        client.send({"t": "rows", "counts": {"0": 5}})  # type: ignore[arg-type]
    with pytest.raises(protocol.ProtocolError, match="not a message of the control channel"):
        server.broadcast({"t": "abort", "reason": "x"})  # type: ignore[arg-type]
    with pytest.raises(protocol.ProtocolError, match="LD_PRELOAD"):
        server.broadcast(protocol.Rendezvous(1, {"LD_PRELOAD": "x"}))
    with pytest.raises(protocol.ProtocolError, match="may not travel"):
        client.send(protocol.Abort("an agent may not order this"))
    client.close()


def _post_lines(client: ChannelClient, count: int) -> list[protocol.Log]:
    """Post ``count`` output lines (each must be queued, none dropped); return them."""
    lines = [protocol.Log(0, protocol.Stream.STDOUT, f"line {i}") for i in range(count)]
    for line in lines:
        assert client.post(line)
    return lines


def test_messages_keep_their_order_and_control_goes_first(served):
    server, secret, inbox = served
    client = _client(server, secret)
    lines = _post_lines(client, 2000)
    assert client.flush(WAIT_S)
    client.send(protocol.Bye(node=0))
    assert inbox.wait_for(lambda i: len(i.messages) == 2001)
    assert inbox.messages == [*lines, protocol.Bye(0)]
    assert client.dropped == 0
    client.close()


def test_a_goodbye_sent_after_the_posted_lines_never_overtakes_them(served):
    # The agent's flush before its bye may time out; the bye must still come last, or the
    # driver stops reading the node's output before its last lines.
    server, secret, inbox = served
    client = _client(server, secret)
    lines = _post_lines(client, 2000)
    client.send(protocol.Rows({0: 1}))  # control: ahead of what is still queued
    client.send(protocol.Bye(node=0), after_posted=True)  # no flush first: still queued
    assert inbox.wait_for(lambda i: len(i.messages) == 2002)
    assert inbox.messages[-1] == protocol.Bye(0)
    assert [m for m in inbox.messages if isinstance(m, protocol.Log)] == lines
    client.close()


def test_no_wake_up_is_lost_while_lines_and_control_messages_race(served):
    # A kick landing between the I/O thread's wake-up handling steps once left the client
    # believing a wake-up was pending forever: later control messages (a goodbye) then sat
    # in the queue until the driver gave the node up, and its last output lines were lost.
    server, secret, inbox = served
    client = _client(server, secret)
    stop = threading.Event()

    def post_lines() -> None:
        while not stop.is_set():
            client.post(protocol.Log(0, protocol.Stream.STDOUT, "x"))
            time.sleep(0)

    poster = threading.Thread(target=post_lines)
    poster.start()
    try:
        for number in range(300):
            client.send(protocol.Rows({0: number}))
            assert inbox.wait_for(lambda i, n=number: protocol.Rows({0: n}) in i.messages, 2.0), (
                f"control message {number} was never sent"
            )
    finally:
        stop.set()
        poster.join()
        client.close()


def test_wrong_secret_is_refused_by_both_sides(served):
    server, _, inbox = served
    with pytest.raises(ChannelClosed, match="did not prove it knows the run's secret"):
        _client(server, new_secret())
    assert inbox.messages == [] and server.peers == []


def test_raw_socket_without_the_secret_gets_nothing_through(served):
    server, _, inbox = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        hello = protocol.ClientHello(protocol.PROTOCOL_VERSION, frames.new_nonce())
        sock.sendall(frames.plain_frame(protocol.encode(hello)))
        sock.recv(4096)  # the driver's proof
        sock.sendall(_frame({"t": "c_proof", "mac": "0" * 64}))
        sock.sendall(_frame({"t": "failed", "rank": 0, "exit_code": 1, "time": 0}))
        assert sock.recv(1) == b""  # closed on us
    assert inbox.messages == []
    assert server.stats["refused"] == 1


def test_oversized_handshake_frame_is_dropped(served):
    server, _, inbox = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(struct.pack(">I", MAX_HANDSHAKE_BYTES + 1) + b"x" * 16)
        assert sock.recv(1) == b""
    assert inbox.messages == [] and server.stats["malformed"] == 1


def test_pickle_bytes_are_never_accepted(served):
    server, _, inbox = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        payload = pickle.dumps({"t": "c_hello"})
        sock.sendall(struct.pack(">I", len(payload)) + payload)
        assert sock.recv(1) == b""
    assert inbox.messages == []


def test_the_server_never_speaks_first(served):
    """No challenge to answer: a stranger gets nothing until it sends a well-formed hello."""
    server, _, _ = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)


def test_the_client_answers_no_challenge():
    """A fake driver that challenges first (the old protocol's MAC oracle) gets only a nonce:
    the agent proves nothing to a side that has not proved itself."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = []

    def fake_driver() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(_frame({"t": "s_proof", "nonce": "ab" * 32, "mac": "cd" * 32}))
            conn.settimeout(WAIT_S)
            while data := conn.recv(4096):
                received.append(data)

    thread = threading.Thread(target=fake_driver, daemon=True)
    thread.start()
    try:
        with pytest.raises(ChannelClosed, match="did not prove"):
            ChannelClient(listener.getsockname(), new_secret(), on_message=lambda m: None)
        thread.join(WAIT_S)
    finally:
        listener.close()
    sent = b"".join(received)
    assert b"c_hello" in sent and b"c_proof" not in sent


def test_close_flushes_control_messages(served):
    """A node that refuses sends one message and hangs up at once: it must still arrive."""
    server, secret, inbox = served
    client = _client(server, secret)
    client.send(protocol.Refused(node=0, host="h", reason="wrong GPU"))
    client.close()
    assert inbox.wait_for(lambda i: len(i.messages) == 1)
    assert inbox.messages[0].reason == "wrong GPU"


def test_close_is_fast_with_clients_connected(served):
    server, secret, _ = served
    clients = [_client(server, secret) for _ in range(20)]
    for client in clients:
        client.post(protocol.Log(0, protocol.Stream.STDOUT, "x"))
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < CLOSE_TIMEOUT_S + 0.1
    for client in clients:
        client.join(WAIT_S)
        assert client.closed


def test_two_threads_whatever_the_number_of_agents():
    before = {t.name for t in threading.enumerate()}
    inbox = Inbox()
    secret = new_secret()
    server = ChannelServer("127.0.0.1", secret, inbox.on_message)
    try:
        clients = [_client(server, secret) for _ in range(30)]
        for i, client in enumerate(clients):
            client.send(protocol.Hello(i, "h"))
        assert inbox.wait_for(lambda i: len(i.messages) == 30)
        ours = [t.name for t in threading.enumerate() if t.name.startswith("sparkdist-channel-")]
        assert sorted(n for n in ours if n not in before and "client" not in n) == [
            "sparkdist-channel-dispatch",
            "sparkdist-channel-io",
        ]
        for client in clients:
            client.close()
    finally:
        server.close()


def test_a_full_queue_drops_lines_and_counts_them(served, monkeypatch):
    server, secret, inbox = served
    monkeypatch.setattr(client_module, "POST_QUEUE", 5)
    release = threading.Event()
    blocked = Inbox()

    def slow(peer, message):  # the driver's handlers stall: TCP and the queue fill up
        release.wait(WAIT_S)
        blocked.on_message(peer, message)

    secret2 = new_secret()
    slow_server = ChannelServer("127.0.0.1", secret2, slow)
    try:
        client = _client(slow_server, secret2)
        big = "z" * 60_000
        accepted = sum(
            client.post(protocol.Log(0, protocol.Stream.STDOUT, big)) for _ in range(2000)
        )
        assert accepted < 2000 and client.dropped == 2000 - accepted
        client.send(protocol.Bye(0, dropped=client.dropped))  # control is never dropped
        release.set()
        assert blocked.wait_for(lambda i: any(isinstance(m, protocol.Bye) for m in i.messages))
        client.close()
    finally:
        release.set()
        slow_server.close()


class StalledDriver:
    """A server whose handlers stall until ``release`` (as a driver printing a flood of lines
    falls behind): its reads stop, TCP fills, then the agent's queues."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.inbox = Inbox()
        self.secret = new_secret()
        self.server = ChannelServer("127.0.0.1", self.secret, self._on_message)

    def _on_message(self, peer, message) -> None:
        self.release.wait(WAIT_S)
        self.inbox.on_message(peer, message)

    def close(self) -> None:
        self.release.set()
        self.server.close()


def _stop_reading_soon(monkeypatch) -> None:
    """A stalled driver stops reading after a few messages, not thousands (TCP fills sooner)."""
    monkeypatch.setattr(dispatch_module, "DISPATCH_HIGH_WATER", 20)
    monkeypatch.setattr(dispatch_module, "DISPATCH_LOW_WATER", 10)


def _sample(number: int) -> protocol.Sample:
    return protocol.Sample(0, time.time(), {"sample": float(number)})


def _got(driver: StalledDriver, kind: type) -> list:
    return [m for m in driver.inbox.messages if isinstance(m, kind)]


def test_a_flood_of_lines_never_pushes_out_the_samples_or_the_progress(monkeypatch):
    _stop_reading_soon(monkeypatch)
    driver = StalledDriver()
    try:
        client = _client(driver.server, driver.secret)
        outbox = Outbox(client)
        stop = threading.Event()
        flooded = []

        def flood() -> None:  # a rank printing flat out, its lines as the agent posts them
            line = protocol.Log(0, protocol.Stream.STDOUT, "f" * 1000)
            while not stop.is_set():
                outbox.line(line)
                flooded.append(1)

        flooder = threading.Thread(target=flood)
        flooder.start()
        for number in range(10):  # one sample per interval, a report per step, amid the flood
            time.sleep(0.1)
            outbox.line(_sample(number))
            outbox.line(protocol.Report(0, step=number))
        stop.set()
        flooder.join()
        driver.release.set()
        outbox.close(WAIT_S, final=protocol.Bye(0))
        assert driver.inbox.wait_for(lambda i: any(isinstance(m, protocol.Bye) for m in i.messages))
        assert [m.metrics["sample"] for m in _got(driver, protocol.Sample)] == list(range(10))
        assert [m.step for m in _got(driver, protocol.Report)] == list(range(10))
        lines = len(_got(driver, protocol.Log))
        assert client.dropped > 0 and lines + client.dropped == len(flooded)  # lines only
        assert driver.inbox.messages[-1] == protocol.Bye(0, dropped=client.dropped)
        client.close()
    finally:
        driver.close()


def test_full_of_metrics_the_lane_drops_the_oldest_reports_first(monkeypatch):
    _stop_reading_soon(monkeypatch)
    monkeypatch.setattr(client_module, "POST_QUEUE", 5)
    monkeypatch.setattr(client_module, "METRIC_QUEUE", 8)
    driver = StalledDriver()
    try:
        client = _client(driver.server, driver.secret)
        big = protocol.Log(0, protocol.Stream.STDOUT, "z" * 60_000)
        while client.flush(0.2):  # until TCP and the lines' lane are full: nothing moves
            for _ in range(20):
                client.post(big)
        lines_dropped = client.dropped
        for step in range(100):  # reports flat out, a sample now and then
            if step % 25 == 0:
                client.post(_sample(step // 25))
            client.post(protocol.Report(0, step=step))
        assert client.dropped > lines_dropped  # the lane overflowed: it dropped its own
        driver.release.set()
        client.send(protocol.Bye(0), after_posted=True)
        assert driver.inbox.wait_for(lambda i: any(isinstance(m, protocol.Bye) for m in i.messages))
        assert [m.metrics["sample"] for m in _got(driver, protocol.Sample)] == [0, 1, 2, 3]
        steps = [m.step for m in _got(driver, protocol.Report)]
        assert steps == sorted(steps) and steps[-4:] == [96, 97, 98, 99]  # the newest won
        client.close()
    finally:
        driver.close()


def test_a_detached_outbox_keeps_lines_that_no_report_or_sample_pushes_out():
    outbox = Outbox(None, keep_lines=3)
    lines = [protocol.Log(0, protocol.Stream.STDOUT, f"line {i}") for i in range(3)]
    for number, line in enumerate(lines):
        outbox.line(line)
        for step in range(10):
            outbox.line(protocol.Report(0, step=step))
        outbox.line(_sample(number))
    assert list(outbox.kept) == lines and outbox.dropped == 33


def test_outbox_drops_an_oversized_report_and_stays_connected(served, caplog):
    server, secret, inbox = served
    client = _client(server, secret)
    outbox = Outbox(client)
    metrics = {f"m{i}": 1.0 for i in range(protocol.MAX_METRICS + 1)}
    outbox.line(protocol.Report(0, step=1, metrics=metrics))
    outbox.line(protocol.Log(0, protocol.Stream.STDOUT, "w" * 70_000))
    outbox.close(WAIT_S, final=protocol.Bye(0))
    assert inbox.wait_for(lambda i: any(isinstance(m, protocol.Bye) for m in i.messages))
    logs = [m for m in inbox.messages if isinstance(m, protocol.Log)]
    assert [len(m.line) for m in logs] == [protocol.MAX_LOG_CHARS, 70_000 - protocol.MAX_LOG_CHARS]
    assert inbox.messages[-1] == protocol.Bye(0, dropped=1)
    assert "entries, over the limit of 1000" in caplog.text
    client.close()


def test_an_agent_that_stops_reading_is_dropped_not_waited_for(served, monkeypatch):
    import sparkdist._wire.channel.peer as peer

    server, secret, inbox = served
    monkeypatch.setattr(peer, "MAX_PEER_BACKLOG_BYTES", 1 << 20)
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = frames.secret_key(secret)
    nonce_c = frames.new_nonce()
    raw.sendall(
        frames.plain_frame(
            protocol.encode(protocol.ClientHello(protocol.PROTOCOL_VERSION, nonce_c))
        )
    )
    buffer = bytearray()
    while (body := frames.split_frame(buffer, 4096)) is None:
        buffer += raw.recv(4096)
    proof = protocol.decode(body)
    mac = frames.proof(key, b"client", proof.nonce, nonce_c)
    raw.sendall(frames.plain_frame(protocol.encode(protocol.ClientProof(mac))))
    sealer = frames.Sealer(frames.session_key(key, nonce_c, proof.nonce), frames.TO_DRIVER)
    raw.sendall(sealer.seal(protocol.encode_batch([protocol.encode(protocol.Hello(7, "h"))])))
    assert inbox.wait_for(lambda i: len(i.messages) == 1)
    started = time.monotonic()
    # Never read: kernel buffers (a few MiB on loopback) fill, then the backlog passes its
    # bound and the peer goes.
    for _ in range(2000):
        server.broadcast(protocol.Abort("a" * 16_000))
    assert time.monotonic() - started < 2.0  # the sender never blocked
    assert inbox.wait_for(lambda i: i.disconnected == [7])
    raw.close()


@pytest.mark.parametrize("key_bytes", [0, 32, 64, 65, 200])
def test_frame_tags_are_hmac_sha256_over_direction_sequence_and_payload(key_bytes):
    import hmac
    import os

    key = os.urandom(key_bytes)
    sealer = frames.Sealer(key, frames.TO_DRIVER)
    for seq, payload in enumerate([b"", b"[]", os.urandom(5000)]):
        frame = sealer.seal(payload)
        expected = hmac.digest(key, b"C" + seq.to_bytes(8, "big") + payload, "sha256")
        assert frame[4:36] == expected
    receiver = frames.Sealer(key, frames.TO_AGENT)
    sender = frames.Sealer(key, frames.TO_DRIVER)
    first, second = sender.seal(b"[1]"), sender.seal(b"[2]")
    with pytest.raises(frames.FrameError, match="integrity"):
        receiver.open(second[4:])  # out of order
    assert receiver.open(first[4:]) == b"[1]"
    with pytest.raises(frames.FrameError, match="integrity"):
        receiver.open(first[4:])  # replayed
    reflector = frames.Sealer(key, frames.TO_AGENT)
    reflector.seal(b"[1]")
    reflected = reflector.seal(b"[2]")  # the right sequence number, the wrong direction
    with pytest.raises(frames.FrameError, match="integrity"):
        receiver.open(reflected[4:])  # the receiver's own direction, sent back at it


# -- the handshake as pure state machines --------------------------------------------------------


def _server_reply(server: frames.ServerHandshake, message) -> protocol.Message:
    reply = server.step(message)
    assert isinstance(reply, bytes)
    return protocol.decode(reply[4:])


def test_the_handshake_agrees_on_a_key_both_ways():
    key = frames.secret_key(new_secret())
    server, client = frames.ServerHandshake(key), frames.ClientHandshake(key)
    proof = _server_reply(server, protocol.decode(client.hello()[4:]))
    mine, client_sealer = client.step(proof)
    server_sealer = server.step(protocol.decode(mine[4:]))
    assert isinstance(server_sealer, frames.Sealer)
    assert server_sealer.open(client_sealer.seal(b"[1]")[4:]) == b"[1]"
    assert client_sealer.open(server_sealer.seal(b"[2]")[4:]) == b"[2]"


def _refusal(steps) -> str:
    with pytest.raises(frames.HandshakeRefused) as refused:
        steps()
    return refused.value.kind


def test_the_driver_refuses_every_broken_handshake():
    key = frames.secret_key(new_secret())
    hello = protocol.ClientHello(protocol.PROTOCOL_VERSION, frames.new_nonce())

    def fresh() -> frames.ServerHandshake:
        return frames.ServerHandshake(key)

    def proof_first():
        fresh().step(protocol.ClientProof("a" * 64))

    def hello_twice():
        server = fresh()
        server.step(hello)
        server.step(hello)

    def wrong_mac():
        server = fresh()
        server.step(hello)
        server.step(protocol.ClientProof("0" * 64))

    def reflected():  # the driver's own proof sent back as the agent's
        server = fresh()
        proof = _server_reply(server, hello)
        server.step(protocol.ClientProof(proof.mac))

    def other_secret():
        server = fresh()
        proof = _server_reply(server, hello)
        stranger = frames.secret_key(new_secret())
        mac = frames.proof(stranger, b"client", proof.nonce, hello.nonce)
        server.step(protocol.ClientProof(mac))

    def old_version():
        fresh().step(protocol.ClientHello(1, frames.new_nonce()))

    assert _refusal(proof_first) == "malformed"
    assert _refusal(hello_twice) == "malformed"
    assert _refusal(wrong_mac) == "refused"
    assert _refusal(reflected) == "refused"
    assert _refusal(other_secret) == "refused"
    assert _refusal(old_version) == "version"


def test_the_agent_proves_nothing_to_a_driver_that_did_not_prove_itself():
    key = frames.secret_key(new_secret())
    # A proof recorded from another connection (another agent nonce) is worthless here.
    other = frames.ClientHandshake(key)
    recorded = _server_reply(frames.ServerHandshake(key), protocol.decode(other.hello()[4:]))
    for message in [
        recorded,
        protocol.ServerProof(frames.new_nonce(), "0" * 64),
        protocol.Welcome(),
        protocol.ClientHello(protocol.PROTOCOL_VERSION, frames.new_nonce()),
    ]:
        client = frames.ClientHandshake(key)
        client.hello()
        assert _refusal(lambda: client.step(message)) == "refused"  # noqa: B023
