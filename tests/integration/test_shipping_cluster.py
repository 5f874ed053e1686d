"""The environment follows the function (issue 12): local code, package versions, large captures.

On local-cluster[2,1,1024], whose executors do not see the driver's extra ``sys.path`` entries.
(Named to sort after the other local-cluster file, so that master is started once.)
"""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
import venv
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest

from sparkdist import ClusterError, ConfigError, Distributor, RunTimeoutError
from tests.conftest import FAST_JVM_OPTIONS, run_processes

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

_DRIVER_ONLY = ("sd_ship_helper", "sd_ship_dep", "sd_ship_pkg", "sd_ship_pkg.inner")


@pytest.fixture
def driver_only_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A module, its dependency and a package in a directory only the driver's sys.path has."""
    (tmp_path / "sd_ship_helper.py").write_text(
        textwrap.dedent("""
        import sd_ship_dep

        def scale(x):
            return sd_ship_dep.FACTOR * x
    """)
    )
    (tmp_path / "sd_ship_dep.py").write_text("FACTOR = 3\n")
    package = tmp_path / "sd_ship_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .inner import answer\n")
    (package / "inner.py").write_text("def answer():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in _DRIVER_ONLY:
        sys.modules.pop(name, None)


def test_modules_known_only_to_the_driver_reach_the_executors(spark_cluster, driver_only_code):
    from sd_ship_helper import scale  # imported here, used by reference in the function

    driver_dir = str(driver_only_code)

    def train():
        import sd_ship_pkg  # imported only when the rank runs

        rank = int(os.environ["RANK"])
        return scale(rank + 1) + sd_ship_pkg.answer(), sd_ship_pkg.__file__, driver_dir in sys.path

    values = Distributor(2, local_mode=False, use_gpu=False).run_all(train).values
    assert [v[0] for v in values] == [45, 48]
    for _, where, saw_driver_path in values:
        # The executors imported the shipped copy, from their run directory.
        assert not saw_driver_path and where.endswith(
            os.path.join("code", "sd_ship_pkg", "__init__.py")
        )
        assert not where.startswith(driver_dir)


def test_a_mismatched_requirement_fails_before_any_rank_starts(spark_cluster):
    seen: list[object] = []
    stop = threading.Event()

    def watch() -> None:  # any rank process of this session, at any moment of the launch
        while not stop.is_set():
            seen.extend(run_processes())
            stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(ClusterError) as info:
            Distributor(
                2,
                local_mode=False,
                use_gpu=False,
                requirements=["numpy==1.0.0", "sd-not-installed-anywhere==1.0", "cloudpickle"],
            ).run(lambda: 1)
    finally:
        stop.set()
        watcher.join()
    assert not seen, f"a rank process started: {seen}"
    text = str(info.value)
    # Both executors refused, so the message can say that nothing started anywhere.
    assert "no rank process was started" in text
    lines = text.splitlines()
    [numpy_row] = [line for line in lines if " numpy " in line]
    assert "127.0.0.1" in numpy_row and "==1.0.0 (pinned)" in numpy_row
    assert numpy_row.rstrip().endswith(np.__version__)
    [missing_row] = [line for line in lines if "sd-not-installed-anywhere" in line]
    assert missing_row.rstrip().endswith("missing")
    assert "cloudpickle" not in text.split("fix:")[0]  # the same version as the driver's
    assert not run_processes()


# The executors' copies go as the last attempt's tasks end; an earlier attempt's stay for a
# restart (which reads them), and a run that succeeds with restarts left has its copies removed
# by the application's next barrier task on each executor.
@pytest.mark.parametrize(
    ("max_restarts", "fail_once"),
    [(0, False), (1, False), (1, True)],
    ids=["no restarts", "succeeds with restarts left", "fails once"],
)
def test_a_large_job_travels_as_a_file_that_is_emptied_afterwards(
    spark_cluster, caplog, max_restarts, fail_once
):
    caplog.set_level(logging.WARNING, logger="sparkdist")
    data = np.arange(1_500_000, dtype=np.float64)  # 11.4 MB

    def train():
        from sparkdist import runtime

        if fail_once and runtime.restart_count() == 0 and runtime.get_global_rank() == 1:
            raise RuntimeError("the first attempt fails")
        return float(data[-1])

    result = Distributor(
        2, local_mode=False, use_gpu=False, job_size_warn_mb=5, max_restarts=max_restarts
    ).run_all(train)
    assert result.values == [1_499_999.0, 1_499_999.0]
    [warning] = [r.getMessage() for r in caplog.records if "job_size_warn_mb=5" in r.getMessage()]
    assert "variable 'data' captured by" in warning and "numpy.ndarray, 11.4 MB" in warning
    assert "load the data inside the function" in warning.lower()
    sc = spark_cluster.sparkContext
    name = f"sparkdist-job-{result.run_id}.pkl"
    assert any(path.endswith(name) for path in sc.listFiles)  # it went through addFile
    # Served from the run's own private directory (tests/integration/test_files.py).
    [served] = glob.glob(os.path.join(tempfile.gettempdir(), f"sparkdist_job-*/{name}"))
    assert os.path.getsize(served) == 0  # emptied: Spark cannot forget an added file
    from pyspark import SparkFiles

    assert not os.path.exists(os.path.join(SparkFiles.getRootDirectory(), name))
    # Nor does any executor keep its copy (Spark would leave it in work/app-*/ for good).
    app_dirs = glob.glob(os.path.join(_worker_dir(), f"{sc.applicationId}", "*"))
    assert app_dirs, "the executors' work directories were not found"
    if max_restarts and not fail_once:  # a restart could have followed: the next task sweeps
        assert Distributor(2, local_mode=False, use_gpu=False).run(int) == 0
    assert not [d for d in app_dirs if os.path.exists(os.path.join(d, name))]


def _executor_copies(app_id: str, name: str) -> list[str]:
    """The executors' copies of the job file ``name`` (in work/<app id>/<executor id>/)."""
    return glob.glob(os.path.join(_worker_dir(), app_id, "*", name))


@pytest.mark.parametrize(
    ("ending", "max_restarts"),
    [("timed out", 0), ("cancelled", 0), ("cancelled", 1)],
    ids=["timed out", "cancelled", "cancelled with restarts left"],
)
def test_a_stopped_runs_large_job_leaves_no_copy_on_the_executors(
    spark_cluster, tmp_path, ending, max_restarts
):
    """A run stopped mid-way (its timeout, a cancel) has its stage cancelled, and Spark keeps
    what an executor fetched until the application ends. The last attempt's tasks remove
    their executor's copy of the large job as they end; with restarts left a task cannot know
    that none follows (a stopped run is not restarted), and the application's next barrier
    task on that executor removes it. No executor is lost on the way (a task killed inside a
    barrier ``allGather`` takes its executor down with it)."""
    data = np.arange(1_500_000, dtype=np.float64)  # 11.4 MB
    marks = str(tmp_path)

    def train():
        import pathlib
        import time

        pathlib.Path(marks, f"rank-{os.environ['RANK']}").touch()  # the job was loaded
        time.sleep(120)
        return float(data[-1])

    timeout_s = 15 if ending == "timed out" else 200  # the ranks start in a few seconds
    run = Distributor(
        2,
        local_mode=False,
        use_gpu=False,
        job_size_warn_mb=5,
        timeout_s=timeout_s,
        max_restarts=max_restarts,
    ).run_async(train)
    app_id = spark_cluster.sparkContext.applicationId
    name = f"sparkdist-job-{run.run_id}.pkl"
    executors = sorted(glob.glob(os.path.join(_worker_dir(), app_id, "*")))
    try:
        deadline = time.monotonic() + timeout_s
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the ranks' marks are files: nothing to handshake with
        assert sorted(os.listdir(tmp_path)) == ["rank-0", "rank-1"], "the ranks did not start"
        assert len(_executor_copies(app_id, name)) == 2  # one per executor, while it runs
    finally:
        if ending == "cancelled":
            run.cancel()
    with pytest.raises(RunTimeoutError if ending == "timed out" else CancelledError):
        run.result(timeout=120)
    if max_restarts:
        # The next run of the application (any run: a small job here) sweeps both executors.
        assert Distributor(2, local_mode=False, use_gpu=False).run(int) == 0
    assert _executor_copies(app_id, name) == []
    # No executor was lost on the way (a lost one is replaced by one with a new directory).
    assert sorted(glob.glob(os.path.join(_worker_dir(), app_id, "*"))) == executors
    assert not run_processes()


def _worker_dir() -> str:
    """Where local-cluster's workers keep their executors' directories (SPARK_HOME/work)."""
    import pyspark

    return os.environ.get("SPARK_WORKER_DIR") or os.path.join(
        os.path.dirname(pyspark.__file__), "work"
    )


def test_a_200_mb_capture_is_named_and_the_run_still_works(caplog):
    caplog.set_level(logging.WARNING, logger="sparkdist")
    weights = np.full(200 * 2**20 // 8, 0.5)  # 200 MB, over the default 100 MB warning

    def train():
        return float(weights[int(os.environ["RANK"])] * 2)

    values = Distributor(2, use_gpu=False).run_all(train).values
    assert values == [1.0, 1.0]
    [warning] = [r.getMessage() for r in caplog.records if "job_size_warn_mb=100" in r.getMessage()]
    assert "variable 'weights' captured by" in warning
    assert "numpy.ndarray, 200.0 MB" in warning


def test_past_the_hard_limit_the_error_names_the_object():
    def train(config):
        return len(config)

    config = {"lr": 0.1, "weights": np.ones(3 * 2**20 // 8)}  # 3 MB inside a dict argument
    with pytest.raises(ConfigError) as info:
        Distributor(2, use_gpu=False, job_size_warn_mb=1, job_size_limit_mb=2).run(train, config)
    text = str(info.value)
    assert "more than job_size_limit_mb=2" in text
    assert "argument 0['weights'] (numpy.ndarray, 3.0 MB)" in text
    assert "Load the data inside the function" in text
    assert not run_processes()


def test_local_mode_checks_only_pinned_versions():
    with pytest.raises(ClusterError, match=r"numpy +==1\.0\.0 \(pinned\) +" + np.__version__):
        Distributor(2, use_gpu=False, requirements=["numpy==1.0.0"]).run(lambda: 1)
    assert not run_processes()
    # A bare name is the driver's own version: nothing to check when the ranks run here.
    assert Distributor(1, use_gpu=False, requirements=["numpy"]).run(lambda: 7) == 7


_PACKED_ENV_JOB = """
import json, os, sys
os.environ["PYSPARK_PYTHON"] = "./environment/bin/python"  # the unpacked archive's Python
from pyspark.sql import SparkSession
# One executor (two slots) is enough to show the archive's Python running the ranks.
fast = sys.argv[2]
spark = (SparkSession.builder.master("local-cluster[1,2,1024]")
         .config("spark.archives", sys.argv[1] + "#environment")
         .config("spark.driver.extraJavaOptions", fast)
         .config("spark.executor.extraJavaOptions", fast)
         .config("spark.executor.memory", "768m").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
from sparkdist import Distributor

def where():
    import importlib.metadata, sys
    return sys.executable, importlib.metadata.version("sd-envpack-marker")

try:
    values = Distributor(2, local_mode=False, use_gpu=False,
                         requirements=["sd-envpack-marker==1.0"]).run_all(where).values
finally:
    spark.stop()
print("RESULT " + json.dumps(values))
"""


def test_a_packed_environment_shipped_with_spark_archives_runs_the_ranks(tmp_path):
    """The README's isolated environment: a venv packed with venv-pack, unpacked by Spark on
    every executor (spark.archives), whose Python then runs the ranks.

    The venv holds a package the driver lacks (a pinned requirement that only it satisfies);
    torch, pyspark and sparkdist come from the test venv through a sitecustomize (a real packed
    environment holds them, but building one here would download torch).
    """
    venv_pack = pytest.importorskip("venv_pack")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    site_dir = env_dir / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site_dir = site_dir / "site-packages"
    (site_dir / "sitecustomize.py").write_text(
        f"import site\nsite.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
    )
    marker = site_dir / "sd_envpack_marker-1.0.dist-info"
    marker.mkdir()
    (marker / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sd-envpack-marker\nVersion: 1.0\n"
    )
    (marker / "RECORD").write_text("")
    archive = tmp_path / "env.tar.gz"
    venv_pack.pack(prefix=str(env_dir), output=str(archive))
    script = tmp_path / "job.py"
    script.write_text(_PACKED_ENV_JOB)
    done = subprocess.run(
        [sys.executable, str(script), str(archive), FAST_JVM_OPTIONS],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "SPARKDIST_MLFLOW": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    values = json.loads(line[len("RESULT ") :])
    for executable, marker_version in values:
        assert executable.endswith(os.path.join("environment", "bin", "python"))
        assert marker_version == "1.0"
    assert not run_processes()


def test_a_refusal_with_dataframe_input_does_not_hang(spark_cluster):
    frame = spark_cluster.range(8)
    with pytest.raises(ClusterError, match="no rank process was started"):
        Distributor(2, local_mode=False, use_gpu=False, requirements=["numpy==1.0.0"]).run(
            lambda: 1, spark_dataframe=frame
        )
    assert not run_processes()


def test_a_detached_node_refuses_through_its_task_error(spark_cluster, monkeypatch):
    monkeypatch.setenv("SPARKDIST_CONTROL_CHANNEL", "off")  # executors "cannot reach" us
    with pytest.raises(ClusterError) as info:
        Distributor(2, local_mode=False, use_gpu=False, requirements=["numpy==1.0.0"]).run(
            lambda: 1
        )
    [numpy_row] = [line for line in str(info.value).splitlines() if " numpy " in line]
    assert "==1.0.0 (pinned)" in numpy_row and numpy_row.rstrip().endswith(np.__version__)
    assert "SPARKDIST-REFUSAL" not in str(info.value)  # the driver decoded it
    assert not run_processes()
