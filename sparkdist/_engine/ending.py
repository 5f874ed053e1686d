"""How a started run ends, as whoever holds its handle sees it: done, its result or error, and
a cancel when the caller's own code raises meanwhile.

``Launch`` (one world) and ``GroupedLaunch`` (replica groups) both end this way; each sets
``_result`` or ``_error`` and then ``_done`` when its last process is gone, and says how it is
cancelled.

Non-goals: running anything (``launch``, ``replica_groups``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from sparkdist._core.run.result import RunResult


class Ending:
    """The end of a started run: poll it, wait for it, cancel it."""

    run_id: str

    def __init__(self) -> None:
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        """True once the run ended (every rank has exited)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RunResult:
        """Wait for the run and return its RunResult, or raise its error.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the run goes on).
            concurrent.futures.CancelledError: the run was cancelled.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"run {self.run_id} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def cancel(self, reason: str = "the run was cancelled") -> bool:  # pragma: no cover
        """Stop every rank and wait until they are gone; False if the run had already ended."""
        raise NotImplementedError

    @contextlib.contextmanager
    def cancel_on_exception(self) -> Iterator[None]:
        """Cancel the run when the block raises anything, then let the exception go on
        unchanged: for the caller's own code between starting a run and waiting for it."""
        try:
            yield
        except BaseException as exc:
            self.cancel(interruption(exc))
            raise


def interruption(exc: BaseException) -> str:
    """Why a run is cancelled when ``exc`` interrupted the thread waiting for it."""
    if isinstance(exc, KeyboardInterrupt):
        return "the driver was interrupted (Ctrl-C)"
    text = str(exc).strip().splitlines()
    detail = f": {text[0][:200]}" if text else ""
    return f"the driver's waiting thread was interrupted by {type(exc).__name__}{detail}"
