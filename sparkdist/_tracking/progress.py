"""The driver's live view of ``runtime.report()``: a progress bar, or plain lines.

In a terminal (or a notebook with ipywidgets) and with tqdm installed, a tqdm bar shows the step,
steps/s, the ETA when the total is known, and the latest metrics; with two ranks or more
reporting, also the slowest and the fastest rank's steps/s. Anywhere else (CI logs,
spark-submit writing to a file, no tqdm) a plain line is written every few seconds and once at
the end, never ``\\r`` noise. Nothing is shown for a run that never reports.

``update`` is called on the control channel's reader threads, so it only records the state and
wakes the display's own thread, which does the drawing.

Non-goals: choosing which rank's reports to show, MLflow (both ``_tracking``).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from sparkdist._core.env import PROGRESS_INTERVAL_VAR
from sparkdist._core.run.stragglers import RateSpread

#: Seconds between two plain progress lines (overridable with SPARKDIST_PROGRESS_INTERVAL_S).
LINE_INTERVAL_S = 10.0
#: Seconds between two redraws of a bar.
BAR_INTERVAL_S = 0.2
#: Metrics shown beside the bar or in a line (the first ones reported).
MAX_SHOWN_METRICS = 6


class ProgressDisplay:
    """Shows one run's progress on the driver's stderr (or notebook)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        # Latest state, guarded by _cond.
        self._step = 0
        self._total: int | None = None
        self._metrics: dict[str, float] = {}
        self._spread: RateSpread | None = None  # the slowest and fastest rank's steps/s
        self._version = 0
        self._first: tuple[float, int] | None = None  # (monotonic time, step) of 1st report
        self._last_at = 0.0
        # Owned by the display thread.
        self._bar: Any = None
        self._terminal_bar = False
        self._shown_version = 0

    # -- called from any thread --------------------------------------------------------------

    def update(self, step: int, total: int | None, metrics: Mapping[str, float]) -> None:
        """Record a report (cheap: the display thread draws it)."""
        now = time.monotonic()
        with self._cond:
            if self._closing:
                return
            if self._first is None or step < self._step:
                self._first = (now, step)  # first report, or a restart went back
            self._step, self._last_at = step, now
            if total is not None:
                self._total = total
            self._metrics.update(metrics)
            self._version += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._show, name=f"sparkdist-progress-{self.run_id}", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def update_spread(self, spread: RateSpread | None) -> None:
        """Record the slowest and the fastest rank's rates (shown with the next draw)."""
        with self._cond:
            if spread != self._spread and self._thread is not None:
                self._spread = spread
                self._version += 1
                self._cond.notify()

    def output_guard(self) -> contextlib.AbstractContextManager[Any]:
        """Wrap each line written to the terminal: a live bar steps aside and comes back."""
        if self._terminal_bar and self._bar is not None:
            from tqdm import tqdm

            return tqdm.external_write_mode()  # type: ignore[no-any-return]
        return contextlib.nullcontext()

    def announce(self, line: str) -> None:
        """Write one line of the launcher's own (the MLflow run link) without tearing a bar."""
        with self.output_guard():
            _write(sys.stderr, f"sparkdist: {line}\n")

    def close(self, timeout_s: float = 5.0) -> None:
        """Draw the final state (a last line, or the bar left in place) and stop."""
        with self._cond:
            self._closing = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join(timeout_s)

    # -- the display thread ------------------------------------------------------------------

    def _show(self) -> None:
        with self._cond:
            version, step, total, shown, _ = self._snapshot()
        # Rates count from the first report; the bar shows it as it opens.
        bar = _open_bar(self.run_id, step, total, shown)
        if bar is not None:
            self._bar, self._terminal_bar = bar
            self._shown_version = version
        interval = BAR_INTERVAL_S if bar is not None else _line_interval()
        drawn_at = -float("inf")
        try:
            while True:
                with self._cond:
                    wait = drawn_at + interval - time.monotonic()
                    if not self._closing and (self._version == self._shown_version or wait > 0):
                        self._cond.wait(
                            max(wait, 0.05) if self._version != self._shown_version else None
                        )
                        continue
                    closing = self._closing
                    state = self._snapshot()
                if state[0] != self._shown_version:
                    self._draw(state)
                    drawn_at = time.monotonic()
                if closing:
                    return
        finally:
            if self._bar is not None:
                with contextlib.suppress(Exception):
                    self._bar.close()

    def _snapshot(self) -> tuple[int, int, int | None, str, float | None]:
        """(version, step, total, the metrics and rates' spread as shown, steps/s)."""
        rate = None
        if self._first is not None and self._last_at > self._first[0]:
            rate = (self._step - self._first[1]) / (self._last_at - self._first[0])
        parts = [_format_spread(self._spread), _format_metrics(self._metrics)]
        shown = ", ".join(part for part in parts if part)
        return self._version, self._step, self._total, shown, rate

    def _draw(self, state: tuple[int, int, int | None, str, float | None]) -> None:
        version, step, total, shown, rate = state
        self._shown_version = version
        if self._bar is None:
            _write(
                sys.stderr,
                f"sparkdist: run {self.run_id}: {_line(step, total, rate)}"
                f"{' | ' + shown if shown else ''}\n",
            )
            return
        try:
            bar = self._bar
            if total is not None and bar.total != total:
                bar.total = total
            bar.set_postfix_str(shown, refresh=False)
            printed_at = bar.last_print_t
            bar.update(step - bar.n)  # a negative step after a restart is fine
            if bar.last_print_t == printed_at:  # update() did not draw it
                bar.refresh()
        except Exception:  # noqa: BLE001 - the display must never take the run down
            self._bar = None


