"""Attacks on the control channel from another process on this host, with raw sockets on
127.0.0.1: a connection flood to EMFILE, forged, replayed and reordered frames, a relay that
rewrites the rendezvous, a slow drip, thousands of slow drips held open, oversized frames and
garbage handshakes.

Each test bounds its connections and its time, and checks that the legitimate agent still
gets through (or fails with the right cause) and that the server still shuts down fast.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import resource
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from sparkdist._core.env import ROWS_PER_RANK_VAR
from sparkdist._wire import frames, protocol
from sparkdist._wire.channel.admission import HANDSHAKE_DEADLINE_S
from sparkdist._wire.channel.server import (
    CLOSE_TIMEOUT_S,
    ChannelClient,
    ChannelClosed,
    ChannelServer,
    new_secret,
)
from tests._helpers.channel import Inbox
from tests._helpers.relay import LoopbackRelay

WAIT_S = 20.0  # a loaded 2-core machine
HOST = "127.0.0.1"


@pytest.fixture
def served():
    inbox = Inbox(WAIT_S)
    secret = new_secret()
    server = ChannelServer(HOST, secret, inbox.on_message, inbox.on_disconnect)
    yield server, secret, inbox
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < CLOSE_TIMEOUT_S + 0.2


def _legit(port: int, secret: str, node: int = 0, **kwargs) -> ChannelClient:
    kwargs.setdefault("on_message", lambda m: None)
    client = ChannelClient((HOST, port), secret, timeout_s=WAIT_S, **kwargs)
    client.send(protocol.Hello(node, "legit"))
    return client


def _hellos(inbox: Inbox) -> list[int]:
    return [m.node for m in inbox.messages if isinstance(m, protocol.Hello)]


# -- a relay in the middle -----------------------------------------------------------------------

Hook = Callable[[str, int, bytes], list[bytes]]


class Relay(LoopbackRelay):
    """Passes frames between an agent and the server, through ``hook(direction, index, body)
    -> bodies`` ("up" is agent to server)."""

    def __init__(self, server_port: int, hook: Hook) -> None:
        self.hook = hook
        super().__init__(server_port)

    def pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        buffer = bytearray()
        index = 0
        try:
            while data := src.recv(1 << 16):
                buffer += data
                while (body := frames.split_frame(buffer, 1 << 24)) is not None:
                    for out in self.hook(direction, index, body):
                        dst.sendall(struct.pack(">I", len(out)) + out)
                    index += 1
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# Frame indexes: up 0 = hello, 1 = proof, 2.. = the agent's tagged frames;
# down 0 = the server's proof, 1 = welcome, 2.. = the server's tagged frames.


def test_a_relay_cannot_rewrite_the_rendezvous(served, caplog):
    server, secret, inbox = served
    inbox.on_hello = lambda peer: peer.send(
        protocol.Rendezvous(29500, {ROWS_PER_RANK_VAR: "[1]", "MLFLOW_RUN_ID": "run"})
    )
    rewritten = []

    def rewrite(direction: str, index: int, body: bytes) -> list[bytes]:
        if direction == "down" and index == 2:
            tag, payload = body[: frames.TAG_BYTES], body[frames.TAG_BYTES :]
            evil = payload.replace(b'"MLFLOW_RUN_ID"', b'"LD_PRELOAD"').replace(b"29500", b"29501")
            rewritten.append(evil != payload)
            return [tag + evil]
        return [body]

    relay = Relay(server.port, rewrite)
    got, closed = [], threading.Event()
    try:
        with caplog.at_level(logging.WARNING, "sparkdist"):
            client = _legit(
                relay.port, secret, on_message=got.append, on_close=lambda _silent: closed.set()
            )
            assert closed.wait(WAIT_S)  # the agent hung up on the tampered frame
        assert rewritten == [True] and got == []  # nothing tampered reached the agent
        assert "failed its integrity check" in caplog.text
        assert inbox.wait_for(lambda i: i.disconnected == [0])  # the driver saw the node go
        client.close()
    finally:
        relay.close()


def test_a_relay_cannot_strip_the_tags_either(served):
    """The old protocol's untagged rendezvous, sent in place of the real one, is refused."""
    server, secret, inbox = served
    inbox.on_hello = lambda peer: peer.send(protocol.Rendezvous(29500))
    plain = json.dumps([{"t": "rendezvous", "master_port": 1, "env": {}}]).encode()
    relay = Relay(server.port, lambda d, i, b: [plain] if (d, i) == ("down", 2) else [b])
    got, closed = [], threading.Event()
    try:
        client = _legit(
            relay.port, secret, on_message=got.append, on_close=lambda _silent: closed.set()
        )
        assert closed.wait(WAIT_S) and got == []
        client.close()
    finally:
        relay.close()


