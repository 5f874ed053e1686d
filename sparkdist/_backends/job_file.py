"""A large job shipped to the executors as a Spark file instead of inside each task.

Past ``job_size_warn_mb`` (``_wire.captures``), Spark mode adds the pickled job with
``SparkContext.addFile`` (or a Connect artifact); each executor fetches it once and the barrier
task finds it with ``SparkFiles.get`` (``executor_path``).

The file is private to the driver's user: mode 0600, in a 0700 directory of its own per run
(``sparkdist_job-<host>-<pid>-<run id>-*`` under the temp directory, not pyspark's shared one).
It is emptied when the run ends, whichever way it ends; its directory goes when the
SparkContext that serves it has stopped (noticed at the next start, or at exit), and a
directory left by a driver that was killed is removed at the next run's start on this host,
whatever its mode (``sweep_job_leftovers``, called by ``_engine.launch``; only this user's,
only once the driver's pid is gone: a live driver's file is never touched).

Spark leaves what an executor fetched in its work directory until the application ends. The
tasks of a run's last attempt remove their executor's copy as they end, whichever way
(``holding_job_copy``: the last task of the executor to end removes it); an earlier attempt's
copy stays for a restart, and any later barrier task of the application on that executor
removes the copies of the runs this driver has ended (``ended_job_names``,
``drop_job_copies``), as it does a copy whose task was killed before it could.

Non-goals: deciding that a job is large (``_wire.captures``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import os
import shutil
import threading
from collections.abc import Iterator
from typing import Any

from sparkdist._backends.session import is_connect
from sparkdist._core.files import make_owned_dir, sweep_dead_owners, write_private_file

#: The ``kind`` of the per-run directories (``_core.files.make_owned_dir``).
JOB_DIR_KIND = "job"
#: Ended runs' job names handed to later tasks: enough for every run a session keeps in
#: flight or recently ended, few enough that a task's closure stays small (~40 bytes each).
ENDED_JOBS_KEPT = 256


class JobFile:
    """A large job shipped to the executors as a file: ``SparkContext.addFile`` on a classic
    session, ``addArtifacts(..., file=True)`` on a Spark Connect one (untested here).

    ``name`` is what the barrier task passes to ``SparkFiles.get`` (``executor_path``);
    ``path`` is the served file (0600), in ``directory`` (0700), which belongs to this run.
    """

    def __init__(self, session: Any, job_bytes: bytes, run_id: str) -> None:
        self.name = job_file_name(run_id)
        connect = self._connect = is_connect(session)
        self._context: Any = None if connect else session.sparkContext
        self.directory = make_owned_dir(JOB_DIR_KIND, run_id)
        self.path = os.path.join(self.directory, self.name)
        try:
            write_private_file(self.path, job_bytes)
            if connect:
                session.addArtifacts(self.path, file=True)  # uploaded: the copy here can go
                self._delete_directory()
            else:
                session.sparkContext.addFile(self.path)
        except BaseException:
            self._delete_directory()
            raise

    def _delete_directory(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def remove(self) -> None:
        """Free the driver's disk once the run (every attempt) is over; call it on every way
        a run ends.

        Spark cannot forget an added file, and an executor that joins later fetches every
        added file before its first task: deleting the file would fail that task. So the
        served file is emptied (its name stays, still 0600 in this run's 0700 directory, until
        the SparkContext stops; then the directory goes), and the driver's own copy under
        SparkFiles' root directory is deleted.
        """
        with _ended_lock:
            _ended.append(self.name)  # no attempt reads it again: executors may drop it
        if self._connect:
            return  # uploaded to the remote driver at once; nothing is left here
        with contextlib.suppress(OSError):
            os.truncate(self.path, 0)
        _keep_until_stopped(self.directory, self._context)
        try:
            from pyspark import SparkFiles

            copy = os.path.join(SparkFiles.getRootDirectory(), self.name)
        except Exception:  # noqa: BLE001 - the session is gone: so is its directory
            return
        if os.path.realpath(copy) != os.path.realpath(self.path):
            with contextlib.suppress(OSError):
                os.unlink(copy)


def job_file_name(run_id: str) -> str:
    """The name a run's job file has in ``SparkFiles``."""
    return f"sparkdist-job-{run_id}.pkl"


