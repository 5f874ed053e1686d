"""The probe's sockets: a listener that counts the tasks presenting a token, the knock on it,
and this host's own lookups, each bounded.

A knock is one line, ``<word> <token> <task>``; the answer ``<word> ok <token>``. A task counts
a listener as reached only when it answers with the token (a stray service on that port does
not count), and the listener counts only knocks that carry it (a stray connection does not).

Non-goals: Spark (``network_probe``), judging (``network``).
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sparkdist._core.addresses import ip_literal, pick_address
from sparkdist._core.supported import SUPPORTED
from sparkdist._core.versions import installed_version
from sparkdist._doctor.network import NodeObservation, Reach
from sparkdist._node.host.interfaces import interface_of

#: Each connection attempt, and each name lookup, gets this long.
CONNECT_TIMEOUT_S = 5.0
_WORD = "sparkdist-doctor-probe"
_MAX_LINE_BYTES = 256
T = TypeVar("T")


class TokenListener:
    """A TCP listener on one address that counts the tasks presenting the token.

    A knock is one line, ``<word> <token> <task>``; the answer ``<word> ok <token>``. Anything
    else is closed unanswered. Pending connections, line sizes and the listener's life are
    bounded; it serves on its own thread until ``close`` or ``timeout_s``.
    """

    def __init__(self, host: str, token: str, expected: int, timeout_s: float) -> None:
        family = socket.AF_INET6 if (ip := ip_literal(host)) and ip.version == 6 else 0
        infos = socket.getaddrinfo(host, 0, family, socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        self._socket = socket.socket(family, kind, proto)
        try:
            self._socket.bind(address)
            self._socket.listen(min(expected + 16, 1024))
        except OSError:
            self._socket.close()
            raise
        self._socket.setblocking(False)
        self.port = int(self._socket.getsockname()[1])
        self._token = token
        self._expected = expected
        self._deadline = time.monotonic() + timeout_s
        self._closing = threading.Event()
        self.seen: set[int] = set()
        self._all_seen = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sparkdist-doctor", daemon=True)
        self._thread.start()

    def wait_for_all(self, timeout_s: float) -> bool:
        """Wait until every expected task knocked; False when ``timeout_s`` passed first."""
        return self._all_seen.wait(timeout_s)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._closing.set()
        self._thread.join(2.0)

    def _serve(self) -> None:
        pending: dict[socket.socket, tuple[bytearray, float]] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(self._socket, selectors.EVENT_READ)
            while not self._closing.is_set() and time.monotonic() < self._deadline:
                for key, _ in selector.select(timeout=0.1):
                    if key.fileobj is self._socket:
                        self._accept(selector, pending)
                    else:
                        self._read(selector, pending, key.fileobj)  # type: ignore[arg-type]
                stale = time.monotonic() - CONNECT_TIMEOUT_S
                for conn in [c for c, (_, at) in pending.items() if at < stale]:
                    self._drop(selector, pending, conn)
            for conn in list(pending):
                self._drop(selector, pending, conn)
        self._socket.close()

    def _accept(self, selector: selectors.BaseSelector, pending: dict[Any, Any]) -> None:
        try:
            conn, _ = self._socket.accept()
        except OSError:
            return
        if len(pending) >= self._expected + 16:
            conn.close()
            return
        conn.setblocking(False)
        pending[conn] = (bytearray(), time.monotonic())
        selector.register(conn, selectors.EVENT_READ)

    def _read(
        self, selector: selectors.BaseSelector, pending: dict[Any, Any], conn: socket.socket
    ) -> None:
        buffer, _ = pending[conn]
        try:
            data = conn.recv(_MAX_LINE_BYTES)
        except OSError:
            data = b""
        buffer.extend(data)
        if not data or len(buffer) > _MAX_LINE_BYTES:
            self._drop(selector, pending, conn)
            return
        if b"\n" not in buffer:
            return
        words = buffer.split(b"\n", 1)[0].decode("ascii", "replace").split()
        if len(words) == 3 and words[0] == _WORD and secrets.compare_digest(words[1], self._token):
            with contextlib.suppress(OSError, ValueError):
                conn.setblocking(True)
                conn.settimeout(1.0)
                conn.sendall(f"{_WORD} ok {self._token}\n".encode())
                self.seen.add(int(words[2]))
                if len(self.seen) >= self._expected:
                    self._all_seen.set()
        self._drop(selector, pending, conn)

    @staticmethod
    def _drop(selector: selectors.BaseSelector, pending: dict[Any, Any], conn: Any) -> None:
        pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn)
        conn.close()


def knock(host: str, port: int, token: str, task: int, timeout_s: float) -> Reach:
    """Knock on a ``TokenListener``: reached only when it answers with the token."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    started = time.monotonic()
    deadline = started + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(f"{_WORD} {token} {task}\n".encode())
            answer = b""
            while b"\n" not in answer and len(answer) <= _MAX_LINE_BYTES:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                data = conn.recv(_MAX_LINE_BYTES)
                if not data:
                    break
                answer += data
    except ConnectionRefusedError:
        return Reach(target, False, "connection refused", time.monotonic() - started)
    except TimeoutError:
        return Reach(target, False, f"no answer within {timeout_s:g} s", time.monotonic() - started)
    except OSError as exc:
        return Reach(target, False, exc.strerror or str(exc), time.monotonic() - started)
    took = time.monotonic() - started
    if answer.split(b"\n", 1)[0] != f"{_WORD} ok {token}".encode():
        return Reach(target, False, "answered without the token (another service?)", took)
    return Reach(target, True, "", took)


def bounded(call: Callable[[], T], timeout_s: float) -> T:
    """``call()`` on a daemon thread, given up after ``timeout_s`` (a slow DNS lookup).

    Raises:
        TimeoutError: it took longer.
        Exception: what ``call`` raised.
    """
    answers: queue.Queue[tuple[bool, Any]] = queue.Queue(1)

    def run() -> None:
        try:
            answers.put((True, call()))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            answers.put((False, exc))

    threading.Thread(target=run, name="sparkdist-doctor-lookup", daemon=True).start()
    try:
        ok, value = answers.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def resolve(name: str) -> list[str]:
    """``name``'s addresses, in the resolver's order."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def observe_here(task: int, address: str, timeout_s: float) -> NodeObservation:
    """This host's part of a task's observation (nothing connected yet)."""
    name = socket.gethostname()
    addresses: tuple[str, ...] = ()
    error = ""
    try:
        addresses = tuple(bounded(lambda: resolve(name), timeout_s))
    except (OSError, UnicodeError, TimeoutError) as exc:
        error = str(exc)
    held = address
    if ip_literal(address) is None:  # Spark named the executor by name: its address
        with contextlib.suppress(OSError, UnicodeError, TimeoutError):
            held = pick_address(bounded(lambda: resolve(address), timeout_s)) or address
    return NodeObservation(
        task=task,
        address=address,
        interface=interface_of(held) or "",
        host_name=name,
        name_addresses=addresses,
        name_error=error,
        versions={entry.name: installed_version(entry.name) for entry in SUPPORTED},
    )
