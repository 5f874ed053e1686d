"""The processes ``channel_scale.py`` starts: the driver (one real ``ChannelServer``) and the
agent processes (simulated agents: real ``ChannelClient``s, or the real handshake and frames
multiplexed on one thread).

Each speaks to the parent over its stdin (commands: ``mark``, ``report``, ``hello``, ``log
SECONDS RATE``, ``quit``) and stdout (one JSON object a line), so the parent times the phases
on one clock. The driver's handler does what the supervisor's cheapest path does with a line:
count it and its latency, no printing.

Non-goals: the figures and the table (``channel_scale.py``), ranks and Spark.
"""

from __future__ import annotations

import concurrent.futures
import json
import resource
import select
import selectors
import sys
import threading
import time
from typing import Any

from sparkdist._wire import frames, protocol
from sparkdist._wire.channel import client as client_module
from sparkdist._wire.channel.server import ChannelClient, ChannelServer, new_secret

LINE_PAD = "x" * 72  # a line is ~100 bytes: stamp, node, sequence, padding
_BUCKETS = 100_000  # latency histogram: 0.1 ms buckets up to 10 s


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


# -- the driver process ----------------------------------------------------------------------------


class Driver:
    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.hellos = 0
        self.rendezvous_sent_at: float | None = None
        self.first_hello_at: float | None = None
        self.lines = 0
        self.first_line_at = 0.0
        self.last_line_at = 0.0
        self.histogram = [0] * _BUCKETS
        self.max_latency = 0.0
        self.server = ChannelServer("127.0.0.1", new_secret(), self.on_message)

    def on_message(self, peer: Any, message: protocol.Message) -> None:
        if isinstance(message, protocol.Log):
            now = time.time()
            latency = now - float(message.line.partition("|")[0])
            self.histogram[min(_BUCKETS - 1, max(0, int(latency * 10_000)))] += 1
            self.max_latency = max(self.max_latency, latency)
            if not self.lines:
                self.first_line_at = now
            self.last_line_at = now
            self.lines += 1
        elif isinstance(message, protocol.Hello):
            peer.node = message.node
            self.hellos += 1
            if self.first_hello_at is None:
                self.first_hello_at = time.time()
            if self.hellos == self.nodes:
                self.server.broadcast(protocol.Rendezvous(29500, {"MLFLOW_RUN_ID": "bench"}))
                self.rendezvous_sent_at = time.time()

    def percentile(self, fraction: float) -> float | None:
        target = fraction * self.lines
        seen = 0
        for bucket, count in enumerate(self.histogram):
            seen += count
            if count and seen >= target:
                return (bucket + 1) / 10.0  # ms, the bucket's upper edge
        return None


def run_driver(nodes: int) -> None:
    raise_fd_limit()
    driver = Driver(nodes)
    emit({"port": driver.server.port, "secret": driver.server._secret})
    peak_threads = threading.active_count()
    cpu_mark = time.process_time()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.1)
        peak_threads = max(peak_threads, proc_status("Threads"))
        if not ready:
            continue
        command = sys.stdin.readline().strip()
        if command == "mark":  # the logging starts: count lines and CPU from here
            driver.lines, driver.histogram, driver.max_latency = 0, [0] * _BUCKETS, 0.0
            cpu_mark = time.process_time()
        elif command == "report":
            emit(
                {
                    "hellos": driver.hellos,
                    "first_hello_at": driver.first_hello_at,
                    "rendezvous_sent_at": driver.rendezvous_sent_at,
                    "lines": driver.lines,
                    "span_s": driver.last_line_at - driver.first_line_at,
                    "p50_ms": driver.percentile(0.5),
                    "p99_ms": driver.percentile(0.99),
                    "max_ms": round(driver.max_latency * 1000, 1),
                    "rss_mb": proc_status("VmRSS") / 1024,
                    "peak_mb": proc_status("VmHWM") / 1024,
                    "threads": peak_threads,
                    "cpu_s": time.process_time() - cpu_mark,
                    "stats": dict(driver.server.stats),
                }
            )
        elif command in ("quit", ""):
            driver.server.close()
            return


# -- an agent process ------------------------------------------------------------------------------


