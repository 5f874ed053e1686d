"""Inside a rank: the batches of a sharded DataFrame (``sparkdist.data.sharded``), resumable.

The agent wrote this rank's file with every row of the shards its slot holds, and the attempt's
plan in the file's schema metadata (``_node.agent.partition``). The loader orders each shard's
rows by their hash key (so a shard's order is the same on every host and attempt), walks the
plan's segments in lockstep with the other ranks (``_core.data_plan``), and puts its position
into every checkpoint this rank commits; the driver reads it back at the next attempt's start.

Non-goals: which rows a rank gets (the plan); saving (``runtime.save_checkpoint``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from sparkdist._checkpoint import api as checkpoints
from sparkdist._core.data_plan import (
    KEY_COLUMN,
    MARKER_KEY,
    PLAN_METADATA,
    SHARD_COLUMN,
    SLOT_METADATA,
    DataPlan,
    Piece,
    row_order,
)
from sparkdist._core.env import PARTITION_FILE_VAR
from sparkdist._node.rank.arrow_columns import converter


class ShardLoader:
    """See ``sparkdist.data.loader``."""

    def __init__(self, columns: Sequence[str] | None, batch_size: int, float_dtype: Any) -> None:
        import numpy as np
        import pyarrow as pa
        import torch

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: pass the rows per batch, 1 or more")
        path = os.environ.get(PARTITION_FILE_VAR)
        if not path:
            raise RuntimeError(
                "this rank has no DataFrame rows: pass spark_dataframe=sparkdist.data.sharded(df)"
                " to Distributor.run (Spark mode), and make the loader in the training function"
            )
        table = pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()
        meta = table.schema.metadata or {}
        if PLAN_METADATA not in meta:
            raise RuntimeError(
                "this run's DataFrame is not sharded: pass spark_dataframe=sparkdist.data."
                "sharded(df) to resume exactly where a checkpoint left it, or read a plain "
                "DataFrame with sparkdist.data.partition_dataset()"
            )
        self.plan = DataPlan.from_json(meta[PLAN_METADATA].decode())
        self.slot = int(meta[SLOT_METADATA])
        names = [n for n in table.column_names if n not in (SHARD_COLUMN, KEY_COLUMN)]
        self.columns = list(columns) if columns is not None else names
        for name in self.columns:
            if name not in names:
                raise ValueError(f"column {name!r} is not in the DataFrame (it has {names})")
            converter(name, table.schema.field(name).type)  # refuse bad types up front
        self._table = table.select(self.columns) if self.columns else table
        self._float_dtype = float_dtype or torch.float32
        self.batch_size = batch_size
        self._orders: dict[tuple[int, int], list[int]] = {}  # (epoch, shard): its row order
        self._rows = self._rows_by_shard(np, table)
        self.epoch = self.plan.start.epoch
        self._taken = 0  # steps taken in the current epoch's segment, by every rank
        self._checked = False
        checkpoints.add_marker_entry(MARKER_KEY, self.position)

    def _rows_by_shard(self, np: Any, table: Any) -> dict[int, Any]:
        """Each held shard's row numbers in this file, in hash-key order."""
        if table.num_rows == 0:
            shards, keys = np.zeros(0, np.int32), np.zeros(0, np.int64)
        else:
            shards = table.column(SHARD_COLUMN).to_numpy()
            keys = table.column(KEY_COLUMN).to_numpy()
        order = np.lexsort((keys, shards))
        bounds = np.searchsorted(shards[order], np.arange(len(self.plan.sizes) + 1))
        rows = {}
        for shard in self.plan.shards_of(self.slot):
            rows[shard] = order[bounds[shard] : bounds[shard + 1]]
            if len(rows[shard]) != self.plan.sizes[shard]:
                raise RuntimeError(
                    f"shard {shard} has {len(rows[shard])} rows here but {self.plan.sizes[shard]} "
                    "when the driver counted them: the DataFrame is not deterministic (a "
                    "sample, a limit, or an input that changes); cache or checkpoint it first"
                )
        return rows

    def position(self) -> dict[str, Any]:
        """Where the epoch stands once every rank has trained on the batches handed out."""
        segment = self.plan.segment(self.epoch)
        steps = segment.steps(self.batch_size)
        position = segment.after(self._taken, steps) if steps else segment.after(0, 0)
        return position.to_json()

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        segment = self.plan.segment(self.epoch)
        return segment.steps(self.batch_size) - self._taken

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch's batches; the epoch then counts up."""
        self._check_resumed()
        segment = self.plan.segment(self.epoch)
        steps = segment.steps(self.batch_size)
        while self._taken < steps:
            pieces = segment.batch(self.slot, self._taken, steps)
            batch = self._batch(pieces)
            self._taken += 1  # handed out: a save from here on counts it as trained on
            yield batch
        self.epoch += 1
        self._taken = 0

    def _check_resumed(self) -> None:
        if self._checked:
            return
        self._checked = True
        loaded = checkpoints.loaded_step()
        if loaded != self.plan.from_step:
            where = (
                f"the checkpoint of step {self.plan.from_step}"
                if self.plan.from_step is not None
                else "the start of the data (no checkpoint with a data position was found)"
            )
            got = f"step {loaded}" if loaded is not None else "no checkpoint"
            raise RuntimeError(
                f"this attempt's data resumes from {where}, but load_checkpoint loaded {got}: "
                "call runtime.load_checkpoint() before the loader's first batch, and save "
                "checkpoints after making the loader (its position goes with them)"
            )

    def _batch(self, pieces: list[Piece]) -> Any:
        import numpy as np
        import torch

        picked: list[int] = []
        for shard, start, end in pieces:
            order = self._orders.get((self.epoch, shard))
            if order is None:  # one epoch's orders kept at a time
                self._orders = {k: v for k, v in self._orders.items() if k[0] == self.epoch}
                order = row_order(self.plan.seed, self.epoch, shard, self.plan.sizes[shard])
                self._orders[(self.epoch, shard)] = order
            picked.extend(int(self._rows[shard][order[i]]) for i in range(start, end))
        rows = self._table.take(np.asarray(picked, dtype=np.int64))
        tensors = []
        for name in self.columns:
            column = rows.column(name).combine_chunks()
            get = converter(name, column.type)(column, self._float_dtype)
            values = [get(i) for i in range(rows.num_rows)]
            tensors.append(torch.stack(values) if values else torch.empty(0))
        return tensors[0] if len(tensors) == 1 else tuple(tensors)
