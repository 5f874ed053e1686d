"""The driver's side of one zygote (``zygote``): starting it, asking it for a rank, ending it.

A forked rank's exit code arrives on its request's connection; the kernel (a pidfd) says when
it exits, so a stuck zygote never hides a rank's end (the code then comes from ``/proc``).

Non-goals: which zygote a rank uses, leases and retirement (``pool``); the zygote's own side
(``zygote``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO

from sparkdist._core.env import CHECKPOINT_DIR_VAR, ZYGOTE_VAR
from sparkdist._core.files import make_owned_dir, unix_socket_address
from sparkdist._node.pool.rank_process import (
    RankProcess,
    StartStop,
    StartStopped,
    python_command,
)
from sparkdist._node.pool.zygote import PREPARED_ARG

#: How long a zygote may take to import torch and start listening.
ZYGOTE_START_TIMEOUT_S = 120.0
#: How long a zygote may take to answer a spawn request with the rank's pid (spares are forked
#: ahead, so the answer normally takes milliseconds): past it the zygote counts as stuck.
FORK_ANSWER_TIMEOUT_S = 5.0
#: After the kernel says a forked rank exited, how long its zygote may take to report the code.
EXIT_ANSWER_TIMEOUT_S = 5.0
#: Variables of a rank's environment that shape what a zygote imports (torch's native
#: libraries, the packages found first): two ranks that differ here need different zygotes.
IMPORT_VARS = (
    "PYTHONPATH",
    "PYTHONHOME",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "VIRTUAL_ENV",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
)
#: The ``kind`` of a zygote's directory (``_core.files.make_owned_dir``).
POOL_DIR_KIND = "pool"

ZygoteKey = tuple[str, ...]


def prepares_restarts(env: Mapping[str, str]) -> bool:
    """Whether a rank with ``env`` belongs to a run that checkpoints, and so may restart: its
    zygote also holds what a restarted rank's checkpoint load and first DDP import (~1 s),
    imported once per zygote instead of in every rank of every attempt."""
    return bool(env.get(CHECKPOINT_DIR_VAR))


class Zygote:
    """One zygote process, started with the import-time variables of ``import_env``;
    ``leases`` and ``retired`` belong to the pool (guarded by its lock)."""

    def __init__(
        self,
        key: ZygoteKey,
        import_env: Mapping[str, str],
        *,
        on_rank_end: Callable[[Zygote], None],
        on_stuck: Callable[[Zygote, str], None],
        stop: StartStop | None = None,
    ) -> None:
        self.key = key
        self.on_rank_end = on_rank_end  # a rank forked from it ended
        self.on_stuck = on_stuck  # it failed to answer in time
        self.leases = 0
        self.retired = False
        self.last_used = time.monotonic()
        self.process: subprocess.Popen[bytes] | None = None
        self.directory = make_owned_dir(POOL_DIR_KIND, "zygote")
        try:
            self._start(import_env, stop if stop is not None else StartStop())
        except BaseException:
            self.close()
            raise

    def _start(self, import_env: Mapping[str, str], stop: StartStop) -> None:
        """Start the zygote and wait for its "ready" (it imports torch: seconds), or for the
        agent's stop: a zygote stuck in its imports must not hold a run past its start
        deadline (``StartStopped``; the caller's ``close`` ends it)."""
        self.socket_path = os.path.join(self.directory, "zygote.sock")
        env = {k: v for k, v in os.environ.items() if k not in IMPORT_VARS}
        env.update({k: import_env[k] for k in IMPORT_VARS if import_env.get(k)})
        env[ZYGOTE_VAR] = "1"
        self.process = subprocess.Popen(
            python_command(
                "sparkdist._node.pool.zygote",
                self.socket_path,
                *([PREPARED_ARG] if PREPARED_ARG in self.key else []),  # ``pool.zygote_key``
            ),
            stdin=subprocess.PIPE,  # its end of file tells the zygote we are gone
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        # The stop shuts ``woken``'s peer down: ``woken`` then reads end of file, at once.
        woken, waker = socket.socketpair()
        try:
            with stop.interrupting(waker):
                watched: list[int] = [self.process.stdout.fileno(), woken.fileno()]
                ready, _, _ = select.select(watched, [], [], ZYGOTE_START_TIMEOUT_S)
        finally:
            woken.close()
            waker.close()
        stop.check()
        if not ready or self.process.stdout.readline().strip() != b"ready":
            raise OSError("the worker pool's zygote did not start")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def fork(
        self, env: Mapping[str, str], ctrl_fds: tuple[int, int], stop: StartStop | None = None
    ) -> RankProcess:
        """Ask the zygote for a rank.

        Raises:
            OSError: the zygote failed the request (it is stuck or gone): start the rank cold.
            StartStopped: ``stop`` came first (the agent's stop wakes the wait at once).
        """
        stop = stop if stop is not None else StartStop()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        # Owned by these objects from here on (closed once, by them, whatever happens).
        stdout, stderr = os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with stop.interrupting(conn):
                conn.settimeout(FORK_ANSWER_TIMEOUT_S)  # a stuck zygote's full backlog blocks too
                with unix_socket_address(self.socket_path) as address:
                    conn.connect(address)
                body = json.dumps({"env": dict(env), "cwd": os.getcwd()}).encode()
                header = [len(body).to_bytes(4, "big")]
                socket.send_fds(conn, header, [out_write, err_write, *ctrl_fds])
                conn.sendall(body)
                conn.settimeout(None)
                process = ForkedProcess(self, conn, stdout, stderr)
        except BaseException as exc:
            conn.close()
            stdout.close()
            stderr.close()
            if stop.reason is not None:  # whatever broke the request, the stop came first
                raise StartStopped(stop.reason) from exc
            if isinstance(exc, (OSError, ValueError)):
                raise OSError(f"spawn request failed: {exc}") from exc
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
        return process

    def close(self) -> None:
        """End the zygote (its idle spares and any rank it still has go with it)."""
        process = self.process
        if process is not None:
            if process.poll() is None:
                process.kill()
                process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    stream.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class ForkedProcess(RankProcess):
    """A rank forked by a zygote; its exit code arrives on the request's connection, and the
    kernel (a pidfd) says when it exits, so a stuck zygote never hides a rank's end."""

    def __init__(
        self, zygote: Zygote, conn: socket.socket, stdout: IO[bytes], stderr: IO[bytes]
    ) -> None:
        self._zygote = zygote
        self._conn = conn
        self._buffer = b""
        answer = self._read_line(time.monotonic() + FORK_ANSWER_TIMEOUT_S)
        if answer is None:
            raise OSError(f"no answer to a spawn request within {FORK_ANSWER_TIMEOUT_S:g} s")
        self.pid = int(json.loads(answer)["pid"])
        self.stdout, self.stderr = stdout, stderr
        self.returncode = None
        self._lock = threading.Lock()

    def wait(self) -> int:
        with self._lock:
            if self.returncode is None:
                try:
                    self.returncode = self._await_exit()
                finally:
                    self._conn.close()
                    self._zygote.on_rank_end(self._zygote)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def _await_exit(self) -> int:
        pidfd = _open_pidfd(self.pid)
        try:
            while True:
                watched: list[int | socket.socket] = [self._conn]
                if pidfd is not None:
                    watched.append(pidfd)
                line = self._buffered_line()
                if line is None:
                    readable, _, _ = select.select(watched, [], [])
                    if self._conn in readable:
                        if self._receive():
                            continue
                        # The zygote died: its rank (if alive) goes with its group.
                        _kill_group(self.pid)
                        return -signal.SIGKILL
                    # The rank exited: its zygote reports the code within a moment, or is stuck.
                    line = self._read_line(time.monotonic() + EXIT_ANSWER_TIMEOUT_S)
                    if line is None:
                        self._zygote.on_stuck(self._zygote, "it did not report a rank's exit")
                        return _zombie_exit_code(self.pid)
                return int(json.loads(line)["exit"])
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _buffered_line(self) -> bytes | None:
        line, newline, rest = self._buffer.partition(b"\n")
        if not newline:
            return None
        self._buffer = rest
        return line

    def _receive(self) -> bool:
        chunk = self._conn.recv(4096)
        self._buffer += chunk
        return bool(chunk)

    def _read_line(self, deadline: float) -> bytes | None:
        """The next line from the zygote, or None at ``deadline`` or its end of file."""
        while (line := self._buffered_line()) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._conn], [], [], left)[0]:
                return None
            if not self._receive():
                return None
        return line


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None  # already reaped, or no pidfds here: the zygote's answer alone tells


def _zombie_exit_code(pid: int) -> int:
    """The exit code of an exited, unreaped rank, from ``/proc`` (its zygote is stuck)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return os.waitstatus_to_exitcode(int(fields[-1]))  # field 52: exit_code, as waitpid
    except (OSError, ValueError, IndexError):
        return -signal.SIGKILL


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
