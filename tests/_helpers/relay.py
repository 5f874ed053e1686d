"""A relay on loopback between one agent and the driver's channel server, for the tests that
stand in the middle of the channel (rewriting frames, cutting a direction)."""

from __future__ import annotations

import socket
import threading

HOST = "127.0.0.1"


class LoopbackRelay:
    """Listens on a loopback port of its own (``port``), takes one agent's connection and opens
    one to the server at ``server_port``; each direction ("up": agent to server) runs ``pump``
    on a thread of its own, which subclasses define."""

    def __init__(self, server_port: int) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.server_port = server_port
        self.sockets: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            agent, _ = self.listener.accept()
        except OSError:
            return
        upstream = socket.create_connection((HOST, self.server_port))
        self.sockets += [agent, upstream]
        for src, dst, direction in ((agent, upstream, "up"), (upstream, agent, "down")):
            threading.Thread(target=self.pump, args=(src, dst, direction), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()
