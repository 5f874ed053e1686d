"""Whether this machine can hold the multi-host lab, and if not, why (the skip reason).

The decision is a pure function of facts (``LabFacts``), so it is unit-tested table-driven;
``probe`` gathers the facts from this machine, a real trial ``unshare`` included (a container
may forbid namespaces that every tool needed is present for).

Non-goals: installing anything; choosing addresses (``holder``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

#: ``0`` turns the lab off (its tests then skip, saying so).
LAB_VAR = "SPARKDIST_LAB"
#: The programs the lab runs: namespaces, links and addresses, entering a host.
TOOLS = ("unshare", "nsenter", "ip", "java")


@dataclass(frozen=True)
class LabFacts:
    """What the decision needs to know about this machine."""

    platform: str
    euid: int
    tools: dict[str, bool]
    max_user_namespaces: int
    disabled: bool
    #: stderr of a trial ``unshare`` with the namespaces the lab needs ("" when it worked).
    trial_error: str


@dataclass(frozen=True)
class LabSupport:
    """The verdict: ``ok``, and otherwise the reason tests skip with."""

    ok: bool
    reason: str = ""
    #: Not root: the holder maps the caller to root in a user namespace of its own.
    rootless: bool = False


def decide(facts: LabFacts) -> LabSupport:
    """Whether the lab can run here; the first thing missing is the reason."""
    if facts.disabled:
        return LabSupport(False, f"the multi-host lab is turned off ({LAB_VAR}=0)")
    if facts.platform != "linux":
        return LabSupport(False, f"the multi-host lab needs Linux namespaces ({facts.platform})")
    missing = [tool for tool in TOOLS if not facts.tools.get(tool)]
    if missing:
        return LabSupport(
            False,
            f"the multi-host lab needs {', '.join(missing)} on PATH (util-linux, iproute2, a "
            "Java runtime for Spark)",
        )
    rootless = facts.euid != 0
    if rootless and facts.max_user_namespaces <= 0:
        return LabSupport(
            False,
            "the multi-host lab needs root or rootless user namespaces "
            "(user.max_user_namespaces is 0)",
        )
    if facts.trial_error:
        return LabSupport(
            False,
            "the multi-host lab could not create its namespaces here (a container that forbids "
            f"unshare?): {facts.trial_error.strip()[:300]}",
        )
    return LabSupport(True, rootless=rootless)


def unshare_prefix(rootless: bool) -> list[str]:
    """The holder's ``unshare``: new network, mount and PID namespaces; it dies whole with its
    first process (``--kill-child``). Rootless, a user namespace maps the caller to root."""
    user = ["--user", "--map-root-user"] if rootless else []
    return ["unshare", *user, "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]


def probe() -> LabSupport:
    """Decide for this machine (runs one short trial ``unshare``)."""
    tools = {tool: shutil.which(tool) is not None for tool in TOOLS}
    euid = os.geteuid() if hasattr(os, "geteuid") else -1
    try:
        with open("/proc/sys/user/max_user_namespaces") as limit:
            max_user_namespaces = int(limit.read().strip() or 0)
    except (OSError, ValueError):
        max_user_namespaces = 0
    trial_error = ""
    disabled = os.environ.get(LAB_VAR) == "0"
    if sys.platform == "linux" and all(tools.values()) and not disabled:
        try:
            trial = subprocess.run(
                [*unshare_prefix(euid != 0), "--uts", "true"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            trial_error = trial.stderr or (
                "" if trial.returncode == 0 else f"exit {trial.returncode}"
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            trial_error = str(error)
    return decide(LabFacts(sys.platform, euid, tools, max_user_namespaces, disabled, trial_error))
