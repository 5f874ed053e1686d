"""Find the ```python blocks of README.md and docs/*.md, and how each one asks to be run.

A block runs as a script by default. An HTML comment on the last non-blank line before its
opening fence changes that:

- ``<!-- docs-test: skip (why) -->``: not run; the reason is required (it shows as the skip
  reason), so nothing is left out silently.
- ``<!-- docs-test: spark -->``: run while a local[2] SparkSession is active, so the block's
  ``SparkSession.builder.getOrCreate()`` finds it.
- ``<!-- docs-test: pytest -->``: the block is a test file; it is written to ``test_*.py`` and
  run with pytest (the sparkdist plugin provides its fixtures).

Anything else after ``docs-test:`` is an error, and so is a directive that is not followed by a
python block: a typo must not turn a check off.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
_SKIP = re.compile(r"^skip(?:\s*\((?P<reason>.*)\))?$")


class How(Enum):
    SCRIPT = "script"
    SPARK = "spark"
    PYTEST = "pytest"
    SKIP = "skip"


@dataclass(frozen=True)
class Block:
    """One ```python block of a page."""

    page: str  # relative to the repository root, e.g. "docs/launching.md"
    line: int  # 1-based line of the opening fence
    source: str
    how: How
    skip_reason: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def stem(self) -> str:
        """A file-name-safe name for the block, e.g. ``docs_launching_L42``."""
        page = re.sub(r"[^A-Za-z0-9]+", "_", self.page.removesuffix(".md"))
        return f"{page}_L{self.line}"


class DocsTestError(ValueError):
    """A page's docs-test directive is malformed or misplaced."""


def pages(repo: Path = REPO) -> list[Path]:
    """README.md and every docs/*.md page."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def parse_directive(body: str, where: str) -> tuple[How, str | None]:
    """The run mode a directive's body asks for, and a skip's reason."""
    text = body.strip()
    if text in ("spark", "pytest"):
        return How(text), None
    skip = _SKIP.match(text)
    if skip is not None:
        reason = (skip.group("reason") or "").strip()
        if not reason:
            raise DocsTestError(
                f"{where}: a skipped block must say why, e.g. "
                "<!-- docs-test: skip (needs 8 GPUs) -->"
            )
        return How.SKIP, reason
    raise DocsTestError(
        f"{where}: unknown directive 'docs-test:{body}'; use 'skip (reason)', 'spark' or 'pytest'"
    )


def blocks_of(text: str, page: str) -> list[Block]:
    """Every ```python block of one page, in order, with its directive applied."""
    lines = text.splitlines()
    found: list[Block] = []
    pending: tuple[int, How, str | None] | None = None  # a directive waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE.match(line)
        if directive is not None:
            if pending is not None:
                raise DocsTestError(f"{page}:{pending[0]}: a docs-test directive has no block")
            how, reason = parse_directive(directive.group("body"), f"{page}:{i + 1}")
            pending = (i + 1, how, reason)
            i += 1
            continue
        fence = _FENCE_OPEN.match(line)
        if fence is None:
            if line.strip() and pending is not None:
                raise DocsTestError(
                    f"{page}:{pending[0]}: a docs-test directive must be right before a "
                    "```python block"
                )
            i += 1
            continue
        indent = fence.group("indent")
        info = fence.group("info").strip()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise DocsTestError(f"{page}:{i + 1}: a ``` block is never closed")
        is_python = info.split()[0] == "python" if info else False
        if pending is not None and not is_python:
            raise DocsTestError(
                f"{page}:{pending[0]}: a docs-test directive is followed by a ```{info} block; "
                "only ```python blocks are run"
            )
        if is_python:
            body = [
                ln[len(indent) :] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[i + 1 : end]
            ]
            how, reason = (pending[1], pending[2]) if pending is not None else (How.SCRIPT, None)
            found.append(Block(page, i + 1, "\n".join(body) + "\n", how, reason))
        pending = None
        i = end + 1
    if pending is not None:
        raise DocsTestError(f"{page}:{pending[0]}: a docs-test directive has no block")
    return found


def all_blocks(repo: Path = REPO) -> list[Block]:
    """The python blocks of README.md and docs/*.md."""
    found: list[Block] = []
    for path in pages(repo):
        found += blocks_of(path.read_text(encoding="utf-8"), path.relative_to(repo).as_posix())
    return found
