"""A large job shipped to the executors as a Spark file instead of inside each task.

Past ``job_size_warn_mb`` (``_wire.captures``), Spark mode adds the pickled job with
``SparkContext.addFile`` (or a Connect artifact); each executor fetches it once and the barrier
task finds it with ``SparkFiles.get`` (``executor_path``).

Non-goals: deciding that a job is large (``_wire.captures``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

from sparkdist._backends.session import is_connect


class JobFile:
    """A large job shipped to the executors as a file: ``SparkContext.addFile`` on a classic
    session, ``addArtifacts(..., file=True)`` on a Spark Connect one (untested here).

    ``name`` is what the barrier task passes to ``SparkFiles.get`` (``executor_path``).
    """

    def __init__(self, session: Any, job_bytes: bytes, run_id: str) -> None:
        self.name = job_file_name(run_id)
        connect = self._connect = is_connect(session)
        # Classic: pyspark's own temporary directory under spark.local.dir, which Spark
        # removes when the driver stops (so a driver killed mid-run leaves nothing for long).
        directory: str | None = (
            None if connect else getattr(session.sparkContext, "_temp_dir", None)
        )
        self._own_dir: str | None = None
        if directory is None:
            directory = self._own_dir = tempfile.mkdtemp(prefix="sdjob-")
        self.path = os.path.join(directory, self.name)
        try:
            with open(self.path, "wb") as f:
                f.write(job_bytes)
            if connect:
                session.addArtifacts(self.path, file=True)  # uploaded: the copy here can go
                self._delete_own()
            else:
                session.sparkContext.addFile(self.path)
        except BaseException:
            self._delete_own()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise

    def _delete_own(self) -> None:
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def remove(self) -> None:
        """Free the driver's disk once the run (every attempt) is over.

        Spark cannot forget an added file, and an executor that joins later fetches every
        added file before its first task: deleting the file would fail that task. So the
        served file is emptied (its name stays until Spark removes its directory), and the
        driver's own copy under SparkFiles' root directory is deleted.
        """
        if self._connect:
            return  # uploaded to the remote driver at once; nothing is left here
        with contextlib.suppress(OSError):
            os.truncate(self.path, 0)
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
