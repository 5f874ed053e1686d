"""One node's side of a preemption: notices reaching the agent, the drain it passes on to its
ranks, and the bound after which it ends the ranks that still run.

A notice reaches a node three ways: a rank got SIGTERM (its ``Preempted`` note), the agent's
own process got SIGTERM or SIGHUP (``own_signals``: PySpark's daemon sends SIGHUP to its
workers when the executor's JVM shuts them down), or the driver's ``Drain`` (another node's
notice, or the driver's own SIGTERM). A notice of this node's own goes to the driver, which
drains the whole run, and to this node's ranks at once, without waiting for that round trip.

The driver keeps the run's grace (``preemption_grace_s``) and stops what still runs after it.
The agent keeps it too, ``AGENT_SLACK_S`` later, for when the driver cannot: its link is gone
(the driver was preempted with the node), or the node runs detached. A node whose drain began
with no word from the driver counts ``DEFAULT_PREEMPTION_GRACE_S``.

Non-goals: the ranks' side (``drain``); deciding the run's fate (``_core.run_state``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from sparkdist._core.launch.config import DEFAULT_PREEMPTION_GRACE_S
from sparkdist._node.host.signal_notice import SignalNotice
from sparkdist._wire import protocol

if TYPE_CHECKING:
    from sparkdist._node.agent.ranks import RankHandle

#: How long past the grace the agent waits for the driver's stop before ending its own ranks:
#: normally the driver's word comes first, and its reason names the grace.
AGENT_SLACK_S = 2.0

_SIGNAL_WORDS = {
    signal.SIGTERM: "SIGTERM",
    signal.SIGHUP: "SIGHUP (its executor is shutting its Python workers down)",
}


class NodeDrain:
    """One agent's preemption state: what it was told, and until when its ranks may run."""

    def __init__(self, node: int, host: str) -> None:
        self.where = f"node {node} (host {host})"
        self.reason: str | None = None
        self.deadline: float | None = None  # monotonic
        self._driver_said = False

    def notice(self, why: str, now: float) -> tuple[protocol.Preempted, protocol.Drain] | None:
        """A notice of this node's own (``why``: what and where): what to tell the driver and
        the ranks, the first time; None once the node drains already."""
        if self.reason is not None:
            return None
        self.reason = why
        self.deadline = now + DEFAULT_PREEMPTION_GRACE_S + AGENT_SLACK_S
        return protocol.Preempted(self.reason), protocol.Drain(
            self.reason, DEFAULT_PREEMPTION_GRACE_S
        )

    def from_driver(self, drain: protocol.Drain, now: float) -> protocol.Drain | None:
        """The driver's drain: what to tell the ranks, the first time (the driver's grace,
        from now, replaces the default a notice of our own started)."""
        if self._driver_said:
            return None
        self._driver_said = True
        self.reason = self.reason or drain.reason
        self.deadline = now + drain.grace_s + AGENT_SLACK_S
        return drain

    def act(
        self,
        kind: str,
        payload: Any,
        tell_driver: Callable[[protocol.Message], None],
        ranks: Iterable[RankHandle],
    ) -> None:
        """The agent's "preempt" (a notice's why) or "drain" (the driver's ``Drain``) event:
        tell the driver and the ranks what they must hear."""
        now = time.monotonic()
        if kind == "preempt":
            told = self.notice(str(payload), now)
            to_ranks = None if told is None else told[1]
            if told is not None:
                tell_driver(told[0])
        else:
            to_ranks = self.from_driver(payload, now)
        if to_ranks is not None:
            for rank in ranks:
                rank.tell(to_ranks)

    def overdue(self, now: float) -> str | None:
        """Why the agent must end its ranks now (the grace ran out), or None."""
        if self.deadline is None or now < self.deadline:
            return None
        return f"preempted ({self.reason}): ranks still running past the grace were stopped"


def _process_stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _nearest_jvm() -> tuple[int, str] | None:
    """This process's nearest ancestor that is a JVM (the executor's, or local mode's
    driver's), as (pid, start time); None where /proc does not say."""
    pid = os.getppid()
    for _ in range(4):  # worker <- daemon <- JVM, with room for a wrapper
        stat = _process_stat(pid)
        if stat is None or pid <= 1:
            return None
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            return None
        if exe == "java":
            return pid, stat[19]  # starttime: a reused pid is another process
        pid = int(stat[1])
    return None


#: ``/proc/<pid>/stat``'s flags bit the kernel sets when a task begins to exit (a SIGKILL, the
#: OOM killer, or its own ``exit``): from then on it never runs user code again.
PF_EXITING = 0x4


def _alive(pid: int, started: str) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (``still_running``)."""
    return still_running(_process_stat(pid), started)


def still_running(stat: list[str] | None, started: str) -> bool:
    """Whether a process whose ``/proc`` stat fields (after the command name) are ``stat``, and
    which started at ``started``, still runs: it exists, is the same process (start time), is
    no zombie, and has not begun to exit.

    The last matters for a killed JVM: its sockets close (PySpark's daemon sees that and sends
    SIGHUP) while the kernel is still tearing the dying process down, before it turns zombie.
    """
    if stat is None or len(stat) < 20 or stat[19] != started or stat[0] in ("Z", "X", "x"):
        return False
    try:
        return not int(stat[6]) & PF_EXITING
    except ValueError:
        return True  # an unreadable flags field says nothing against it


@contextlib.contextmanager
def own_signals(events: queue.Queue[tuple[str, Any]], where: str) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP to this process are notices on the agent's
    ``events`` (``where`` names the node), where the agent runs on its process's main thread (a
    barrier task's Python worker); elsewhere nothing changes (local mode: the agent is a thread
    of the driver, whose own SIGTERM handling applies). The previous handlers come back after:
    the process is not ended by us (the platform's SIGKILL follows a real preemption)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    jvm = _nearest_jvm()

    def on_signal(signum: int) -> None:
        if signum == signal.SIGHUP and jvm is not None and not _alive(*jvm):
            # PySpark's daemon sends SIGHUP both when its JVM shuts its workers down (still
            # alive, running its shutdown hooks: a preemption) and when the JVM died under
            # it (a crash, SIGKILL, the OOM killer): then nothing is being taken back in an
            # orderly way, and the node fails at once, as SIGHUP always ended it.
            os._exit(128 + signal.SIGHUP)
        words = _SIGNAL_WORDS.get(signal.Signals(signum), signal.Signals(signum).name)
        events.put(("preempt", f"{where} got {words}"))

    notices = SignalNotice((signal.SIGTERM, signal.SIGHUP), on_signal, "sparkdist-agent-signals")
    try:
        yield
    finally:
        notices.close()