def _open_bar(run_id: str, step: int, total: int | None, postfix: str) -> tuple[Any, bool] | None:
    """A tqdm bar where one can be drawn: (bar, whether it is a terminal bar), else None."""
    options: dict[str, Any] = {
        "desc": f"run {run_id}",
        "unit": "step",
        "initial": step,
        "total": total,
        "postfix": postfix or None,
    }
    try:
        if _in_notebook():
            from tqdm.notebook import tqdm as notebook_tqdm

            return notebook_tqdm(**options), False
        if not _isatty(sys.stderr) or _columns(sys.stderr) <= 0:
            return None  # no terminal, or one of no width (a bare pty): plain lines
        from tqdm import tqdm
    except Exception:  # noqa: BLE001 - no tqdm, no ipywidgets...: plain lines
        return None
    return tqdm(file=sys.stderr, dynamic_ncols=True, **options), True


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
        return shell is not None and "IPKernelApp" in shell.config
    except Exception:  # noqa: BLE001 - not a kernel we know
        return False


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _columns(stream: IO[str]) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return 80  # a terminal-like stream without a size of its own (a notebook's, a test's)


def _line_interval() -> float:
    try:
        return max(0.0, float(os.environ.get(PROGRESS_INTERVAL_VAR, LINE_INTERVAL_S)))
    except ValueError:
        return LINE_INTERVAL_S


def _line(step: int, total: int | None, rate: float | None) -> str:
    parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
    if rate is not None and rate > 0:
        parts.append(f"{rate:.3g} steps/s")
        if total and step < total:
            parts.append(f"ETA {_duration((total - step) / rate)}")
    return ", ".join(parts)


def _duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _format_metrics(metrics: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in list(metrics.items())[:MAX_SHOWN_METRICS])


def _format_spread(spread: RateSpread | None) -> str:
    """The slowest and the fastest rank's steps/s, or "" (fewer than two ranks judged)."""
    if spread is None:
        return ""
    return (
        f"slowest rank {spread.slowest_rank} {spread.slowest_rate:.3g} steps/s, "
        f"fastest rank {spread.fastest_rank} {spread.fastest_rate:.3g} steps/s"
    )


def _write(stream: IO[str], text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass  # the driver's own output is gone; training goes on
