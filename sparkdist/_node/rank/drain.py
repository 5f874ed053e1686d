"""A rank's side of a preemption: the notice, the flag ``runtime.should_stop`` reads, and the
callbacks of ``runtime.on_preemption``.

SIGTERM to a rank does not end it: it starts a drain. The rank's handler (``signal_notice``:
it only wakes a thread) has that thread tell the agent (a ``Preempted`` note); the agent tells
the driver, the driver every agent, every agent its ranks (``Drain``, read by the worker's
pipe reader). Either way the notice reaches this module once per process: the flag is set,
the agent is told (when the notice is this rank's own), and the callbacks run on a thread of
their own (``sparkdist-preemption``), never on the main thread and never on the pipe reader.

sparkdist's own stop of a rank begins with SIGTERM too (``reaper``: a clean-up chance for what
the rank started). Before it signals, the agent leaves a marker file (``stop_marker_path``);
a rank that finds it takes the signal's default action, as before: it ends at once.

Non-goals: agreeing across ranks (``runtime.should_stop``'s collective), the grace (the driver
and the agent keep it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from sparkdist._core.run_dir import stop_marker_path
from sparkdist._node.host.signal_notice import SignalNotice
from sparkdist._wire import protocol

logger = logging.getLogger("sparkdist")

#: Why this rank drains, once a notice reached it (None before).
_reason: str | None = None
#: The collective of ``runtime.should_stop`` answered True once: every rank knows.
_agreed = False
_callbacks: list[Callable[[str], object]] = []
_lock = threading.Lock()
#: This process's SIGTERM handler (a rank's main thread installs it once).
_notice: SignalNotice | None = None


def install(rank: int, run_dir: str, send: Callable[[protocol.Message], None]) -> None:
    """Make SIGTERM a preemption notice for this rank (from its main thread, once)."""
    global _notice
    marker = stop_marker_path(run_dir, rank)

    def on_signal(signum: int) -> None:
        why = f"rank {rank} got {signal.Signals(signum).name}"
        if _reach(why):
            send(protocol.Preempted(why))  # first: the run's drain must not wait for callbacks
            _run_callbacks(why)

    _notice = SignalNotice(
        (signal.SIGTERM,),
        on_signal,
        "sparkdist-sigterm",
        accept=lambda _: not os.path.exists(marker),
    )


def drain_from_agent(reason: str) -> None:
    """The driver's ``Drain`` reached this rank (the pipe reader's thread)."""
    if _reach(reason):
        _run_callbacks(reason)


def requested() -> bool:
    """Whether a drain reached this rank (its own signal, or the driver's word)."""
    # The handler's own record counts at once: the main thread may ask before the notice's
    # thread ran, and the step of the signal is the one to save.
    return _reason is not None or _agreed or bool(_notice is not None and _notice.received)


def agreed() -> bool:
    """Whether the ranks already agreed to stop (``runtime.should_stop`` said True)."""
    return _agreed


def agree() -> None:
    """Every rank answered True at the same call: from now on, no collective is needed."""
    global _agreed
    _agreed = True


def on_preemption(callback: Callable[[str], object]) -> None:
    """Run ``callback(reason)`` when a notice reaches this rank; at once (on this thread) if
    one already did."""
    with _lock:
        reason = _reason
        if reason is None:
            _callbacks.append(callback)
            return
    _call(callback, reason)


def _reach(reason: str) -> bool:
    """Record the notice; True for the first one in this process."""
    global _reason
    with _lock:
        if _reason is not None:
            return False
        _reason = reason
        return True


def _run_callbacks(reason: str) -> None:
    with _lock:
        callbacks = list(_callbacks)
        _callbacks.clear()
    if not callbacks:
        return

    def run() -> None:
        for callback in callbacks:
            _call(callback, reason)

    threading.Thread(target=run, name="sparkdist-preemption", daemon=True).start()


def _call(callback: Callable[[str], object], reason: str) -> None:
    try:
        callback(reason)
    except Exception:  # a callback never ends the rank: it would lose the step it saves
        logger.warning(
            "sparkdist: runtime.on_preemption callback %r raised (the rank goes on)",
            callback,
            exc_info=True,
        )
