"""Sweeps from one driver: concurrent local runs never touch each other (issue 19).

Four runs start together from threads, two of them with import-time environments of their own
(so warm-pool zygotes of their own), one failing on purpose. Only that one fails; every other
run returns its own ranks' values; and a second round, after the pool holds zygotes for every
environment, does the same (replacing a zygote used to kill the ranks of the runs in flight).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from sparkdist import Distributor, WorkerFailedError, distributed

HELPER = "sparkdist_sweep_helper"


def overlapping(tag, delay_s):
    """Join the world, stay in flight a while (the runs overlap), say who we are."""
    import importlib
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    time.sleep(delay_s)
    helper = None
    try:
        helper = importlib.import_module(HELPER).VALUE
    except ImportError:
        pass
    if tag == "fails":
        raise ValueError(f"planted failure on rank {dist.get_rank()}")
    return {"tag": tag, "rank": dist.get_rank(), "sum": int(total.item()), "helper": helper}


def _sweep(tmp_path, round_no):
    helper_dir = tmp_path / "helpers"
    helper_dir.mkdir(exist_ok=True)
    (helper_dir / f"{HELPER}.py").write_text("VALUE = 'found'\n")
    other_libs = tmp_path / "libs"
    other_libs.mkdir(exist_ok=True)
    runs = {
        "plain": {},
        "own-pythonpath": {"PYTHONPATH": str(helper_dir)},
        "own-libraries": {"LD_LIBRARY_PATH": str(other_libs)},
        "fails": {},
    }
    start = threading.Barrier(len(runs))
    outcomes: dict[str, object] = {}

    def run(tag, env):
        launcher = Distributor(2, use_gpu=False, env=env, timeout_s=240)
        start.wait()
        try:
            outcomes[tag] = launcher.run_all(overlapping, tag, 1.0).values
        except BaseException as exc:  # noqa: BLE001 - compared below
            outcomes[tag] = exc

    threads = [threading.Thread(target=run, args=item) for item in runs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), f"round {round_no}: a run never returned"
    return outcomes


@pytest.mark.timeout(600)
def test_four_concurrent_runs_only_the_failing_one_fails(tmp_path):
    for round_no in (1, 2):
        outcomes = _sweep(tmp_path, round_no)
        failure = outcomes.pop("fails")
        assert isinstance(failure, WorkerFailedError), f"round {round_no}: {failure!r}"
        assert "planted failure" in str(failure)
        for tag, values in outcomes.items():
            assert not isinstance(values, BaseException), f"round {round_no}, {tag}: {values!r}"
            assert [v["rank"] for v in values] == [0, 1]
            assert {v["tag"] for v in values} == {tag}
            assert {v["sum"] for v in values} == {3}
            expected = "found" if tag == "own-pythonpath" else None
            assert {v["helper"] for v in values} == {expected}, f"round {round_no}, {tag}"


def test_concurrent_decorated_runs_each_get_their_own_values():
    @distributed(gpus=2, use_gpu=False)
    def scaled(factor):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return dist.get_rank() * factor

    handles = [scaled.distributed_async(factor) for factor in (1, 10, 100)]
    assert [h.result(timeout=240) for h in handles] == [[0, 1], [0, 10], [0, 100]]
    assert os.environ.get("RANK") is None  # nothing of a run leaked into the driver


def marked_then_overlapping(marker_dir, tag, delay_s):
    """``overlapping``, having said (with a file) that this rank is running."""
    import pathlib

    pathlib.Path(marker_dir, f"running-{os.environ['RANK']}").touch()
    return overlapping(tag, delay_s)


def test_a_changed_driver_environment_leaves_the_run_in_flight_alone(tmp_path, monkeypatch):
    """The driver's import-time environment changes while a run is in flight (a notebook sets
    LD_LIBRARY_PATH): the next run gets a zygote of its own, the first run's ranks live on
    (the pool used to replace its only zygote and SIGKILL them)."""
    Distributor(1, use_gpu=False).run(int)  # the pool's zygote for this environment exists
    first = distributed(gpus=2, use_gpu=False)(marked_then_overlapping)
    handle = first.distributed_async(str(tmp_path), "first", 4.0)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("running-*"))) < 2:
        assert time.monotonic() < deadline and not handle.done(), "the first run never ran"
        time.sleep(0.05)
    other_libs = tmp_path / "libs"
    other_libs.mkdir()
    monkeypatch.setenv("LD_LIBRARY_PATH", str(other_libs))
    second = Distributor(2, use_gpu=False).run_all(overlapping, "second", 0.0).values
    assert [v["tag"] for v in second] == ["second", "second"]
    assert [v["tag"] for v in handle.result(timeout=240)] == ["first", "first"]
