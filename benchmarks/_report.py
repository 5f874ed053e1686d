"""Turning figures into output: JSON records, ratios, the machine it ran on, and the table.

Non-goals: measuring (``_measure``), running launchers (``launch.py``).
"""

from __future__ import annotations

import os
import platform
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
HEADER = ("figure", "mode", "sparkdist", "pyspark", "sparkdist/pyspark", "torchrun", "notes")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


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


def table_rows(figures: Sequence[Figure]) -> list[tuple[str, ...]]:
    """One row per (figure, mode): medians, the sparkdist/pyspark ratio, notes.

    torchrun only launches on one machine, so its reference figures sit in the local row.
    """
    by_key = {(f.figure, f.mode, f.launcher): f for f in figures}
    keys = sorted(
        dict.fromkeys((f.figure, f.mode) for f in figures),
        key=lambda k: (FIGURES.index(k[0]), MODE_ORDER.index(k[1])),
    )
    rows: list[tuple[str, ...]] = []
    for figure, mode in keys:
        cells = {launcher: by_key.get((figure, mode, launcher)) for launcher in LAUNCHERS}
        medians = {launcher: f.median if f else None for launcher, f in cells.items()}
        value = ratio(medians["sparkdist"], medians["pyspark"])
        notes = "; ".join(note for note in map(failure_note, cells.values()) if note)
        rows.append(
            (
                figure,
                mode,
                _seconds(medians["sparkdist"]),
                _seconds(medians["pyspark"]),
                "-" if value is None else f"{value:.2f}x",
                _seconds(medians["torchrun"]),
                notes,
            )
        )
    return rows


def format_table(figures: Sequence[Figure]) -> str:
    """The table, columns aligned (the last one, notes, left ragged)."""
    rows = [HEADER, *table_rows(figures)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER) - 1)]
    return "\n".join(
        (
            "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True))
            + "  "
            + row[-1]
        ).rstrip()
        for row in rows
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"
