"""A rank's process as the agent holds it, whichever way it started, and the cold start.

``RankProcess`` is the interface (pid, output pipes, exit status); ``ColdProcess`` starts the
worker as a fresh interpreter (``python_command``). A warm start is ``zygote_client``'s.
``StartStop`` is the agent's stop as a start in progress sees it.

Non-goals: choosing warm or cold (``pool``); what a rank does (``worker``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import IO

from sparkdist._core.env import PARENT_PID_VAR


def python_command(module: str, *args: str) -> list[str]:
    """``python -c`` running ``module.main()``, minus the implicit working-directory entry that
    ``-c`` puts first on ``sys.path``: a ``torch.py`` or ``cloudpickle.py`` lying in the
    directory a rank starts in must not shadow the real package. Ranks import exactly what the
    driver would: its ``sys.path``, passed explicitly in ``PYTHONPATH`` (``_backends.local``).
    """
    code = (
        f"import sys; sys.path[:] = [p for p in sys.path if p]; from {module} import main; main()"
    )
    return [sys.executable, "-c", code, *args]


_WORKER_COMMAND = python_command("sparkdist._node.rank.worker")


class RankProcess:
    """A started rank: its pid (also its process group), output pipes, and exit status."""

    pid: int
    stdout: IO[bytes]
    stderr: IO[bytes]
    returncode: int | None

    def wait(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def poll(self) -> int | None:  # pragma: no cover - interface
        raise NotImplementedError


class ColdProcess(RankProcess):
    """A rank started as a fresh interpreter: about a second of torch import, no zygote."""

    def __init__(self, env: Mapping[str, str], ctrl_fds: tuple[int, int]) -> None:
        env = dict(env)
        # Started from the agent's thread, which outlives the rank: the rank asks the kernel
        # to end it with that thread (``parent_death``), checking it is still our child.
        env[PARENT_PID_VAR] = str(os.getpid())
        self._popen = subprocess.Popen(
            _WORKER_COMMAND,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=ctrl_fds,
            start_new_session=True,  # its own group: Ctrl-C is ours, killpg reaches children
        )
        assert self._popen.stdout is not None and self._popen.stderr is not None
        self.pid = self._popen.pid
        self.stdout, self.stderr = self._popen.stdout, self._popen.stderr
        self.returncode = None

    def wait(self) -> int:
        self.returncode = self._popen.wait()
        return self.returncode

    def poll(self) -> int | None:
        self.returncode = self._popen.poll()
        return self.returncode


class StartStopped(Exception):
    """A rank's start was given up because its agent was stopped meanwhile: nothing is to be
    started in its place (not even cold)."""


class StartStop:
    """The agent's stop, reaching a rank's start that waits on a zygote.

    A frozen zygote accepts a spawn request and never answers; its requester would wait out
    the whole answer deadline, and the agent's stop (a start deadline passed, a cancel) could
    not end the agent before. ``set`` shuts the waiting request's socket down, which wakes its
    wait at once; the start then raises ``StartStopped``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reason: str | None = None
        self._waiting: set[socket.socket] = set()

    def set(self, reason: str) -> None:
        """Stop every start now and to come, from any thread."""
        with self._lock:
            if self.reason is None:
                self.reason = reason
            # Under the lock: a socket leaves ``_waiting`` (under it too) before it is closed,
            # so a shut-down never reaches a descriptor number reused since.
            for sock in self._waiting:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def check(self) -> None:
        """Raise ``StartStopped`` if the agent was stopped."""
        if self.reason is not None:
            raise StartStopped(self.reason)

    @contextlib.contextmanager
    def interrupting(self, sock: socket.socket) -> Iterator[None]:
        """While inside, ``set`` wakes any wait on ``sock`` (close it only after leaving)."""
        with self._lock:
            self.check()
            self._waiting.add(sock)
        try:
            yield
        finally:
            with self._lock:
                self._waiting.discard(sock)
