"""Package versions every host that runs ranks must have, checked before any rank starts.

The driver decides what a run needs (``expected_requirements``): its own Python (same
major.minor: cloudpickle ships bytecode), torch, cloudpickle and sparkdist, DeepSpeed in
mode "deepspeed", and the packages the user lists in ``requirements=`` (a bare name means
"the driver's version", ``name==version`` means that version). Each agent compares them with
what its own interpreter has (``unmet_requirements``, importlib.metadata, no import) before it
spawns a rank, and refuses with one row per difference; the driver turns every node's rows into
one table (``refusal_message``).

Versions match as PEP 440's ``==`` does, without needing the ``packaging`` package on the
executors: a local label ("+cpu", "+cu121") is ignored unless the wanted version has one, and
trailing zeros do not count ("2.2" is "2.2.0"); a pin may end in ".*" to match a prefix.

Non-goals: installing anything; specifiers other than ``==`` (a range rarely says what the
executors should be brought to, an exact version does).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparkdist._core.errors import ClusterError, ConfigError

#: The name a requirement uses for the interpreter itself.
PYTHON = "python"

_REFUSAL_MARKER = re.compile(r"SPARKDIST-REFUSAL<<<(.*?)>>>", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_RELEASE = re.compile(r"^v?(\d+(?:\.\d+)*)(.*)$")


@dataclass(frozen=True)
class Requirement:
    """One package (or the interpreter) every host that runs ranks must have.

    Attributes:
        name: the distribution name ("torch", "pandas"), or "python".
        version: the version it must have; None means "installed, any version".
        pinned: True when the user pinned the version; False when it is the driver's.
        major_minor_only: compare only the first two release numbers (Python itself).
    """

    name: str
    version: str | None
    pinned: bool = False
    major_minor_only: bool = False

    def wanted(self) -> str:
        """How the table shows what is wanted."""
        if self.version is None:
            return "any (not on the driver)"
        if self.pinned:
            return f"=={self.version} (pinned)"
        if self.major_minor_only:
            major_minor = ".".join(self.version.split(".")[:2])
            return f"{major_minor}.* (driver {self.version})"
        return f"{self.version} (driver)"


@dataclass(frozen=True)
class Refusal:
    """One agent's refusal as the driver received it."""

    node: int
    host: str
    reason: str | None
    rows: tuple[tuple[str, str, str, str], ...]

    @classmethod
    def of(cls, message: Mapping[str, Any]) -> Refusal:
        rows = tuple(
            (str(r[0]), str(r[1]), str(r[2]), str(r[3]))
            for r in message.get("rows") or ()
            if len(r) == 4
        )
        reason = message.get("reason")
        return cls(
            int(message.get("node", -1)),
            str(message.get("host", "")),
            str(reason) if reason else None,
            rows,
        )

    @property
    def summary(self) -> str:
        """One line: why this node would not start its ranks."""
        if self.reason:
            return self.reason
        names = ", ".join(dict.fromkeys(row[1] for row in self.rows))
        return f"host {self.host or self.node} lacks the package versions the run needs ({names})"


def parse_requirements(entries: Iterable[str] | None) -> tuple[str, ...]:
    """Check ``requirements=`` and return it normalised (``name`` or ``name==version``).

    Raises:
        ConfigError: an entry that is not a package name, optionally ``==version``.
    """
    if entries is None:
        return ()
    if isinstance(entries, str):
        raise ConfigError(
            f"requirements must be a list of package names, got the string {entries!r}; "
            f"write requirements=[{entries!r}]"
        )
    parsed: dict[str, str] = {}
    for entry in entries:
        name, version = _split(entry)
        parsed[_key(name)] = f"{name}=={version}" if version is not None else name
    return tuple(parsed.values())


def _split(entry: Any) -> tuple[str, str | None]:
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(f"requirements entries must be package names, got {entry!r}")
    text = entry.strip()
    name, sep, version = text.partition("==")
    name, version = name.strip(), version.strip()
    bad_version = bool(sep) and (not version or " " in version or "=" in version)
    if not _NAME.match(name) or bad_version:
        raise ConfigError(
            f"requirements entry {entry!r} is not understood: write a package name "
            "('numpy', meaning the driver's version) or an exact pin ('pandas==2.2.0'); "
            "other specifiers (>=, ~=, extras, markers) are not supported"
        )
    return name, (version if sep else None)


def _key(name: str) -> str:
    """PEP 503 normalisation: "Scikit_Learn" and "scikit-learn" are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str) -> str | None:
    """This interpreter's version of a distribution (or of Python), or None if missing."""
    if name == PYTHON:
        return platform.python_version()
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def expected_requirements(
    mode: str, user: Sequence[str], *, pinned_only: bool = False
) -> tuple[Requirement, ...]:
    """What every host that runs ranks must have, as the driver sees it.

    Args:
        mode: the launch mode's name ("deepspeed" adds DeepSpeed).
        user: ``requirements=`` as ``parse_requirements`` returned it.
        pinned_only: only the user's pinned versions (local mode: the ranks run the driver's
            own interpreter, so nothing else can differ).

    Raises:
        ConfigError: a bare name the driver does not have (there is no version to match).
    """
    wanted: dict[str, Requirement] = {}
    if not pinned_only:
        wanted[PYTHON] = Requirement(PYTHON, platform.python_version(), major_minor_only=True)
        names = ["torch", "cloudpickle", "sparkdist"] + (
            ["deepspeed"] if mode == "deepspeed" else []
        )
        for name in names:
            version = installed_version(name)
            if version is None and name == "sparkdist":
                continue  # running from a source tree: nothing to compare with
            wanted[_key(name)] = Requirement(name, version)
    for entry in user:
        name, version = _split(entry)
        if version is not None:
            wanted[_key(name)] = Requirement(name, version, pinned=True, major_minor_only=False)
        elif not pinned_only:
            driver_version = installed_version(name)
            if driver_version is None:
                raise ConfigError(
                    f"requirements lists {name!r}, which the driver does not have, so there is "
                    f"no version to match; pin one ('{name}==<version>') or install it here"
                )
            wanted[_key(name)] = Requirement(name, driver_version)
    return tuple(wanted.values())


