"""Getting MLflow ready: the warm-up starts only where a launch may follow, never touches a
half-imported mlflow, and store set-up is quiet without changing anyone's logging for good."""

from __future__ import annotations

import logging
import sys
import threading
import types

import pytest

from sparkdist._core.env import RUN_ID_VAR
from sparkdist._tracking import mlflow_store
from sparkdist._tracking.mlflow_store import (
    CallerContext,
    caller_context,
    is_local_store,
    prewarm,
    quiet_store_setup,
)


@pytest.fixture
def warm_ups(monkeypatch):
    """The warm-ups prewarm starts (the thread itself is replaced: no mlflow import here)."""
    started: list[str] = []
    monkeypatch.setattr(mlflow_store, "_warmed", set())
    monkeypatch.setattr(mlflow_store, "_warm_up", started.append)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/somewhere/mlflow.db")
    monkeypatch.delenv(RUN_ID_VAR, raising=False)
    monkeypatch.delenv(mlflow_store.TRACKING_VAR, raising=False)
    return started


def _settle() -> None:
    for thread in threading.enumerate():
        if thread.name == "sparkdist-mlflow-warm-up":
            thread.join(10)


@pytest.mark.parametrize(
    ("flag", "env", "in_rank", "started"),
    [
        (None, None, False, 1),  # tracking on by default
        (True, "0", False, 1),  # mlflow=True wins over the environment
        (False, None, False, 0),
        (None, "0", False, 0),
        (None, None, True, 0),  # inside a rank: its module's decorators must not warm up
    ],
)
def test_warm_up_starts_once_where_tracking_is_on(
    warm_ups, monkeypatch, flag, env, in_rank, started
):
    if env is not None:
        monkeypatch.setenv(mlflow_store.TRACKING_VAR, env)
    if in_rank:
        monkeypatch.setenv(RUN_ID_VAR, "abc")
    prewarm(flag)
    prewarm(flag)  # once per process and store
    _settle()
    assert warm_ups == ["sqlite:////tmp/somewhere/mlflow.db"] * started


def test_a_half_imported_mlflow_is_left_alone(monkeypatch):
    # While the warm-up imports mlflow, sys.modules holds the package half-initialized;
    # reading it from another thread would break that import.
    half = types.ModuleType("mlflow")
    half.__spec__ = types.SimpleNamespace(_initializing=True)  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "mlflow", half)
    assert caller_context() == CallerContext()


@pytest.mark.parametrize(
    ("uri", "local"),
    [
        ("sqlite:////tmp/mlflow.db", True),
        ("file:///tmp/mlruns", True),
        ("/tmp/mlruns", True),
        ("http://127.0.0.1:5000", False),
        ("databricks", False),  # a workspace's tracking server, not a path
        ("mlruns", True),  # a bare path
        ("databricks://profile", False),
    ],
)
def test_local_stores(uri, local):
    assert is_local_store(uri) is local


@pytest.fixture
def setup_loggers():
    """The loggers as a user configured them: alembic at INFO, mlflow.store unset."""
    alembic, store = logging.getLogger("alembic"), logging.getLogger("mlflow.store")
    saved = (alembic.level, store.level)
    alembic.setLevel(logging.INFO)
    store.setLevel(logging.NOTSET)
    yield alembic, store
    alembic.setLevel(saved[0])
    store.setLevel(saved[1])


def test_store_setup_is_quiet_and_levels_come_back(setup_loggers):
    alembic, store = setup_loggers
    with quiet_store_setup():
        with quiet_store_setup():  # nested (two launches opening stores at once)
            assert not alembic.isEnabledFor(logging.INFO)
            assert not logging.getLogger("alembic.runtime.migration").isEnabledFor(logging.INFO)
            assert not logging.getLogger("mlflow.store.db.utils").isEnabledFor(logging.INFO)
            assert alembic.isEnabledFor(logging.WARNING)
        assert not alembic.isEnabledFor(logging.INFO)  # the outer one still holds
    assert (alembic.level, store.level) == (logging.INFO, logging.NOTSET)


def test_concurrent_quiet_setups_leave_the_levels_as_they_were(setup_loggers):
    alembic, store = setup_loggers
    inside, release = threading.Event(), threading.Event()

    def other_launch():
        with quiet_store_setup():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other_launch)
    thread.start()
    assert inside.wait(10)
    with quiet_store_setup():
        pass
    assert not alembic.isEnabledFor(logging.INFO)  # the other thread is still opening
    release.set()
    thread.join(10)
    assert (alembic.level, store.level) == (logging.INFO, logging.NOTSET)
