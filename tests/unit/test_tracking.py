"""Tracking and progress, the pure parts: switches, store choice, outcome tags, which rank's
reports count, and what the display writes (no MLflow, no processes)."""

from __future__ import annotations

import concurrent.futures
import io
import time

import pytest

from sparkdist import ConfigError, RankFailure, RunTimeoutError, WorkerFailedError
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import Placement
from sparkdist._tracking.mlflow_run import outcome_tags, tracking_uri
from sparkdist._tracking.progress import ProgressDisplay
from sparkdist._tracking.tracker import RunTracker, tracking_wanted
from sparkdist._wire.protocol import Report


@pytest.mark.parametrize(
    ("flag", "env", "wanted"),
    [
        (None, None, True),
        (None, "0", False),
        (None, "off", False),
        (None, "1", True),
        (True, "0", True),
        (False, None, False),
        (False, "1", False),
    ],
)
def test_mlflow_argument_wins_over_the_environment(monkeypatch, flag, env, wanted):
    if env is None:
        monkeypatch.delenv("SPARKDIST_MLFLOW", raising=False)
    else:
        monkeypatch.setenv("SPARKDIST_MLFLOW", env)
    assert tracking_wanted(flag) is wanted


def test_mlflow_argument_must_be_a_bool():
    with pytest.raises(ConfigError, match="mlflow must be True, False or None"):
        LaunchConfig(mlflow="yes")  # type: ignore[arg-type]


def test_store_is_explicit_then_environment_then_sqlite_in_the_working_directory(
    monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"  # absolute: ranks agree
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking_uri() == "http://mlflow:5000"
    assert tracking_uri("sqlite:///runs/x.db") == f"sqlite:///{tmp_path}/runs/x.db"
    assert tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"
    assert tracking_uri("databricks") == "databricks"


def test_outcome_tags_name_the_root_cause():
    root = RankFailure(
        rank=3, host="node-b", exit_code=1, exc_type="builtins.ValueError", message="bad batch"
    )
    status, tags = outcome_tags(WorkerFailedError({3: root}, root))
    assert status == "FAILED"
    assert {
        k: tags[k]
        for k in (
            "sparkdist.outcome",
            "sparkdist.root_cause_rank",
            "sparkdist.root_cause_type",
            "sparkdist.root_cause_host",
        )
    } == {
        "sparkdist.outcome": "failed",
        "sparkdist.root_cause_rank": "3",
        "sparkdist.root_cause_type": "builtins.ValueError",
        "sparkdist.root_cause_host": "node-b",
    }
    killed = RankFailure(rank=0, host="", exit_code=-9, exc_type="", message="killed")
    assert (
        outcome_tags(WorkerFailedError({0: killed}, killed))[1]["sparkdist.root_cause_type"]
        == "exit code -9"
    )
    assert outcome_tags(None) == ("FINISHED", {"sparkdist.outcome": "succeeded"})
    assert outcome_tags(concurrent.futures.CancelledError("stop"))[0] == "KILLED"
    status, tags = outcome_tags(RunTimeoutError("the run exceeded timeout_s=5"))
    assert (status, tags["sparkdist.error_type"]) == ("FAILED", "RunTimeoutError")


def report(rank, step, **metrics):
    return Report(rank, step, 10, metrics)


def test_lowest_reporting_rank_counts_and_no_step_counts_twice(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    tracker = RunTracker(
        LaunchConfig(num_processes=2, mlflow=False),
        Placement(num_tasks=1, processes_per_task=2, use_gpu=False),
        "r1",
    )
    tracker.on_report(report(1, 1, loss=101.0))  # rank 1 happens to arrive first
    tracker.on_report(report(0, 1, loss=1.0))  # rank 0 takes over, but step 1 was taken
    assert tracker.last_metrics == {"loss": 101.0}
    tracker.on_report(report(0, 2, loss=0.5))
    tracker.on_report(report(1, 2, loss=100.5))  # ignored from now on
    tracker.on_report(report(0, None, acc=0.9))  # no step: counted per report
    assert tracker.last_metrics == {"loss": 0.5, "acc": 0.9}
    tracker.on_report(Report(0, metrics={"bad": "x", "nan": float("nan")}))  # type: ignore[dict-item]
    assert tracker.last_metrics == {"loss": 0.5, "acc": 0.9}
    tracker.close(None, None)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_progress_is_plain_lines(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    monkeypatch.setenv("SPARKDIST_PROGRESS_INTERVAL_S", "3600")  # first and last line only
    display = ProgressDisplay("r2")
    for step in range(1, 101):
        display.update(step, 100, {"loss": 1.0 / step})
    display.close()
    lines = stderr.getvalue().splitlines()
    assert "\r" not in stderr.getvalue()
    assert lines[0].startswith("sparkdist: run r2: step ") and len(lines) <= 2
    assert lines[-1].startswith("sparkdist: run r2: step 100/100 (100%)")
    assert lines[-1].endswith("| loss=0.01")


def test_in_a_terminal_progress_is_a_bar_that_rank_lines_do_not_tear(monkeypatch):
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    display = ProgressDisplay("r3")
    display.update(5, 10, {"loss": 0.25})
    deadline = time.monotonic() + 10
    while "loss=0.25" not in terminal.getvalue():  # the display thread drew it
        assert time.monotonic() < deadline, terminal.getvalue()
        time.sleep(0.01)
    with display.output_guard():
        terminal.write("[rank 0] hello\n")
    display.announce("MLflow run x")
    display.update(6, 10, {"loss": 0.2})
    display.close()
    out = terminal.getvalue()
    assert "run r3:  50%" in out and "5/10" in out and "6/10" in out and "loss=0.2]" in out
    # The bar's line is blanked before a line is written, and drawn again after it.
    before, after = out.split("[rank 0] hello\n")
    assert before.endswith("\r") and after.startswith("\rrun r3:  50%")
    assert "\rsparkdist: MLflow run x\n" in out


def test_runs_that_never_report_show_nothing(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    display = ProgressDisplay("r4")
    display.close()
    assert stderr.getvalue() == ""
