"""MLflow tracking and live progress, end to end: real MLflow (a sqlite store in a temp dir),
real ranks. conftest turns tracking off for every other test; these opt in with mlflow=True."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkdist import Distributor, WorkerFailedError

pytestmark = pytest.mark.mlflow

MLFLOW_VARS = ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_TRACKING_URI")
STEPS = 5


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module: creating one costs seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture(autouse=True)
def tracking_store(
    store_uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[str]:
    """Every test tracks to the temp store, from a temp working directory: a fall-back to the
    default sqlite:///mlflow.db would land there (and fail the test), never in the repo."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    yield store_uri
    assert not (tmp_path / "mlflow.db").exists(), "a run fell back to the default store"


def client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def report_and_log(steps):
    """Every rank reports (only one rank's reports may reach MLflow) and logs on its own."""
    import mlflow

    from sparkdist import runtime

    seen = {name: os.environ.get(name) for name in MLFLOW_VARS}  # mlflow consumes RUN_ID
    rank = runtime.get_global_rank()
    for step in range(1, steps + 1):
        runtime.report(step=step, total=steps, loss=1.0 / step)
        mlflow.log_metric(f"rank{rank}_seen", float(step), step=step)
    return seen


@pytest.fixture(scope="module")
def tracked(store_uri: str) -> tuple[Any, str]:
    """One tracked 2-rank run shared by the tests that read it (ranks importing mlflow cost
    seconds); the driver's stderr of that run is captured."""
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setenv("MLFLOW_TRACKING_URI", store_uri)
        patch.setenv("SPARKDIST_PROGRESS_INTERVAL_S", "0.2")
        patch.delenv("MLFLOW_RUN_ID", raising=False)
        result = Distributor(2, use_gpu=False, mlflow=True).run_all(report_and_log, STEPS)
    return result, stderr.getvalue()


def test_every_rank_logs_into_the_one_run_of_the_launch(tracked, store_uri):
    result, _ = tracked
    run_id = result.mlflow_run_id
    assert run_id
    absolute = "sqlite:///" + os.path.abspath(store_uri[len("sqlite:///") :])
    run = client(store_uri).get_run(run_id)
    assert (
        result.values
        == [
            {
                "MLFLOW_RUN_ID": run_id,
                "MLFLOW_EXPERIMENT_ID": run.info.experiment_id,
                "MLFLOW_TRACKING_URI": absolute,
            }
        ]
        * 2
    )
    for rank in (0, 1):
        history = client(store_uri).get_metric_history(run_id, f"rank{rank}_seen")
        assert sorted((m.step, m.value) for m in history) == [
            (s, float(s)) for s in range(1, STEPS + 1)
        ]
    assert run.info.status == "FINISHED"
    assert run.data.tags["sparkdist.outcome"] == "succeeded"
    assert run.data.tags["sparkdist.run_id"] == result.run_id


def test_launch_params_are_logged(tracked, store_uri):
    result, _ = tracked
    from sparkdist import __version__

    params = client(store_uri).get_run(result.mlflow_run_id).data.params
    assert {
        k: params[k]
        for k in (
            "sparkdist.num_processes",
            "sparkdist.mode",
            "sparkdist.backend",
            "sparkdist.num_tasks",
            "sparkdist.gpus_per_task",
            "sparkdist.processes_per_task",
            "sparkdist.version",
        )
    } == {
        "sparkdist.num_processes": "2",
        "sparkdist.mode": "ddp",
        "sparkdist.backend": "gloo",
        "sparkdist.num_tasks": "1",
        "sparkdist.gpus_per_task": "0",
        "sparkdist.processes_per_task": "2",
        "sparkdist.version": __version__,
    }
    assert client(store_uri).get_run(result.mlflow_run_id).data.tags["sparkdist.hosts"] == (
        "127.0.0.1"
    )


