"""Starting a rank's process: forked from a warm zygote (``_zygote``) when one is available,
spawned cold otherwise. Both give the agent the same ``RankProcess`` interface.

One zygote per process that runs agents (the driver in local mode, each executor's Python worker
in Spark mode), started on first use and kept for later runs; it is replaced when the
interpreter or the environment it was started with changes, and ends with its owner. Set
``SPARKDIST_WORKER_POOL=0`` to always spawn cold.

Non-goals: what a rank does once started (``_worker``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import IO

from sparkdist._core.env import WORKER_POOL_VAR, ZYGOTE_VAR

logger = logging.getLogger("sparkdist")

POOL_VAR = WORKER_POOL_VAR
#: How long a zygote may take to import torch and start listening.
ZYGOTE_START_TIMEOUT_S = 120.0
#: Environment variables whose change makes a zygote stale (they shape imports).
_ENV_KEYS = (
    "PYTHONPATH",
    "PYTHONHOME",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "VIRTUAL_ENV",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
)


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


_WORKER_COMMAND = python_command("sparkdist._node.worker")


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


class _ColdProcess(RankProcess):
    def __init__(self, env: Mapping[str, str], ctrl_fds: tuple[int, int]) -> None:
        self._popen = subprocess.Popen(
            _WORKER_COMMAND,
            env=dict(env),
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


class _ForkedProcess(RankProcess):
    """A rank forked by the zygote; its exit status arrives on the request's connection."""

    def __init__(self, conn: socket.socket, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self._conn = conn
        self._lines = conn.makefile("rb")
        self.pid = int(json.loads(self._lines.readline())["pid"])
        self.stdout, self.stderr = stdout, stderr
        self.returncode = None
        self._lock = threading.Lock()
        self._done = threading.Event()

    def wait(self) -> int:
        with self._lock:
            if self.returncode is None:
                line = self._lines.readline()
                # No answer means the zygote died; the rank (if alive) is killed with its group.
                self.returncode = int(json.loads(line)["exit"]) if line else -signal.SIGKILL
                if not line:
                    _kill_group(self.pid)
                self._lines.close()
                self._conn.close()
                self._done.set()
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


def start_rank(env: Mapping[str, str], ctrl_fds: tuple[int, int]) -> RankProcess:
    """Start one rank with ``env``; ``ctrl_fds`` are its command-read and notes-write ends,
    whose numbers ``env`` already names (they are renumbered when the rank is forked)."""
    zygote = _shared_zygote()
    if zygote is not None:
        try:
            return zygote.fork(env, ctrl_fds)
        except OSError as exc:
            logger.warning("sparkdist: warm worker pool failed (%s); starting ranks cold", exc)
            _drop_zygote(zygote)
    return _ColdProcess(env, ctrl_fds)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Zygote:
    def __init__(self, key: tuple[str, ...]) -> None:
        self.key = key
        # Not "sparkdist-*": that prefix marks one run's directory, removed with the run.
        self.directory = tempfile.mkdtemp(prefix="sparkdist_pool-")
        self.socket_path = os.path.join(self.directory, "zygote.sock")
        env = dict(os.environ)
        env[ZYGOTE_VAR] = "1"
        self.process = subprocess.Popen(
            python_command("sparkdist._node.zygote", self.socket_path),
            stdin=subprocess.PIPE,  # its end of file tells the zygote we are gone
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], ZYGOTE_START_TIMEOUT_S)
        if not ready or self.process.stdout.readline().strip() != b"ready":
            self.close()
            raise OSError("the worker pool's zygote did not start")

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, env: Mapping[str, str], ctrl_fds: tuple[int, int]) -> RankProcess:
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket_path)
            body = json.dumps({"env": dict(env), "cwd": os.getcwd()}).encode()
            socket.send_fds(conn, [len(body).to_bytes(4, "big")], [out_write, err_write, *ctrl_fds])
            conn.sendall(body)
            process = _ForkedProcess(conn, os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))
        except (OSError, ValueError) as exc:
            conn.close()
            os.close(out_read)
            os.close(err_read)
            raise OSError(f"spawn request failed: {exc}") from exc
        finally:
            os.close(out_write)
            os.close(err_write)
        return process

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        shutil.rmtree(self.directory, ignore_errors=True)


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _shared_zygote() -> _Zygote | None:
    global _zygote
    if os.environ.get(POOL_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    key = (sys.executable, *(f"{k}={os.environ.get(k, '')}" for k in _ENV_KEYS))
    with _zygote_lock:
        if _zygote is not None and (_zygote.key != key or not _zygote.alive()):
            _zygote.close()
            _zygote = None
        if _zygote is None:
            try:
                _zygote = _Zygote(key)
            except OSError as exc:
                logger.warning("sparkdist: no warm worker pool (%s); starting ranks cold", exc)
                return None
        return _zygote


def _drop_zygote(zygote: _Zygote) -> None:
    global _zygote
    with _zygote_lock:
        zygote.close()
        if _zygote is zygote:
            _zygote = None


def shutdown() -> None:
    """Stop this process's warm pool (it also ends on its own when this process exits)."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


atexit.register(shutdown)
