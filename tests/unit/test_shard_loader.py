"""A rank's sharded files and its loader, without processes: the agent's writer cuts a task's
rows by shard, the loader walks them from the plan's position, saves where it stands, and
refuses to train from a position its checkpoint was not loaded at."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from sparkdist._checkpoint import api as checkpoints
from sparkdist._core.data_plan import Position, make_plan
from sparkdist._core.env import PARTITION_FILE_VAR
from sparkdist._node.agent.partition import write_partition
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._node.rank.shard_loader import ShardLoader
from tests._helpers.specs import agent_spec

SHARDS = 4


def _rows(n: int) -> pa.RecordBatch:
    ids = list(range(n))
    return pa.RecordBatch.from_pydict(
        {
            "id": pa.array(ids, pa.int64()),
            "x": pa.array([float(i) / 2 for i in ids], pa.float64()),
            "_sparkdist_key": pa.array([(i * 7919) % 1000 for i in ids], pa.int64()),
            "_sparkdist_shard": pa.array([i % SHARDS for i in ids], pa.int32()),
        }
    )


def _spec(plan_json: str) -> AgentSpec:
    return agent_spec(processes_per_node=2, data_plan_json=plan_json)


@pytest.fixture(autouse=True)
def fresh_checkpoint_state(monkeypatch):
    monkeypatch.setattr(checkpoints, "_marker_entries", {})
    monkeypatch.setattr(checkpoints, "_loaded", {})


def _write(tmp_path, plan, batches):
    paths = {rank: str(tmp_path / f"rank-{rank}.arrow") for rank in (0, 1)}
    counts = write_partition(batches, paths, _spec(plan.to_json()))
    return paths, counts


def test_each_rank_file_holds_whole_shards_and_the_loaders_take_every_row_once(
    tmp_path, monkeypatch
):
    sizes = [5, 5, 5, 5]  # ids 0..19, shard = id % 4
    plan = make_plan(seed=1, sizes=sizes, slots=2)
    paths, counts = _write(tmp_path, plan, [_rows(20).slice(0, 9), _rows(20).slice(9)])
    assert sum(counts.values()) >= 20
    seen: list[int] = []
    for rank in (0, 1):
        monkeypatch.setenv(PARTITION_FILE_VAR, paths[rank])
        loader = ShardLoader(["id", "x"], batch_size=3, float_dtype=None)
        assert loader.slot == rank
        batches = list(loader)
        assert loader.epoch == 1 and len(batches) == 4  # ceil(10 / 3), in lockstep
        for ids, x in batches:
            assert (x * 2).long().tolist() == ids.tolist()  # the columns stay row-aligned
            seen.extend(ids.tolist())
    assert sorted(seen) == list(range(20))


def test_the_position_is_saved_and_a_resumed_world_takes_only_the_rest(tmp_path, monkeypatch):
    sizes = [5, 5, 5, 5]
    plan = make_plan(seed=1, sizes=sizes, slots=2)
    paths, _ = _write(tmp_path, plan, [_rows(20)])
    taken: list[int] = []
    positions = []
    for rank in (0, 1):
        monkeypatch.setattr(checkpoints, "_marker_entries", {})
        monkeypatch.setenv(PARTITION_FILE_VAR, paths[rank])
        loader = ShardLoader(["id"], batch_size=2, float_dtype=None)
        batches = iter(loader)
        taken.extend(next(batches).tolist())
        taken.extend(next(batches).tolist())
        positions.append(checkpoints._marker_entries["data"]())  # what a save would commit
    assert positions[0] == positions[1]  # every rank computes the same global position
    # The next attempt: one rank, from the saved position (the driver read it at step 7).
    resumed = make_plan(1, sizes, 1, Position.from_json(positions[0], sizes), from_step=7)
    spec = _spec(resumed.to_json())
    one = {0: str(tmp_path / "resumed.arrow")}
    write_partition([_rows(20)], one, dataclasses.replace(spec, processes_per_node=1))
    monkeypatch.setenv(PARTITION_FILE_VAR, one[0])
    loader = ShardLoader(["id"], batch_size=4, float_dtype=None)
    with pytest.raises(RuntimeError, match="resumes from the checkpoint of step 7, but "):
        next(iter(loader))  # its checkpoint was not loaded: the model would not match
    monkeypatch.setattr(checkpoints, "_loaded", {"step": 7})
    loader = ShardLoader(["id"], batch_size=4, float_dtype=None)
    rest = [i for ids in loader for i in ids.tolist()]
    assert sorted(taken + rest) == list(range(20))  # nothing twice, nothing left out


def test_a_plain_dataframes_file_is_refused_naming_sharded(tmp_path, monkeypatch):
    path = tmp_path / "plain.arrow"
    batch = pa.RecordBatch.from_pydict({"id": [1, 2]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    monkeypatch.setenv(PARTITION_FILE_VAR, str(path))
    with pytest.raises(RuntimeError, match=r"not sharded: pass spark_dataframe=sparkdist\.data"):
        ShardLoader(None, batch_size=1, float_dtype=None)
    with pytest.raises(ValueError, match="batch_size=0: pass the rows per batch"):
        ShardLoader(None, batch_size=0, float_dtype=None)
