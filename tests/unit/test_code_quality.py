"""The test command also lints, format-checks and type-checks the code, so CI enforces them.

Each tool runs as this interpreter's module (the versions pinned in the ``test`` extra); the
output is shown when a check fails. ruff covers the package and the code beside it (tests,
benchmarks, examples: users copy the examples, and a shadowed import in a test hides what it
tests); mypy --strict covers the package only, the promise ``py.typed`` makes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: What ruff reads: the package, and the code beside it that must stay as clean.
LINTED = ["sparkdist", "tests", "benchmarks", "examples"]

CHECKS = {
    "ruff check": [sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED],
    "ruff format --check": [
        sys.executable,
        "-m",
        "ruff",
        "format",
        "--check",
        "--no-cache",
        *LINTED,
    ],
    "mypy --strict": [sys.executable, "-m", "mypy", "--strict", "sparkdist"],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CHECKS))
def test_package_passes(name: str) -> None:
    proc = subprocess.run(
        CHECKS[name], cwd=REPO, capture_output=True, text=True, timeout=540, check=False
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