@pytest.mark.parametrize("attack", ["forged", "replayed", "reordered", "altered"])
def test_frames_cannot_be_injected_replayed_or_reordered(served, caplog, attack):
    server, secret, inbox = served
    held: list[bytes] = []
    forged = os.urandom(frames.TAG_BYTES) + protocol.encode_batch(
        [protocol.encode(protocol.Failed(rank=0, exit_code=1, time=0.0))]
    )

    def tamper(direction: str, index: int, body: bytes) -> list[bytes]:
        if direction != "up" or index < 2:
            return [body]
        if attack == "forged":
            return [body, forged] if index == 2 else [body]
        if attack == "replayed":
            return [body, body] if index == 2 else [body]
        if attack == "altered":  # one bit of the payload flipped
            return [body[:-2] + bytes([body[-2] ^ 1]) + body[-1:]] if index == 3 else [body]
        if index == 2:  # reordered: hold the hello, send it after the next frame
            held.append(body)
            return []
        return [body, *held] if index == 3 else [body]

    relay = Relay(server.port, tamper)
    try:
        with caplog.at_level(logging.WARNING, "sparkdist"):
            client = _legit(relay.port, secret)
            client.flush(WAIT_S)  # the hello and the ready in frames of their own
            client.send(protocol.Ready(rank=5))
            assert inbox.wait_for(lambda i: i.disconnected)
        accepted = inbox.messages
        assert not any(isinstance(m, protocol.Failed) for m in accepted)
        assert len(accepted) <= 1  # at most the genuine hello, never twice, never out of turn
        if attack in ("forged", "replayed", "altered"):
            assert _hellos(inbox) == [0]
        assert server.stats["bad_frames"] == 1
        assert "failed its integrity check" in caplog.text
        client.close()
    finally:
        relay.close()


def test_a_slow_drip_is_cut_at_the_deadline_and_never_delays_anyone(served):
    server, secret, inbox = served
    hello = frames.plain_frame(
        protocol.encode(protocol.ClientHello(protocol.PROTOCOL_VERSION, frames.new_nonce()))
    )
    cut_after: list[float] = []
    stop = threading.Event()

    def drip() -> None:
        started = time.monotonic()
        try:
            sock = socket.create_connection((HOST, server.port))
        except OSError:
            return  # a late one that came after the close (an early one is missed below)
        with sock:
            try:
                for byte in hello:  # one byte every 50 ms: the hello would take ~5 s
                    sock.sendall(bytes([byte]))
                    if stop.wait(0.05):
                        return
            except OSError:
                cut_after.append(time.monotonic() - started)
                return

    drippers = [threading.Thread(target=drip, daemon=True) for _ in range(8)]
    for thread in drippers:
        thread.start()
    started = time.monotonic()
    client = _legit(server.port, secret)
    assert inbox.wait_for(lambda i: _hellos(i) == [0])
    assert time.monotonic() - started < 2.0  # the legit agent does not wait for the drips
    for thread in drippers:
        thread.join(HANDSHAKE_DEADLINE_S + WAIT_S)
    assert len(cut_after) == 8
    assert all(HANDSHAKE_DEADLINE_S - 0.2 < s < HANDSHAKE_DEADLINE_S + 2.0 for s in cut_after)
    assert server.stats["handshake_timeouts"] == 8
    # Shutting down with drips in flight is as fast as without.
    stop.clear()
    late = [threading.Thread(target=drip, daemon=True) for _ in range(8)]
    for thread in late:
        thread.start()
    client.close()
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < CLOSE_TIMEOUT_S + 0.1
    stop.set()
    for thread in late:
        thread.join(WAIT_S)


