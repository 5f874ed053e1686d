"""Inside a rank: this rank's rows of the Spark DataFrame the run was given.

``Distributor(...).run(train, spark_dataframe=df)`` makes the barrier stage stream each task's
partition to local disk as an Arrow IPC stream (one file per rank); here a rank memory-maps its
file, so a partition larger than memory is never loaded at once. The same file is what pyspark's
``_get_spark_partition_data_loader`` reads on the same rank (code written for pyspark's
``TorchDistributor._train_on_dataframe`` works unchanged), so using both reads the rows once
from disk, never into memory twice.

Equal steps: DDP hangs when ranks take different numbers of steps, and partitions rarely hold
exactly the same number of rows. Every rank knows every rank's count (``rows_per_rank()``), so
``partition_dataset`` equalizes by default: ``equalize="drop"`` keeps the first ``min(counts)``
rows of each rank (the few excess rows are skipped this epoch), ``"wrap"`` pads every rank to
``max(counts)`` by starting over its own rows, ``None`` keeps this rank's rows as they are.

Resuming exactly: a run that restarts, shrinks or grows mid-epoch re-reads its partitions from
the top with the above. Pass ``spark_dataframe=data.sharded(df, key="id")`` instead and read it
with ``data.loader(...)``: rows go to fixed shards (a stable hash of the ``key`` column, or of
the whole row), every epoch walks them in a seeded order, and the loader's position goes into
each checkpoint, so every row of an epoch is trained on exactly once whatever the world does
(docs/restarts.md).

Example:
    >>> from sparkdist import data  # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(
    ...     data.partition_dataset(["features", "label"]), batch_size=64, num_workers=2)
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from typing import Any

from sparkdist._core.env import PARTITION_FILE_VAR, ROWS_PER_RANK_VAR
from sparkdist._core.errors import ConfigError
from sparkdist._node.rank.arrow_columns import converter as _converter

__all__ = [
    "PartitionDataset",
    "loader",
    "partition_dataset",
    "partition_table",
    "rows_per_rank",
    "sharded",
]

_POLICIES = ("drop", "wrap", None)


#: Shards a DataFrame is cut into unless told: many more than ranks, so that whole shards
#: balance well over any world, few enough that a plan stays small.
DEFAULT_SHARDS = 64


def sharded(
    frame: Any, *, key: str | None = None, shards: int = DEFAULT_SHARDS, seed: int = 0
) -> Any:
    """On the driver: ``frame`` for ``run(..., spark_dataframe=...)``, cut into fixed shards
    that every attempt resumes from where the last checkpoint left them; read it in the
    ranks with ``loader``.

    Args:
        frame: the Spark DataFrame.
        key: a column that identifies a row (an id): a row's shard and its place in the shard
            come from a stable hash of it. None: of the whole row (identical rows are then
            interchangeable).
        shards: how many shards (1 to 4096); more than the largest world you will run.
        seed: the orders' seed: each epoch walks the shards, and the rows of each, in an order
            that depends on the seed and the epoch only, never on the world size.

    Raises:
        ConfigError: a bad argument, named with what is accepted, before anything runs.
    """
    from sparkdist._backends.sharding import ShardedFrame

    if not hasattr(frame, "columns") or not hasattr(frame, "sparkSession"):
        raise ConfigError(f"sharded() takes a Spark DataFrame; got {type(frame).__name__}")
    return ShardedFrame(frame, shards, key, seed)


def loader(
    columns: Sequence[str] | None = None, *, batch_size: int, float_dtype: Any = None
) -> Any:
    """In a rank: this rank's batches of a ``sharded`` DataFrame, resumable.

    Iterating it gives the rest of the current epoch's batches (a tensor per column, as
    ``partition_dataset`` gives them; one tensor when one column is asked for), then counts
    ``loader.epoch`` up: ``while loader.epoch < epochs: for batch in loader: ...``. Every rank
    takes the same number of batches (about ``batch_size`` rows each; ranks' batches differ by
    a row or so; a rank gets empty batches when an epoch has fewer rows left than ranks, or
    fewer shards with rows than ranks: use more shards than ranks). Its position goes into
    every checkpoint committed after it is made; load the checkpoint
    (``runtime.load_checkpoint``) before its first batch.
    """
    from sparkdist._node.rank.shard_loader import ShardLoader

    return ShardLoader(columns, batch_size, float_dtype)


def _partition_file() -> str:
    path = os.environ.get(PARTITION_FILE_VAR)
    if not path:
        raise RuntimeError(
            "this rank has no DataFrame partition: pass spark_dataframe=df to "
            "Distributor.run (Spark mode), and call sparkdist.data inside the training function"
        )
    return path


def partition_table() -> Any:
    """This rank's rows as a ``pyarrow.Table``, memory-mapped from local disk."""
    import pyarrow as pa

    # Batches read from a memory map point into it: the table costs no copy of the rows.
    return pa.ipc.open_stream(pa.memory_map(_partition_file(), "r")).read_all()


