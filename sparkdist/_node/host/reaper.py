"""Ending ranks and everything they started, bounded in time.

A rank leads its own process group, so signalling the group reaches its ordinary children
(DataLoader workers, a ``ninja`` build and the compilers it runs). A child that called
``setsid`` (or ``setpgid``) left the group, and once its parent dies it is re-parented to init,
where no tree walk finds it. So ``end_processes`` first records every process to end: the
ranks, every member of their groups, every descendant (walking parent links in ``/proc``), and,
with a tag, every process whose environment carries the tag (what a rank's descendants inherit:
strays whose parent already died). It then sends SIGTERM (a compiler driver stops its jobs and
removes partial output), re-scans for children forked meanwhile, and sends SIGKILL to whatever
is still alive after a short grace. A process is identified by pid and start time, so a pid
reused by an unrelated process is never signalled.

Linux only for the tree and the tags (``/proc``); elsewhere only the groups are signalled.

Non-goals: deciding when to end a rank (``agent``); reaping exit statuses (each process's
parent does that).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: How long SIGTERM has to work before SIGKILL follows.
KILL_GRACE_S = 0.5
#: How long after SIGKILL a process may take to disappear before it is reported as a survivor
#: (a process in uninterruptible sleep, on a slow disk, say).
KILL_CONFIRM_S = 1.0
#: Between two looks at the process table while waiting.
_POLL_S = 0.02


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    started: int  # clock ticks after boot: with the pid, names the process uniquely
    zombie: bool


def process_table() -> dict[int, _Proc]:
    """Every process visible in ``/proc`` (empty where there is no ``/proc``)."""
    table: dict[int, _Proc] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        proc = _read_stat(int(name))
        if proc is not None:
            table[proc.pid] = proc
    return table


def _read_stat(pid: int) -> _Proc | None:
    # Raw descriptors, not open(): a scan reads every process's stat, and a buffered file
    # object costs several times the read itself (a scan sits on every rank's exit).
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None  # gone between listing and reading
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name may hold spaces and parentheses: the fields start after the last ")".
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return _Proc(
            pid=pid,
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            started=int(fields[19]),
            zombie=fields[0] in (b"Z", b"X"),
        )
    except (IndexError, ValueError):
        return None


def _has_tag(pid: int, tag: Mapping[str, str]) -> bool:
    """Whether the process's environment holds every ``name=value`` of ``tag``."""
    try:
        fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY)
    except OSError:
        return False  # gone, or another user's: never ours
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except OSError:
        return False
    finally:
        os.close(fd)
    entries = set(b"".join(chunks).split(b"\0"))
    return all(f"{k}={v}".encode() in entries for k, v in tag.items())