def _raw_agent(port: int, secret: str) -> tuple[socket.socket, frames.Sealer]:
    """An agent's handshake by hand: a peer that has the secret but breaks the rules after."""
    sock = socket.create_connection((HOST, port), timeout=WAIT_S)
    key = frames.secret_key(secret)
    nonce_c = frames.new_nonce()
    sock.sendall(
        frames.plain_frame(
            protocol.encode(protocol.ClientHello(protocol.PROTOCOL_VERSION, nonce_c))
        )
    )
    buffer = bytearray()
    while (body := frames.split_frame(buffer, 4096)) is None:
        buffer += sock.recv(4096)
    proof = protocol.decode(body)
    assert isinstance(proof, protocol.ServerProof)
    mac = frames.proof(key, b"client", proof.nonce, nonce_c)
    sock.sendall(frames.plain_frame(protocol.encode(protocol.ClientProof(mac))))
    return sock, frames.Sealer(frames.session_key(key, nonce_c, proof.nonce), frames.TO_DRIVER)


def test_oversized_frames_end_only_their_connection(served, caplog):
    server, secret, inbox = served
    # Before the handshake: a 2 GiB announcement is refused on its header, nothing is read.
    with socket.create_connection((HOST, server.port), timeout=WAIT_S) as sock:
        sock.sendall(struct.pack(">I", 2 << 30))
        assert _closed_on_us(sock)
    # After it: an authenticated peer announcing more than a frame may hold is dropped...
    sock, sealer = _raw_agent(server.port, secret)
    sock.sendall(sealer.seal(protocol.encode_batch([protocol.encode(protocol.Hello(1, "big"))])))
    assert inbox.wait_for(lambda i: _hellos(i) == [1])
    with caplog.at_level(logging.WARNING, "sparkdist"):
        sock.sendall(struct.pack(">I", frames.MAX_SEALED_BYTES + 1))
        assert inbox.wait_for(lambda i: i.disconnected == [1])
    assert "exceeds the limit" in caplog.text
    sock.close()
    # ...and an honest agent's over-long line travels in pieces, its report is refused at
    # its sender, and it stays connected.
    client = _legit(server.port, secret, node=2)
    for part in protocol.log_chunks(0, "stdout", "x" * (3 * protocol.MAX_LOG_CHARS)):
        assert client.post(part)
    with pytest.raises(protocol.ProtocolError, match="over the limit of 1000"):
        client.post(protocol.Report(0, metrics={f"m{i}": 0.0 for i in range(1001)}))
    client.send(protocol.Bye(2))
    assert inbox.wait_for(lambda i: any(isinstance(m, protocol.Bye) for m in i.messages))
    assert sum(len(m.line) for m in inbox.messages if isinstance(m, protocol.Log)) == (
        3 * protocol.MAX_LOG_CHARS
    )
    assert inbox.disconnected == [1]
    client.close()


def _closed_on_us(sock: socket.socket) -> bool:
    """The server hung up (a reset when it left our bytes unread), having sent nothing."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


DEEP = 200_000
GARBAGE = [
    ("deep arrays", b"[" * DEEP),
    ("deep objects", b'{"t":' * DEEP),
    ("deep in a field", b'{"t":"c_hello","version":2,"nonce":' + b"[" * 480 + b"]" * 480 + b"}"),
    ("wrong types", b'{"t":"c_hello","version":[],"nonce":{}}'),
    ("null kind", b'{"t":null}'),
    ("not an object", b"[1,2,3]"),
    ("bool version", b'{"t":"c_hello","version":true,"nonce":"' + b"a" * 64 + b'"}'),
    ("huge int", b'{"t":"c_hello","version":' + b"9" * 5000 + b',"nonce":""}'),
    ("NaN", b'{"t":"c_hello","version":NaN,"nonce":""}'),
    ("bad utf-8", b'{"t":"\xff\xfe"}'),
    ("pickle", b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01t\x94K\x01s."),
    ("proof first", b'{"t":"c_proof","mac":"' + b"a" * 64 + b'"}'),
    ("agent message", b'{"t":"failed","rank":0,"exit_code":1,"time":0}'),
    ("old protocol", b'{"t":"auth","mac":"00","nonce":"00"}'),
    ("empty", b""),
]


def test_garbage_handshakes_are_refused_without_a_traceback(served, caplog):
    server, secret, inbox = served
    with caplog.at_level(logging.DEBUG, "sparkdist"):
        for _, payload in GARBAGE:
            with socket.create_connection((HOST, server.port), timeout=WAIT_S) as sock:
                if len(payload) > 1000:  # over the handshake cap: sent as a frame anyway
                    sock.sendall(struct.pack(">I", len(payload)))
                    sock.sendall(payload[:65536])
                else:
                    sock.sendall(struct.pack(">I", len(payload)) + payload)
                assert _closed_on_us(sock)  # refused: nothing answered
        client = _legit(server.port, secret)
        assert inbox.wait_for(lambda i: _hellos(i) == [0])
    assert server.stats["malformed"] == len(GARBAGE)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text
    client.close()


# -- a flood to EMFILE, against a server in a process with few file descriptors ------------------

SERVER_PROCESS = r"""
import json, resource, sys, threading, time
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
from sparkdist._wire import protocol
from sparkdist._wire.channel.server import ChannelServer, new_secret

