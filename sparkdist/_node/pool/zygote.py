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

A zygote for the ranks of a run that checkpoints (started with ``PREPARED_ARG``) also imports
``PREPARED_MODULES`` before it says "ready": what a restarted rank's checkpoint load and its
first DistributedDataParallel would import (~1 s), paid once per zygote instead of by every rank
of every attempt, and never while a fork answer waits (a long import after "ready" would hold
up every answer).

Every rank is forked from the pristine zygote, never from a previous rank, so nothing of one run
(environment, CUDA_VISIBLE_DEVICES, user modules, cwd) leaks into the next. End of file on the
zygote's stdin means its owner died: its ranks see their control pipes close and end themselves;
after ``OWNER_GONE_GRACE_S`` the zygote exits, and the kernel kills whatever rank is left (each
asked for that at fork: ``parent_death``), even one stuck in a C call.

Non-goals: deciding when a pool is used or replaced (``_pool``).
"""

from __future__ import annotations

import gc
import importlib
import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import sys
import time
from typing import Any

from sparkdist._core.files import unix_socket_address
from sparkdist._node.host.parent_death import die_with_parent

_HEADER = struct.Struct(">I")
#: Descriptors sent with each request, in order.
FDS_PER_REQUEST = 4
#: Spares kept parked: at least this many, and as many as ranks ever ran at once (capped).
MIN_SPARES = 2
MAX_SPARES = 16
#: Spares are forked again once no request came for this long (a run's requests come together).
REPLENISH_AFTER_QUIET_S = 0.05
#: What a prepared zygote imports beyond the warm part: a restarted rank's checkpoint load and
#: first DistributedDataParallel import them (~0.9 s on a quiet core).
PREPARED_MODULES = ("torch.distributed.checkpoint", "torch._dynamo")
#: The argument that makes a zygote prepared.
PREPARED_ARG = "--prepared"
#: After its owner died, how long the zygote lets its ranks end themselves before it exits.
OWNER_GONE_GRACE_S = 0.5
#: The process name of a parked spare (15 characters at most).
SPARE_NAME = "sparkdist-spare"
#: A forked rank's process name is this plus its global rank ("sparkdist-r3"): its environment
#: block is the zygote's, so this is how ps (and leak checks) tell a pooled rank.
RANK_NAME_PREFIX = "sparkdist-r"


def main() -> None:
    socket_path = sys.argv[1]
    # The warm part: what every rank would otherwise import itself.
    import cloudpickle  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401

    from sparkdist._node.rank import worker as _worker  # noqa: F401
    from sparkdist._wire import payload  # noqa: F401 - unpickling every job needs it

    if PREPARED_ARG in sys.argv[2:]:
        for name in PREPARED_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - only a head start: a rank imports what it needs
                continue

    # Move everything imported so far out of the collector's reach: a forked rank's first
    # collection would otherwise touch (and so copy) every page of the inherited heap.
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_socket_address(socket_path) as address:
        listener.bind(address)
    listener.listen(64)
    server = _Server(listener)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        server.serve()
    finally:
        listener.close()
        # The owner may have died without cleaning up (an executor's Python worker is
        # killed, not stopped): the pool directory is ours to remove.
        shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)


class _Spare:
    """A forked child parked before becoming a rank: fork and first-touch costs are paid."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock


