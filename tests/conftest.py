"""Shared fixtures: one SparkSession per master for the whole test session, and leak checks.

Only one SparkContext can live in a process, so sessions are switched (stop one, start the
next) when a test asks for a different master; test files are ordered so that each master is
started once. Every test is checked for processes of a run left alive and temp dirs left behind.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkdist._frontdoors.pytest_support import SESSION_MARKER_VAR, RankProcess, rank_processes

# The JVM flags of the tests' short-lived JVMs are the lab's (start-up matters, not peak speed).
from sparkdist._lab.spark import FAST_JVM_OPTIONS as FAST_JVM_OPTIONS
from tests._helpers.s3_server import S3Server, start_s3_server, weed_binary
from tests._helpers.spark import NO_CONNECT_SERVER_ON_3, pyspark_major

# All traffic stays on loopback: Spark's driver address, and so every channel bound to it.
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

# Leak checks must see only this test session's runs (another session may share the machine):
# every process we start inherits this marker, and run directories go to our own temp dir.
SESSION_MARKER = SESSION_MARKER_VAR  # the pytest plugin's marker: one leak detector for both
os.environ[SESSION_MARKER] = uuid.uuid4().hex
_SESSION_TMP = tempfile.mkdtemp(prefix="sparkdist-tests-")
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = None  # re-read TMPDIR

REPO = Path(__file__).resolve().parent.parent
FAKE_GPU_SCRIPT = REPO / "conf" / "fakeGpusResources.sh"
LOCAL_CLUSTER = "local-cluster[2,1,1024]"

_session: dict[str, Any] = {}


def spark_session(master: str) -> Any:
    """The test session's SparkSession for ``master`` (replacing one for another master)."""
    if _session.get("master") == master:
        return _session["spark"]
    _stop_session()
    from pyspark.sql import SparkSession

    if master.startswith("connect:"):
        # A local Spark Connect server in this process's JVM; its executors inherit
        # PYSPARK_PYTHON from this process (Connect cannot set that conf).
        spark = SparkSession.builder.remote(master.removeprefix("connect:")).getOrCreate()
        _session.update(master=master, spark=spark)
        return spark
    builder = (
        SparkSession.builder.master(master)
        .appName("sparkdist-tests")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        .config("spark.driver.extraJavaOptions", FAST_JVM_OPTIONS)
        .config("spark.executor.extraJavaOptions", FAST_JVM_OPTIONS)
    )
    if master.startswith("local-cluster"):
        # Each executor advertises 2 fake GPUs and every task takes 1: GPU placement can be
        # tested here, and CPU runs (one task per rank) still find 2 slots.
        builder = (
            builder.config("spark.worker.resource.gpu.amount", "2")
            .config("spark.worker.resource.gpu.discoveryScript", str(FAKE_GPU_SCRIPT))
            .config("spark.executor.resource.gpu.amount", "2")
            .config("spark.executor.resource.gpu.discoveryScript", str(FAKE_GPU_SCRIPT))
            .config("spark.task.resource.gpu.amount", "1")
            .config("spark.executor.memory", "768m")
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    _session.update(master=master, spark=spark)
    return spark


def _stop_session() -> None:
    spark = _session.pop("spark", None)
    _session.pop("master", None)
    if spark is not None:
        spark.stop()


@pytest.fixture(scope="session", autouse=True)
def _stop_spark_at_end() -> Iterator[None]:
    yield
    _stop_session()
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


@pytest.fixture
def spark_local() -> Any:
    """A local[2] SparkSession, shared by the whole test session."""
    return spark_session("local[2]")


@pytest.fixture
def spark_cluster() -> Any:
    """A local-cluster[2,1,1024] session (two executor JVMs, 2 fake GPUs each)."""
    return spark_session(LOCAL_CLUSTER)


@pytest.fixture
def spark_connect() -> Any:
    """A Spark Connect session on a local server (local[2]), shared by the test session."""
    if pyspark_major() < 4:
        pytest.skip(NO_CONNECT_SERVER_ON_3)
    return spark_session("connect:local[2]")


@pytest.fixture
def no_spark() -> Iterator[None]:
    """Runs the test with no active SparkSession."""
    _stop_session()
    yield


def run_processes() -> list[RankProcess]:
    """Live processes of this test session's runs: the pytest plugin's own leak detector
    (``sparkdist._frontdoors.pytest_support.rank_processes``), so there is one definition."""
    return rank_processes(os.environ[SESSION_MARKER])


def run_dirs() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), "sparkdist-*"))


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Every test: no process of a run survives it, and no run directory is left behind."""
    dirs_before = set(run_dirs())
    yield
    deadline = time.monotonic() + 2.0  # Spark's python workers release their tasks async
    while (run_processes() or set(run_dirs()) - dirs_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = run_processes()
    for proc in survivors:  # just listed as ours, so the pid is still this session's
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)
    assert not survivors, f"processes of a run survived the test: {survivors}"
    assert not set(run_dirs()) - dirs_before, "a run directory was left behind"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS S3 server on 127.0.0.1 (tests/_helpers/s3_server.py), started on first use
    and stopped (its process waited for) at the end of the session. Its process is not a run's:
    the leak checks do not count it."""
    try:
        weed_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    server = start_s3_server(tmp_path_factory.mktemp("s3-server"))
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    """A prefix no other test uses: ``s3://<bucket>/<unique>``."""
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, s3_server: S3Server) -> S3Server:
    """The server's keys in this process's environment for the test (AWS_ACCESS_KEY_ID, ...),
    so s3fs here and in every process the test starts (ranks) finds them."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


# Runs track to MLflow by default; tests must not write mlflow.db into the repo: they opt in.
os.environ["SPARKDIST_MLFLOW"] = "0"


# -- test order: each Spark master is started once ---------------------------------------------
# Only one SparkContext lives in a process, and switching masters costs a JVM start, so tests
# run grouped by the master they use: none, local[2], Spark Connect, local-cluster. A test that
# names no session fixture stays with the tests before it in its file (it may rely on the active
# session they made). The sort is stable: the order within a group is the collection order.
_MASTER_GROUPS = {"spark_local": 1, "spark": 1, "spark_connect": 2, "spark_cluster": 3}


def _master_group(item: pytest.Item) -> int | None:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("session_kind") == "connect":
        return _MASTER_GROUPS["spark_connect"]
    groups = [g for name, g in _MASTER_GROUPS.items() if name in getattr(item, "fixturenames", ())]
    return max(groups) if groups else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    current: dict[str, int] = {}
    keys: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        group = _master_group(item)
        if group is not None:
            current[module] = group
        keys[item.nodeid] = current.get(module, 0)
    items.sort(key=lambda item: keys[item.nodeid])
    _overlap_the_floor_with_the_unit_tests(items)


# -- the floor beside the unit tests -------------------------------------------------------------
# The floor test (tests/floor/test_floor.py) runs ~95 s of Spark in its own environment; the unit
# tests (~60 s) use one core and start no run. The floor's session starts with the first unit
# test and its test runs right after the last one, so the two overlap.
_FLOOR_TEST = "::".join(
    (
        "tests/floor/test_floor.py",
        "test_the_floor_of_the_tested_range_passes_the_version_dependent_tests",
    )
)


def _overlap_the_floor_with_the_unit_tests(items: list[pytest.Item]) -> None:
    floor = next((i for i in items if i.nodeid == _FLOOR_TEST), None)
    first = next((n for n, i in enumerate(items) if i.nodeid.startswith("tests/unit/")), None)
    if floor is None or first is None:
        return
    last = first  # the unit tests that run together (those with a session run later)
    while last + 1 < len(items) and items[last + 1].nodeid.startswith("tests/unit/"):
        last += 1
    _session["floor_starts_at"] = items[first].nodeid
    ends_after = items[last]
    items.remove(floor)
    items.insert(items.index(ends_after) + 1, floor)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid == _session.get("floor_starts_at"):
        from tests.floor import test_floor

        test_floor.start_in_background()


def pytest_sessionfinish() -> None:
    from tests.floor import test_floor

    if test_floor.background is not None:  # the session ended before the floor's test
        test_floor.background.stop()
