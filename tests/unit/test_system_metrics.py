"""The node sampler (real psutil, this test's own processes; NVML as this machine has it), the
driver's run watch (where a rank runs, its timeline), the progress line's rate spread and the
run report, without launching a run."""

from __future__ import annotations

import builtins
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sparkdist._core.launch.config import build_config
from sparkdist._core.launch.placement import Placement
from sparkdist._core.run.result import RankTimeline, RunResult, SystemSample
from sparkdist._core.run.stragglers import RateSpread, Straggling
from sparkdist._node.agent.sampler import NodeSampler
from sparkdist._tracking import progress
from sparkdist._tracking.run_watch import RunWatch
from sparkdist._wire import protocol

CPU_NAMES = {
    "cpu_utilization_percentage",
    "system_memory_usage_megabytes",
    "system_memory_usage_percentage",
    "ranks_memory_rss_megabytes",
}


@pytest.fixture
def sleeper():
    """A process with a child of its own: a rank and what it started."""
    code = (  # the child says it is up first: its memory no longer grows while measured
        "import subprocess, sys; "
        "kid = subprocess.Popen([sys.executable, '-c', "
        "'import time; print(1, flush=True); time.sleep(600)'], stdout=subprocess.PIPE); "
        "kid.stdout.readline(); "
        "print(kid.pid, flush=True); sys.stdin.read(); kid.kill(); kid.wait()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    yield proc.pid, child
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(30)


def test_a_sample_has_mlflows_names_and_the_ranks_whole_trees(sleeper):
    import psutil

    parent, child = sleeper
    sampler = NodeSampler(0, 10.0, lambda: [parent], lambda _: None)
    sampler._psutil = psutil  # what start() sets, without its thread
    sampler.open()
    metrics = sampler.sample()
    assert set(metrics) == CPU_NAMES  # CPU run: no GPU fields
    tree = sum(psutil.Process(p).memory_info().rss for p in (parent, child)) / 1e6
    alone = psutil.Process(parent).memory_info().rss / 1e6
    assert metrics["ranks_memory_rss_megabytes"] == pytest.approx(tree, rel=0.2)
    assert metrics["ranks_memory_rss_megabytes"] > alone * 1.5  # the child counts
    assert 0 <= metrics["cpu_utilization_percentage"] <= 100
    assert 0 < metrics["system_memory_usage_percentage"] < 100
    protocol.encode(protocol.Sample(0, 1.0, metrics))  # it travels


def test_the_sampler_thread_sends_until_stopped(sleeper):
    sent: list[protocol.Sample] = []
    two = threading.Event()

    def send(sample: protocol.Sample) -> None:
        sent.append(sample)
        if len(sent) >= 2:
            two.set()

    sampler = NodeSampler(3, 0.05, lambda: [sleeper[0]], send, gpus=None)
    assert sampler.start()
    assert two.wait(30)
    sampler.stop()
    count = len(sent)
    assert sampler._thread is not None and not sampler._thread.is_alive()
    assert len(sent) == count  # nothing after stop
    assert {s.node for s in sent} == {3} and all(s.gpus == "" for s in sent)
    assert sent[0].time <= sent[1].time


def test_without_nvml_gpu_ranks_get_no_gpu_fields_and_no_error(sleeper):
    # This machine has no NVIDIA driver (or no GPU 0): NVML fails to open or finds nothing.
    import psutil

    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        has_gpu = pynvml.nvmlDeviceGetCount() > 0
        pynvml.nvmlShutdown()
    except Exception:
        has_gpu = False
    if has_gpu:
        pytest.skip("this machine has an NVIDIA GPU: tests/integration covers it")
    sampler = NodeSampler(0, 10.0, lambda: [sleeper[0]], lambda _: None, gpus="0,1")
    sampler._psutil = psutil
    sampler.open()
    assert set(sampler.sample()) == CPU_NAMES
    sampler.close()


def test_interval_zero_or_no_psutil_never_starts(monkeypatch, caplog):
    assert not NodeSampler(0, 0, list, lambda _: None).start()
    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError("No module named 'psutil'", name="psutil")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    with caplog.at_level(logging.DEBUG, logger="sparkdist"):
        assert not NodeSampler(5, 10.0, list, lambda _: None).start()
    lines = [r for r in caplog.records if "psutil is not installed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG
    assert "node 5" in lines[0].getMessage() and "sparkdist[metrics]" in lines[0].getMessage()


# -- the driver's side ------------------------------------------------------------------------

WHERE = [
    # (placement, node gpus from samples, rank, expected)
    (Placement(2, 2, use_gpu=False), None, 3, "node 1 on host-b, CPU"),
    (Placement(1, 2, use_gpu=True, driver_gpus=("4", "5")), None, 1, "node 0 on host-a, GPU 5"),
    (Placement(2, 2, use_gpu=True), "2,3", 3, "node 1 on host-b, GPU 3"),
    (Placement(2, 2, use_gpu=True), None, 2, "node 1 on host-b, its local rank 0's GPU"),
]


@pytest.mark.parametrize(("placement", "gpus", "rank", "expected"), WHERE)
def test_where_a_rank_runs(placement, gpus, rank, expected):
    watch = RunWatch(build_config(), placement)
    if gpus is not None:
        watch.sample(protocol.Sample(rank // 2, 1.0, {}, gpus), "host-b")
    assert watch.where(rank, {0: "host-a", 1: "host-b"}) == expected


def test_the_straggler_line_names_rank_place_rates_and_threshold():
    watch = RunWatch(build_config(straggler_fraction=0.5), Placement(1, 3, use_gpu=False))
    line = watch.straggler_line(Straggling(2, 1.25, 10.0, since=0.0), {0: "h"})
    assert line.startswith("rank 2 (node 0 on h, CPU) is a straggler: 1.25 steps/s for ")
    assert line.endswith("below 0.5 of the median rank's 10 steps/s")


def test_the_timeline_gets_each_ranks_steps_and_a_restart_starts_it_afresh():
    watch = RunWatch(build_config(), Placement(1, 2, use_gpu=False))
    for step in (1, 2, 3):
        watch.report(protocol.Report(0, step=step))
    watch.report(protocol.Report(1))  # no step: its report count
    spawned = [RankTimeline(r, 0, "h", 10.0, 99.0) for r in (0, 1)]
    first, second = watch.timeline(spawned)
    assert (first.steps, second.steps) == (3, 1)
    assert first.first_step_at is not None and first.last_step_at is not None
    assert first.first_step_at <= first.last_step_at
    watch.new_attempt()
    assert watch.timeline(spawned) == spawned


def test_samples_are_kept_with_their_host_and_counted_per_node():
    watch = RunWatch(build_config(), Placement(2, 1, use_gpu=False))
    assert watch.sample(protocol.Sample(1, 5.0, {"cpu_utilization_percentage": 3.0}), "b")[0] == 0
    assert watch.sample(protocol.Sample(0, 6.0, {}), "a")[0] == 0
    index, record = watch.sample(protocol.Sample(1, 7.0, {}), "b")
    assert index == 1 and record == SystemSample(1, "b", 7.0, {})
    assert [s.node for s in watch.samples] == [1, 0, 1]


def test_the_progress_line_shows_the_slowest_and_the_fastest_rank():
    assert progress._format_spread(None) == ""
    shown = progress._format_spread(RateSpread(3, 1.234, 0, 9.876))
    assert shown == "slowest rank 3 1.23 steps/s, fastest rank 0 9.88 steps/s"
    display = progress.ProgressDisplay("r")
    display.update_spread(RateSpread(1, 1.0, 0, 2.0))  # before any report: nothing to show
    assert display._snapshot()[3] == ""
    display.update(5, None, {"loss": 0.5})
    display.update_spread(RateSpread(1, 1.0, 0, 2.0))
    assert display._snapshot()[3] == (
        "slowest rank 1 1 steps/s, fastest rank 0 2 steps/s, loss=0.5"
    )
    display.close()


def test_the_report_draws_timelines_and_samples(tmp_path: Path):
    pytest.importorskip("matplotlib")
    timeline = [RankTimeline(r, 0, "h", 100.0 + r, 110.0, 101.0 + r, 109.0, 50) for r in range(3)]
    samples = [
        SystemSample(0, "h", 100.0 + i, {"cpu_utilization_percentage": 10.0 * i,
                                         "gpu_0_utilization_percentage": 50.0})
        for i in range(5)
    ]  # fmt: skip
    result = RunResult([1, 2, 3], [1.0] * 3, ["h"] * 3, "run", "ddp", False, True, 1,
                       timeline=timeline, system_samples=samples)  # fmt: skip
    path = result.save_report(tmp_path / "run.png")
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    bare = RunResult([1], [1.0], ["h"], "run", "ddp", False, True, 1,
                     timeline=[RankTimeline(0, 0, "h", 1.0, 2.0)])  # fmt: skip
    assert Path(bare.save_report(tmp_path / "bare.png")).stat().st_size > 1_000
