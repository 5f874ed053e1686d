"""The MLflow run of one launch: created off the launch path, shared by every rank.

While the workers start, a thread of its own imports mlflow and creates (or reuses) the MLflow
run; every attempt's rendezvous is held until then, so each rank gets ``MLFLOW_RUN_ID``,
``MLFLOW_EXPERIMENT_ID`` and ``MLFLOW_TRACKING_URI`` before user code runs and a bare
``mlflow.log_metric`` lands in that run. Only what the run's creation needs happens before the
release (the slow imports usually ran earlier: ``_mlflow_store.prewarm``); the launch's params
and MLflow's context tags (user, source, git commit) are logged after it. Reported metrics go in
batches, at most one a second; at the end the last ones and the outcome go together (tags; a run
this launch created is ended FINISHED, FAILED or KILLED, a reused one is left to its owner).

One line says where the run is: for a tracking server, its page, as the run starts; for a store
on disk (sqlite, file), which no server shows until someone starts ``mlflow ui``, where it was
logged and the command that shows it, as the run ends.

Nothing here may fail a launch: mlflow missing, failing or too slow turns tracking off for the
run with one line saying so.

Nodes' system samples go with the metrics (named by the tracker), straggler tags as they come,
and the run's report (a PNG) as an artifact with the outcome.

A replica-group run (torchft) has one MLflow run for the whole run (created, or the caller's
own, as above) and one nested run per group under it (``parent``): each group's ranks log to
their group's run, and the whole run's says how the run ended. Only the whole run's says where
it is.

Non-goals: models, autologging; which rank's reports count (``_tracking``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from sparkdist._core.env import (
    MLFLOW_EXPERIMENT_ID_VAR,
    MLFLOW_EXPERIMENT_NAME_VAR,
    MLFLOW_RUN_ID_VAR,
    MLFLOW_TRACKING_URI_VAR,
)
from sparkdist._core.errors import WorkerFailedError
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import Placement
from sparkdist._tracking.hooks import AttemptHooks
from sparkdist._tracking.mlflow_store import (
    DEFAULT_TRACKING_URI,
    caller_context,
    is_local_store,
    open_client,
    tracking_uri,
)
from sparkdist._tracking.progress import ProgressDisplay

__all__ = ["DEFAULT_TRACKING_URI", "MlflowRun", "outcome_tags", "tracking_uri"]

logger = logging.getLogger("sparkdist")

#: How long the rendezvous waits for the MLflow run before the ranks start without tracking
#: (at most half of start_timeout_s, so a slow MLflow never fails the start-up).
SETUP_TIMEOUT_S = 60.0
#: At most one batch of metrics per this many seconds (the last one is sent at the end).
FLUSH_INTERVAL_S = 1.0
#: How long the end of a run waits for MLflow to take the last metrics and the outcome.
CLOSE_TIMEOUT_S = 30.0
#: Reported steps kept while MLflow is not ready; older ones are dropped beyond that.
MAX_QUEUED_REPORTS = 100_000
_MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for log_batch
_OUTCOME_METRICS = _MAX_METRICS_PER_BATCH - 100  # the outcome's tags share its batch
_MAX_TAG_CHARS = 5000


class MlflowRun:
    """The MLflow side: set-up thread, hold/release of rendezvous, metric batches, outcome."""

    def __init__(
        self,
        config: LaunchConfig,
        placement: Placement,
        run_id: str,
        display: ProgressDisplay,
        *,
        parent: MlflowRun | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        """``parent``: the whole run's, when this is one replica group's (created nested under
        it); ``tags``: set on the run besides sparkdist's own."""
        self.run_id = run_id
        self.mlflow_run_id: str | None = None
        self._parent = parent
        self._run_tags = dict(tags or {})
        self._config = config
        self._placement = placement
        self._display = display
        self._context = caller_context()
        self._cond = threading.Condition()
        self._env: dict[str, str] | None = None  # None until the rendezvous may go
        self._waiting: list[AttemptHooks] = []
        self._queue: collections.deque[tuple[int, int, dict[str, float]]] = collections.deque(
            maxlen=MAX_QUEUED_REPORTS
        )
        self._off = False  # set when tracking was given up for this run
        self._metrics_failed = False  # said once
        self._closing = False
        self._outcome: tuple[BaseException | None, list[str], int] = (None, [], 0)
        self._tags: dict[str, str] = {}  # set since the last batch
        self._artifacts: list[str] = []  # files logged with the outcome
        self._setup_timeout_s = min(SETUP_TIMEOUT_S, config.start_timeout_s / 2)
        self._timer = threading.Timer(self._setup_timeout_s, self._give_up)
        self._timer.daemon = True
        self._thread = threading.Thread(
            target=self._main, name=f"sparkdist-mlflow-{run_id}", daemon=True
        )
        self._thread.start()
        self._timer.start()

    # -- called by the launcher and the reader threads ---------------------------------------

    def hold(self, monitor: AttemptHooks) -> None:
        """Hold ``monitor``'s rendezvous until the MLflow run is ready (or tracking is off)."""
        with self._cond:
            env = self._env
            if env is None:
                monitor.hold_rendezvous()
                self._waiting.append(monitor)
                return
        if env:
            monitor.release_rendezvous(env)

    def ready_env(self, timeout_s: float) -> dict[str, str]:
        """The run's variables for the ranks once it is set up, waiting at most ``timeout_s``;
        {} while it is not, or when tracking is off."""
        with self._cond:
            self._cond.wait_for(lambda: self._env is not None, timeout=timeout_s)
            return dict(self._env or {})

    def log_metrics(self, step: int, metrics: dict[str, float], at: float | None = None) -> None:
        """Queue ``metrics`` of ``step``, taken at ``at`` (wall-clock seconds; default now)."""
        with self._cond:
            if not self._off and not self._closing:
                self._queue.append((step, int((at or time.time()) * 1000), metrics))
                self._cond.notify_all()

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queue tags for the run (sent with the next batch)."""
        with self._cond:
            if not self._off and not self._closing:
                self._tags.update(tags)
                self._cond.notify_all()

    def close(
        self,
        error: BaseException | None,
        hosts: list[str],
        restarts: int,
        artifacts: list[str] | None = None,
    ) -> str | None:
        """Send the last metrics, the outcome and ``artifacts`` (files; waits up to
        CLOSE_TIMEOUT_S); the run id."""
        with self._cond:
            self._closing = True
            self._outcome = (error, hosts, restarts)
            self._artifacts = list(artifacts or [])
            self._cond.notify_all()
            given_up = self._off
        if not given_up:  # else the thread may hang on a dead server: leave it
            self._thread.join(CLOSE_TIMEOUT_S)
        self._timer.cancel()
        if not given_up and self._thread.is_alive():
            logger.warning(
                "sparkdist: MLflow did not take the run's outcome within %.0f s", CLOSE_TIMEOUT_S
            )
        with self._cond:
            return None if self._off else self.mlflow_run_id

    # -- the MLflow thread -------------------------------------------------------------------

    def _main(self) -> None:
        if self._parent is not None and not self._parent.ready_env(self._setup_timeout_s):
            self._release({})  # the whole run's tracking is off, and said so there, once
            return
        try:
            started = self._start_run()
        except Exception as exc:  # a broken store, an unreachable server, a bad run id...
            logger.debug("sparkdist: MLflow set-up failed", exc_info=True)
            self._turn_off(f"MLflow failed ({_first_line(exc)}); tracking is off for this run")
            return
        if started is None:
            self._turn_off(
                "mlflow is not installed; tracking is off for this run (pip install "
                "'sparkdist[mlflow]', or pass mlflow=False / set SPARKDIST_MLFLOW=0 to silence "
                "this)"
            )
            return
        client, run, owned, uri = started
        env = {
            MLFLOW_RUN_ID_VAR: run.info.run_id,
            MLFLOW_EXPERIMENT_ID_VAR: run.info.experiment_id,
            MLFLOW_TRACKING_URI_VAR: uri,
        }
        if not self._release(env):  # given up meanwhile: nobody knows this run
            if owned:
                _quietly(client.set_terminated, run.info.run_id, "KILLED")
            return
        nested = self._parent is not None  # the whole run's says where it is
        if not is_local_store(uri) and not nested:  # a server shows it as it goes: its page
            self._display.announce(_run_page(uri, run.info.experiment_id, run.info.run_id))
        if (
            not nested
            and not self._config.local_mode
            and is_local_store(uri)
            and not _spark_master_is_local()
        ):
            logger.warning(
                "sparkdist: MLflow tracks to %s on the driver; mlflow.log_* inside the ranks "
                "only reaches it where the executors share that path. Set MLFLOW_TRACKING_URI "
                "to a tracking server (metrics from runtime.report() are logged by the driver "
                "either way)",
                uri,
            )
        try:
            self._log_launch(client, run, owned)
        except Exception:
            logger.warning("sparkdist: logging the launch's params to MLflow failed", exc_info=True)
        last_metrics = self._pump(client, run.info.run_id)
        logged = self._log_outcome(client, run.info.run_id, owned, last_metrics)
        if logged and is_local_store(uri) and not nested:
            self._display.announce(
                f"MLflow run {run.info.run_id} logged to {uri} (open it with: mlflow ui "
                f"--backend-store-uri {uri})"
            )

    def _start_run(self) -> tuple[Any, Any, bool, str] | None:
        try:
            import mlflow  # noqa: F401 - the slow import, here on this thread
        except ImportError as exc:
            if exc.name == "mlflow":
                return None
            raise  # installed but broken: say why
        uri = tracking_uri(self._context.tracking_uri)
        client = open_client(uri)  # quiet; usually opened already by the warm-up
        if self._parent is not None:  # a replica group's: nested under the whole run's
            parent = self._parent.ready_env(0.0)  # set up: _main waited for it
            tags = {
                "sparkdist.run_id": self.run_id,
                "mlflow.parentRunId": parent[MLFLOW_RUN_ID_VAR],
                **self._run_tags,
            }
            run = client.create_run(parent[MLFLOW_EXPERIMENT_ID_VAR], tags=tags)
            return client, run, True, parent[MLFLOW_TRACKING_URI_VAR]
        reused = self._context.run_id or os.environ.get(MLFLOW_RUN_ID_VAR)
        if reused:
            # Someone else's run (the notebook's active run, a job's MLFLOW_RUN_ID): logged
            # to, tagged, but left for its owner to end.
            return client, client.get_run(reused), False, uri
        experiment_id = _experiment_id(client)
        # MLflow's context tags (user, source, git commit: a git lookup) come after the
        # release, with the params: nothing the ranks need waits for them.
        run = client.create_run(experiment_id, tags={"sparkdist.run_id": self.run_id})
        return client, run, True, uri

    def _release(self, env: dict[str, str]) -> bool:
        """Let every held rendezvous go with ``env`` ({}: tracking off); False if done before."""
        with self._cond:
            if self._env is not None:
                return False
            self._env = env
            self._cond.notify_all()  # ready_env's waiters
            self._off = not env
            if self._off:
                self._queue.clear()
            self.mlflow_run_id = env.get(MLFLOW_RUN_ID_VAR)
            waiting, self._waiting = self._waiting, []
        self._timer.cancel()
        for monitor in waiting:
            monitor.release_rendezvous(env)
        return True

    def _turn_off(self, line: str) -> None:
        if self._release({}):  # said once, whoever turns it off first
            self._display.announce(line)

    def _give_up(self) -> None:
        self._turn_off(
            f"MLflow did not answer within {self._setup_timeout_s:.0f} s; tracking "
            "is off for this run"
        )

    def _log_launch(self, client: Any, run: Any, owned: bool) -> None:
        from importlib.metadata import version

        from mlflow.entities import Param, RunTag

        __version__ = version("sparkdist")  # the package metadata: its one definition

        config, placement = self._config, self._placement
        params: dict[str, Any] = {
            "num_processes": placement.world_size,
            "mode": config.mode.value,
            "backend": "nccl" if placement.use_gpu else "gloo",
            "use_gpu": placement.use_gpu,
            "local_mode": config.local_mode,
            "num_tasks": placement.num_tasks,
            "processes_per_task": placement.processes_per_task,
            "gpus_per_task": placement.processes_per_task if placement.use_gpu else 0,
            "max_restarts": config.max_restarts,
            "version": __version__,
            **{k: v for k, v in config.mode_settings().items() if k != "mode"},
        }
        wanted = {f"sparkdist.{k}": str(v) for k, v in params.items()}
        if not owned:  # params are write-once: a reused run may hold them from a past launch
            have = run.data.params
            wanted = {k: v for k, v in wanted.items() if k not in have}
        tags = {"sparkdist.run_id": self.run_id, **self._run_tags}
        if owned:
            tags = {**_context_tags(), **tags}
        client.log_batch(
            run.info.run_id,
            params=[Param(k, v) for k, v in wanted.items()],
            tags=[RunTag(k, v) for k, v in tags.items()],
        )

    def _pump(self, client: Any, mlflow_run_id: str) -> list[Any]:
        """Send reported metrics, a batch at most every FLUSH_INTERVAL_S, until the run ends;
        return the last ones, which go with the outcome (one write fewer at the end)."""
        from mlflow.entities import Metric, RunTag

        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._tags or self._closing)
                reports = list(self._queue)
                self._queue.clear()
                last = self._closing
                # The last tags go with the outcome.
                tags, self._tags = ({}, self._tags) if last else (self._tags, {})
            metrics = [
                Metric(key, value, timestamp, step)
                for step, timestamp, values in reports
                for key, value in values.items()
            ]
            if last:
                return metrics
            if tags:  # a straggler named: rare, and worth seeing at once
                tagged = [RunTag(k, v) for k, v in tags.items()]
                _quietly(client.log_batch, mlflow_run_id, (), (), tagged)  # metrics, params, tags
            self._send_metrics(client, mlflow_run_id, metrics)
            with self._cond:  # at most one batch a second, unless the run ends
                self._cond.wait_for(lambda: self._closing, timeout=FLUSH_INTERVAL_S)

    def _send_metrics(self, client: Any, mlflow_run_id: str, metrics: list[Any]) -> None:
        for start in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            try:
                client.log_batch(
                    mlflow_run_id, metrics=metrics[start : start + _MAX_METRICS_PER_BATCH]
                )
            except Exception:
                if not self._metrics_failed:  # said once; training goes on
                    logger.warning("sparkdist: logging metrics to MLflow failed", exc_info=True)
                self._metrics_failed = True

    def _log_outcome(
        self, client: Any, mlflow_run_id: str, owned: bool, last_metrics: list[Any]
    ) -> bool:
        """The last metrics and the outcome tags in one batch, then the run's end; True when
        MLflow took them."""
        from mlflow.entities import RunTag

        error, hosts, restarts = self._outcome
        status, tags = outcome_tags(error)
        tags = {**self._tags, **tags}  # straggler tags named as the run ended
        if hosts:
            tags["sparkdist.hosts"] = ",".join(sorted(set(hosts)))
        if restarts:
            tags["sparkdist.restarts"] = str(restarts)
        self._send_metrics(client, mlflow_run_id, last_metrics[_OUTCOME_METRICS:])
        try:
            client.log_batch(
                mlflow_run_id,
                metrics=last_metrics[:_OUTCOME_METRICS],
                tags=[RunTag(k, v) for k, v in tags.items()],
            )
            for path in self._artifacts:
                client.log_artifact(mlflow_run_id, path)
            if owned:
                client.set_terminated(mlflow_run_id, status)
        except Exception:
            logger.warning("sparkdist: logging the run's outcome to MLflow failed", exc_info=True)
            return False
        return True


def outcome_tags(error: BaseException | None) -> tuple[str, dict[str, str]]:
    """The MLflow run status for a run's ending, and the tags that say why."""
    if error is None:
        return "FINISHED", {"sparkdist.outcome": "succeeded"}
    if isinstance(error, (concurrent.futures.CancelledError, KeyboardInterrupt)):
        status, tags = "KILLED", {"sparkdist.outcome": "cancelled"}
    else:
        status, tags = "FAILED", {"sparkdist.outcome": "failed"}
    tags["sparkdist.error_type"] = type(error).__name__
    tags["sparkdist.error"] = (str(error).strip() or type(error).__name__)[:_MAX_TAG_CHARS]
    if isinstance(error, WorkerFailedError):
        root = error.root_cause
        tags["sparkdist.root_cause_rank"] = str(root.rank)
        tags["sparkdist.root_cause_type"] = root.exc_type or (
            f"exit code {root.exit_code}" if root.exit_code is not None else "unknown"
        )
        if root.host:
            tags["sparkdist.root_cause_host"] = root.host
    return status, tags


