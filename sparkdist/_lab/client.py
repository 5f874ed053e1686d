"""The test process's end of the holder: JSON requests down its stdin, replies up its stdout.

This is the only way into the lab from outside: pipes to a child process, never a socket, so
nothing outside the holder ever sends to a lab address. Replies are matched to requests by id,
so several threads may wait on the holder at once (a run on the driver host while a fault is
injected on another host).

If this process dies, the holder's stdin closes, it exits, and the kernel ends the whole lab;
``PR_SET_PDEATHSIG`` on the holder covers a caller killed while the holder is busy.

Non-goals: what a request means (``holder``), hosts and addresses (``lab``).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any

from sparkdist._lab.support import unshare_prefix

_PR_SET_PDEATHSIG = 1


class LabError(RuntimeError):
    """The lab could not do what was asked (the holder's error, or the holder is gone)."""


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class HolderClient:
    """One holder process and its request/reply pipes."""

    def __init__(self, rootless: bool, log_path: str) -> None:
        self._log = open(log_path, "ab")
        self._proc = subprocess.Popen(
            [*unshare_prefix(rootless), sys.executable, "-m", "sparkdist._lab.holder"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            preexec_fn=_die_with_parent,
        )
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="sparkdist-lab-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            reply = json.loads(line)
            with self._lock:
                future = self._waiting.pop(reply["id"], None)
            if future is not None:
                future.set_result(reply)
        with self._lock:
            left, self._waiting = self._waiting, {}
        for future in left.values():
            future.set_exception(LabError("the lab's holder exited; see its log"))

    def call(self, op: str, timeout_s: float = 120.0, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply (``LabError`` if it failed)."""
        request_id = next(self._ids)
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._proc.poll() is not None:
                raise LabError(f"the lab's holder exited ({self._proc.returncode})")
            self._waiting[request_id] = future
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps({"id": request_id, "op": op, **fields}) + "\n")
            self._proc.stdin.flush()
        try:
            reply = future.result(timeout_s)
        except TimeoutError as error:
            raise LabError(f"the lab did not answer {op} within {timeout_s:.0f} s") from error
        if not reply.pop("ok"):
            raise LabError(f"{op}: {reply['error']}")
        reply.pop("id")
        return reply

    def close(self, timeout_s: float = 10.0) -> int:
        """End the holder, and with it every process of the lab; returns its exit status."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()  # the holder's cue: it exits, the kernel does the rest
            except OSError:
                pass
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout_s)
        self._log.close()
        return self._proc.returncode
