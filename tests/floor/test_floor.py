"""The floor of the tested range, in CI: the tests that depend on pyspark's and MLflow's
versions run again in the second environment README command 1 makes (``.venv-floor``: pyspark
3.5.0, MLflow 2.21.3, tests/floor/constraints.txt), as the main suite runs them on the newest.

What runs there: Spark mode (restarts, an elastic start, a preemption drain, a killed executor),
DataFrame input and its bad-input errors, MLflow tracking, and pyspark's own classes side by
side with the drop-ins. The multi-host lab runs in the main environment only.

The floor's session runs beside this session's unit tests (``tests/conftest.py`` starts it at
the first of them and runs this test right after the last): they use one core, start no run
and no JVM, and the floor's ~95 s of Spark then cost the suite only what the unit tests leave.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

#: This session's temporary directory (conftest's); the floor's goes beside it, not inside.
TMP = tempfile.gettempdir()

FLOOR_PYTHON = REPO / ".venv-floor" / "bin" / "python"
FLOOR_TESTS = (
    "tests/integration/test_spark_mode.py",
    "tests/integration/test_spark_mode_decorator.py",
    "tests/integration/test_dataframe.py",
    "tests/integration/test_local_cluster.py",
    "tests/integration/test_preemption.py",
    "tests/integration/test_tracking.py",
    "tests/compat/test_differential.py",
    "tests/compat/test_driver_gpus.py",
)
#: Within those files: what depends on Spark or MLflow (DeepSpeed is not installed there).
FLOOR_MARKERS = "(spark or mlflow) and not deepspeed and not multihost"
#: Left out there (the suite's time is bounded): sparkdist's own logic over the same Spark and
#: MLflow calls its neighbours make (row policies, a model on rows, a silent server's timeout,
#: ranks spread over two executors: the killed-executor test runs on the same local-cluster).
FLOOR_SKIPS = (
    "not test_uneven_partitions_still_give_equal_steps and not test_model_learns_from_a_dataframe"
    " and not test_an_mlflow_server_that_does_not_answer_is_given_up"
    " and not test_cpu_ranks_on_separate_executors"
)
#: Fewer than this many passing would mean the selection broke, not that the floor works.
AT_LEAST_PASSED = 70

pytestmark = pytest.mark.spark


def _floor_pins() -> dict[str, str]:
    text = (REPO / "tests" / "floor" / "constraints.txt").read_text()
    return dict(line.split("==") for line in text.splitlines() if "==" in line)


def _floor_env() -> dict[str, str]:
    """This process's environment, with the floor's interpreter on Spark's executors and first
    on PATH (this suite's PYSPARK_PYTHON would put pyspark 4's worker under a 3.5 JVM)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYTHONPATH")}
    bin_dir = str(FLOOR_PYTHON.parent)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(FLOOR_PYTHON.parent.parent),
    )
    return env


class FloorRun:
    """The floor's pytest session, a subprocess writing to a file: started ahead of its test by
    ``tests/conftest.py`` (beside the unit tests, which use one core of the two and start no
    run), or by the test itself when it runs alone.

    Its runs' processes carry the marker its own conftest sets, and its temporary files go to
    a directory of its own, outside this session's: the leak checks of the tests it overlaps
    never take them for strays."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="sparkdist-floor-", dir=os.path.dirname(TMP)))
        self.log = self.tmp / "floor.log"
        self.started = time.monotonic()
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [
                    str(FLOOR_PYTHON),
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "--durations=5",
                    "-m",
                    FLOOR_MARKERS,
                    "-k",
                    FLOOR_SKIPS,
                    *FLOOR_TESTS,
                ],
                cwd=REPO,
                env={**_floor_env(), "TMPDIR": str(self.tmp)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stop() reaches its Spark and ranks
            )

    def wait(self, timeout_s: float) -> tuple[int | None, str]:
        """The exit status (None: still running at ``timeout_s`` after its start, then stopped)
        and the output."""
        try:
            code: int | None = self.process.wait(
                max(1.0, self.started + timeout_s - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            code = None
        self.stop()
        output = self.log.read_text(errors="replace")
        shutil.rmtree(self.tmp, ignore_errors=True)
        return code, output

    def stop(self) -> None:
        """End it and everything it started (idempotent)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


#: The floor's run when conftest started it ahead of its test.
background: FloorRun | None = None


def start_in_background() -> None:
    """Start the floor's run now, if it can run (README command 1 made its environment)."""
    global background
    if background is None and FLOOR_PYTHON.exists():
        background = FloorRun()


@pytest.mark.timeout(900)
def test_the_floor_of_the_tested_range_passes_the_version_dependent_tests():
    assert FLOOR_PYTHON.exists(), f"{FLOOR_PYTHON} is missing: README command 1 makes it"
    found = subprocess.run(
        [
            str(FLOOR_PYTHON),
            "-c",
            "import pyspark, mlflow; print(pyspark.__version__, mlflow.__version__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        env=_floor_env(),
        timeout=120,
    ).stdout.split()
    pins = _floor_pins()
    assert found == [pins["pyspark"], pins["mlflow"]], (found, pins)

    run = background if background is not None else FloorRun()
    code, output = run.wait(840)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    assert code == 0, output[-20_000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= AT_LEAST_PASSED, summary
    print(summary)
