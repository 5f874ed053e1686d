"""The ranks of one checkpoint call: their own gloo group, decisions global rank 0 makes for
all of them, problems they agree on, and DCP's failures (one per failed rank) as one line.

Every call here that reaches the group is collective: the checkpoint calls that use it
(``save_checkpoint``, ``load_checkpoint`` into a template) are made by every rank, in the same
order. The group is gloo whatever the training's backend: DCP's plans and these decisions are
Python objects on the CPU, and an asynchronous save's collectives (on its own thread) must not
interleave with the training's on the default group.

Non-goals: what is written or read (``checkpoint_io``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")


def distributed() -> bool:
    """Whether a default process group is up (a world of ranks, not one process alone)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


#: (the default group it was made in, the checkpoint group): both held, so a default group
#: made again (destroyed, then initialised anew) is never mistaken for the old one.
_made: tuple[ProcessGroup, ProcessGroup] | None = None


def checkpoint_group() -> ProcessGroup | None:
    """The checkpoint group (every rank, gloo), made on first use: a collective call, as every
    checkpoint call that reaches it is. None without a process group."""
    global _made
    if not distributed():
        return None
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    if _made is None or _made[0] is not default:
        _made = (default, cast("ProcessGroup", dist.new_group(backend="gloo")))
    return _made[1]


def is_coordinator() -> bool:
    """Global rank 0, which DCP coordinates through and which commits (True without a group)."""
    import torch.distributed as dist

    return not distributed() or dist.get_rank() == 0


def share_from_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on global rank 0 only and give every rank its result; its failure raises on
    every rank (the other ranks get a ``RuntimeError`` with its text). A collective call."""
    group = checkpoint_group()
    if group is None:
        return fn()
    import torch.distributed as dist

    if dist.get_rank() == 0:
        try:
            value = fn()
        except Exception as exc:
            dist.broadcast_object_list([(False, describe(exc))], src=0, group=group)
            raise
        dist.broadcast_object_list([(True, value)], src=0, group=group)
        return value
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    ok, value = box[0]
    if not ok:
        raise RuntimeError(f"{value} (on global rank 0)")
    return cast(T, value)


def agree(problem: T | None) -> T | None:
    """Every rank's ``problem`` (None: none) in, the lowest rank's problem out, on every rank:
    ranks that read a checkpoint each on their own go on together, or not at all."""
    group = checkpoint_group()
    if group is None:
        return problem
    import torch.distributed as dist

    problems: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p is not None), None)


# -- errors ------------------------------------------------------------------------------------


def _failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, exception) of each rank that failed, for DCP's ``CheckpointException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        return sorted((rank, wrapped[0]) for rank, wrapped in exc.failures.items())
    return []


def cause(exc: BaseException) -> BaseException:
    """What to chain an error to: the first failed rank's own error inside DCP's."""
    failures = _failures(exc)
    return failures[0][1] if failures else exc


def find(exc: BaseException, kind: type[T]) -> T | None:
    """An error of ``kind`` in ``exc``, its causes, or any failed rank's error inside DCP's."""
    for candidate in [exc, *(e for _, e in _failures(exc))]:
        seen: set[int] = set()
        while candidate is not None and id(candidate) not in seen:
            if isinstance(candidate, kind):
                return candidate
            seen.add(id(candidate))
            candidate = candidate.__cause__ or candidate.__context__  # type: ignore[assignment]
    return None


def describe(exc: BaseException) -> str:
    """One line for an error: DCP's are named by the first rank that failed."""
    failures = _failures(exc)
    if failures:
        rank, first = failures[0]
        return f"{_first_line(first)} (on rank {rank})"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
