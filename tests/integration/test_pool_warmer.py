"""A restart that lands on an executor where no rank of the run ran forks its rank from a warm
zygote: while the first attempt ran, the driver's pool warmer started one there
(``_backends.pool_warmer``), so the restart skips the seconds of a cold start.

local-cluster (two executor JVMs of one slot each): a one-rank run that may restart; once the
idle executor has a zygote, the test kills the rank's executor; the restart, on the other
executor, forks from the zygote that was there before the kill.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from sparkdist import Distributor
from sparkdist._core.env import ZYGOTE_VAR
from tests.conftest import SESSION_MARKER, run_processes

pytestmark = pytest.mark.spark

EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


def note_zygote(notes: str) -> int:
    import json
    import os
    import time

    import psutil

    from sparkdist import runtime

    zygote = psutil.Process().parent()
    path = os.path.join(notes, f"attempt-{runtime.restart_count()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"zygote": zygote.pid, "zygote_started": zygote.create_time()}, f)
    os.replace(path + ".tmp", path)
    if runtime.restart_count() == 0:
        time.sleep(120)  # the test kills this rank's executor
    return runtime.restart_count()


def _executor_of(pid: int) -> psutil.Process | None:
    """The executor JVM above process ``pid`` (a rank, a zygote), if any."""
    for parent in psutil.Process(pid).parents():
        if EXECUTOR_CLASS in " ".join(parent.cmdline()):
            return parent
    return None


def _zygotes_under(executor: psutil.Process, library_path: str) -> list[psutil.Process]:
    """The zygotes of this run's import environment (``library_path``) under ``executor``."""
    found = []
    for child in executor.children(recursive=True):
        try:
            env = child.environ()
        except psutil.Error:
            continue
        if env.get(ZYGOTE_VAR) == "1" and env.get("LD_LIBRARY_PATH") == library_path:
            if child.parent() is not None and child.parent().environ().get(ZYGOTE_VAR) != "1":
                found.append(child)  # a zygote, not one of its spares
    return found


def _zygotes_elsewhere(ranks_executor: psutil.Process, library_path: str) -> list[psutil.Process]:
    """This run's zygotes under this session's executors other than the rank's."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if (
                EXECUTOR_CLASS in " ".join(process.info["cmdline"] or [])
                and process.environ().get(SESSION_MARKER) == os.environ[SESSION_MARKER]
                and process.pid != ranks_executor.pid
            ):
                found += _zygotes_under(process, library_path)
        except psutil.Error:
            continue  # an executor that just ended
    return found


def _wait_for(path: Path, timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.05)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_a_restart_on_an_executor_without_a_rank_forks_from_a_warm_zygote(
    spark_cluster, tmp_path: Path
) -> None:
    notes, library_path = tmp_path / "notes", tmp_path / "lib"
    notes.mkdir()
    library_path.mkdir()
    handle = Distributor(
        1,
        local_mode=False,
        use_gpu=False,
        max_restarts=1,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        # An import environment of its own: zygotes of earlier tests' runs do not count.
        env={"LD_LIBRARY_PATH": str(library_path)},
    ).run_async(note_zygote, str(notes))
    try:
        first = _wait_for(notes / "attempt-0.json", 120)
        ranks_executor = _executor_of(int(first["zygote"]))
        assert ranks_executor is not None
        deadline = time.monotonic() + 60
        while not (warm := _zygotes_elsewhere(ranks_executor, str(library_path))):
            assert time.monotonic() < deadline, "no zygote was started on the idle executor"
            time.sleep(0.2)
        killed_at = time.time()
        ranks_executor.kill()  # the rank's host is lost: the restart can only go to the other
        assert handle.run_result(timeout=120).values == [1]
    finally:
        handle.cancel()  # a no-op once it ended; else its rank sleeps on
    restarted = _wait_for(notes / "attempt-1.json", 5)
    assert restarted["zygote"] in {z.pid for z in warm}
    assert restarted["zygote_started"] < killed_at  # warm before the fault, not started after
    assert not run_processes()
