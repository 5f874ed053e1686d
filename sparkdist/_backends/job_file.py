"""A large job shipped to the executors as a Spark file instead of inside each task.

Past ``job_size_warn_mb`` (``_wire.captures``), Spark mode adds the pickled job with
``SparkContext.addFile`` (or a Connect artifact); each executor fetches it once and the barrier
task finds it with ``SparkFiles.get`` (``executor_path``).

The file is private to the driver's user: mode 0600, in a 0700 directory of its own per run
(``sparkdist_job-<host>-<pid>-<run id>-*`` under the temp directory, not pyspark's shared one).
It is emptied when the run ends, whichever way it ends; its directory goes when the
SparkContext that serves it has stopped (noticed at the next large job, or at exit), and a
directory left by a driver that was killed is removed at the next large job's start
(``sweep_job_leftovers``; only this user's, only once the driver's pid is gone).

Non-goals: deciding that a job is large (``_wire.captures``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import threading
from typing import Any

from sparkdist._backends.session import is_connect
from sparkdist._core.files import make_owned_dir, sweep_dead_owners, write_private_file

#: The ``kind`` of the per-run directories (``_core.files.make_owned_dir``).
JOB_DIR_KIND = "job"


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
        sweep_job_leftovers()
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


def sweep_job_leftovers() -> list[str]:
    """Remove job directories this process no longer serves (their SparkContext stopped) and
    those of drivers that died without cleaning up (this user's, this host's, pid gone).

    Cheap (one listing of the temp directory); called at each large job's start.

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
