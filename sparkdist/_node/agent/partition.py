"""Writing one barrier task's share of a DataFrame to local disk, for its ranks to memory-map.

The task's Arrow record batches are streamed (never held whole) into one Arrow IPC stream file
per local rank, each batch cut into contiguous, near-equal slices, so a partition larger than
memory passes through in batches and the ranks of a task get near-equal row counts.

The stream format (not the IPC file format) is what pyspark's own partition loader reads, so one
file on disk serves both readers of a rank: ``sparkdist.data`` memory-maps it and
``pyspark.ml.torch.distributor._get_spark_partition_data_loader`` streams it batch by batch
(``SPARK_PARTITION_ARROW_DATA_FILE`` names it; ``SPARK_DATAFRAME_SCHEMA_FILE`` names the
DataFrame's Spark schema as JSON, written by ``write_schema``).

A sharded DataFrame (``sparkdist.data.sharded``) is written by shard instead: each local rank's
file gets every row of the shards its slot holds (``write_sharded_partition``), with the
attempt's plan and the rank's slot in the file's schema metadata, where its loader reads them.

Non-goals: reading (``sparkdist.data``), deciding row policies (the ranks do, knowing every
rank's count).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sparkdist._core.data_plan import PLAN_METADATA, SHARD_COLUMN, SLOT_METADATA, DataPlan
from sparkdist._node.agent.spec import AgentSpec


def partition_path(run_dir: str, rank: int) -> str:
    """This rank's partition file in the node's run directory."""
    return os.path.join(run_dir, f"data-rank-{rank}.arrow")


def schema_path(run_dir: str) -> str:
    """The DataFrame's Spark schema (JSON) in the node's run directory."""
    return os.path.join(run_dir, "dataframe-schema.json")


def write_schema(run_dir: str, schema_json: str) -> str:
    """Write the DataFrame's Spark schema (``df.schema.json()``) for pyspark's loader; return
    its path."""
    path = schema_path(run_dir)
    with open(path, "w", encoding="utf-8") as out:
        out.write(schema_json)
    return path


def write_partition(
    batches: Iterable[Any], paths: Mapping[int, str], spec: AgentSpec | None = None
) -> dict[int, int]:
    """Stream ``batches`` (pyarrow RecordBatches) into one IPC stream file per rank in ``paths``:
    near-equal contiguous slices, or by shard when ``spec`` carries a data plan.

    Returns:
        Rows written per rank.
    """
    if spec is not None and spec.data_plan_json is not None:
        first_slot = spec.node_rank * spec.processes_per_node
        return write_sharded_partition(batches, paths, spec.data_plan_json, first_slot)
    import pyarrow as pa

    ranks = sorted(paths)
    counts = {rank: 0 for rank in ranks}
    with _RankFiles(paths) as files:
        for batch in batches:
            if not files.writers:
                files.open(_same(batch.schema))
            rows, k = batch.num_rows, len(ranks)
            for i, rank in enumerate(ranks):
                start, end = rows * i // k, rows * (i + 1) // k
                if end > start:
                    files.writers[rank].write_batch(batch.slice(start, end - start))
                    counts[rank] += end - start
        if not files.writers:  # an empty partition still gives every rank a readable (empty) file
            files.open(_same(pa.schema([])))
    return counts


def write_sharded_partition(
    batches: Iterable[Any], paths: Mapping[int, str], plan_json: str, first_slot: int
) -> dict[int, int]:
    """Stream ``batches`` into one file per rank in ``paths``: the rows of the shards its slot
    holds (the ranks in order take slots ``first_slot``, ``first_slot + 1``...). A row's shard
    may be held by several of them: it is written to each.

    Returns:
        Rows written per rank.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    plan = DataPlan.from_json(plan_json)
    ranks = sorted(paths)
    slots = {rank: first_slot + i for i, rank in enumerate(ranks)}
    wanted = {rank: pa.array(sorted(plan.shards_of(slots[rank])), pa.int32()) for rank in ranks}
    counts = {rank: 0 for rank in ranks}

    def schema_of(schema: Any) -> Callable[[int], Any]:
        def with_plan(rank: int) -> Any:
            meta = {PLAN_METADATA: plan_json.encode(), SLOT_METADATA: str(slots[rank]).encode()}
            return schema.with_metadata(meta)

        return with_plan

    with _RankFiles(paths) as files:
        for batch in batches:
            if not files.writers:
                files.open(schema_of(batch.schema))
            for rank in ranks:
                mine = batch.filter(pc.is_in(batch.column(SHARD_COLUMN), value_set=wanted[rank]))
                if mine.num_rows:
                    files.writers[rank].write_batch(mine.replace_schema_metadata(None))
                    counts[rank] += mine.num_rows
        if not files.writers:  # no rows here (a world larger than the shards): readable, empty
            files.open(schema_of(pa.schema([pa.field(SHARD_COLUMN, pa.int32())])))
    return counts


def _same(schema: Any) -> Callable[[int], Any]:
    """Every rank's file gets ``schema``."""
    return lambda rank: schema


class _RankFiles:
    """One Arrow IPC stream file per rank, opened with the first batch's schema (``open``), all
    closed together however the writing ends."""

    def __init__(self, paths: Mapping[int, str]) -> None:
        self.paths = paths
        self.writers: dict[int, Any] = {}
        self._sinks: list[Any] = []

    def open(self, schema_of: Callable[[int], Any]) -> None:
        import pyarrow as pa

        for rank in sorted(self.paths):
            sink = pa.OSFile(self.paths[rank], "wb")
            self._sinks.append(sink)
            self.writers[rank] = pa.ipc.new_stream(sink, schema_of(rank))

    def __enter__(self) -> _RankFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for writer in self.writers.values():
            writer.close()
        for sink in self._sinks:
            sink.close()
