"""What runs inside the ranks of ``dataframe_io.py``: one reader's loop over this rank's rows.

``read_rows`` iterates the rank's rows as (features, label) tensor batches, one of three ways
(``reader``): ``dataset`` (``DataLoader(sparkdist.data.partition_dataset(...))``), ``table``
(``sparkdist.data.partition_table()`` cut into batches, columns to tensors) or ``parquet`` (the
baseline: rank r reads Parquet file r with ``pyarrow``); it times the loop and samples the
rank's memory over it (``_measure.PeakSampler``).

sparkdist ships this module by value with the job (and ``_measure``, which it refers to by name,
as local code), so the ranks need no benchmark module on their path.

Non-goals: writing the table, the driver's side (``dataframe_io.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from _measure import PeakSampler


def read_rows(
    reader: str, batch_size: int, width: int, loader_workers: int, parquet_files: list[str]
) -> dict[str, Any]:
    """Iterate this rank's rows as (features, label) tensor batches; time it, watch memory."""
    import torch

    rows, checksum = 0, 0.0
    with PeakSampler() as peak:
        started = time.perf_counter()
        for features, label in _batches(reader, batch_size, width, loader_workers, parquet_files):
            rows += len(label)
            checksum += float(features[:, 0].sum())  # the tensors are really there
        elapsed = time.perf_counter() - started
    return {
        "rows": rows,
        "loop_s": elapsed,
        "rss_start_mb": peak.start_rss_mb,
        "rss_peak_mb": peak.rss_mb,
        "anon_start_mb": peak.start_anon_mb,
        "anon_peak_mb": peak.anon_mb,
        "checksum": checksum,
        "torch_threads": torch.get_num_threads(),
    }


def _batches(
    reader: str, batch_size: int, width: int, loader_workers: int, parquet_files: list[str]
) -> Any:
    import torch

    if reader == "dataset":
        from sparkdist import data

        yield from torch.utils.data.DataLoader(
            data.partition_dataset(["features", "label"]),
            batch_size=batch_size,
            num_workers=loader_workers,
        )
        return
    if reader == "table":
        from sparkdist import data

        batches = (
            data.partition_table()
            .select(["features", "label"])
            .to_batches(max_chunksize=batch_size)
        )
    else:
        import pyarrow.parquet as pq

        rank = int(os.environ["RANK"])
        batches = pq.ParquetFile(parquet_files[rank]).iter_batches(
            batch_size=batch_size, columns=["features", "label"]
        )
    for batch in batches:
        features = batch.column(0).flatten().to_numpy().reshape(-1, width)
        yield torch.from_numpy(features), torch.from_numpy(batch.column(1).to_numpy())
