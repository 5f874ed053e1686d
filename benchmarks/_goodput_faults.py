"""The faults ``goodput.py`` strikes its runs with, on a thread of the driver's process.

``Faults`` strikes rank ``TARGET_RANK`` (found by the note it writes when it enters ``train``)
with a signal every ``interval_s``: the first one ``interval_s`` after the launch, each next one
``interval_s`` after the previous struck; each attempt is struck once at most, and a fault that
finds no rank running waits for the next one to enter. ``LabFaults`` strikes the rank's host in
the lab instead. Both stop the run at ``cap_s``.

Non-goals: what a run does (``_goodput_jobs``), the figures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _goodput_jobs import read_note

#: The rank the local faults strike (and whose host the lab's faults strike).
TARGET_RANK = 1


class Faults:
    """Strike rank ``TARGET_RANK`` every ``interval_s`` (``signum`` None: never), and stop the
    run at ``cap_s`` (``on_cap``), on a thread of the driver's process.

    A rank is found by the note it writes at entry (``rank-N``: attempt, pid, start time,
    host); each attempt is struck once at most.
    """

    def __init__(
        self,
        run_dir: Path,
        signum: int | None,
        interval_s: float,
        cap_s: float,
        on_cap: Callable[[], None],
    ) -> None:
        self.run_dir, self.signum, self.interval_s = run_dir, signum, interval_s
        self.cap_s, self.on_cap = cap_s, on_cap
        self.strikes: list[dict[str, Any]] = []
        self.capped = False
        self.launched = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="goodput-faults", daemon=True)

    def __enter__(self) -> Faults:
        self.launched = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        due = self.launched + self.interval_s
        while not self._stop.wait(0.02):
            now = time.time()
            if now >= self.launched + self.cap_s:
                self.capped = True
                self.on_cap()
                return
            if self.signum is None or now < due:
                continue
            target = self.target()
            if target is None:
                continue
            struck = self.strike(target)
            self.strikes.append({"at": struck, "attempt": target["attempt"]})
            due = struck + self.interval_s

    def note(self) -> dict[str, Any] | None:
        """The target rank's latest note, unless its attempt was struck already."""
        found = read_note(self.run_dir, TARGET_RANK)
        if found is None or any(s["attempt"] == found["attempt"] for s in self.strikes):
            return None
        return found

    def target(self) -> dict[str, Any] | None:
        """The target rank, if it is alive (same pid, same start time, not a zombie)."""
        found = self.note()
        if found is None:
            return None
        try:
            with open(f"/proc/{found['pid']}/stat", encoding="ascii") as stat:
                after = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return found if after[19] == found["started"] and after[0] != "Z" else None

    def strike(self, target: dict[str, Any]) -> float:
        assert self.signum is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(target["pid"], self.signum)
        return time.time()


class LabFaults(Faults):
    """The lab's faults: rank 1's host killed and brought back, or SIGTERM to its executor."""

    def __init__(self, cluster: Any, app: str, schedule: str, *args: Any) -> None:
        super().__init__(*args)
        self.cluster, self.app, self.schedule = cluster, app, schedule
        self.by_name = {h.hostname: h.name for h in cluster.lab.hosts.values()}

    def target(self) -> dict[str, Any] | None:
        found = self.note()
        if found is None:
            return None
        host = self.by_name.get(found["host"])
        if host is None:
            return None
        processes = self.cluster.lab.processes(host)
        if not any(  # a rank (as ``Lab.rank_processes`` tells them)
            p["name"].startswith("sparkdist-r") or "SPARKDIST_RUN_ID" in p["env_names"]
            for p in processes
        ):
            return None
        jvms = [
            p["pid"]
            for p in processes
            if any("CoarseGrainedExecutorBackend" in a for a in p["argv"]) and self.app in p["argv"]
        ]
        if not jvms:
            return None
        return {**found, "lab_host": host, "jvm": jvms[0]}

    def strike(self, target: dict[str, Any]) -> float:
        lab, host = self.cluster.lab, target["lab_host"]
        if self.schedule.startswith("host-kill"):
            lab.kill_host(host)
            struck = time.time()
            # Capacity comes back (a new machine, same name and address). The cluster has no
            # ``driver`` of its own, so this does not move executors about (its spreading could
            # SIGKILL a live executor while Spark still lists the killed one beside it).
            self.cluster.restart_host(host)
            return struck
        lab.signal(target["jvm"], signal.SIGTERM)
        return time.time()  # its Worker starts a new executor there on its own
