"""The warm worker pool's server: a process that imported torch once and forks ranks on demand.

A cold rank pays about a second to import torch; a rank forked from this process pays a few
milliseconds. The zygote imports torch but never initialises CUDA (so forking stays safe: no
CUDA context, no threads of its own), then serves spawn requests on a Unix socket in a 0700
directory:

1. the client sends a 4-byte length with four file descriptors attached (the rank's stdout and
   stderr write ends, its command pipe's read end and its notes pipe's write end), then a JSON
   body: ``{"env": {...}, "cwd": "..."}``;
2. the zygote forks; the child becomes a fresh rank: new session, those descriptors as
   stdout/stderr and control pipes, exactly the requested environment, working directory and
   ``sys.path``, reseeded random generators, then ``_worker.main()``;
3. the zygote answers ``{"pid": pid}`` and, when the child exits, ``{"exit": code}`` (negative:
   killed by that signal) on the same connection.

Every rank is forked from the pristine zygote, never from a previous rank, so nothing of one run
(environment, CUDA_VISIBLE_DEVICES, user modules, cwd) leaks into the next. End of file on the
zygote's stdin means its owner died: it exits (its ranks notice their own agent is gone).

Non-goals: deciding when a pool is used or replaced (``_pool``).
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import struct
import sys
from typing import Any

_HEADER = struct.Struct(">I")
#: Descriptors sent with each request, in order.
FDS_PER_REQUEST = 4


def main() -> None:
    socket_path = sys.argv[1]
    # The warm part: what every rank would otherwise import itself.
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from sparkdist import _worker  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    try:
        _serve(listener, wake_read, children)
    finally:
        listener.close()
        try:
            os.unlink(socket_path)
        except OSError:
            pass


def _serve(listener: socket.socket, wake_read: int, children: dict[int, socket.socket]) -> None:
    stdin = sys.stdin.fileno()
    while True:
        try:
            readable, _, _ = select.select([stdin, listener, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in readable:
            os.read(wake_read, 4096)
        _reap(children)
        if stdin in readable and not os.read(stdin, 4096):
            return  # the owner is gone
        if listener in readable:
            conn, _ = listener.accept()
            try:
                _spawn(listener, conn, wake_read, children)
            except (OSError, ValueError):
                conn.close()


def _spawn(
    listener: socket.socket, conn: socket.socket, wake_read: int,
    children: dict[int, socket.socket],
) -> None:
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, FDS_PER_REQUEST)
    if len(fds) != FDS_PER_REQUEST or len(header) != _HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ValueError("malformed spawn request")
    (size,) = _HEADER.unpack(header)
    request = json.loads(_recv_exact(conn, size))
    pid = os.fork()
    if pid == 0:  # the new rank
        try:
            listener.close()
            conn.close()
            os.close(wake_read)
            for other in children.values():
                other.close()
            _become_rank(request, fds)
        except BaseException:  # noqa: BLE001 - a child must never return into the server
            import traceback

            traceback.print_exc()
            os._exit(70)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        try:
            conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass
        conn.close()


def _become_rank(request: dict[str, Any], fds: list[int]) -> None:
    stdout_w, stderr_w, ctrl_in, ctrl_out = fds
    os.setsid()  # its own group: the agent's killpg reaches it and its children
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout_w, 1)
    os.dup2(stderr_w, 2)
    for fd in (devnull, stdout_w, stderr_w):
        os.close(fd)
    # Unbuffered text streams on the new descriptors, as PYTHONUNBUFFERED gives a fresh rank.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    env = {str(k): str(v) for k, v in request["env"].items()}
    from sparkdist import _worker

    env[_worker.CTRL_IN_VAR] = str(ctrl_in)
    env[_worker.CTRL_OUT_VAR] = str(ctrl_out)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    sys.argv = ["-c"]
    _reseed()
    _worker.main()
    os._exit(0)


def _reseed() -> None:
    """A fresh interpreter seeds its generators from the OS; a fork inherits the zygote's."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = conn.recv(min(size, 1 << 16))
        if not chunk:
            raise ValueError("spawn request cut short")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    main()