def unmet_requirements(
    requirements: Sequence[Requirement], host: str
) -> list[tuple[str, str, str, str]]:
    """Rows (host, package, wanted, found) for every requirement this interpreter fails."""
    rows = []
    for requirement in requirements:
        found = installed_version(requirement.name)
        if found is None:
            rows.append((host, requirement.name, requirement.wanted(), "missing"))
        elif requirement.version is not None and not versions_match(
            found, requirement.version, requirement.major_minor_only
        ):
            rows.append((host, requirement.name, requirement.wanted(), found))
    return rows


def versions_match(found: str, wanted: str, major_minor_only: bool = False) -> bool:
    """PEP 440 ``==`` for the common cases, with no dependency (see the module docstring)."""
    wanted = wanted.strip()
    if wanted.endswith(".*"):
        prefix = _release(wanted[:-2])[0]
        return _release(found)[0][: len(prefix)] == prefix
    if "+" not in wanted:
        found = found.split("+", 1)[0]
    found_release, found_rest = _release(found)
    wanted_release, wanted_rest = _release(wanted)
    if major_minor_only:
        return _pad(found_release, 2)[:2] == _pad(wanted_release, 2)[:2]
    width = max(len(found_release), len(wanted_release))
    return (_pad(found_release, width), found_rest.lower()) == (
        _pad(wanted_release, width),
        wanted_rest.lower(),
    )


def release_of(version: str) -> tuple[int, ...]:
    """The release numbers of ``version`` ("2.13.0+cpu" -> (2, 13, 0)); () if it has none."""
    return _release(version)[0]


def _release(version: str) -> tuple[tuple[int, ...], str]:
    match = _RELEASE.match(version.strip())
    if match is None:
        return (), version.strip()
    return tuple(int(part) for part in match.group(1).split(".")), match.group(2)


def _pad(release: tuple[int, ...], width: int) -> tuple[int, ...]:
    return release + (0,) * (width - len(release))


def refusal_message(refusals: Sequence[Refusal], num_nodes: int) -> str:
    """One message for every node's refusal: a single version table, then other reasons."""
    rows = sorted({row for refusal in refusals for row in refusal.rows})
    parts = []
    if rows:
        refused_nodes = {refusal.node for refusal in refusals}
        started = (
            "no rank process was started"
            if len(refused_nodes) >= num_nodes
            else "these hosts started no rank (any rank started on another host was stopped)"
        )
        parts.append(
            "the hosts that would run the ranks do not have the packages this run needs, so "
            f"{started}:\n{format_table(rows)}\nfix: install these versions on the executors "
            "(cluster libraries, an init script, or a packed environment shipped with "
            "spark.archives), or change requirements="
        )
    parts += [r for r in dict.fromkeys(refusal.reason for refusal in refusals) if r]
    return "\n".join(parts)


def format_table(rows: Sequence[tuple[str, str, str, str]], found: str = "executor") -> str:
    """The table of version differences, one row per host and package."""
    header = ("host", "package", "driver / required", found)
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(4)]

    def line(cells: Sequence[str]) -> str:
        return (
            "  " + "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=False)).rstrip()
        )

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def check_local(requirements: Sequence[Requirement]) -> None:
    """Local mode: the ranks run the driver's interpreter, so its own pins are checked here.

    Raises:
        ClusterError: with the table of what differs; nothing has started.
    """
    rows = unmet_requirements(requirements, "driver (local mode)")
    if rows:
        raise ClusterError(
            "this Python does not have the pinned package versions, so no rank process was "
            f"started:\n{format_table(rows, 'installed')}\nfix: install these versions, or "
            "change requirements="
        )


def refusal_error(message: Mapping[str, Any]) -> ClusterError:
    """A refusal that cannot reach the driver's channel (a detached node): raised from the
    barrier task, it carries the message for ``refusals_in`` on the driver."""
    text = refusal_message([Refusal.of(message)], 1)
    return ClusterError(f"{text}\nSPARKDIST-REFUSAL<<<{json.dumps(dict(message))}>>>")


def refusals_in(error: BaseException | None) -> list[Refusal]:
    """The refusals detached tasks encoded in a failed stage's error, if any."""
    if error is None:
        return []
    found = []
    for match in _REFUSAL_MARKER.finditer(str(error)):
        try:
            found.append(Refusal.of(json.loads(match.group(1))))
        except (ValueError, TypeError):
            continue
    return found
