"""Resumable DataFrame shards as data: which rows each rank trains on at each step, and where an
epoch stands, so that a run that shrinks, grows or restarts trains on every row of an epoch
exactly once.

- **Fixed shards**: a row's shard comes from a stable hash of its id column (or its content),
  so shards do not depend on the world size; inside a shard the rows are in hash order.
- **Seeded orders**: epoch ``e`` walks the shards in ``shard_order(seed, e)`` and the rows of
  each in ``row_order(seed, e, shard)``: the same for every world size.
- **Position**: the rows of the epoch not trained on yet, as pieces ``(shard, start, end)``:
  positions ``start..end-1`` of that shard's row order. A checkpoint keeps it (the commit
  marker), the driver reads it at the next attempt's start.
- **Plan**: an attempt of W ranks ("slots") splits the remaining pieces into W contiguous runs
  of near-equal length (a piece may be split, its shard then goes to both slots); later epochs
  of the attempt give each slot whole shards ("homes", largest first to the least loaded).
- **Lockstep**: every slot takes the same number of steps in an epoch (DDP hangs otherwise):
  ``T = ceil(n_min / batch_size)``, and slot j takes rows ``n_j*t//T .. n_j*(t+1)//T`` at step
  t, so batches differ by at most one row in the current epoch, and by the homes' imbalance
  in later ones; no row is dropped or repeated.

Pure: the driver (``_backends.sharding``) and the ranks (``_node.rank.shard_loader``) both
compute from it, and must agree.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The most shards a DataFrame may be cut into (the plan travels in every rank's environment).
MAX_SHARDS = 4096

#: The columns the driver adds to a sharded DataFrame (the ranks' files keep the first two).
SHARD_COLUMN, KEY_COLUMN, ROUTE_COLUMN = "_sparkdist_shard", "_sparkdist_key", "_sparkdist_route"
#: A sharded rank file's schema metadata: the attempt's plan (JSON) and the rank's slot in it.
PLAN_METADATA, SLOT_METADATA = b"sparkdist.data_plan", b"sparkdist.data_slot"
#: The commit marker's entry that holds the data position.
MARKER_KEY = "data"

#: ``(shard, start, end)``: positions ``start..end-1`` of the shard's row order in its epoch.
Piece = tuple[int, int, int]


def _rng(*parts: int) -> random.Random:
    """A generator that depends only on ``parts``: no process's or Python's hash seed."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def shard_order(seed: int, epoch: int, shards: int) -> list[int]:
    """The order epoch ``epoch`` walks the shards in."""
    order = list(range(shards))
    _rng(seed, epoch).shuffle(order)
    return order


def row_order(seed: int, epoch: int, shard: int, size: int) -> list[int]:
    """The order epoch ``epoch`` walks shard ``shard``'s rows in (indices into hash order)."""
    order = list(range(size))
    _rng(seed, epoch, shard).shuffle(order)
    return order


def full_epoch(seed: int, epoch: int, sizes: Sequence[int]) -> list[Piece]:
    """Every row of an epoch, as one piece per non-empty shard in the epoch's shard order."""
    return [(s, 0, sizes[s]) for s in shard_order(seed, epoch, len(sizes)) if sizes[s] > 0]


def rows_in(pieces: Sequence[Piece]) -> int:
    return sum(end - start for _, start, end in pieces)


def take(pieces: Sequence[Piece], first: int, last: int) -> list[Piece]:
    """Rows ``first..last-1`` of the pieces laid end to end, as pieces."""
    taken: list[Piece] = []
    offset = 0
    for shard, start, end in pieces:
        length = end - start
        lo, hi = max(first - offset, 0), min(last - offset, length)
        if lo < hi:
            taken.append((shard, start + lo, start + hi))
        offset += length
        if offset >= last:
            break
    return taken