def rows_per_rank() -> list[int]:
    """Every rank's row count, indexed by global rank (the same list on every rank)."""
    raw = os.environ.get(ROWS_PER_RANK_VAR)
    if raw is None:
        _partition_file()  # raises the explanatory error
        raise RuntimeError("row counts are missing from this rank's environment")
    return [int(n) for n in json.loads(raw)]


def partition_dataset(
    columns: Sequence[str] | None = None,
    *,
    equalize: str | None = "drop",
    float_dtype: Any = None,
) -> PartitionDataset:
    """A ``torch.utils.data.Dataset`` over this rank's rows: one tensor per column.

    Args:
        columns: the columns to return, in this order (default: all). A row is a tuple of
            tensors, or a single tensor when one column is asked for.
        equalize: "drop" (default), "wrap" or None; see the module docstring.
        float_dtype: dtype for floating columns and ML vectors (default ``torch.float32``).

    Column types: integers (int64 tensors), floats, booleans, arrays of numbers (1-D
    tensors), and Spark ML vectors, dense or sparse (dense 1-D tensors).

    Raises:
        ValueError: a column is missing, or of a type that cannot become a tensor (the
            message names the column and its type); ``equalize`` is not a known policy.
    """
    if equalize not in _POLICIES:
        raise ValueError(f"equalize={equalize!r}; use 'drop', 'wrap' or None")
    return PartitionDataset(columns, equalize, float_dtype)


class PartitionDataset:
    """See ``partition_dataset``. Safe with DataLoader workers: each process maps the file."""

    def __init__(
        self, columns: Sequence[str] | None, equalize: str | None, float_dtype: Any
    ) -> None:
        import torch

        self._path = _partition_file()
        self._float_dtype = float_dtype or torch.float32
        table = self._table()
        self.columns = list(columns) if columns is not None else list(table.column_names)
        for name in self.columns:
            if name not in table.column_names:
                raise ValueError(
                    f"column {name!r} is not in the DataFrame (it has "
                    f"{', '.join(table.column_names)})"
                )
            _converter(name, table.schema.field(name).type)  # refuse bad types up front
        self.own_rows = table.num_rows
        counts = rows_per_rank()
        if equalize == "drop":
            self._length = min(counts)
        elif equalize == "wrap":
            self._length = max(counts)
        else:
            self._length = self.own_rows
        self._state: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self._length:
            raise IndexError(index)
        chunks, starts = self._chunks()
        row = index % self.own_rows
        which = bisect.bisect_right(starts, row) - 1
        local = row - starts[which]
        values = tuple(convert(local) for convert in chunks[which])
        return values[0] if len(values) == 1 else values

    def _table(self) -> Any:
        import pyarrow as pa

        return pa.ipc.open_stream(pa.memory_map(self._path, "r")).read_all()

    def _chunks(self) -> tuple[list[list[Any]], list[int]]:
        # One mapping per process: DataLoader workers fork or spawn after construction.
        if self._state is None or self._state[0] != os.getpid():
            table = self._table().select(self.columns)
            batches = table.to_batches()
            converters, starts, offset = [], [], 0
            for batch in batches:
                converters.append(
                    [
                        _converter(name, batch.schema.field(name).type)(
                            batch.column(name), self._float_dtype
                        )
                        for name in self.columns
                    ]
                )
                starts.append(offset)
                offset += batch.num_rows
            self._state = (os.getpid(), (converters, starts))
        return self._state[1]  # type: ignore[no-any-return,unused-ignore]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_state"] = None  # mappings are per process
        return state
