"""@distributed(remote=True) on Spark local[2]: the ranks run as one barrier stage.

A file of its own so that it runs right after test_spark_mode.py, while the shared local[2]
session is up (test_local_mode.py stops it; restarting the JVM costs seconds).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time

import pytest

from sparkdist import distributed, runtime
from tests.conftest import run_processes

pytestmark = pytest.mark.spark


def where_am_i(tag):
    return {
        "tag": tag,
        "rank": runtime.get_global_rank(),
        "local_rank": runtime.get_local_rank(),
        "world_size": runtime.get_world_size(),
        "local_world_size": runtime.get_local_world_size(),
        "node_rank": runtime.get_node_rank(),
        "main": runtime.is_main_process(),
    }


def test_remote_runs_as_barrier_tasks_on_local_spark(spark_local, caplog):
    caplog.set_level(logging.WARNING, logger="sparkdist")
    values = distributed(gpus=2, remote=True, spark=spark_local)(where_am_i).distributed("r")
    assert [
        (
            v["tag"],
            v["rank"],
            v["node_rank"],
            v["local_rank"],
            v["local_world_size"],
            v["world_size"],
            v["main"],
        )
        for v in values
    ] == [("r", 0, 0, 0, 2, 2, True), ("r", 1, 0, 1, 2, 2, False)]  # local[2]: one host
    [warning] = [r for r in caplog.records if "CPU process(es) with gloo" in r.message]
    assert "spark.task.resource.gpu.amount is unset or 0" in warning.message
    assert not run_processes()


def sleep_after_marking(marker_dir):
    with open(os.path.join(marker_dir, str(runtime.get_global_rank())), "w"):
        pass
    time.sleep(120)


def test_remote_handle_cancel_stops_the_stage_and_every_rank(spark_local, tmp_path):
    fn = distributed(gpus=2, remote=True, use_gpu=False, spark=spark_local)(sleep_after_marking)
    run = fn.distributed_async(str(tmp_path))
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the ranks' handshake files, with a deadline
    assert sorted(os.listdir(tmp_path)) == ["0", "1"], "ranks did not start"
    assert not run.done()

    assert run.cancel() is True
    assert run.done() and not run_processes()
    with pytest.raises(concurrent.futures.CancelledError):
        run.result()
    # The session is still usable afterwards.
    assert (
        distributed(gpus=2, remote=True, use_gpu=False)(where_am_i).distributed("again")[1]["rank"]
        == 1
    )
