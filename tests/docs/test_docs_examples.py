"""Every ```python block of README.md and docs/*.md runs, so no example can rot.

Blocks run as scripts (see ``_blocks`` for the ``<!-- docs-test: ... -->`` directives that skip
a block with a reason, run it with an active local[2] SparkSession, or run it as a pytest file).
Script blocks share one interpreter, Spark and pytest blocks another (``_run_blocks.py``), so
imports, the JVM and sparkdist's warm worker pool are paid once per runner; each block still
gets fresh globals, as ``python block.py`` would. The environment is a user's: loopback only
(``SPARK_LOCAL_IP=127.0.0.1``), this interpreter on Spark's executors, MLflow tracking on (its
default) with the store in a temp dir, and a temp dir as the working directory.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkdist._frontdoors.pytest_support import SESSION_MARKER_VAR, rank_processes
from tests.docs._blocks import REPO, Block, DocsTestError, How, all_blocks, blocks_of

RUNNER = Path(__file__).resolve().parent / "_run_blocks.py"
#: Generous for a loaded 2-core machine (the blocks take well under a minute on a quiet one), and
#: under pytest-timeout's 300 s, so a hung block is named by the runner's report, not lost.
GROUP_TIMEOUT_S = 240


def _collect() -> list[Block]:
    try:
        return all_blocks()
    except DocsTestError:
        return []  # test_every_directive_is_well_formed reports it


BLOCKS = _collect()


def docs_env(workdir: Path, marker: str = "") -> dict[str, str]:
    """A reader's environment for a runner in ``workdir``; with ``marker``, its runs' processes
    carry a marker and its run directories a temp dir of their own: the two runners overlap the
    tests around them, whose leftover checks must not take the runners' live runs for strays
    (nor kill them). The runner's own leftovers are checked once it ended (``GroupRun``)."""
    env = dict(os.environ)
    env.pop("SPARKDIST_MLFLOW", None)  # the test suite turns tracking off; a reader has it on
    if marker:
        (workdir / "tmp").mkdir(exist_ok=True)
        env.update({SESSION_MARKER_VAR: marker, "TMPDIR": str(workdir / "tmp")})
    env.update(
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        MLFLOW_TRACKING_URI=f"sqlite:///{workdir / 'mlflow.db'}",
        PYTHONUNBUFFERED="1",
    )
    return env