def split(pieces: Sequence[Piece], slots: int) -> list[list[Piece]]:
    """The pieces laid end to end, cut into ``slots`` contiguous runs of near-equal length."""
    total = rows_in(pieces)
    return [take(pieces, total * j // slots, total * (j + 1) // slots) for j in range(slots)]


def homes(sizes: Sequence[int], slots: int) -> list[list[int]]:
    """Whole shards per slot for the epochs after the first: the largest shard first, each to
    the slot holding the fewest rows so far (the lowest slot on ties)."""
    loads = [0] * slots
    owned: list[list[int]] = [[] for _ in range(slots)]
    for shard in sorted(range(len(sizes)), key=lambda s: (-sizes[s], s)):
        slot = min(range(slots), key=lambda j: (loads[j], j))
        owned[slot].append(shard)
        loads[slot] += sizes[shard]
    return [sorted(shards) for shards in owned]


@dataclass(frozen=True)
class Position:
    """Where an epoch stands: its number and the rows left (None: none taken yet)."""

    epoch: int
    remaining: tuple[Piece, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        remaining = None if self.remaining is None else [list(p) for p in self.remaining]
        return {"epoch": self.epoch, "remaining": remaining}

    @classmethod
    def from_json(cls, data: Any, sizes: Sequence[int]) -> Position:
        """Checked against the shards' sizes: a checkpoint of other data is refused."""
        try:
            epoch = int(data["epoch"])
            raw = data["remaining"]
            remaining = None if raw is None else tuple((int(s), int(a), int(b)) for s, a, b in raw)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not a data position: {data!r}") from None
        for shard, start, end in remaining or ():
            if not (0 <= shard < len(sizes) and 0 <= start < end <= sizes[shard]):
                raise ValueError(
                    f"the checkpoint's data position has rows {start}..{end - 1} of shard "
                    f"{shard}, which this DataFrame's {len(sizes)} shards do not have"
                )
        return cls(epoch, remaining)


@dataclass(frozen=True)
class Segment:
    """One epoch's rows per slot within one attempt, walked in lockstep."""

    epoch: int
    pieces: tuple[tuple[Piece, ...], ...]

    def counts(self) -> list[int]:
        return [rows_in(p) for p in self.pieces]

    def steps(self, batch_size: int) -> int:
        """Steps every slot takes: enough that the smallest slot's batches are ``batch_size``
        or fewer, and never so many that a slot with rows runs dry (0 when the epoch is empty).
        A slot with no rows at all (fewer shards with rows than slots) takes empty batches
        rather than making the others take all of theirs in one."""
        counts = [n for n in self.counts() if n]
        if not counts:
            return 0
        return max(1, -(-min(counts) // batch_size))

    def batch(self, slot: int, step: int, steps: int) -> list[Piece]:
        """Slot ``slot``'s rows at ``step`` of ``steps``."""
        n = rows_in(self.pieces[slot])
        return take(self.pieces[slot], n * step // steps, n * (step + 1) // steps)

    def after(self, taken: int, steps: int) -> Position:
        """The epoch's position once every slot has taken ``taken`` of ``steps`` steps."""
        if taken >= steps:
            return Position(self.epoch + 1)
        left: list[Piece] = []
        for slot_pieces in self.pieces:
            n = rows_in(slot_pieces)
            left.extend(take(slot_pieces, n * taken // steps, n))
        return Position(self.epoch, tuple(left))


@dataclass(frozen=True)
class DataPlan:
    """What one attempt's slots hold and walk: the same on the driver and in every rank.

    Attributes:
        seed: the orders' seed.
        sizes: rows per shard.
        start: the position the attempt starts from.
        from_step: the checkpoint step ``start`` was read from (None: a fresh start).
        current: per slot, the start epoch's rows.
        homes: per slot, its shards in later epochs.
    """

    seed: int
    sizes: tuple[int, ...]
    start: Position
    from_step: int | None
    current: tuple[tuple[Piece, ...], ...]
    homes: tuple[tuple[int, ...], ...]

    @property
    def slots(self) -> int:
        return len(self.current)

    def segment(self, epoch: int) -> Segment:
        """Epoch ``epoch``'s rows per slot: the start epoch's split, or whole home shards."""
        if epoch == self.start.epoch:
            return Segment(epoch, self.current)
        order = shard_order(self.seed, epoch, len(self.sizes))
        return Segment(
            epoch,
            tuple(
                tuple((s, 0, self.sizes[s]) for s in order if s in set(own) and self.sizes[s])
                for own in self.homes
            ),
        )

    def shards_of(self, slot: int) -> set[int]:
        """The shards whose rows slot ``slot`` must hold."""
        return {s for s, _, _ in self.current[slot]} | set(self.homes[slot])

    def to_json(self) -> str:
        return json.dumps(
            {
                "seed": self.seed,
                "sizes": list(self.sizes),
                "start": self.start.to_json(),
                "from_step": self.from_step,
                "current": [[list(p) for p in pieces] for pieces in self.current],
                "homes": [list(h) for h in self.homes],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> DataPlan:
        data = json.loads(text)
        sizes = tuple(int(n) for n in data["sizes"])
        return cls(
            seed=int(data["seed"]),
            sizes=sizes,
            start=Position.from_json(data["start"], sizes),
            from_step=None if data["from_step"] is None else int(data["from_step"]),
            current=tuple(
                tuple((int(s), int(a), int(b)) for s, a, b in pieces) for pieces in data["current"]
            ),
            homes=tuple(tuple(int(s) for s in h) for h in data["homes"]),
        )


def make_plan(
    seed: int,
    sizes: Sequence[int],
    slots: int,
    start: Position | None = None,
    from_step: int | None = None,
) -> DataPlan:
    """The plan of an attempt of ``slots`` ranks starting at ``start`` (None: epoch 0)."""
    if slots < 1:
        raise ValueError(f"slots={slots}: an attempt has at least one rank")
    start = start or Position(0)
    pieces = (
        full_epoch(seed, start.epoch, sizes) if start.remaining is None else list(start.remaining)
    )
    return DataPlan(
        seed=seed,
        sizes=tuple(sizes),
        start=start,
        from_step=from_step,
        current=tuple(tuple(p) for p in split(pieces, slots)),
        homes=tuple(tuple(h) for h in homes(sizes, slots)),
    )
