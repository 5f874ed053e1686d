"""A signal turned into a call on a thread: the handler itself only writes a byte to a pipe.

A Python signal handler runs on the main thread between two bytecodes, wherever that thread
is: inside ``queue.put``, holding the lock of a rank's pipe to its agent, in a logging call.
A handler that takes a lock may deadlock its own process, and a second signal may run it again
inside itself. So the handler here does only what cannot block: it notes the signal and writes
one byte to a non-blocking pipe (a full pipe drops the byte: a wake-up is pending anyway). A
daemon thread reads the pipe and calls ``on_signal`` there, where locks, queues and sockets
are safe.

Installed only from the main thread (``signal.signal`` refuses the others); ``close`` puts back
the dispositions that were there before, and ``redeliver`` sends the signals received again,
so that they then do what they would have done without us (end the process, run a handler
the user installed). A process forked from the owner (a DataLoader worker inherits the
handler) is not the owner: there, and wherever ``accept`` says no, the signal's default action
is restored and the signal delivered again at once.

Non-goals: what a notice means (a rank's ``drain``, the ``agent``, the driver's ``launch``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

logger = logging.getLogger("sparkdist")


class SignalNotice:
    """Handlers for ``signals`` that call ``on_signal(signum)`` on a thread of their own.

    Args:
        signals: the signals to take over.
        on_signal: called with each signal's number, on the notice's thread, in order.
        name: the thread's name.
        accept: called in the handler itself (so: no locks, nothing that blocks; a ``stat``
            is fine) with the signal's number; False gives the signal its default action.

    Raises:
        ValueError: not called from the main thread.
    """

    def __init__(
        self,
        signals: Sequence[signal.Signals],
        on_signal: Callable[[int], None],
        name: str,
        accept: Callable[[int], bool] | None = None,
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("signal handlers can only be installed from the main thread")
        self._on_signal = on_signal
        self._accept = accept
        self._owner = os.getpid()
        self.received: list[int] = []  # appended by the handler (the main thread) only
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous: dict[signal.Signals, Any] = {}
        try:
            for signum in signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        except BaseException:
            self._restore()
            os.close(self._read)
            os.close(self._write)
            raise
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner or (self._accept is not None and not self._accept(signum)):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received.append(signum)
        try:
            os.write(self._write, bytes([signum]))
        except OSError:
            pass  # full (a wake-up is pending) or closed (``close`` ran): nothing to add

    def _serve(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                break  # ``close``
            for signum in data:
                try:
                    self._on_signal(signum)
                except Exception:  # a notice must never end the thread that hears the next
                    logger.exception("sparkdist: handling signal %d failed", signum)
        os.close(self._read)

    def close(self) -> None:
        """Put the previous handlers back (from the main thread) and end the thread."""
        self._restore()
        os.close(self._write)  # the thread reads what is left, then its end of file

    def redeliver(self) -> None:
        """Send every signal received to this process again (after ``close``): with the
        previous disposition back, it does now what it would have done without us."""
        for signum in dict.fromkeys(self.received):
            os.kill(os.getpid(), signum)

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            # None: installed outside Python; there is nothing we could put back.
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


@contextlib.contextmanager
def notices_during(
    signals: Sequence[signal.Signals], on_signal: Callable[[int], None], name: str
) -> Iterator[None]:
    """While the block runs, ``signals`` call ``on_signal`` on a thread (``SignalNotice``);
    after it, the previous dispositions are back and the signals received are delivered again.

    Installs nothing off the main thread, nor over a disposition that says to ignore a signal
    (``SIG_IGN``) or that Python cannot put back (a handler installed outside Python).
    """
    if threading.current_thread() is not threading.main_thread() or any(
        signal.getsignal(signum) in (signal.SIG_IGN, None) for signum in signals
    ):
        yield
        return
    notice = SignalNotice(signals, on_signal, name)
    try:
        yield
    finally:
        notice.close()
        notice.redeliver()