def test_reports_show_on_the_driver_and_reach_mlflow_once(tracked, store_uri):
    result, stderr = tracked
    history = client(store_uri).get_metric_history(result.mlflow_run_id, "loss")
    # Both ranks reported every step: each step is logged once, not once per rank.
    assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in range(1, STEPS + 1)]
    assert result.last_metrics == {"loss": 1.0 / STEPS}
    # One line says where the run went (no server link: nobody started one), and opening the
    # store said nothing (MLflow's migrations log at INFO).
    uri = "sqlite:///" + os.path.abspath(store_uri[len("sqlite:///") :])
    assert [line for line in stderr.splitlines() if "MLflow" in line] == [
        f"sparkdist: MLflow run {result.mlflow_run_id} logged to {uri} (open it with: mlflow ui "
        f"--backend-store-uri {uri})"
    ]
    assert "http://" not in stderr and "database tables" not in stderr
    lines = [
        line
        for line in stderr.splitlines()
        if line.startswith(f"sparkdist: run {result.run_id}: step ")
    ]
    assert f"step {STEPS}/{STEPS} (100%)" in lines[-1] and "loss=0.2" in lines[-1]
    assert "\r" not in stderr  # no terminal: plain lines, no bar


def one():
    return 1


def test_tracking_adds_under_a_second_to_a_warm_launch(tracked):
    """A notebook's later launches: mlflow imported, the store open. (The first launch of a
    process, and a new store, are measured by benchmarks/tracking.py.)"""

    def seconds(tracking: bool) -> float:
        started = time.perf_counter()
        Distributor(2, use_gpu=False, mlflow=tracking).run(one)
        return time.perf_counter() - started

    seconds(True), seconds(False)  # the worker pool warm for both
    on, off = [], []
    for _ in range(3):  # interleaved: load on the box hits both alike
        on.append(seconds(True))
        off.append(seconds(False))
    assert sorted(on)[1] - sorted(off)[1] < 1.0, (on, off)


def fail_on_rank_1():
    from sparkdist import runtime

    if runtime.get_global_rank() == 1:
        raise ValueError("bad batch")
    return "ok"


def test_failed_run_is_marked_failed_with_its_root_cause(monkeypatch, tracking_store):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "failing")
    with pytest.raises(WorkerFailedError):
        Distributor(2, use_gpu=False, mlflow=True).run(fail_on_rank_1)
    mlflow_client = client(tracking_store)
    experiment = mlflow_client.get_experiment_by_name("failing")
    (run,) = mlflow_client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    tags = run.data.tags
    assert (
        tags["sparkdist.root_cause_rank"],
        tags["sparkdist.outcome"],
        tags["sparkdist.error_type"],
    ) == ("1", "failed", "WorkerFailedError")
    assert tags["sparkdist.root_cause_type"].endswith("ValueError")


def fail_once(_unused=None):
    import torch.distributed as dist

    from sparkdist import runtime

    dist.init_process_group("gloo")
    attempt = runtime.restart_count()
    if runtime.is_main_process():
        runtime.report(step=attempt + 1, attempt=float(attempt))
    dist.barrier()  # rank 0 has reported before rank 1 fails
    if attempt == 0 and dist.get_rank() == 1:
        raise RuntimeError("first attempt fails")
    dist.destroy_process_group()
    return os.environ.get("MLFLOW_RUN_ID")


def test_restarts_share_one_mlflow_run(tracking_store):
    result = Distributor(2, use_gpu=False, mlflow=True, max_restarts=1).run_all(fail_once)
    assert result.values == [result.mlflow_run_id] * 2
    run = client(tracking_store).get_run(result.mlflow_run_id)
    history = client(tracking_store).get_metric_history(result.mlflow_run_id, "attempt")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.0), (2, 1.0)]
    assert (run.info.status, run.data.tags["sparkdist.restarts"]) == ("FINISHED", "1")


def mlflow_run_id():
    return os.environ.get("MLFLOW_RUN_ID")


def test_active_run_is_reused_and_left_to_its_owner(tracking_store):
    import mlflow

    with mlflow.start_run() as active:
        result = Distributor(2, use_gpu=False, mlflow=True).run_all(mlflow_run_id)
        assert result.values == [active.info.run_id] * 2 == [result.mlflow_run_id] * 2
        run = client(tracking_store).get_run(active.info.run_id)
        assert run.info.status == "RUNNING"  # still the notebook's to end
        assert run.data.params["sparkdist.num_processes"] == "2"


def group_and_run_or_lost():
    """Each replica group's MLflow run as its rank sees it; group 1's rank dies (no exception
    of its own: a lost host), in every attempt."""
    import signal

    from sparkdist import runtime

    if runtime.replica_group() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return runtime.replica_group(), os.environ.get("MLFLOW_RUN_ID")


