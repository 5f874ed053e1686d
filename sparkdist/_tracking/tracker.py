"""What a launch reports: the live progress display and the MLflow run, behind one object.

One ``RunTracker`` per ``Launch``, so a run's restarts share one MLflow run and one display.
Reports from the ranks (``runtime.report()``) arrive on the control channel's reader threads;
the tracker keeps only those of the lowest rank that reports (normally rank 0: the same step
must not reach MLflow once per rank), remembers the last metrics for ``RunResult``, and hands
them to the display (``_progress``) and to MLflow (``_mlflow_run``), which do the slow work on
threads of their own. Every rank's reports also go to the launch's ``RunWatch`` (timeline, step
rates, stragglers), and the nodes' system samples become MLflow ``system/node_N/...`` metrics.

Non-goals: drawing (``_progress``), talking to MLflow (``_mlflow_run``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
import threading
from collections.abc import Mapping

from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import Placement
from sparkdist._core.run.result import RunResult
from sparkdist._core.run.stragglers import RateSpread, StragglerEvent, Straggling
from sparkdist._tracking.hooks import AttemptHooks
from sparkdist._tracking.mlflow_run import MlflowRun
from sparkdist._tracking.mlflow_store import TRACKING_VAR, tracking_wanted
from sparkdist._tracking.progress import ProgressDisplay
from sparkdist._tracking.run_watch import RunWatch
from sparkdist._wire.protocol import Report, Sample

__all__ = ["TRACKING_VAR", "RunTracker", "tracking_wanted"]

logger = logging.getLogger("sparkdist")


class RunTracker:
    """Progress display, last metrics and (optionally) the MLflow run of one launch."""

    def __init__(
        self,
        config: LaunchConfig,
        placement: Placement,
        run_id: str,
        *,
        mlflow_parent: MlflowRun | None = None,
        mlflow_tags: Mapping[str, str] | None = None,
    ) -> None:
        """``mlflow_parent``: the whole run's MLflow run, when this launch is one replica group
        (its own run nests under it); ``mlflow_tags``: set on the MLflow run."""
        self.display = ProgressDisplay(run_id)
        self.last_metrics: dict[str, float] = {}
        self._lock = threading.Lock()
        self._source_rank: int | None = None
        self._reports = 0
        self._last_step: int | None = None
        self._catching_up = False  # a lower rank took over: skip the steps already taken
        self._monitor: AttemptHooks | None = None
        self._attempts = 0
        self.watch = RunWatch(config, placement)
        self._mlflow = (
            MlflowRun(
                config, placement, run_id, self.display, parent=mlflow_parent, tags=mlflow_tags
            )
            if tracking_wanted(config.mlflow)
            else None
        )

    @property
    def mlflow_run_id(self) -> str | None:
        """The launch's MLflow run, once it exists (before any rank's rendezvous); else None."""
        return None if self._mlflow is None else self._mlflow.mlflow_run_id

    def attach(self, monitor: AttemptHooks) -> None:
        """Wire one attempt's monitor: reports come here, its rendezvous waits for MLflow."""
        monitor.on_report = self.on_report
        monitor.output_guard = self.display.output_guard
        self._monitor = monitor
        self._attempts += 1
        self.watch.new_attempt()
        if self._mlflow is not None:
            self._mlflow.hold(monitor)

    def on_report(self, message: Report | Sample) -> None:
        """A rank's ``runtime.report()`` or a node's system sample: runs on a channel reader
        thread, so it stays cheap."""
        if isinstance(message, Sample):
            self._on_sample(message)
            return
        checked = self.watch.report(message)
        if checked is not None:
            self._on_check(*checked)
        rank, step, total = message.rank, message.step, message.total
        # The channel admits only finite numbers; a report built in-process is held to the same.
        metrics = {
            str(k): float(v)
            for k, v in message.metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        with self._lock:
            # The lowest rank that reports is the one shown and logged: the same step must
            # not reach MLflow once per rank. Should a lower rank's first report arrive after
            # a higher one's, it takes over from the next step not taken yet.
            if self._source_rank is not None and rank > self._source_rank:
                return
            if rank != self._source_rank:
                self._catching_up = self._source_rank is not None
                self._source_rank, self._reports = rank, 0
            self._reports += 1
            step = step if step is not None else self._reports
            if self._catching_up:
                if self._last_step is not None and step <= self._last_step:
                    return
                self._catching_up = False
            self._last_step = step
            self.last_metrics.update(metrics)
        self.display.update(step, total, metrics)
        if self._mlflow is not None and metrics:
            self._mlflow.log_metrics(step, metrics)

    def _on_sample(self, message: Sample) -> None:
        hosts = self._monitor.node_hosts if self._monitor is not None else {}
        index, sample = self.watch.sample(message, hosts.get(message.node, ""))
        if self._mlflow is not None:  # named as MLflow's own monitor names a node's metrics
            prefix = f"system/node_{message.node}/"
            metrics = {prefix + name: value for name, value in sample.metrics.items()}
            self._mlflow.log_metrics(index, metrics, at=sample.time)

    def _on_check(self, events: list[StragglerEvent], spread: RateSpread | None) -> None:
        self.display.update_spread(spread)
        hosts = self._monitor.node_hosts if self._monitor is not None else {}
        for event in events:
            if not isinstance(event, Straggling):
                logger.info("sparkdist: rank %d caught up (%.3g steps/s)", event.rank, event.rate)
                continue
            line = self.watch.straggler_line(event, hosts)
            with self.display.output_guard():
                logger.warning("sparkdist: %s", line)
            if self._mlflow is not None:
                self._mlflow.set_tags({f"sparkdist.straggler.rank_{event.rank}": line})

    def close(self, result: RunResult | None, error: BaseException | None) -> RunResult | None:
        """End the display and the MLflow run; return ``result`` with the tracking fields."""
        mlflow_run_id = None
        if result is not None:
            result = dataclasses.replace(
                result,
                last_metrics=dict(self.last_metrics),
                timeline=self.watch.timeline(result.timeline),
                system_samples=list(self.watch.samples),
            )
        try:
            self.display.close()
            if self._mlflow is not None:
                hosts = (
                    result.hosts
                    if result is not None
                    else (list(self._monitor.node_hosts.values()) if self._monitor else [])
                )
                with tempfile.TemporaryDirectory(prefix="sparkdist-report-") as folder:
                    artifacts = _report(result, folder)
                    mlflow_run_id = self._mlflow.close(error, hosts, self._attempts - 1, artifacts)
        except Exception:  # tracking never changes a run's outcome
            logger.debug("sparkdist: closing the run's tracking failed", exc_info=True)
        if result is None:
            return None
        return dataclasses.replace(result, mlflow_run_id=mlflow_run_id)


#: The run report's file name among the MLflow run's artifacts.
REPORT_ARTIFACT = "sparkdist_report.png"


def _report(result: RunResult | None, folder: str) -> list[str]:
    """The run's report, drawn into ``folder``, for a run that has system samples (a run
    shorter than one sample interval has nothing to draw but its timeline, and is spared
    matplotlib's import)."""
    if result is None or not result.system_samples:
        return []
    try:
        return [result.save_report(os.path.join(folder, REPORT_ARTIFACT))]
    except Exception:  # noqa: BLE001 - no matplotlib, a drawing bug: the run is fine
        logger.debug("sparkdist: drawing the run report failed", exc_info=True)
        return []
