"""Writing one barrier task's share of a DataFrame to local disk, for its ranks to memory-map.

The task's Arrow record batches are streamed (never held whole) into one Arrow IPC file per
local rank, each batch cut into contiguous, near-equal slices, so a partition larger than
memory passes through in batches and the ranks of a task get near-equal row counts.

Non-goals: reading (``sparkdist.data``), deciding row policies (the ranks do, knowing every
rank's count).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any


def partition_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"data-rank-{rank}.arrow")


def write_partition(batches: Iterable[Any], paths: Mapping[int, str]) -> dict[int, int]:
    """Stream ``batches`` (pyarrow RecordBatches) into one IPC file per rank in ``paths``.

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
                    writers[rank] = pa.ipc.new_file(sink, batch.schema)
            rows, k = batch.num_rows, len(ranks)
            for i, rank in enumerate(ranks):
                start, end = rows * i // k, rows * (i + 1) // k
                if end > start:
                    writers[rank].write_batch(batch.slice(start, end - start))
                    counts[rank] += end - start
        if not writers:  # an empty partition still gives every rank a readable (empty) file
            for rank in ranks:
                with pa.OSFile(paths[rank], "wb") as sink, pa.ipc.new_file(sink, pa.schema([])):
                    pass
    finally:
        for writer in writers.values():
            writer.close()
        for sink in sinks:
            sink.close()
    return counts