def test_replica_groups_nest_their_runs_under_the_whole_runs(tracking_store):
    pytest.importorskip("torchft")
    import mlflow

    groups = Distributor(2, use_gpu=False, mlflow=True, replica_groups=2, max_restarts=0)
    with mlflow.start_run() as active:  # the notebook's run: the whole run's, left to its owner
        result = groups.run_all(group_and_run_or_lost)
        whole = client(tracking_store).get_run(active.info.run_id)
    assert result.mlflow_run_id == active.info.run_id
    assert whole.info.status == "RUNNING"
    assert whole.data.tags["sparkdist.replica_groups"] == "2"
    assert whole.data.tags["sparkdist.lost_replica_groups"] == "1"  # names the lost group
    nested = client(tracking_store).search_runs(
        [whole.info.experiment_id], f"tags.mlflow.parentRunId = '{active.info.run_id}'"
    )
    by_group = {run.data.tags["sparkdist.replica_group"]: run for run in nested}
    assert sorted(by_group) == ["0", "1"]
    assert by_group["1"].info.run_name == "replica_group_1"
    # Group 0's rank logged to its own group's run, which finished; group 1's, lost for good,
    # failed naming its host.
    assert result.values == [(0, by_group["0"].info.run_id)]
    assert by_group["0"].info.status == "FINISHED"
    assert by_group["1"].info.status == "FAILED"
    assert by_group["1"].data.tags["sparkdist.root_cause_host"] == "127.0.0.1"


def test_mlflow_run_id_from_the_environment_is_reused(monkeypatch, tracking_store):
    existing = client(tracking_store).create_run("0").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", existing)
    result = Distributor(2, use_gpu=False, mlflow=True).run_all(mlflow_run_id)
    assert result.values == [existing] * 2 and result.mlflow_run_id == existing


def test_tracking_off_creates_no_run_and_passes_nothing(monkeypatch, tracking_store, capfd):
    before = len(client(tracking_store).search_runs(["0"]))
    off_by_argument = Distributor(2, use_gpu=False, mlflow=False).run_all(mlflow_run_id)
    monkeypatch.setenv("SPARKDIST_MLFLOW", "0")
    off_by_environment = Distributor(2, use_gpu=False).run_all(mlflow_run_id)
    for result in (off_by_argument, off_by_environment):
        assert result.values == [None, None] and result.mlflow_run_id is None
    assert len(client(tracking_store).search_runs(["0"])) == before
    assert "MLflow" not in capfd.readouterr().err


def test_a_broken_store_turns_tracking_off_for_the_run(monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchstore://here")
    result = Distributor(2, use_gpu=False, mlflow=True).run_all(mlflow_run_id)
    assert result.values == [None, None] and result.mlflow_run_id is None
    off = [line for line in capfd.readouterr().err.splitlines() if "tracking is off" in line]
    assert len(off) == 1 and off[0].startswith("sparkdist: MLflow failed (")


def test_an_mlflow_server_that_does_not_answer_is_given_up(monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")  # sparkdist's limit comes first
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        # Room for a loaded machine: the launch and MLflow's import fit in the other half.
        result = Distributor(2, use_gpu=False, mlflow=True, start_timeout_s=20).run_all(
            mlflow_run_id
        )
        took = time.monotonic() - started
    assert result.values == [None, None] and result.mlflow_run_id is None
    assert took < 20  # given up after start_timeout_s / 2, not at the start deadline
    off = [line for line in capfd.readouterr().err.splitlines() if "tracking is off" in line]
    assert off == ["sparkdist: MLflow did not answer within 10 s; tracking is off for this run"]


def test_without_mlflow_training_runs_and_one_line_says_tracking_is_off(tmp_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["mlflow"] = None  # what an interpreter without mlflow sees
        from sparkdist import Distributor, runtime

        def train():
            import os
            runtime.report(step=1, total=1, loss=0.5)
            return os.environ.get("MLFLOW_RUN_ID")

        result = Distributor(2, use_gpu=False, mlflow=True).run_all(train)
        print("RESULT", result.values, result.mlflow_run_id, result.last_metrics)
    """)
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_VARS}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "RESULT [None, None] None {'loss': 0.5}" in done.stdout
    off = [line for line in done.stderr.splitlines() if "tracking is off" in line]
    assert len(off) == 1 and "mlflow is not installed" in off[0], done.stderr
    assert not (tmp_path / "mlflow.db").exists()
