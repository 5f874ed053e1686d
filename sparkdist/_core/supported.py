"""The versions sparkdist supports: one tested range per package, defined here once.

``pyproject.toml``'s extras, ``sparkdist doctor``'s verdicts and the table in
docs/platforms.md all follow this table (tests/unit/test_supported.py holds each to it). The
floor of a range is what CI's second test environment runs (tests/floor/constraints.txt: the
Spark and MLflow that managed clusters ship), the newest release below its bound is what the
first runs; torch's and DeepSpeed's floors are the oldest releases the documented modes need.

Versions compare by their release numbers only ("3.5.0", "2.13.0+cpu", "4.1.0.dev1" all
compare as their numbers), without the ``packaging`` package, which executors may lack.

Non-goals: what one run requires of its executors (``versions``: the driver's own versions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sparkdist._core.versions import release_of

#: The oldest Python sparkdist runs on (``requires-python``).
PYTHON_FLOOR = "3.10"


@dataclass(frozen=True)
class Supported:
    """One package's tested range: ``floor`` (inclusive) up to ``below`` (exclusive).

    Attributes:
        name: the distribution's name.
        floor: the oldest supported release.
        below: the first release no longer supported.
        extra: the sparkdist extra that installs it.
        why: what sets the floor, for the docs and the doctor.
    """

    name: str
    floor: str
    below: str
    extra: str
    why: str

    @property
    def specifier(self) -> str:
        """The range as pip writes it: ``>=3.5,<5``."""
        return f">={self.floor},<{self.below}"

    def holds(self, version: str) -> bool:
        """Whether ``version`` lies inside the range."""
        found = release_of(version)
        return _at_least(found, release_of(self.floor)) and not _at_least(
            found, release_of(self.below)
        )

    def fix(self) -> str:
        """What to do about a version outside the range."""
        return (
            f"install a {self.name} in the tested range: pip install '{self.name}{self.specifier}'"
        )


SUPPORTED: tuple[Supported, ...] = (
    Supported(
        "pyspark",
        "3.5",
        "5",
        "spark",
        "Spark 3.5: Databricks 14.3, 15.4 and 16.4 LTS, EMR 7, Dataproc 2.2",
    ),
    Supported("mlflow", "2.21", "4", "mlflow", "MLflow 2.21: Databricks ML 16.4 LTS"),
    Supported(
        "torch", "2.6", "3", "torch", "torch 2.6: FSDP2 (torch.distributed.fsdp.fully_shard)"
    ),
    Supported("deepspeed", "0.16", "1", "deepspeed", "DeepSpeed 0.16: torch_adam on CPU, ZeRO-3"),
)
BY_NAME = {entry.name: entry for entry in SUPPORTED}


def outside_range(versions: Mapping[str, str | None]) -> list[tuple[Supported, str]]:
    """The (range, version) of every installed package of ``versions`` (name -> version, None
    where it is missing) that lies outside its tested range, in the table's order."""
    return [
        (entry, version)
        for entry in SUPPORTED
        if (version := versions.get(entry.name)) is not None and not entry.holds(version)
    ]


def describe(name: str, version: str) -> str:
    """``version`` with its verdict: "3.5.0 (tested range >=3.5,<5)" or "... outside ..."."""
    entry = BY_NAME[name]
    where = "tested range" if entry.holds(version) else "OUTSIDE the tested range"
    return f"{version} ({where} {entry.specifier})"


def _at_least(found: tuple[int, ...], bound: tuple[int, ...]) -> bool:
    width = max(len(found), len(bound))
    return found + (0,) * (width - len(found)) >= bound + (0,) * (width - len(bound))
