"""CI runs README.md's two set-up commands verbatim: the lines in .ci/run are the README's.

The README marks each command with ``<!-- setup-command-N -->`` right before its one-line
```bash block; .ci/run holds the same two lines, and nothing else that installs or tests.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CI_RUN = REPO / ".ci" / "run"
README = REPO / "README.md"


def readme_commands(text: str) -> list[str]:
    """The single line of the ```bash block after each setup-command marker, in order."""
    found = re.findall(r"<!-- setup-command-(\d) -->\s*\n\s*```bash\n\s*(.+?)\n\s*```", text)
    return [command.strip() for _, command in sorted(found)]


def test_the_readme_marks_two_one_line_commands():
    install, tests = readme_commands(README.read_text())
    words = shlex.split(install)
    # The CPU build of torch, pinned, and this package with its test extra, in one pip install.
    assert "pip" in words and "install" in words and "torch==2.13.0" in words, install
    assert '-e ".[test]"' in install, install
    assert re.search(r"\bpython -m pytest$", tests), tests


def test_ci_runs_the_readme_commands_verbatim_and_nothing_else():
    lines = [line.strip() for line in CI_RUN.read_text().splitlines()]
    for command in readme_commands(README.read_text()):
        assert command in lines, f".ci/run does not run the README's command: {command}"
    script = CI_RUN.read_text()
    # Command 1 installs twice: the main environment and the floor's (tests/floor/).
    assert script.count("pip install") == 2 and script.count("pytest") == 2  # cmd + exit-5 note
    for extra in ("ShareMemCommBuilder", "--quiet", "--steps"):
        assert extra not in script, extra
    assert "set -euo pipefail" in script and "SPARK_LOCAL_IP=127.0.0.1" in script


def test_a_drifted_readme_is_caught():
    text = README.read_text().replace("python -m pytest", "python -m pytest -x", 1)
    assert readme_commands(text)[1] not in CI_RUN.read_text().splitlines()
