"""System metrics, straggler detection and the run report, end to end: real ranks (one of them
slow on purpose), a real MLflow sqlite store in a temp dir, the driver's real stderr."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from sparkdist import Distributor

pytestmark = pytest.mark.mlflow

SLOW_RANK = 1
STEPPING_S = 6.0  # every rank steps this long after a common barrier
WINDOW_S = 2.0  # the straggler window: the slow rank is named after ~1 s (horizon) + 2 s


def step_unevenly(stepping_s: float) -> int:
    """Every rank steps for ``stepping_s`` after a barrier; rank 1 takes 10x longer a step."""
    import torch.distributed as dist

    from sparkdist import runtime

    dist.init_process_group("gloo")
    dist.barrier()  # the ranks start stepping together, however unevenly they started up
    rank = dist.get_rank()
    pause = 0.25 if rank == SLOW_RANK else 0.025
    step, end = 0, time.monotonic() + stepping_s
    while time.monotonic() < end:
        time.sleep(pause)
        step += 1
        runtime.report(step=step, loss=1.0 / step)
    dist.barrier()
    dist.destroy_process_group()
    return step


@pytest.fixture(scope="module")
def uneven_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str, list[str], str]:
    """One tracked 3-rank run, rank 1 slow: (result, driver stderr, warnings, store uri)."""
    folder = tmp_path_factory.mktemp("metrics")
    uri = f"sqlite:///{folder}/mlflow.db"
    stderr = io.StringIO()
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    keep = Keep()
    logger = logging.getLogger("sparkdist")
    logger.addHandler(keep)
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
            patch.setenv("MLFLOW_TRACKING_URI", uri)
            patch.setenv("SPARKDIST_PROGRESS_INTERVAL_S", "0.5")
            for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
                patch.delenv(name, raising=False)
            patch.chdir(folder)
            result = Distributor(
                3,
                use_gpu=False,
                mlflow=True,
                system_metrics_interval_s=0.5,
                straggler_window_s=WINDOW_S,
            ).run_all(step_unevenly, STEPPING_S)
    finally:
        logger.removeHandler(keep)
    return result, stderr.getvalue(), warnings, uri


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_the_slow_rank_is_named_once_with_its_node_and_device(uneven_run):
    result, _, warnings, uri = uneven_run
    named = [w for w in warnings if "is a straggler" in w]
    assert len(named) == 1, warnings  # once per episode, not once per check
    assert named[0].startswith(f"sparkdist: rank {SLOW_RANK} (node 0 on ")
    assert ", CPU) is a straggler" in named[0] and "below 0.7 of the median" in named[0]
    tags = _client(uri).get_run(result.mlflow_run_id).data.tags
    stragglers = {k: v for k, v in tags.items() if k.startswith("sparkdist.straggler.")}
    assert list(stragglers) == [f"sparkdist.straggler.rank_{SLOW_RANK}"]
    assert stragglers[f"sparkdist.straggler.rank_{SLOW_RANK}"] in named[0]


def test_the_progress_line_shows_the_slowest_and_fastest_rank(uneven_run):
    _, stderr, _, _ = uneven_run
    lines = [line for line in stderr.splitlines() if "slowest rank" in line]
    assert lines, stderr
    assert f"slowest rank {SLOW_RANK} " in lines[-1]
    assert "fastest rank 0 " in lines[-1] or "fastest rank 2 " in lines[-1]


def test_system_samples_reach_the_result_and_mlflow_by_node(uneven_run):
    result, _, _, uri = uneven_run
    assert result.system_samples, "no samples in a run several intervals long"
    first = result.system_samples[0]
    assert first.node == 0 and first.host == result.hosts[0]
    for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes"):
        assert name in first.metrics
    # Samples taken while the ranks ran hold their trees' memory (one taken as they exit may not).
    assert any(s.metrics["ranks_memory_rss_megabytes"] > 10 for s in result.system_samples)
    assert not any(k.startswith("gpu_") for s in result.system_samples for k in s.metrics)
    client = _client(uri)
    history = client.get_metric_history(
        result.mlflow_run_id, "system/node_0/cpu_utilization_percentage"
    )
    assert len(history) == len(result.system_samples)
    assert [m.step for m in history] == list(range(len(history)))
    assert 0 <= min(m.value for m in history) and max(m.value for m in history) <= 100


def test_the_timeline_orders_every_ranks_life(uneven_run):
    result, _, _, _ = uneven_run
    assert [t.rank for t in result.timeline] == [0, 1, 2]
    for t in result.timeline:
        assert t.first_step_at is not None and t.last_step_at is not None
        assert t.started_at < t.first_step_at <= t.last_step_at <= t.ended_at + 1.0
        assert t.steps == result.values[t.rank]
    assert result.timeline[SLOW_RANK].steps * 4 < result.timeline[0].steps


def test_the_report_is_an_artifact_of_the_run(uneven_run, tmp_path):
    result, _, _, uri = uneven_run
    client = _client(uri)
    assert [a.path for a in client.list_artifacts(result.mlflow_run_id)] == ["sparkdist_report.png"]
    local = client.download_artifacts(result.mlflow_run_id, "sparkdist_report.png", tmp_path)
    assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = result.save_report(tmp_path / "again.png")  # and on demand
    assert os.path.getsize(again) > 10_000


def test_an_interval_of_zero_samples_nothing():
    def quick() -> int:
        time.sleep(1.0)
        return 1

    result = Distributor(1, use_gpu=False, mlflow=False, system_metrics_interval_s=0).run_all(quick)
    assert result.system_samples == [] and result.values == [1]
    assert result.timeline[0].first_step_at is None  # it never reported
