"""Files a run writes: private to this user, written whole, and swept when their owner died.

Three rules for every file and directory sparkdist creates on a machine:

- private: directories 0700, files 0600, whatever the umask (other users of a shared machine
  may neither read a pickled job or a checkpoint nor plant files in our directories);
- whole: a file a reader could see while it is written goes to a fresh ``mkstemp`` name in the
  same directory, is flushed and fsynced, then renamed over its final name, and the directory
  is fsynced, so a crash leaves the old file or the new one, never half of one;
- swept: a per-run directory carries its owner's host and pid in its name, so the next start
  removes what a killed driver left behind (this user's only, and only once its owner is gone).

Non-goals: deciding what a run writes where (the callers), removing what a live run still
uses.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

#: Modes of what sparkdist creates (the umask can only take bits away from these).
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600

#: The kind of an agent's run directory (``agent_run_dir_prefix``); every other kind names
#: ``make_owned_dir`` directories.
AGENT_RUN_KIND = "run"


def _owned_dir_pattern(kind: str) -> re.Pattern[str]:
    if kind == AGENT_RUN_KIND:  # sparkdist-<run id>-<node rank>-<host tag>-<pid>-<random>
        return re.compile(r"^sparkdist-[0-9a-f]+-\d+-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-")
    # sparkdist_<kind>-<host tag>-<pid>-<run id>-<random>: not "sparkdist-*", which marks an
    # agent's run directory (removed with its run; tests look for leftovers by that prefix).
    return re.compile(rf"^sparkdist_{re.escape(kind)}-(?P<host>[0-9a-f]{{8}})-(?P<pid>\d+)-")


def make_private_dirs(path: str) -> None:
    """Create ``path`` and every missing parent with mode 0700; existing ones stay as they are.

    ``os.makedirs(mode=...)`` applies the mode to the last component only; here every
    directory this call creates is private.
    """
    path = os.path.abspath(path)
    missing: list[str] = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, PRIVATE_DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue
        os.chmod(directory, PRIVATE_DIR_MODE)  # mkdir's mode passes through the umask


def write_private_file(path: str, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` with mode 0600; refuse to follow or reuse a name.

    For a file nobody reads until it is complete (its name is handed out afterwards).

    Raises:
        FileExistsError: ``path`` exists (a file, a link, anything): nothing was written.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def replace_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Write a file through ``write(f)`` to a private temporary name beside ``path``, fsync it,
    rename it over ``path`` and fsync the directory: readers see the old file or the new one.

    The temporary name is ``.<name>.<random>.tmp`` (``mkstemp``: unpredictable, created
    exclusively, mode 0600); it is removed if ``write`` fails.
    """
    directory, name = os.path.split(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be fsynced)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # Windows, or a directory we may not open: the rename itself still happened
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems (network, FUSE) refuse fsync on a directory: nothing more to do.
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EPERM):
            raise
    finally:
        os.close(fd)


def make_owned_dir(kind: str, run_id: str, root: str | None = None) -> str:
    """A fresh 0700 directory for one run, named after this host and process (see ``sweep``).

    Args:
        kind: lower-case letters naming what the directory holds ("job").
        run_id: the run's id, for people reading the temp directory.
        root: where to create it (default: ``tempfile.gettempdir()``, which honours TMPDIR).
    """
    if not kind.isalpha() or not kind.islower() or kind == AGENT_RUN_KIND:
        raise ValueError(f"kind={kind!r} must be lower-case letters, not {AGENT_RUN_KIND!r}")
    return tempfile.mkdtemp(prefix=f"sparkdist_{kind}-{owner_tag()}-{run_id}-", dir=root)


def agent_run_dir_prefix(run_id: str, node_rank: int) -> str:
    """The ``mkdtemp`` prefix of an agent's run directory: ``sparkdist-<run id>-<node rank>-``
    as before, then this process's ``owner_tag`` (so ``sweep_dead_owners("run")`` finds it)."""
    return f"sparkdist-{run_id}-{node_rank}-{owner_tag()}-"


def owner_tag() -> str:
    """``<host tag>-<pid>`` of this process, as directory names carry it."""
    return f"{_host_tag()}-{os.getpid()}"


def sweep_dead_owners(kind: str, root: str | None = None) -> list[str]:
    """Remove ``kind`` directories (``make_owned_dir``; ``"run"``: ``agent_run_dir_prefix``)
    left by processes that are gone.

    Only directories of this host, owned by this user, that are real directories (not links),
    and whose owner pid no longer exists are removed; a pid reused since keeps its directory
    until that process ends too (never removing a live run's files matters more).

    Returns:
        The directories removed.
    """
    root = root if root is not None else tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    pattern, host, uid = _owned_dir_pattern(kind), _host_tag(), _uid()
    removed = []
    for name in names:
        match = pattern.match(name)
        if match is None or match["host"] != host:
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or (uid is not None and info.st_uid != uid):
            continue
        if pid_exists(int(match["pid"])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def pid_exists(pid: int) -> bool:
    """True while a process ``pid`` exists (zombies and other users' processes included)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    except OSError:
        return True  # cannot tell: keep what it may own
    return True


def _uid() -> int | None:
    getuid = getattr(os, "getuid", None)
    return getuid() if getuid is not None else None


def _host_tag() -> str:
    """8 hex digits for this host: a pid is only meaningful on the host that issued it (a temp
    directory can be shared, by a network home or by containers)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


#: Longest AF_UNIX path the kernel takes (108 bytes with its terminating NUL on Linux).
MAX_SOCKET_PATH_BYTES = 107


@contextlib.contextmanager
def unix_socket_address(path: str) -> Iterator[str]:
    """An address for binding or connecting to the socket at ``path``, whatever its length.

    A long TMPDIR (a pytest ``tmp_path``, a cluster's scratch path) puts a private
    directory's socket past the kernel's limit for AF_UNIX paths; it is then reached through
    an open descriptor of its directory (``/proc/self/fd/N/name``), which keeps the
    directory's 0700 protection. (An abstract socket would have no length limit and no
    permissions: any local user could connect.)
    """
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES or not os.path.isdir("/proc/self/fd"):
        yield path
        return
    directory = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{os.path.basename(path)}"
    finally:
        os.close(directory)