class _Server:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select via the wakeup fd
        self.children: dict[int, socket.socket] = {}  # rank pid -> its requester
        self.spares: list[_Spare] = []
        self.spare_target = MIN_SPARES
        self._replenish()

    def serve(self) -> None:
        stdin = sys.stdin.fileno()
        replenish_at: float | None = None  # spares are made once requests pause
        while True:
            wait = None if replenish_at is None else max(0.0, replenish_at - time.monotonic())
            try:
                readable, _, _ = select.select([stdin, self.listener, self.wake_read], [], [], wait)
            except InterruptedError:
                continue
            if not readable:
                # A quiet moment after a burst: fork the spares now, off every rank's path (a
                # fork of this torch-sized process takes 10-15 ms; between two requests of one
                # run it would delay the next rank by as much).
                self._replenish()
                replenish_at = None
                continue
            if self.wake_read in readable:
                os.read(self.wake_read, 4096)
            self._reap()
            if stdin in readable and not os.read(stdin, 4096):
                self._let_ranks_end()
                return  # the owner is gone
            if self.listener in readable:
                conn, _ = self.listener.accept()
                try:
                    self._hand_out(conn)
                except (OSError, ValueError):
                    conn.close()
                replenish_at = time.monotonic() + REPLENISH_AFTER_QUIET_S

    def _let_ranks_end(self) -> None:
        """The owner died: its ranks see their control pipes close and end themselves (and
        what they started); give them a moment before this process's exit ends them outright
        (each asked the kernel to kill it with the zygote)."""
        deadline = time.monotonic() + OWNER_GONE_GRACE_S
        while self.children and time.monotonic() < deadline:
            time.sleep(0.02)
            self._reap()

    def _hand_out(self, conn: socket.socket) -> None:
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, FDS_PER_REQUEST)
        try:
            if len(fds) != FDS_PER_REQUEST or len(header) != _HEADER.size:
                raise ValueError("malformed spawn request")
            (size,) = _HEADER.unpack(header)
            body = _recv_exact(conn, size)
            if _hung_up(conn):
                # The requester gave up waiting (this process was stuck) and started the rank
                # cold: forking it now would run the same rank twice on the same pipes.
                raise ValueError("the requester hung up")
            spare = self.spares.pop(0) if self.spares else self._fork_spare()
            socket.send_fds(spare.sock, [header], fds)
            spare.sock.sendall(body)
        finally:
            for fd in fds:
                os.close(fd)
        spare.sock.close()
        self.children[spare.pid] = conn
        conn.sendall(json.dumps({"pid": spare.pid}).encode() + b"\n")
        # Keep as many spares as ranks were ever running at once here (a run's burst).
        self.spare_target = min(MAX_SPARES, max(self.spare_target, len(self.children)))

    def _replenish(self) -> None:
        while len(self.spares) < self.spare_target:
            self.spares.append(self._fork_spare())

    def _fork_spare(self) -> _Spare:
        parent_end, child_end = socket.socketpair()
        zygote_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                # Ends with the zygote, whatever it is doing then: the zygote ends with its
                # owner, so no rank outlives the driver (or executor) that asked for it.
                die_with_parent(zygote_pid)
                parent_end.close()
                self.listener.close()
                os.close(self.wake_read)
                signal.set_wakeup_fd(-1)
                for conn in self.children.values():
                    conn.close()
                for spare in self.spares:
                    spare.sock.close()
                _park(child_end)
            except BaseException:  # noqa: BLE001 - a child must never return into the server
                import traceback

                traceback.print_exc()
            os._exit(70)
        child_end.close()
        return _Spare(pid, parent_end)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.spares = [s for s in self.spares if s.pid != pid]
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            try:
                message = {"exit": os.waitstatus_to_exitcode(status)}
                conn.sendall(json.dumps(message).encode() + b"\n")
            except OSError:
                pass
            conn.close()


def _park(sock: socket.socket) -> None:
    """Wait, as a spare, for a request; then become that rank (never returns)."""
    os.setsid()  # its own group: the agent's killpg reaches it and its children
    _set_process_name(SPARE_NAME)
    for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    _reseed()  # while parked: it costs ~20 ms, off the launch path
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, FDS_PER_REQUEST)
    if len(header) != _HEADER.size:
        os._exit(0)  # the zygote is gone: nothing to become
    (size,) = _HEADER.unpack(header)
    request = json.loads(_recv_exact(sock, size))
    sock.close()
    _set_process_name(f"{RANK_NAME_PREFIX}{request['env'].get('RANK', '')}")
    _become_rank(request, fds)


def _set_process_name(name: str) -> None:
    """Name the process (what ps and psutil show) so an idle spare is told from a rank."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _become_rank(request: dict[str, Any], fds: list[int]) -> None:
    stdout_w, stderr_w, ctrl_in, ctrl_out = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout_w, 1)
    os.dup2(stderr_w, 2)
    for fd in (devnull, stdout_w, stderr_w):
        os.close(fd)
    # Unbuffered text streams on the new descriptors, as PYTHONUNBUFFERED gives a fresh rank.
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    env = {str(k): str(v) for k, v in request["env"].items()}
    from sparkdist._node.rank import worker as _worker

    env[_worker.CTRL_IN_VAR] = str(ctrl_in)
    env[_worker.CTRL_OUT_VAR] = str(ctrl_out)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    sys.argv = ["-c"]
    _apply_import_time_settings(env)
    _worker.main()
    os._exit(0)


def _apply_import_time_settings(env: dict[str, str]) -> None:
    """Redo what torch read from the environment when the zygote imported it."""
    threads = env.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _reseed() -> None:
    """A fresh interpreter seeds its generators from the OS; a fork inherits the zygote's."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _hung_up(conn: socket.socket) -> bool:
    """Whether the peer of ``conn`` closed it (nothing more to read, end of file)."""
    if not select.select([conn], [], [], 0)[0]:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


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