def executor_path(name: str | None) -> str | None:
    """Inside a Spark task: where this executor keeps the job file ``name`` (None: no file)."""
    if name is None:
        return None
    from pyspark import SparkFiles

    return SparkFiles.get(name)


def ended_job_names() -> tuple[str, ...]:
    """On the driver: the job files of runs this process has ended (the latest ones)."""
    with _ended_lock:
        return tuple(_ended)


def drop_job_copies(names: tuple[str, ...]) -> None:
    """Inside a Spark task: remove this executor's copies of the job files ``names`` (runs
    that ended: nothing reads them again; a name this executor never fetched is skipped)."""
    if not names:
        return
    from pyspark import SparkFiles

    for name in names:
        with contextlib.suppress(OSError):
            os.remove(SparkFiles.get(name))


@contextlib.contextmanager
def holding_job_copy(path: str | None, *, remove: bool) -> Iterator[None]:
    """Inside a Spark task: hold this executor's copy of the job (``path``; None: no file) while
    the task runs, and with ``remove``, remove it on the way out, whichever way the task ends.

    Tasks of one executor share its copy: each holds a shared lock on it, and only the last to
    end (an exclusive lock granted at once) removes it. A task's ranks read the job before the
    rendezvous, which waits for every task's agent, so no task ends well before another took
    its lock; one that ends first, failing, may remove a copy a slower task still needs: that
    attempt is over anyway.
    """
    if path is None:
        yield
        return
    held = _lock_copy(path, fcntl.LOCK_SH)
    try:
        yield
    finally:
        if held is not None:
            os.close(held)
        if remove:
            _remove_unless_held(path)


def _lock_copy(path: str, operation: int) -> int | None:
    """An open descriptor of ``path`` holding ``operation``'s lock, or None (no such file, or
    another task holds it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        pass  # a file system without locks: every task counts as the last
    return fd


def _remove_unless_held(path: str) -> None:
    fd = _lock_copy(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:
        return  # gone already, or another task holds it: that one removes it as it ends
    try:
        with contextlib.suppress(OSError):
            os.remove(path)
    finally:
        os.close(fd)


_ended: collections.deque[str] = collections.deque(maxlen=ENDED_JOBS_KEPT)
_ended_lock = threading.Lock()


def sweep_job_leftovers() -> list[str]:
    """Remove job directories this process no longer serves (their SparkContext stopped) and
    those of drivers that died without cleaning up (this user's, this host's, pid gone).

    Cheap (one listing of the temp directory); called at every run's start (``_engine``).

    Returns:
        The directories removed.
    """
    return _drop_stopped() + sweep_dead_owners(JOB_DIR_KIND)


# Emptied job files still served by a live SparkContext: directory -> that context. Removed
# once the context has stopped (at the next large job) or when this process exits.
_kept: dict[str, Any] = {}
_kept_lock = threading.Lock()
_atexit_registered = False


def _keep_until_stopped(directory: str, context: Any) -> None:
    global _atexit_registered
    with _kept_lock:
        _kept[directory] = context
        if not _atexit_registered:
            atexit.register(_drop_all)
            _atexit_registered = True
    _drop_stopped()


def _stopped(context: Any) -> bool:
    return context is None or getattr(context, "_jsc", None) is None  # stop() clears _jsc


def _drop_stopped() -> list[str]:
    with _kept_lock:
        ended = [d for d, context in _kept.items() if _stopped(context)]
        for directory in ended:
            del _kept[directory]
    for directory in ended:
        shutil.rmtree(directory, ignore_errors=True)
    return ended


def _drop_all() -> None:
    """At exit: nothing will be served any more (the JVM ends with this process)."""
    with _kept_lock:
        directories = list(_kept)
        _kept.clear()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
