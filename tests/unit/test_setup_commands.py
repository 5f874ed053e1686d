"""CI runs README.md's two set-up commands verbatim: .ci/run reads them from the README.

``.ci/run --print [FILE]`` prints what ``.ci/run`` would run, read from the ```bash block right
after each ``<!-- setup-command-N -->`` marker, and runs nothing.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CI_RUN = REPO / ".ci" / "run"


def print_commands(readme: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = ["bash", str(CI_RUN), "--print", *([str(readme)] if readme else [])]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def test_ci_reads_exactly_two_one_line_commands_from_the_readme():
    done = print_commands()
    assert done.returncode == 0, done.stderr
    commands = done.stdout.splitlines()
    assert len(commands) == 2, commands
    assert all(command.strip() == command and command for command in commands)
    install, tests = commands
    words = shlex.split(install)
    # The CPU build of torch, pinned, and this package with its test extra, in one pip install.
    assert "pip" in words and "install" in words, install
    assert "torch==2.13.0" in words, install
    assert '-e ".[test]"' in install and ".[test]" in words, install
    assert re.search(r"\bpython -m pytest\b", tests), tests


def test_ci_runs_nothing_but_the_readme_commands():
    script = CI_RUN.read_text()
    # What the README's commands do themselves must not be repeated (or quietly added) here.
    for extra in ("pip install", "ShareMemCommBuilder", "--quiet", "--steps", "pytest -"):
        assert extra not in script, extra
    assert "set -euo pipefail" in script and "SPARK_LOCAL_IP=127.0.0.1" in script


@pytest.mark.parametrize(
    ("readme", "reason"),
    [
        (
            "<!-- setup-command-1 -->\n```bash\npip install a\npip install b\n```\n",
            "holds 2 command line(s), not one",
        ),
        ("<!-- setup-command-1 -->\n\n```bash\npip install a\n```\n", "does not open a ```bash"),
        ("<!-- setup-command-1 -->\n```bash\npip install a\n", "is not closed"),
        ("no markers at all\n```bash\npip install a\n```\n", "occurs 0 time(s), not once"),
        (
            "<!-- setup-command-1 -->\n```bash\na\n```\n" * 2
            + "<!-- setup-command-2 -->\n```bash\nb\n```\n",
            "occurs 2 time(s), not once",
        ),
    ],
)
def test_a_readme_that_does_not_say_exactly_one_command_is_refused(tmp_path, readme, reason):
    path = tmp_path / "README.md"
    path.write_text(readme)
    done = print_commands(path)
    assert done.returncode == 3
    assert reason in done.stderr and "setup-command-1" in done.stderr
    assert done.stdout == ""


def test_indented_blocks_in_a_list_item_are_read(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(
        "1. Install:\n\n   <!-- setup-command-1 -->\n   ```bash\n   pip install x\n   ```\n\n"
        "2. Test:\n\n   <!-- setup-command-2 -->\n   ```bash\n   python -m pytest\n   ```\n"
    )
    done = print_commands(path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["pip install x", "python -m pytest"]
