"""Installing sparkdist where a platform already put its Spark and MLflow: the wheel built from
this clone installs into a fresh environment and works, and installing it (with the cluster's
extras) beside a platform's pyspark 3.5, MLflow 2, torch, pyarrow and pandas (.venv-floor holds
those) replaces none of them: pip's own plan, with no index to fetch from, installs sparkdist
and nothing else."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkdist._core.supported import SUPPORTED
from tests.conftest import REPO
from tests.floor.test_floor import FLOOR_PYTHON, _floor_env

#: What a platform ships and an install must leave alone.
PLATFORM_PACKAGES = ("pyspark", "mlflow", "torch", "pyarrow", "pandas", "numpy", "sqlalchemy")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``python -m build --wheel`` would make, built from a copy of the clone (the
    build writes its scratch files next to the sources), with this environment's setuptools."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(
        REPO / "sparkdist", source / "sparkdist", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=240,
    )
    [built] = out.glob("sparkdist-*-py3-none-any.whl")
    return built


def test_the_wheel_installs_in_a_fresh_environment_and_carries_the_tested_range(wheel, tmp_path):
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=120)
    python = fresh / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    shown = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m, json, sparkdist; "
            "print(json.dumps([sparkdist.__file__, m.requires('sparkdist')]))",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    where, requires = json.loads(shown.stdout)
    assert where.startswith(str(fresh)), where  # the wheel's copy, not this clone
    for entry in SUPPORTED:
        stated = [r for r in requires if r.startswith(f"{entry.name}") and "extra ==" in r]
        assert stated, (entry.name, requires)
        bounds = stated[0].split(";")[0].removeprefix(entry.name).strip()
        assert sorted(bounds.split(",")) == sorted(entry.specifier.split(",")), stated
    cli = subprocess.run(
        [str(fresh / "bin" / "sparkdist"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 0 and "doctor" in cli.stdout, cli.stderr


@pytest.mark.parametrize("extras", ["", "[spark,mlflow]"])
def test_installing_beside_a_platforms_spark_and_mlflow_replaces_nothing(wheel, tmp_path, extras):
    assert FLOOR_PYTHON.exists(), f"{FLOOR_PYTHON} is missing: README command 1 makes it"
    report = tmp_path / "report.json"
    plan = subprocess.run(
        [
            str(FLOOR_PYTHON),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "-q",
            "--report",
            str(report),
            f"sparkdist{extras} @ {wheel.as_uri()}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=_floor_env(),
    )
    assert plan.returncode == 0, plan.stdout + plan.stderr  # nothing it needs is missing
    installs = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert set(installs) == {"sparkdist"}, installs  # the wheel itself, and nothing else
    assert not set(installs) & set(PLATFORM_PACKAGES)