def run_agents(port: int, secret: str, first: int, count: int, connect_threads: int) -> None:
    raise_fd_limit()
    received: dict[int, float] = {}
    all_in = threading.Event()
    lock = threading.Lock()

    def on_message_of(node: int) -> Any:
        def on_message(message: protocol.Message) -> None:
            if isinstance(message, protocol.Rendezvous):
                with lock:
                    received[node] = time.time()
                    if len(received) == count:
                        all_in.set()

        return on_message

    def connect(node: int) -> ChannelClient:
        return ChannelClient(("127.0.0.1", port), secret, on_message_of(node), timeout_s=60.0)

    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(connect_threads) as pool:
        clients = list(pool.map(connect, range(first, first + count)))
    emit({"connected_at": time.time(), "started_at": started})
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "hello":
            for node, client in zip(range(first, first + count), clients, strict=True):
                client.send(protocol.Hello(node, "bench"))
            all_in.wait(60.0)
            emit({"rendezvous_last_at": max(received.values()) if received else None})
        elif command == "log":
            seconds, _, rate = argument.partition(" ")
            started = time.monotonic()
            deadline = started + float(seconds)
            per_s = float(rate) if rate else 0.0  # lines per second from this process; 0: flat out
            posted = dropped = 0
            nodes = list(range(first, first + count))
            stdout = protocol.Stream.STDOUT
            while time.monotonic() < deadline:
                if per_s:  # paced: a round of one line per agent when it is due
                    due = started + (posted + dropped) / per_s
                    if due > time.monotonic():
                        time.sleep(due - time.monotonic())
                for node, client in zip(nodes, clients, strict=True):
                    line = f"{time.time():.6f}|{node}|{posted}|{LINE_PAD}"
                    if client.post(protocol.Log(node, stdout, line)):
                        posted += 1
                    else:
                        dropped += 1
            flushed = all(client.flush(30.0) for client in clients)
            emit({"posted": posted, "dropped": dropped, "flushed": flushed})
        elif command == "quit":
            break
    for client in clients:
        client.close(flush_s=0.5)


class MuxAgent:
    """One simulated agent of a multiplexed process: the real handshake and frames, its lines
    batched for ``client.LINGER_S`` as ``ChannelClient`` does, no thread of its own."""

    def __init__(self, node: int, connection: tuple[Any, Any, bytearray]) -> None:
        self.node = node
        self.sock, self.sealer, self.inbox = connection
        self.pending: list[bytes] = []
        self.out = b""
        self.rendezvous_at: float | None = None

    def send(self, encoded: list[bytes]) -> bool:
        """Send a frame of ``encoded`` now if the socket takes it; False: dropped (full)."""
        if self.out:
            self.flush()
            if self.out:
                return False
        frame = self.sealer.seal(protocol.encode_batch(encoded))
        try:
            sent = self.sock.send(frame)
        except BlockingIOError:
            sent = 0
        self.out = frame[sent:]
        return True

    def flush(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except BlockingIOError:
            sent = 0
        self.out = self.out[sent:]

    def read(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        self.inbox += data
        while (body := frames.split_frame(self.inbox, frames.MAX_SEALED_BYTES)) is not None:
            for message in protocol.decode_batch(self.sealer.open(body), protocol.Route.TO_AGENT):
                if isinstance(message, protocol.Rendezvous):
                    self.rendezvous_at = time.time()


def run_mux_agents(port: int, secret: str, first: int, count: int, connect_threads: int) -> None:
    raise_fd_limit()
    key = frames.secret_key(secret)
    started = time.time()

    def connect(node: int) -> MuxAgent:
        deadline = time.monotonic() + 60.0
        return MuxAgent(node, client_module._connect(("127.0.0.1", port), key, deadline))

    with concurrent.futures.ThreadPoolExecutor(connect_threads) as pool:
        agents = list(pool.map(connect, range(first, first + count)))
    emit({"connected_at": time.time(), "started_at": started})
    selector = selectors.DefaultSelector()
    for agent in agents:
        selector.register(agent.sock, selectors.EVENT_READ, agent)
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "hello":
            for agent in agents:
                agent.send([protocol.encode(protocol.Hello(agent.node, "bench"))])
            waiting = set(range(len(agents)))
            deadline = time.monotonic() + 60.0
            while waiting and time.monotonic() < deadline:
                for key_, _ in selector.select(1.0):
                    agent = key_.data
                    agent.read()
                    if agent.rendezvous_at is not None:
                        waiting.discard(agent.node - first)
            last = [a.rendezvous_at for a in agents]
            emit({"rendezvous_last_at": None if None in last else max(last)})  # type: ignore[type-var]
        elif command == "log":
            seconds, _, rate = argument.partition(" ")
            started_s = time.monotonic()
            deadline = started_s + float(seconds)
            per_s = float(rate) if rate else 0.0
            posted = dropped = 0
            stdout = protocol.Stream.STDOUT
            since = time.monotonic()
            while time.monotonic() < deadline:
                if per_s:
                    due = started_s + (posted + dropped) / per_s
                    time.sleep(max(0.0, due - time.monotonic()))  # read the clock once
                for agent in agents:
                    line_ = f"{time.time():.6f}|{agent.node}|{posted}|{LINE_PAD}"
                    agent.pending.append(protocol.encode(protocol.Log(agent.node, stdout, line_)))
                    posted += 1
                if time.monotonic() - since >= client_module.LINGER_S:
                    since = time.monotonic()
                    for agent in agents:
                        if not agent.send(agent.pending):
                            dropped += len(agent.pending)
                            posted -= len(agent.pending)
                        agent.pending = []
            for agent in agents:
                if agent.pending and not agent.send(agent.pending):
                    dropped += len(agent.pending)
                    posted -= len(agent.pending)
                agent.pending = []
            flush_deadline = time.monotonic() + 30.0
            while any(a.out for a in agents) and time.monotonic() < flush_deadline:
                for agent in agents:
                    if agent.out:
                        agent.flush()
                time.sleep(0.001)
            emit({"posted": posted, "dropped": dropped, "flushed": not any(a.out for a in agents)})
        elif command == "quit":
            break
    for agent in agents:
        agent.sock.close()