def on_message(peer, message):
    if isinstance(message, protocol.Hello):
        peer.node = message.node
        print(json.dumps({"hello": message.node}), flush=True)
    else:
        print(json.dumps({"from": peer.node, "kind": message.kind}), flush=True)

secret = new_secret()
server = ChannelServer("127.0.0.1", secret, on_message)
print(json.dumps({"port": server.port, "secret": secret}), flush=True)
for line in sys.stdin:
    if line.strip() == "stats":
        print(json.dumps({"stats": dict(server.stats), "threads": threading.active_count()}),
              flush=True)
    elif line.strip() == "close":
        started = time.monotonic()
        server.close()
        print(json.dumps({"closed_s": time.monotonic() - started,
                          "threads": threading.active_count()}), flush=True)
        break
"""


class ServerProcess:
    def __init__(self, max_fds: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_PROCESS, str(max_fds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        first = self.next(lambda m: "port" in m)
        self.port, self.secret = first["port"], first["secret"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self, wanted: Callable[[dict], bool], timeout: float = WAIT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            item = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if wanted(item):
                return item

    def ask(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT_S)
        self.reader.join(WAIT_S)  # at the end of its output: the pipes can close
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def test_a_connection_flood_to_emfile_does_not_lock_the_agent_out():
    server = ServerProcess(max_fds=64)
    flood: list[socket.socket] = []
    stop = threading.Event()

    def attacker() -> None:
        # Keeps ~400 connections open (far over the server's 64 descriptors), replacing the
        # ones the server drops, up to 3000 in all; sends nothing.
        opened = 0
        while not stop.is_set() and opened < 3000:
            alive = []
            for sock in flood:
                sock.setblocking(False)
                try:
                    gone = sock.recv(1) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    sock.close()
                else:
                    alive.append(sock)
            flood[:] = alive
            while len(flood) < 400 and opened < 3000:
                try:
                    flood.append(socket.create_connection((HOST, server.port), timeout=1))
                except OSError:
                    break
                opened += 1
            stop.wait(0.02)

    thread = threading.Thread(target=attacker, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + WAIT_S
        while len(flood) < 300 and time.monotonic() < deadline:
            time.sleep(0.01)  # the flood is up before the agent comes
        started = time.monotonic()
        client = _legit(server.port, server.secret, node=0)
        server.next(lambda m: m.get("hello") == 0)
        took = time.monotonic() - started
        server.ask("stats")
        during = server.next(lambda m: "stats" in m)
        stop.set()
        thread.join(WAIT_S)
        for sock in flood:
            sock.close()
        # After the flood, a second agent walks in.
        second = _legit(server.port, server.secret, node=1)
        server.next(lambda m: m.get("hello") == 1)
        server.ask("close")
        closed = server.next(lambda m: "closed_s" in m)
        assert server.proc.wait(WAIT_S) == 0
    finally:
        stop.set()
        for sock in flood:
            sock.close()
        server.stop()
    stats = during["stats"]
    assert stats["accept_backoffs"] > 0  # it did run out of descriptors...
    assert stats["authenticated"] >= 1  # ...and let the agent in anyway
    assert took < 10.0
    assert during["threads"] == 3  # main, I/O, dispatch: no thread per connection
    assert closed["closed_s"] < CLOSE_TIMEOUT_S + 0.1
    client.close()
    second.close()


# -- a flood of slow connections, held at a few thousand ------------------------------------------

FLOOD = 3000  # idle connections the attacker holds: far over the server's cap (MAX_PENDING)
DRIP_S = 4.0  # each sends a byte of a genuine hello this often (the hello would take minutes)
PROBE_S = 5.0  # a newcomer unanswered this long counts as locked out


class DripFlood:
    """Holds ``FLOOD`` raw connections to ``port``, each dripping a byte every ``DRIP_S``;
    one the server cuts is opened again at once, so the attacker always holds ``FLOOD``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.hello = frames.plain_frame(
            protocol.encode(protocol.ClientHello(protocol.PROTOCOL_VERSION, frames.new_nonce()))
        )
        self.selector = selectors.DefaultSelector()
        self.cuts = self.failed = 0
        self.up, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        # Closed with a reset: tens of thousands of connections leave no TIME_WAIT behind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if sock.connect_ex((HOST, self.port)) not in (0, errno.EINPROGRESS):
            self.failed += 1
            sock.close()
            return
        self.selector.register(sock, selectors.EVENT_READ, [0])  # bytes of the hello sent

    def _run(self) -> None:
        try:
            for _ in range(FLOOD):
                self._open()
            self.up.set()
            next_drip = time.monotonic() + DRIP_S
            while not self.stop.is_set():
                for key, _ in self.selector.select(0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        cut = sock.recv(1) == b""
                    except BlockingIOError:
                        cut = False
                    except OSError:
                        cut = True
                    if cut:
                        self.selector.unregister(sock)
                        sock.close()
                        self.cuts += 1
                        self._open()
                if time.monotonic() >= next_drip:
                    next_drip += DRIP_S
                    for key in list(self.selector.get_map().values()):
                        sent = key.data
                        with contextlib.suppress(OSError):
                            sent[0] += key.fileobj.send(self.hello[sent[0] : sent[0] + 1])
        finally:
            self.up.set()
            for key in list(self.selector.get_map().values()):
                key.fileobj.close()
            self.selector.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)


