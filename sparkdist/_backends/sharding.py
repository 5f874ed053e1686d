"""A DataFrame in fixed shards, on the driver: each attempt's rows routed to the barrier task
whose ranks train on them, from where the last checkpoint left the epoch (``_core.data_plan``).

``sparkdist.data.sharded(df, ...)`` wraps the DataFrame in a ``ShardedFrame``. At each attempt's
start the driver reads the data position from the newest committed checkpoint's marker, counts
the rows of each shard (one small Spark job), makes the attempt's plan for its world, and
repartitions the rows so that task ``p`` gets every shard its ranks hold: a shard's rows carry
the route keys of its tasks (``_core.spark_partitioning``), exploded, then hash-partitioned.

Non-goals: the barrier task (``stage``); what a rank reads (``_node.rank.shard_loader``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sparkdist._checkpoint.layout import candidates, read_marker
from sparkdist._core.data_plan import (
    KEY_COLUMN,
    MARKER_KEY,
    MAX_SHARDS,
    ROUTE_COLUMN,
    SHARD_COLUMN,
    DataPlan,
    Position,
    make_plan,
)
from sparkdist._core.errors import ConfigError
from sparkdist._core.run.run_state import NO_ROWS
from sparkdist._core.spark_partitioning import route_keys

logger = logging.getLogger("sparkdist")


@dataclass(frozen=True)
class ShardedFrame:
    """A DataFrame cut into ``shards`` fixed shards by its ``key`` column (None: the whole row),
    walked in ``seed``'s orders (``sparkdist.data.sharded``)."""

    frame: Any
    shards: int
    key: str | None
    seed: int

    def __post_init__(self) -> None:
        columns = list(self.frame.columns)
        if isinstance(self.shards, bool) or not isinstance(self.shards, int):
            raise ConfigError(f"shards={self.shards!r}: pass a number of shards, an int")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ConfigError(f"shards={self.shards}: pass 1 to {MAX_SHARDS} shards")
        if self.key is not None and self.key not in columns:
            raise ConfigError(
                f"key={self.key!r} is not a column of the DataFrame (it has {', '.join(columns)})"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r}: pass an int")
        taken = {SHARD_COLUMN, KEY_COLUMN, ROUTE_COLUMN} & set(columns)
        if taken:
            raise ConfigError(f"the DataFrame has column(s) {sorted(taken)}, which sparkdist adds")

    @property
    def sparkSession(self) -> Any:  # noqa: N802 - the DataFrame's name, for the backends
        return self.frame.sparkSession


def data_position(checkpoint_dir: str | None, options: str | None) -> tuple[Any, int | None]:
    """The data position in the newest committed checkpoint's marker, and its step; (None,
    None) without one. A checkpoint this driver cannot read, or one saved without a position
    (before the loader was made), counts as none: the ranks then refuse to train from a
    checkpoint whose position they were not given, rather than read the epoch again."""
    if checkpoint_dir is None:
        return None, None
    try:
        found = candidates(checkpoint_dir, options)
        newest = next((c for c in found if not c.legacy), None)
        if newest is None:
            return None, None
        position = read_marker(newest, options).get(MARKER_KEY)
        return (None, None) if position is None else (position, newest.step)
    except Exception as exc:  # noqa: BLE001 - any store error: the ranks' check says the rest
        logger.warning("sparkdist: the driver cannot read %s (%s)", checkpoint_dir, exc)
        return None, None


def route(
    sharded: ShardedFrame, num_tasks: int, ranks_per_task: int, position: tuple[Any, int | None]
) -> tuple[Any, DataPlan]:
    """The DataFrame with its shard and key columns, repartitioned one partition per task so
    task ``p`` has the shards of its slots ``p*k .. p*k+k-1``; and the attempt's plan."""
    from pyspark.sql import functions as F

    frame = sharded.frame
    hashed = F.xxhash64(F.col(sharded.key)) if sharded.key else F.xxhash64(*frame.columns)
    keyed = frame.withColumn(KEY_COLUMN, hashed).withColumn(
        SHARD_COLUMN, F.pmod(F.col(KEY_COLUMN), F.lit(sharded.shards)).cast("int")
    )
    counted = {row[0]: row[1] for row in keyed.groupBy(SHARD_COLUMN).count().collect()}
    sizes = [int(counted.get(s, 0)) for s in range(sharded.shards)]
    if not any(sizes):
        raise ConfigError(NO_ROWS)
    saved, step = position
    start = None
    if saved is not None:
        try:
            start = Position.from_json(saved, sizes)
        except ValueError as exc:
            raise ConfigError(
                f"{exc}: the checkpoints in checkpoint_dir are of other data (or another shards="
                "); train this DataFrame with a checkpoint_dir of its own"
            ) from None
    plan = make_plan(sharded.seed, sizes, num_tasks * ranks_per_task, start, step)
    keys = route_keys(num_tasks)
    tasks_of: dict[int, list[int]] = {s: [] for s in range(sharded.shards)}
    for slot in range(plan.slots):
        for shard in plan.shards_of(slot):
            if keys[slot // ranks_per_task] not in tasks_of[shard]:
                tasks_of[shard].append(keys[slot // ranks_per_task])
    routes = F.create_map(
        *[
            part
            for shard, task_keys in tasks_of.items()
            if task_keys
            for part in (F.lit(shard), F.array(*[F.lit(k) for k in task_keys]))
        ]
    )
    routed = (
        keyed.withColumn(ROUTE_COLUMN, F.explode(F.element_at(routes, F.col(SHARD_COLUMN))))
        .repartition(num_tasks, F.col(ROUTE_COLUMN))
        .drop(ROUTE_COLUMN)
    )
    return routed, plan