class _Targets:
    """The processes to end, by (pid, start time), found again on every look."""

    def __init__(self, roots: Mapping[int, int | None], tag: Mapping[str, str] | None) -> None:
        self.roots = dict(roots)
        self.tag = dict(tag) if tag else None
        # A process that carries the tag was started by a root or its descendants, so it
        # cannot be older than the oldest root: environments of older processes are not read
        # (reading them is most of a scan's cost). Unknown start times disable the shortcut.
        starts = [started for started in self.roots.values() if started is not None]
        self.oldest = min(starts) if starts and len(starts) == len(self.roots) else None
        self.known: dict[int, int] = {}  # pid -> start time
        self.groups: set[int] = set()
        # Never this process, its group or its ancestors (local mode runs the agent in the
        # driver; a tag could match the driver itself when it is a rank of an outer run).
        self.spared = {os.getpid(), os.getppid()}
        self.spared_group = os.getpgrp()

    def look(self, with_tags: bool) -> list[_Proc]:
        """Re-scan; return the live (non-zombie) targets, newly found ones included."""
        table = process_table()
        for pid, started in self.roots.items():
            proc = table.get(pid)
            if proc is None:
                # Exited and reaped: its group may still hold strays. While it has members
                # no new process can take the pid, so the group is still the rank's.
                self.groups.add(pid)
            elif started is None or proc.started == started:
                self._add(proc)
            # else: the pid now names another process (reused): neither it nor its group
        self.roots = {}  # only on the first look: later, the pid could be reused meanwhile
        children: dict[int, list[_Proc]] = {}
        for proc in table.values():
            children.setdefault(proc.ppid, []).append(proc)
        for proc in table.values():
            if proc.pgid in self.groups and proc.pid not in self.known:
                self._add(proc)
            elif with_tags and self.tag and proc.pid not in self.known and proc.pid > 1:
                if self.oldest is not None and proc.started < self.oldest:
                    continue
                if proc.pid not in self.spared and _has_tag(proc.pid, self.tag):
                    self._add(proc)
        pending = [pid for pid in self.known if self._same(table.get(pid), pid)]
        while pending:
            for child in children.get(pending.pop(), ()):
                if child.pid not in self.known:
                    self._add(child)
                    pending.append(child.pid)
        return [
            proc
            for pid, proc in table.items()
            if self._same(proc, pid) and not proc.zombie and pid not in self.spared
        ]

    def _add(self, proc: _Proc) -> None:
        if proc.pid in self.spared:
            return
        self.known[proc.pid] = proc.started
        # A process that leads its own group (a rank, a child that called setsid): the group
        # is signalled as one, which also reaches a child forked after the last look.
        if proc.pgid == proc.pid and proc.pgid != self.spared_group:
            self.groups.add(proc.pgid)

    def _same(self, proc: _Proc | None, pid: int) -> bool:
        return proc is not None and self.known.get(pid) == proc.started

    def signal(self, live: list[_Proc], signum: int) -> None:
        groups = {proc.pgid for proc in live if proc.pgid in self.groups}
        for pgid in groups:  # live members prove the group is still the one we saw
            try:
                os.killpg(pgid, signum)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in live:
            if proc.pgid not in groups:
                try:
                    os.kill(proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), or None where it is gone or unknown."""
    proc = _read_stat(pid)
    return proc.started if proc is not None else None


def end_processes(
    roots: Mapping[int, int | None] | Iterable[int],
    *,
    tag: Mapping[str, str] | None = None,
    grace_s: float = KILL_GRACE_S,
    first_signal: int = signal.SIGTERM,
) -> list[int]:
    """End ``roots``, their process groups and every descendant; wait until they are gone.

    Args:
        roots: pids of processes that lead their own group (ranks), or a mapping of those
            pids to their start times (``start_time``), so that a pid already reused by
            another process is left alone.
        tag: environment entries that mark a process as belonging to them (a run's and node's
            ids): such a process is ended even when its parent already died.
        grace_s: how long ``first_signal`` has to work before SIGKILL.
        first_signal: SIGTERM, or SIGKILL to skip the grace.

    Returns:
        The pids still alive ``KILL_CONFIRM_S`` after SIGKILL (normally none).

    Returns within about ``grace_s + KILL_CONFIRM_S`` seconds, whatever the processes do.
    """
    roots = dict(roots) if isinstance(roots, Mapping) else dict.fromkeys(roots)
    if not os.path.isdir("/proc"):  # no tree to walk: the groups are all we can reach
        for pid in roots:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return []
    targets = _Targets(roots, tag)
    live = targets.look(with_tags=True)
    if not live:
        return []
    signum = first_signal
    kill_at = time.monotonic() + (grace_s if signum != signal.SIGKILL else 0.0)
    give_up = kill_at + KILL_CONFIRM_S
    signalled: set[int] = set()
    swept = False  # environments read again since the first signal went out
    while True:
        # SIGTERM goes once to each process (a second one could cut its clean-up short);
        # SIGKILL goes to whatever is still there on every look.
        targets.signal(
            [p for p in live if signum == signal.SIGKILL or p.pid not in signalled], signum
        )
        signalled.update(p.pid for p in live)
        time.sleep(_POLL_S)
        now = time.monotonic()
        switch = signum != signal.SIGKILL and now >= kill_at
        if switch:
            signum = signal.SIGKILL
        # Environments are read again only at the switch to SIGKILL, and once more before
        # saying everything is gone (reading them all is the costly part): a stray orphaned
        # meanwhile is still found.
        live = targets.look(with_tags=switch)
        swept = swept or switch
        if not live and not swept and targets.tag:
            live = targets.look(with_tags=True)
            swept = True
        if not live or now >= give_up:
            return [proc.pid for proc in live]


def end_descendants(tag: Mapping[str, str] | None = None) -> list[int]:
    """End every descendant of this process (SIGKILL at once: this process is going down),
    and every process carrying ``tag``; this process itself is spared.

    Returns:
        The pids still alive ``KILL_CONFIRM_S`` after SIGKILL (normally none).
    """
    me = os.getpid()
    children = [proc.pid for proc in process_table().values() if proc.ppid == me]
    if not children and not tag:
        return []
    return end_processes(children, tag=tag, first_signal=signal.SIGKILL)
