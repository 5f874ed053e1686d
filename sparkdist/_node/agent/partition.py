"""Writing one barrier task's share of a DataFrame to local disk, for its ranks to memory-map.

The task's Arrow record batches are streamed (never held whole) into one Arrow IPC stream file
per local rank, each batch cut into contiguous, near-equal slices, so a partition larger than
memory passes through in batches and the ranks of a task get near-equal row counts.

The stream format (not the IPC file format) is what pyspark's own partition loader reads, so one
file on disk serves both readers of a rank: ``sparkdist.data`` memory-maps it and
``pyspark.ml.torch.distributor._get_spark_partition_data_loader`` streams it batch by batch
(``SPARK_PARTITION_ARROW_DATA_FILE`` names it; ``SPARK_DATAFRAME_SCHEMA_FILE`` names the
DataFrame's Spark schema as JSON, written by ``write_schema``).

Non-goals: reading (``sparkdist.data``), deciding row policies (the ranks do, knowing every
rank's count).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any


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


def write_partition(batches: Iterable[Any], paths: Mapping[int, str]) -> dict[int, int]:
    """Stream ``batches`` (pyarrow RecordBatches) into one IPC stream file per rank in ``paths``.

    Returns:
        Rows written per rank.
    """
    import pyarrow as pa

    ranks = sorted(paths)
    counts = {rank: 0 for rank in ranks}
    writers: dict[int, Any] = {}
    sinks: list[Any] = []
    try:
        for batch in batches:
            if not writers:
                for rank in ranks:
                    sink = pa.OSFile(paths[rank], "wb")
                    sinks.append(sink)
                    writers[rank] = pa.ipc.new_stream(sink, batch.schema)
            rows, k = batch.num_rows, len(ranks)
            for i, rank in enumerate(ranks):
                start, end = rows * i // k, rows * (i + 1) // k
                if end > start:
                    writers[rank].write_batch(batch.slice(start, end - start))
                    counts[rank] += end - start
        if not writers:  # an empty partition still gives every rank a readable (empty) file
            for rank in ranks:
                with pa.OSFile(paths[rank], "wb") as sink, pa.ipc.new_stream(sink, pa.schema([])):
                    pass
    finally:
        for writer in writers.values():
            writer.close()
        for sink in sinks:
            sink.close()
    return counts