class GroupRun:
    """One runner process (``_run_blocks.py``) for a list of blocks, started at once."""

    def __init__(self, blocks: list[Block], workdir: Path, *, spark: bool) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        spec = workdir / "blocks.json"
        self.report = workdir / "report.jsonl"
        spec.write_text(
            json.dumps(
                [
                    {"id": b.id, "stem": b.stem, "source": b.source, "how": b.how.value}
                    for b in blocks
                ]
            ),
            encoding="utf-8",
        )
        command = [sys.executable, str(RUNNER), str(spec), str(self.report)]
        self.workdir, self.marker = workdir, uuid.uuid4().hex
        self.proc = subprocess.Popen(
            command + (["--spark"] if spark else []),
            cwd=workdir,
            env=docs_env(workdir, self.marker),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.result: dict[str, Any] | None = None

    def wait(self) -> dict[str, Any]:
        """Each block's outcome by id, the runner's output, and how it ended."""
        if self.result is not None:
            return self.result
        try:
            log, _ = self.proc.communicate(timeout=GROUP_TIMEOUT_S)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the runner's own session, children too
            log, _ = self.proc.communicate()
            timed_out = True
        outcomes = {}
        if self.report.exists():
            for line in self.report.read_text(encoding="utf-8").splitlines():
                outcome = json.loads(line)
                outcomes[outcome["id"]] = outcome
        self.result = {
            "outcomes": outcomes,
            "log": log.decode(errors="replace"),
            "timed_out": timed_out,
            "returncode": self.proc.returncode,
            "leftovers": [] if timed_out else self._leftovers(),
        }
        return self.result

    def _leftovers(self) -> list[str]:
        """What the runner's runs left behind once it ended: processes (killed here), and run
        directories (the suite's own check, for this runner's marker and temp dir)."""
        deadline = time.monotonic() + 2.0
        while rank_processes(self.marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = rank_processes(self.marker)
        for proc in survivors:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
        dirs = glob.glob(str(self.workdir / "tmp" / "sparkdist-*"))
        return [f"process {proc}" for proc in survivors] + [f"run directory {d}" for d in dirs]

    def kill(self) -> None:
        if self.result is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


def run_group(blocks: list[Block], workdir: Path, *, spark: bool) -> dict[str, Any]:
    return GroupRun(blocks, workdir, spark=spark).wait()


#: Spark and pytest blocks share the runner that holds the local[2] session (the pytest
#: plugin's ``spark`` fixture reuses an active session); plain scripts have their own runner.
SPARK_RUNNER = (How.SPARK, How.PYTEST)


class _Groups:
    """Both runners, started together the first time a block asks, so that one's idle moments
    (JVM and interpreter start-up) overlap the other's work."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[bool, GroupRun] = {}

    def outcome(self, block: Block) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        if not self.runs:
            for spark in (True, False):
                members = [
                    b for b in BLOCKS if b.how is not How.SKIP and (b.how in SPARK_RUNNER) is spark
                ]
                if members:
                    name = "spark" if spark else "scripts"
                    self.runs[spark] = GroupRun(members, self.root / name, spark=spark)
        group = self.runs[block.how in SPARK_RUNNER].wait()
        return group["outcomes"].get(block.id), group


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Groups]:
    started = _Groups(tmp_path_factory.mktemp("docs"))
    yield started
    for run in started.runs.values():  # tests stopped early (-x, Ctrl-C): no runner left alive
        run.kill()


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_docs_block_runs(block: Block, groups: _Groups) -> None:
    if block.how is How.SKIP:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    outcome, group = groups.outcome(block)
    if outcome is None:
        why = "the runner timed out" if group["timed_out"] else "the runner stopped"
        pytest.fail(
            f"{block.id}: no outcome ({why} at or before this block); its output:\n"
            f"{_tail(group['log'])}"
        )
    if outcome["error"] is not None:
        pytest.fail(
            f"{block.id} raised:\n{outcome['error']}\nrunner output:\n{_tail(group['log'], 30)}"
        )
    assert not group["leftovers"], f"the docs runner's runs left: {group['leftovers']}"


# -- the checker itself -------------------------------------------------------------------


def test_every_directive_is_well_formed() -> None:
    blocks = all_blocks()  # raises DocsTestError naming the page and line
    assert blocks == BLOCKS


def test_the_pages_have_blocks_that_run() -> None:
    runs = [b for b in BLOCKS if b.how is not How.SKIP]
    assert any(b.page == "README.md" for b in runs), "README.md's examples are not run"
    assert len(runs) >= 10, [b.id for b in BLOCKS]
    assert {b.page for b in BLOCKS} <= {
        p.relative_to(REPO).as_posix() for p in REPO.glob("*.md")
    } | {p.relative_to(REPO).as_posix() for p in REPO.glob("docs/*.md")}


def page(text: str) -> str:
    return textwrap.dedent(text).lstrip()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            page("""
        ```python
        print(1)
        ```
     """),
            [(How.SCRIPT, None, "print(1)\n")],
        ),
        (
            page("""
        <!-- docs-test: skip (needs 8 GPUs) -->

        ```python
        x = 1
        ```
        ```bash
        echo not python
        ```
        <!-- docs-test: spark -->
        ```python
        y = 2
        ```
        <!-- docs-test:pytest-->
        ```python
        def test_it(): pass
        ```
     """),
            [
                (How.SKIP, "needs 8 GPUs", "x = 1\n"),
                (How.SPARK, None, "y = 2\n"),
                (How.PYTEST, None, "def test_it(): pass\n"),
            ],
        ),
        (
            page("""
        1. A list item:

           ```python
           if True:
               z = 3
           ```
     """),
            [(How.SCRIPT, None, "if True:\n    z = 3\n")],
        ),
    ],
)
def test_blocks_and_their_directives_are_found(text, expected):
    found = blocks_of(text, "page.md")
    assert [(b.how, b.skip_reason, b.source) for b in found] == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- docs-test: skip -->\n```python\nx = 1\n```\n", "must say why"),
        ("<!-- docs-test: skip () -->\n```python\nx = 1\n```\n", "must say why"),
        ("<!-- docs-test: skipp (typo) -->\n```python\nx = 1\n```\n", "unknown directive"),
        ("<!-- docs-test: spark -->\n```bash\nls\n```\n", "only ```python blocks are run"),
        ("<!-- docs-test: spark -->\nsome prose\n```python\nx = 1\n```\n", "right before"),
        ("text\n<!-- docs-test: spark -->\n", "has no block"),
        ("```python\nx = 1\n", "never closed"),
    ],
)
def test_malformed_directives_are_refused_with_where(text, message):
    with pytest.raises(DocsTestError, match=message) as caught:
        blocks_of(text, "page.md")
    assert "page.md:" in str(caught.value)


def test_a_block_that_raises_is_reported_and_the_next_one_still_runs(tmp_path):
    blocks = blocks_of(
        page("""
        ```python
        raise ValueError("boom in the docs")
        ```
        ```python
        import sys
        print("second block ran", __name__, sys.argv[0].endswith(".py"))
        ```
        ```python
        import sys
        sys.exit(0)
        ```
    """),
        "page.md",
    )

    group = run_group(blocks, tmp_path, spark=False)

    outcomes = group["outcomes"]
    assert group["returncode"] == 1
    assert "ValueError: boom in the docs" in outcomes["page.md:1"]["error"]
    assert outcomes["page.md:4"]["error"] is None and outcomes["page.md:8"]["error"] is None
    assert "second block ran __main__ True" in group["log"]