def _experiment_id(client: Any) -> str:
    """mlflow.set_experiment's, else MLFLOW_EXPERIMENT_NAME / _ID, else the context default."""
    try:
        from mlflow.tracking import fluent

        if fluent._active_experiment_id:
            return str(fluent._active_experiment_id)
    except Exception:  # private in mlflow: the environment then
        logger.debug("sparkdist: reading mlflow's active experiment failed", exc_info=True)
    name = os.environ.get(MLFLOW_EXPERIMENT_NAME_VAR)
    if name:
        found = client.get_experiment_by_name(name)
        return (
            str(found.experiment_id) if found is not None else str(client.create_experiment(name))
        )
    if os.environ.get(MLFLOW_EXPERIMENT_ID_VAR):
        return os.environ[MLFLOW_EXPERIMENT_ID_VAR]
    try:
        from mlflow.tracking.default_experiment import registry

        return str(registry.get_experiment_id() or "0")  # a Databricks notebook's own
    except Exception:  # noqa: BLE001 - the Default experiment then
        return "0"


def _run_page(uri: str, experiment_id: str, run_id: str) -> str:
    """Where a tracking server shows the run (an http one: its page)."""
    if urlparse(uri).scheme in ("http", "https"):
        return f"MLflow run {run_id}: {uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"MLflow run {run_id} in experiment {experiment_id} at {uri}"


def _context_tags() -> dict[str, str]:
    """MLflow's context tags for a run it did not start itself (user, source, git commit)."""
    try:
        from mlflow.tracking.context import registry

        return {str(k): str(v) for k, v in registry.resolve_tags({}).items()}
    except Exception:
        logger.debug("sparkdist: resolving MLflow context tags failed", exc_info=True)
        return {}


def _spark_master_is_local() -> bool:
    """Whether the executors run on this machine (local[N], local-cluster): they share paths."""
    if "pyspark" not in sys.modules:
        return False
    try:
        from pyspark import SparkContext

        context = SparkContext._active_spark_context
        return context is not None and str(context.master).startswith("local")
    except Exception:  # noqa: BLE001 - then say it
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        logger.debug("sparkdist: MLflow call failed", exc_info=True)
