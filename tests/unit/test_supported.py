"""The tested version range, defined once (``_core.supported``), and everything that follows
it: pyproject.toml's extras, the floor environment's pins, the doctor's verdicts and the table
in docs/platforms.md."""

from __future__ import annotations

import re

import pytest
import tomllib

from sparkdist._core.supported import BY_NAME, PYTHON_FLOOR, SUPPORTED, outside_range
from sparkdist._core.versions import release_of
from sparkdist._doctor.ranges import in_range
from sparkdist._doctor.table import Status
from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
FLOOR_PINS = dict(
    line.split("==")
    for line in (REPO / "tests" / "floor" / "constraints.txt").read_text().splitlines()
    if "==" in line and not line.startswith("#")
)


def _specifier_in(extra: str, name: str) -> str:
    for requirement in EXTRAS[extra]:
        match = re.fullmatch(rf"{name}(\[[a-z,]+\])?([<>=!~].*)", requirement)
        if match:
            return match.group(2)
    raise AssertionError(f"extra {extra!r} does not list {name}")


@pytest.mark.parametrize("entry", SUPPORTED, ids=lambda e: e.name)
def test_pyproject_states_each_range_as_defined(entry):
    assert _specifier_in(entry.extra, entry.name) == entry.specifier
    if entry.name == "pyspark":  # Spark Connect's extra installs the same pyspark
        assert _specifier_in("connect", "pyspark") == entry.specifier


def test_requires_python_is_the_floor():
    assert PYPROJECT["project"]["requires-python"] == f">={PYTHON_FLOOR}"


def test_the_floor_environment_pins_each_floor():
    assert set(FLOOR_PINS) == {"pyspark", "mlflow"}
    for name, version in FLOOR_PINS.items():
        entry = BY_NAME[name]
        assert entry.holds(version)
        floor = release_of(entry.floor)
        assert release_of(version)[: len(floor)] == floor, f"{name}=={version} is not its floor"


@pytest.mark.parametrize(
    ("name", "version", "inside"),
    [
        ("pyspark", "3.5.0", True),
        ("pyspark", "3.5.9", True),
        ("pyspark", "4.3.0", True),
        ("pyspark", "3.4.4", False),
        ("pyspark", "5.0.0", False),
        ("mlflow", "2.21.3", True),
        ("mlflow", "3.17.2", True),
        ("mlflow", "2.20.4", False),
        ("mlflow", "4.0.0rc1", False),
        ("torch", "2.6.0", True),
        ("torch", "2.13.0+cpu", True),
        ("torch", "2.5.1+cu121", False),
        ("deepspeed", "0.16.0", True),
        ("deepspeed", "0.15.4", False),
    ],
)
def test_the_doctor_judges_both_ends_of_each_range(name, version, inside):
    check = in_range(name, version)
    assert version in check.detail and BY_NAME[name].specifier in check.detail
    if inside:
        assert check.status is Status.OK and "tested range" in check.detail
    else:
        assert check.status is Status.NOTE and "OUTSIDE the tested range" in check.detail
        assert f"pip install '{name}{BY_NAME[name].specifier}'" in check.fix


def test_outside_range_names_only_installed_packages_outside():
    versions = {"pyspark": "3.4.1", "mlflow": None, "torch": "2.13.0", "deepspeed": "0.14.0"}
    assert [entry.name for entry, _ in outside_range(versions)] == ["pyspark", "deepspeed"]