def _time_to_challenge(port: int) -> float:
    """Seconds from a new connection's first SYN to the server's challenge (its proof)."""
    started = time.monotonic()
    hello = protocol.ClientHello(protocol.PROTOCOL_VERSION, frames.new_nonce())
    try:
        with socket.create_connection((HOST, port), timeout=PROBE_S) as sock:
            sock.sendall(frames.plain_frame(protocol.encode(hello)))
            buffer = bytearray()
            while (body := frames.split_frame(buffer, 4096)) is None:
                data = sock.recv(4096)
                if not data:
                    return float("inf")  # cut before it was challenged
                buffer += data
    except TimeoutError:
        return float("inf")
    assert isinstance(protocol.decode(body), protocol.ServerProof)
    return time.monotonic() - started


def test_a_flood_of_slow_connections_never_keeps_a_new_agent_waiting():
    """Before: the accept paused at the cap, the listen backlog filled behind it, and a
    newcomer's SYN was dropped: it waited 1.4 s to 5 s for its challenge, or never got one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 500:
        pytest.skip(f"the flood needs {FLOOD + 500} file descriptors, the hard limit is {hard}")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 500), hard))
    server = ServerProcess(max_fds=1024)
    flood = None
    try:
        running = _legit(server.port, server.secret, node=0)  # the run, there before the flood
        server.next(lambda m: m.get("hello") == 0)
        flood = DripFlood(server.port)
        assert flood.up.wait(WAIT_S)
        waits = []
        for _ in range(12):  # newcomers amid the flood, for ~3 s
            waits.append(_time_to_challenge(server.port))
            time.sleep(0.25)
        late = _legit(server.port, server.secret, node=1)  # a whole handshake gets through too
        server.next(lambda m: m.get("hello") == 1)
        running.send(protocol.Ready(rank=0))  # the run was never cut
        server.next(lambda m: m == {"from": 0, "kind": "ready"})
        server.ask("stats")
        stats = server.next(lambda m: "stats" in m)["stats"]
        flood.close()
        assert flood.failed == 0
        server.ask("close")
        server.next(lambda m: "closed_s" in m)
    finally:
        if flood is not None:
            flood.close()
        server.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # Every newcomer is challenged well within the deadline: none waits out a dropped SYN's
    # retry (1 s) at a full listen backlog, none is cut before its turn.
    assert max(waits) < HANDSHAKE_DEADLINE_S / 2, waits
    assert stats["authenticated"] == 2  # the run and the latecomer, nobody else
    assert flood.cuts >= FLOOD  # the server kept cutting the drips
    running.close()
    late.close()


def test_an_agent_refuses_a_driver_without_the_secret():
    """A stranger listening where the agent expects the driver gets no proof out of it."""
    inbox = Inbox(WAIT_S)
    server = ChannelServer(HOST, new_secret(), inbox.on_message)
    try:
        with pytest.raises(ChannelClosed, match="did not prove it knows the run's secret"):
            _legit(server.port, new_secret())
        assert server.stats["authenticated"] == 0 and inbox.messages == []
    finally:
        server.close()
