"""The resumable shards' pure logic: every row of an epoch exactly once over any resizes, the
orders independent of the world size, lockstep batches, and Spark's partitioning reproduced."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from sparkdist._core.data_plan import (
    DataPlan,
    Position,
    Segment,
    full_epoch,
    homes,
    make_plan,
    row_order,
    rows_in,
    shard_order,
    split,
    take,
)
from sparkdist._core.spark_partitioning import partition_of, route_keys, spark_hash_int


def _walk(
    sizes: list[int], worlds: list[tuple[int, int]], batch: int, seed: int = 3
) -> tuple[list[Counter[tuple[int, int]]], list[list[int]]]:
    """Train through attempts of ``(world, steps)`` each, every attempt starting from the
    position the one before saved (through JSON, as a checkpoint's marker carries it).
    Returns the rows (shard, row index in hash order) each epoch took, and per step the batch
    sizes of the slots."""
    taken: list[Counter[tuple[int, int]]] = [Counter() for _ in range(3)]
    batches: list[list[int]] = []
    position: Position | None = None
    for world, steps in worlds:
        plan = DataPlan.from_json(make_plan(seed, sizes, world, position).to_json())
        epoch = plan.start.epoch
        segment, done = plan.segment(epoch), 0
        total = segment.steps(batch)
        for _ in range(steps):
            if epoch >= 2:
                break  # two epochs are enough to check
            while total == 0:  # an empty epoch: the next one
                epoch += 1
                segment, done = plan.segment(epoch), 0
                total = segment.steps(batch)
            sizes_now = []
            for slot in range(world):
                pieces = segment.batch(slot, done, total)
                assert plan.shards_of(slot) >= {s for s, _, _ in pieces}  # it holds them
                for shard, start, end in pieces:
                    order = row_order(seed, epoch, shard, sizes[shard])
                    taken[epoch].update((shard, order[i]) for i in range(start, end))
                sizes_now.append(rows_in(pieces))
            batches.append(sizes_now)
            done += 1
            if done == total:
                epoch += 1
                segment, done = plan.segment(epoch), 0
                total = segment.steps(batch)
        saved = (segment.after(done, total) if total else Position(epoch + 1)).to_json()
        position = Position.from_json(json.loads(json.dumps(saved)), sizes)
    return taken, batches


def _every_row(sizes: list[int]) -> Counter[tuple[int, int]]:
    return Counter((s, i) for s, n in enumerate(sizes) for i in range(n))


@pytest.mark.parametrize("seed", range(6))
def test_every_row_of_an_epoch_is_taken_once_over_shrinks_grows_and_restarts(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(0, 40) for _ in range(rng.randint(3, 24))]
    worlds = [(rng.randint(1, 5), rng.randint(1, 30)) for _ in range(rng.randint(2, 6))]
    worlds.append((rng.randint(1, 5), 10_000))  # the last attempt runs to the end
    taken, _ = _walk(sizes, worlds, batch=rng.randint(1, 6))
    assert taken[0] == _every_row(sizes)  # each exactly once: nothing dropped, none twice
    assert taken[1] == _every_row(sizes)


def test_a_resize_mid_epoch_keeps_batches_in_lockstep_within_one_row():
    sizes = [30, 10, 25, 5, 40, 12, 18]
    taken, batches = _walk(sizes, [(3, 7), (2, 9), (3, 10_000)], batch=4)
    assert taken[0] == _every_row(sizes)
    first_epoch = rows_in(full_epoch(3, 0, sizes))
    seen = 0
    for step in batches:
        if seen + sum(step) > first_epoch:
            break  # later epochs split by whole shards
        assert max(step) - min(step) <= 1, batches
        assert min(step) >= 1
        seen += sum(step)


def test_the_orders_depend_on_the_seed_and_the_epoch_only():
    assert shard_order(1, 0, 10) == shard_order(1, 0, 10)
    assert sorted(shard_order(1, 0, 10)) == list(range(10))
    assert shard_order(1, 0, 10) != shard_order(1, 1, 10) != shard_order(2, 1, 10)
    assert sorted(row_order(5, 2, 3, 50)) == list(range(50))
    assert row_order(5, 2, 3, 50) != row_order(5, 2, 4, 50)
    # The slots of any world walk the same pieces laid end to end: the epoch's order.
    pieces = full_epoch(9, 0, [4, 7, 0, 3])
    for world in (1, 2, 3, 5):
        assert [p for slot in split(pieces, world) for p in slot] == _merged(split(pieces, world))


def _merged(slots: list[list[tuple[int, int, int]]]) -> list[tuple[int, int, int]]:
    return [p for slot in slots for p in slot]


def test_take_and_split_cut_pieces_end_to_end():
    pieces = [(0, 0, 3), (1, 2, 6)]
    assert take(pieces, 2, 5) == [(0, 2, 3), (1, 2, 4)]
    assert split(pieces, 3) == [[(0, 0, 2)], [(0, 2, 3), (1, 2, 3)], [(1, 3, 6)]]
    assert split([], 2) == [[], []]


def test_homes_balance_whole_shards_largest_first():
    assert homes([5, 1, 4, 3, 3], 2) == [[0, 4], [1, 2, 3]]
    owned = homes([10] * 7, 3)
    assert sorted(s for h in owned for s in h) == list(range(7))
    assert sorted(len(h) for h in owned) == [2, 2, 3]


def test_a_checkpoints_position_of_other_data_is_refused():
    saved = Position(0, ((2, 0, 9),)).to_json()
    with pytest.raises(ValueError, match="rows 0..8 of shard 2, which this DataFrame's 2 shards"):
        Position.from_json(saved, [5, 5])
    with pytest.raises(ValueError, match="not a data position"):
        Position.from_json({"epoch": 1}, [5])


def test_fewer_rows_than_slots_gives_some_slots_an_empty_last_batch():
    plan = make_plan(0, [2], 3)
    segment = plan.segment(0)
    assert segment.steps(8) == 1
    assert sorted(rows_in(segment.batch(j, 0, 1)) for j in range(3)) == [0, 1, 1]
    assert segment.after(1, 1) == Position(1)
    assert Segment(0, ((), ())).steps(4) == 0
    # A slot without rows (fewer shards with rows than slots) does not make the others take
    # all of theirs in one batch: it takes empty ones.
    assert Segment(0, (((0, 0, 40),), ())).steps(4) == 10


def test_spark_hash_and_route_keys_match_spark():
    # Values from Spark 4.x's SQL ``hash(CAST(v AS INT))``.
    spark = {0: 933211791, 1: -559580957, 42: 29417773, -7: -1618159745, 2**31 - 1: 133916647}
    assert {v: spark_hash_int(v) for v in spark} == spark
    for n in (1, 2, 3, 8, 64):
        keys = route_keys(n)
        assert [partition_of(k, n) for k in keys] == list(range(n))
