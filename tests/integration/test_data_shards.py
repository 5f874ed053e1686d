"""A sharded DataFrame (``sparkdist.data.sharded``) in Spark mode: a run that shrinks mid-epoch,
whose first grow cannot be placed, and that grows back in the end, trains on every row of the
epoch exactly once, reading its position from its checkpoints; bad arguments are refused
before anything runs.

The resizes are real: on local-cluster (two executor JVMs of one slot each) the test kills one
executor mid-epoch, the run goes on with one rank from its last checkpoint; once the cluster
has replaced the executor the run drains to grow (``grow_after_s=1``), and the test kills the
replacement right then: the grow falls back to the one rank that fits, and grows once the
cluster has replaced that one too.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from sparkdist import ConfigError, Distributor, data
from tests.conftest import SESSION_MARKER, run_processes

pytestmark = pytest.mark.spark

ROWS = 96


def train(notes: str, shrunk_pause: float) -> list[int]:
    import os

    import torch
    import torch.distributed as dist

    from sparkdist import data, runtime

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = data.loader(["id"], batch_size=2)
    found = runtime.load_checkpoint()
    step = 0 if found is None else found.state["step"].item() + 1
    log = os.path.join(notes, f"attempt-{runtime.restart_count()}-rank-{rank}.jsonl")
    shrunk = world < runtime.requested_world_size()
    while loader.epoch < 1:
        for ids in loader:
            with open(log, "a") as f:
                f.write(json.dumps([step, world, loader.epoch, ids.tolist()]) + "\n")
            runtime.save_checkpoint({"step": torch.tensor(step)}, step)
            if runtime.should_stop():
                open(os.path.join(notes, f"drained-{runtime.restart_count()}"), "w").close()
                return []
            step += 1
            time.sleep(shrunk_pause if shrunk else 0.05)
    while shrunk and not runtime.should_stop():  # the epoch is done: wait to be grown
        time.sleep(0.1)
    runtime.save_checkpoint({"step": torch.tensor(step)}, step)
    dist.destroy_process_group()
    return [step]


def _session_executors() -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend"
        in " ".join(p.info["cmdline"] or [])
        and p.environ().get(SESSION_MARKER) == os.environ[SESSION_MARKER]
    ]


def test_a_run_that_shrinks_fails_to_grow_and_grows_trains_every_row_once(
    spark_cluster, tmp_path: Path
) -> None:
    df = spark_cluster.range(ROWS).selectExpr("id", "id * 2 AS twice")
    notes, checkpoints = tmp_path / "notes", tmp_path / "checkpoints"
    notes.mkdir()
    handle = Distributor(
        2,
        min_processes=1,
        grow_after_s=1,
        max_restarts=2,
        local_mode=False,
        use_gpu=False,
        checkpoint_dir=str(checkpoints),
    ).run_async(
        train, str(notes), 0.25, spark_dataframe=data.sharded(df, key="id", shards=8, seed=5)
    )
    deadline = time.monotonic() + 120
    while _steps_logged(notes / "attempt-0-rank-0.jsonl") < 4:
        assert time.monotonic() < deadline, "the run never trained 4 steps"
        time.sleep(0.05)
    _session_executors()[0].kill()  # a host lost mid-epoch
    while not (notes / "drained-1").exists():  # the one-rank attempt drains to grow...
        assert time.monotonic() < deadline + 60, "the run never drained to grow"
        time.sleep(0.02)
    newest = max(_session_executors(), key=lambda p: p.create_time())
    newest.kill()  # ...and the capacity it would grow onto is lost again
    result = handle.run_result(timeout=240)
    worlds = [a.world_size for a in result.attempts]
    assert worlds[:2] == [2, 1] and result.attempts[1].grew, result.attempts
    assert worlds[2] == 1, result.attempts  # the grow fell back to what fits
    assert worlds[-1] == 2 and result.attempts[-2].grew, result.attempts  # and grew in the end

    # The lineage: each step as the last attempt that trained it saw it.
    steps: dict[int, tuple[int, list[tuple[int, int, list[int]]]]] = {}
    for path in sorted(notes.glob("attempt-*.jsonl")):
        attempt = int(path.name.split("-")[1])
        for line in path.read_text().splitlines():
            step, world, epoch, ids = json.loads(line)
            if steps.get(step, (-1, []))[0] < attempt:
                steps[step] = (attempt, [])
            if steps[step][0] == attempt:
                steps[step][1].append((world, epoch, ids))
    taken: Counter[int] = Counter()
    for step in sorted(steps):
        for _, epoch, ids in steps[step][1]:
            assert epoch == 0
            taken.update(ids)
    assert taken == Counter(range(ROWS))  # every row once: none dropped, none twice
    by_world = [steps[s][1][0][0] for s in sorted(steps)]
    assert by_world[0] == 2 and 1 in by_world, by_world  # shrunk mid-epoch
    assert not run_processes()


def _steps_logged(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_bad_sharding_arguments_are_refused_before_anything_runs(spark_cluster) -> None:
    df = spark_cluster.range(4)
    with pytest.raises(ConfigError, match="key='nope' is not a column of the DataFrame"):
        data.sharded(df, key="nope")
    with pytest.raises(ConfigError, match="shards=0: pass 1 to 4096 shards"):
        data.sharded(df, shards=0)
    with pytest.raises(ConfigError, match="takes a Spark DataFrame; got list"):
        data.sharded([1, 2])
