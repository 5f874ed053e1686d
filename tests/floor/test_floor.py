"""The floor of the tested range, in CI: the tests that depend on pyspark's and MLflow's
versions run again in the second environment README command 1 makes (``.venv-floor``: pyspark
3.5.0, MLflow 2.21.3, tests/floor/constraints.txt), as the main suite runs them on the newest.

What runs there: Spark mode (restarts, an elastic start, a preemption drain, a killed executor),
DataFrame input and its bad-input errors, MLflow tracking, and pyspark's own classes side by
side with the drop-ins. The multi-host lab runs in the main environment only.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.conftest import REPO

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

    run = subprocess.run(
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
        env=_floor_env(),
        capture_output=True,
        text=True,
        timeout=840,
    )
    output = run.stdout + run.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    assert run.returncode == 0, output[-20_000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= AT_LEAST_PASSED, summary
    print(summary)
