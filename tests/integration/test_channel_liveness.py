"""The control channel's liveness on loopback: beats keep an idle connection, a peer that goes
silent (a relay that swallows its bytes, as a cut link does: nothing closes) is counted gone
after the silence limit, on the driver's side and on the agent's."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from sparkdist._wire import protocol
from sparkdist._wire.channel.server import ChannelClient, ChannelServer, Peer, new_secret
from tests._helpers.relay import LoopbackRelay

HOST = "127.0.0.1"
LIMIT_S = 1.5


class CuttableLink(LoopbackRelay):
    """A byte relay between an agent and the server; ``cut(direction)`` swallows every byte
    from then on in that direction ("up": to the server), closing nothing."""

    def __init__(self, server_port: int) -> None:
        self.dead: set[str] = set()
        super().__init__(server_port)

    def cut(self, direction: str) -> None:
        self.dead.add(direction)

    def pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while data := src.recv(1 << 16):
                if direction not in self.dead:
                    dst.sendall(data)
        except OSError:
            pass


class Seen:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.lost: list[Peer] = []
        self.closed: list[float | None] = []

    def on_disconnect(self, peer: Peer) -> None:
        with self.cond:
            self.lost.append(peer)
            self.cond.notify_all()

    def on_close(self, silent_for: float | None) -> None:
        with self.cond:
            self.closed.append(silent_for)
            self.cond.notify_all()

    def wait_for(self, predicate, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)


@pytest.fixture
def linked():
    seen = Seen()
    secret = new_secret()

    def on_message(peer: Peer, message: protocol.Message) -> None:
        if isinstance(message, protocol.Hello):
            peer.node = message.node  # as the driver's monitor does

    server = ChannelServer(HOST, secret, on_message, seen.on_disconnect, silence_limit_s=LIMIT_S)
    link = CuttableLink(server.port)
    client = ChannelClient(
        (HOST, link.port),
        secret,
        on_message=lambda m: None,
        on_close=seen.on_close,
        silence_limit_s=LIMIT_S,
    )
    client.send(protocol.Hello(3, "agent-host"))
    deadline = time.monotonic() + 5
    while not any(peer.node == 3 for peer in server.peers):  # through the link, before any cut
        assert time.monotonic() < deadline, "the hello never arrived"
        time.sleep(0.01)
    yield seen, link, client
    client.close()
    link.close()
    server.close()


def test_beats_keep_an_idle_connection_alive_past_the_limit(linked):
    seen, _, _ = linked
    # Nothing but beats for twice the limit: neither end counts the other gone.
    assert not seen.wait_for(lambda: seen.lost or seen.closed, 2 * LIMIT_S + 0.5)


def test_the_driver_drops_an_agent_gone_silent_and_says_so(linked):
    seen, link, _ = linked
    cut_at = time.monotonic()
    link.cut("up")
    assert seen.wait_for(lambda: seen.lost, LIMIT_S + 2.0)
    took = time.monotonic() - cut_at
    peer = seen.lost[0]
    assert peer.node == 3
    assert peer.silent_for is not None and peer.silent_for >= LIMIT_S
    assert LIMIT_S - 1.1 <= took <= LIMIT_S + 1.0  # its last beat came up to a beat earlier
    assert peer.live.heard_wall <= time.time() - LIMIT_S + 0.3


def test_an_agent_notices_a_driver_gone_silent(linked):
    seen, link, _ = linked
    link.cut("down")
    assert seen.wait_for(lambda: seen.closed, LIMIT_S + 2.0)
    assert seen.closed[0] is not None and seen.closed[0] >= LIMIT_S
