"""Getting MLflow ready for a launch: early, on a thread of its own, and quietly.

Measured here (2 cores): ``import mlflow`` takes ~2 s, opening a sqlite store ~2 s more (the
store's modules: SQLAlchemy, alembic, MLflow's models), and creating a store runs MLflow's ~60
schema migrations (~2 s, once per store). A launch holds its ranks' rendezvous until its MLflow
run exists, so whatever of this is not done when a launch starts adds to its start-up.
``prewarm`` starts it when a ``Distributor`` or a decorated function is made (once per process
and store); the launch's own MLflow thread then finds it done, or waits for it rather than
doing it twice. It never creates anything: a store that does not exist yet is only imported
for, and is created by the first run that logs to it.

Opening a store logs at INFO through alembic and ``mlflow.store`` ("Creating initial MLflow
database tables...", "Updating database tables"): ``quiet_store_setup`` raises those loggers to
WARNING while a store opens and then puts back what was there.

Non-goals: the run itself (``_mlflow_run``), whether tracking is wanted beyond ``mlflow=`` and
SPARKDIST_MLFLOW.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from sparkdist._core.env import MLFLOW_TRACKING_URI_VAR, RUN_ID_VAR
from sparkdist._core.env import TRACKING_VAR as TRACKING_VAR

logger = logging.getLogger("sparkdist")

#: Set to 0 (or false/no/off) to turn MLflow tracking off where ``mlflow=`` is not given.
#: Where runs go unless MLFLOW_TRACKING_URI (or ``mlflow.set_tracking_uri``) says otherwise.
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
#: Loggers that talk while a store opens (children follow their level).
_SETUP_LOGGERS = ("alembic", "mlflow.store")

_lock = threading.Lock()
_warmed: set[str] = set()  # tracking URIs a warm-up was started for
_store_lock = threading.Lock()  # one store opens at a time: the second finds it cached
_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_saved: list[tuple[logging.Logger, int]] = []


def tracking_wanted(flag: bool | None) -> bool:
    """``mlflow=`` when given, else SPARKDIST_MLFLOW (default on)."""
    if flag is not None:
        return flag
    return os.environ.get(TRACKING_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def tracking_uri(explicit: str | None = None) -> str:
    """Where runs go: ``explicit`` (mlflow.set_tracking_uri's), else MLFLOW_TRACKING_URI, else
    ``sqlite:///mlflow.db`` in the working directory, as an absolute path so that every rank
    means the same file."""
    uri = explicit or os.environ.get(MLFLOW_TRACKING_URI_VAR) or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = uri[len(prefix) :]
        if path and not path.startswith(":memory:"):
            return prefix + os.path.abspath(path)
    return uri


def is_local_store(uri: str) -> bool:
    """A store on this machine's disk (sqlite, file): no server shows it until ``mlflow ui``."""
    if uri.split(":", 1)[0] in ("databricks", "databricks-uc", "uc"):  # a workspace's server
        return False
    return urlparse(uri).scheme in ("sqlite", "file", "")


@dataclasses.dataclass(frozen=True)
class CallerContext:
    """What the launching thread's mlflow state says (mlflow's active run is per thread)."""

    run_id: str | None = None
    tracking_uri: str | None = None


def caller_context() -> CallerContext:
    """The active run and explicitly set tracking URI, if mlflow is imported (never imports
    it: that is the slow part)."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or getattr(mlflow.__spec__, "_initializing", False):
        # Not imported, or being imported (by the warm-up): touching a half-imported package
        # from this thread would break that import. The user set nothing through it yet.
        return CallerContext()
    try:
        from mlflow.tracking._tracking_service import utils

        active = mlflow.active_run()
        return CallerContext(
            run_id=active.info.run_id if active is not None else None,
            tracking_uri=mlflow.get_tracking_uri() if utils._tracking_uri else None,
        )
    except Exception:  # noqa: BLE001 - an mlflow we do not know: its defaults then
        return CallerContext()


def prewarm(flag: bool | None) -> None:
    """Import mlflow (and open the run's store, if it exists) on a background thread, once per
    process and store, so a launch soon after does not wait for it. Never in a rank, nor on a
    Spark executor (a decorated function's module is imported there too)."""
    if not tracking_wanted(flag) or RUN_ID_VAR in os.environ or _in_spark_task():
        return
    uri = tracking_uri(caller_context().tracking_uri)
    with _lock:
        if uri in _warmed:
            return
        _warmed.add(uri)
    threading.Thread(
        target=_warm_up, args=(uri,), name="sparkdist-mlflow-warm-up", daemon=True
    ).start()


def open_client(uri: str) -> Any:
    """An ``MlflowClient`` for ``uri`` with its store open (created if new), without the set-up
    chatter. MLflow caches a store per URI, so only the first open in a process is slow."""
    from mlflow.tracking import MlflowClient

    with _store_lock, quiet_store_setup():
        return MlflowClient(tracking_uri=uri)  # opens the store (its tables, migrations)


@contextlib.contextmanager
def quiet_store_setup() -> Iterator[None]:
    """Alembic's and MLflow's store loggers at WARNING or above for the duration; their own
    levels come back after (nested and concurrent uses included)."""
    global _quiet_depth
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_saved[:] = [(log, log.level) for log in map(logging.getLogger, _SETUP_LOGGERS)]
            for log, _ in _quiet_saved:
                if log.getEffectiveLevel() < logging.WARNING:
                    log.setLevel(logging.WARNING)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                for log, level in _quiet_saved:
                    log.setLevel(level)
                _quiet_saved.clear()


def _warm_up(uri: str) -> None:
    try:
        import mlflow  # noqa: F401 - the slow import, here on this thread
        from mlflow.tracking import MlflowClient  # noqa: F401

        if uri.startswith("sqlite:///"):
            path = uri[len("sqlite:///") :]
            if os.path.isfile(path):
                open_client(uri)  # an existing store: imports its modules, checks its schema
            else:
                import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - its ~2 s of imports
    except Exception:  # noqa: BLE001 - the launch's own set-up reports what is wrong
        logger.debug("sparkdist: warming MLflow up failed", exc_info=True)


def _in_spark_task() -> bool:
    if "pyspark" not in sys.modules:
        return False
    try:
        from pyspark import TaskContext

        return TaskContext.get() is not None
    except Exception:  # noqa: BLE001 - not a pyspark we know: assume the driver
        return False
