"""Turning figures into output: rounding and units, the aligned and markdown tables, the JSON
lines, the machine the figures were taken on; and ``launch.py``'s own rows and ratios.

Every script prints one JSON line per figure, a blank line, then a table (``emit``); progress
goes to stderr. A table is a list of rows, each a mapping from column to cell (``table``), so a
column's name stands next to what fills it.

Non-goals: measuring (``_measure``), children and their processes (``_harness``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from _measure import Figure

FIGURES = ("launch_s", "failure_s")
LAUNCHERS = ("sparkdist", "pyspark", "torchrun")
MODE_ORDER = ("local", "local[2]", "local-cluster[2,1,1024]")


# --- numbers and units -----------------------------------------------------------------------


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def median_of(trials: Sequence[Mapping[str, Any]], key: str, digits: int = 4) -> float | None:
    """The median of ``key`` over the trials that have it, rounded (None: none has it)."""
    return rounded(median([t[key] for t in trials if t.get(key) is not None]), digits)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def seconds(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} MB"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def runs_note(values: Sequence[float], prefix: str = "runs ") -> str:
    """``runs 0.41 0.40 0.43``: every run's figure, for a notes cell."""
    return prefix + " ".join(f"{value:.2f}" for value in values)


# --- tables and JSON lines -------------------------------------------------------------------


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned; the last one left ragged."""
    lines = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(row[i]) for row in lines) for i in range(len(header) - 1)]
    return "\n".join(
        (
            "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True))
            + "  "
            + row[-1]
        ).rstrip()
        for row in lines
    )


def table(rows: Sequence[Mapping[str, str]]) -> str:
    """``format_table`` of rows given as {column: cell}; the first row's columns head it."""
    if not rows:
        return ""
    return format_table(list(rows[0]), [list(row.values()) for row in rows])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table, for the scripts whose output goes into docs as it is."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def emit(records: Sequence[Mapping[str, Any]], text: str, title: str = "") -> None:
    """Print the JSON lines, then the table (stdout); progress went to stderr."""
    for record in records:
        print(json.dumps(record))
    print()
    if title:
        print(title)
    print(text, flush=True)


# --- the machine -----------------------------------------------------------------------------


def machine_record(
    load_before: Sequence[float], wall_s: float, leftovers: Mapping[str, int]
) -> dict[str, Any]:
    """Where and how the figures were taken.

    Cores and load (a shared box skews wall times), versions, and what the launchers left in
    their cwd/TMPDIR.
    """
    versions: dict[str, str | None] = {}
    for package in ("sparkdist", "pyspark", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "figure": "machine",
        "revision": source_revision(),
        "cpus": os.cpu_count(),
        "loadavg_1m_before": round(load_before[0], 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "wall_s": round(wall_s, 1),
        "leftover_files": dict(leftovers),
        "python": platform.python_version(),
        "platform": sys.platform,
        **versions,
    }


def source_revision() -> str | None:
    """The checkout's commit, ``+dirty`` when tracked files changed (None: not a git checkout)."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)

    try:
        commit, status = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "-uno")
    except OSError:
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


# --- launch.py's figures ---------------------------------------------------------------------


def ratio_records(figures: Sequence[Figure]) -> list[dict[str, Any]]:
    """One record per (figure, mode) that has both a sparkdist and a pyspark median."""
    medians = {(f.figure, f.mode, f.launcher): f.median for f in figures}
    records = []
    for figure, mode in dict.fromkeys((f.figure, f.mode) for f in figures):
        value = ratio(
            medians.get((figure, mode, "sparkdist")), medians.get((figure, mode, "pyspark"))
        )
        if value is not None:
            records.append(
                {
                    "figure": f"{figure}_ratio",
                    "mode": mode,
                    "launcher": "sparkdist/pyspark",
                    "value": round(value, 3),
                }
            )
    return records


def failure_note(figure: Figure | None) -> str:
    """How the driver learned of the failures: exception types, and if the cause was named."""
    if figure is None or figure.figure != "failure_s":
        return ""
    trials = sum(figure.outcomes.values())
    raised = trials - figure.outcomes.get("returned", 0) - figure.outcomes.get("timeout", 0)
    parts = [f"{name} {count}/{trials}" for name, count in sorted(figure.outcomes.items())]
    if raised:
        parts.append(f"cause named in error {figure.cause_in_error}/{raised}")
    return f"{figure.launcher}: " + ", ".join(parts)


def launch_table(figures: Sequence[Figure]) -> str:
    """One row per (figure, mode): medians, the sparkdist/pyspark ratio, notes.

    torchrun only launches on one machine, so its reference figures sit in the local row.
    """
    by_key = {(f.figure, f.mode, f.launcher): f for f in figures}
    keys = sorted(
        dict.fromkeys((f.figure, f.mode) for f in figures),
        key=lambda k: (FIGURES.index(k[0]), MODE_ORDER.index(k[1])),
    )
    rows = []
    for figure, mode in keys:
        cells = {launcher: by_key.get((figure, mode, launcher)) for launcher in LAUNCHERS}
        medians = {launcher: f.median if f else None for launcher, f in cells.items()}
        rows.append(
            {
                "figure": figure,
                "mode": mode,
                "sparkdist": seconds(medians["sparkdist"]),
                "pyspark": seconds(medians["pyspark"]),
                "sparkdist/pyspark": times(ratio(medians["sparkdist"], medians["pyspark"])),
                "torchrun": seconds(medians["torchrun"]),
                "notes": "; ".join(note for note in map(failure_note, cells.values()) if note),
            }
        )
    return table(rows)
