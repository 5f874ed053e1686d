"""The test command also lints, format-checks and type-checks the package, so CI enforces them.

Each tool runs as this interpreter's module (the versions pinned in the ``test`` extra) over
``sparkdist/`` only; the output is shown when a check fails. The checks start in the background
as soon as the session has collected them (``start_checks``, called by ``tests/conftest.py``):
a cold ``mypy --strict`` takes over a minute on 2 cores, and most tests before these wait on
processes more than they compute.
"""

from __future__ import annotations

import atexit
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 540

CHECKS = {
    "ruff check": [sys.executable, "-m", "ruff", "check", "--no-cache", "sparkdist"],
    "ruff format --check": [
        sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "sparkdist",
    ],
    "mypy --strict": [sys.executable, "-m", "mypy", "--strict", "sparkdist"],
}

_started: dict[str, subprocess.Popen[str]] = {}


def start_checks() -> None:
    """Start every check now; ``test_package_passes`` collects the answers."""
    for name, command in CHECKS.items():
        if name not in _started:
            _started[name] = subprocess.Popen(
                command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )


@atexit.register
def _stop_unread_checks() -> None:
    for proc in _started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CHECKS))
def test_package_passes(name: str) -> None:
    start_checks()  # a no-op when the session started them
    output, _ = _started[name].communicate(timeout=TIMEOUT_S)
    assert _started[name].returncode == 0, f"{name} failed:\n{output}"
