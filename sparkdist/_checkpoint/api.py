"""A run's checkpoints: one ``torch.distributed.checkpoint`` (DCP) directory per step in the
launcher's ``checkpoint_dir``, every rank writing its own shards, committed by a marker that
global rank 0 writes last; read back newest committed first, weights only unless asked.

The implementation behind ``sparkdist.runtime``'s ``checkpoint_dir``, ``save_checkpoint`` and
``load_checkpoint`` (the public names, and what they promise, are documented there): checking
the arguments, and the choice of checkpoint to load (the newest committed one that reads, on
every rank alike when they load together). The layout, the marker and retention are
``checkpoint_layout``'s; writing and reading through DCP ``checkpoint_io``'s; what is unpickled
``checkpoint_pickles``'; state dicts in memory ``checkpoint_state``'s. A DeepSpeed engine
(alone, or in a dict beside its client state) goes to ``checkpoint_deepspeed``: DeepSpeed's own
format in the same layout; each format loads only its own (the marker's ``format``).

Non-goals: deciding when to save (the caller).
"""

from __future__ import annotations

import logging
import operator
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sparkdist._checkpoint import dcp as checkpoint_io
from sparkdist._checkpoint import deepspeed_engine as checkpoint_deepspeed
from sparkdist._checkpoint import layout as checkpoint_layout
from sparkdist._checkpoint import ranks as checkpoint_ranks
from sparkdist._checkpoint.layout import Candidate, Unreadable
from sparkdist._checkpoint.pickles import Refused, load_torch_file, refusal
from sparkdist._checkpoint.state import fill, layout_notes
from sparkdist._checkpoint.storage import storage_for
from sparkdist._core.env import CHECKPOINT_DIR_VAR

logger = logging.getLogger("sparkdist")

T = TypeVar("T")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: the step it was taken after, the saved state, and its path."""

    step: int
    state: Any
    path: str


# Users meet it as ``runtime.Checkpoint`` (the name it had before it moved here): its repr, help
# and pickles say so, and ``sparkdist.runtime`` re-exports it, so such pickles still load. Set
# after the decorator, which looks the class's module up in ``sys.modules`` while it works.
Checkpoint.__module__ = "sparkdist.runtime"


#: What a rank adds to each commit marker it writes, by entry name: a function called when the
#: save is asked for (the data loader's position, ``_node.rank.shard_loader``).
_marker_entries: dict[str, Callable[[], Any]] = {}
#: The step this process last loaded a checkpoint of (None: none yet).
_loaded: dict[str, int] = {}


def add_marker_entry(name: str, entry: Callable[[], Any]) -> None:
    """Put ``entry()`` (JSON) into every commit marker saved from now on, as ``name``."""
    _marker_entries[name] = entry


def loaded_step() -> int | None:
    """The step of the checkpoint this process last loaded, or None."""
    return _loaded.get("step")


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory (``checkpoint_dir=`` of the launcher), or None."""
    return os.environ.get(CHECKPOINT_DIR_VAR) or None


def wait_for_pending_saves() -> None:
    """Finish this rank's asynchronous save, if one is in flight: wait until it is written and
    committed, and raise its failure (naming its step). The worker calls it after the user's
    function returns, before the process group goes; it costs nothing when none is pending."""
    checkpoint_io.wait_for_pending_saves()


# -- saving ------------------------------------------------------------------------------------


def save(
    state: Any, step: int, *, writer: bool, async_: bool = False, keep_last: int | None = None
) -> str:
    """``runtime.save_checkpoint``: every rank calls it and writes its shards (collective when a
    process group is up); without one, only the ``writer`` writes, as a world of one."""
    step = _checked_step(step)
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(
            f"keep_last={keep_last!r}: pass a number of checkpoints to keep, 1 or more, or None "
            "to keep them all"
        )
    directory = _require_checkpoint_dir()  # before the state: this one imports nothing
    entries = {name: entry() for name, entry in _marker_entries.items()}  # as of this call
    found = checkpoint_deepspeed.find_engine(state)
    if found is not None:
        return checkpoint_deepspeed.save(
            found, state, step, directory, async_=async_, keep_last=keep_last, entries=entries
        )
    state = _checked_state(state)
    final = storage_for(directory).join(directory, checkpoint_layout.step_name(step))
    if not checkpoint_ranks.distributed() and not writer:
        return final  # ranks without a process group: the main process saves for them all
    notes = layout_notes(state) if checkpoint_ranks.is_coordinator() else {}
    world_size = _world_size()

    def commit(written_to: str) -> None:
        marker = {
            "format": "dcp",
            "step": step,
            "world_size": world_size,
            "saved_at": round(time.time(), 3),
            "keys": notes,
            **entries,
        }
        checkpoint_layout.commit(directory, written_to, final, marker)
        if keep_last is not None:
            checkpoint_layout.retain(directory, keep_last, step)

    return checkpoint_io.save(
        state,
        step=step,
        prepare=lambda: checkpoint_layout.prepare(directory, step),
        commit=commit,
        async_=async_,
    )


def _checked_step(step: Any) -> int:
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step={step!r} ({type(step).__name__}): pass the step as an int") from None
    if not 0 <= value <= checkpoint_layout.MAX_STEP:
        raise ValueError(
            f"step={value}: pass a step from 0 to {checkpoint_layout.MAX_STEP} (it names the "
            "checkpoint's directory, step-<9 digits>)"
        )
    return value


def _checked_state(state: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.stateful import Stateful

    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise TypeError(
            f"save_checkpoint takes the state as a dict with str keys, such as "
            '{"model": model.state_dict(), "optimizer": optimizer.state_dict()}; got '
            f"{type(state).__name__}"
            + (" with keys that are not str" if isinstance(state, dict) else "")
        )
    # DCP would call state_dict() itself; called here once, the layout notes see the same state.
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def load(
    first: Any = None, *, map_location: Any = "cpu", weights_only: bool = True
) -> Checkpoint | None:
    """``runtime.load_checkpoint``: the newest readable checkpoint, or None when there is none;
    an unreadable one is skipped with a warning, a refused one raises. Collective with
    ``into`` when a process group is up (rank 0 lists the candidates, the ranks load each
    together); without it, each rank reads on its own. Into a DeepSpeed engine, DeepSpeed's."""
    found = checkpoint_deepspeed.find_engine(first)
    if found is not None:
        loaded = checkpoint_deepspeed.load(
            found,
            first,
            _require_checkpoint_dir(),
            map_location=map_location,
            weights_only=weights_only,
        )
        if loaded is None:
            return None
        _loaded["step"] = loaded[0]
        return Checkpoint(step=loaded[0], state=first, path=loaded[1])
    into, map_location = _into_and_location(first, map_location)
    checkpoint_io.wait_for_pending_saves()
    directory = _require_checkpoint_dir()
    together = into is not None and checkpoint_ranks.distributed()
    if together:
        candidates = checkpoint_ranks.share_from_rank0(
            lambda: checkpoint_layout.candidates(directory)
        )
    else:
        candidates = checkpoint_layout.candidates(directory)
    unreadable: list[str] = []
    for candidate in candidates:
        try:
            step, state = _read(candidate, into, map_location, weights_only, together)
        except Refused as exc:
            raise pickle.UnpicklingError(refusal(candidate.path, exc.names)) from exc
        except _Gone:
            continue  # removed since it was listed
        except _WrongFormat as exc:
            raise RuntimeError(str(exc)) from None
        except Unreadable as exc:
            reason = str(exc)
        else:
            _loaded["step"] = step
            return Checkpoint(step=step, state=state, path=candidate.path)
        logger.warning(
            "sparkdist: checkpoint %s cannot be read (%s); trying the checkpoint before it",
            candidate.path,
            reason,
        )
        unreadable.append(f"{candidate.path}: {reason}")
    if unreadable:
        raise RuntimeError(
            f"no checkpoint in {directory} can be read: " + "; ".join(unreadable) + ". Move "
            "these files away to start from scratch, or restore them from a copy"
        )
    return None


def _into_and_location(first: Any, map_location: Any) -> tuple[dict[str, Any] | None, Any]:
    """``load_checkpoint``'s first argument: the state dict to load into, or (as before it took
    one) a ``map_location`` given by position: a str, a ``torch.device`` or a callable."""
    if first is None or isinstance(first, dict):
        return first, map_location
    import torch

    if isinstance(first, torch.nn.Module) or not (
        isinstance(first, (str, torch.device)) or callable(first)
    ):
        raise TypeError(
            f"load_checkpoint(into=...) takes the state dict to load into, such as "
            '{"model": model.state_dict()} or {"model": model}; got '
            f"{type(first).__name__} (pass map_location= by keyword)"
        )
    if not (isinstance(map_location, str) and map_location == "cpu"):
        raise TypeError(
            f"load_checkpoint got map_location twice: {first!r} by position and "
            f"{map_location!r} by keyword"
        )
    return None, first


def _read(
    candidate: Candidate,
    into: dict[str, Any] | None,
    map_location: Any,
    weights_only: bool,
    together: bool,
) -> tuple[int, Any]:
    """(step, state) of one candidate; raises ``Refused``, ``Unreadable`` or ``_Gone``, on
    every rank alike when the ranks read ``together``."""
    if candidate.legacy:
        step, state = _settled(
            lambda: _read_legacy(candidate.path, map_location, weights_only), candidate, together
        )
        if into is None:
            return step, state
        _settled(lambda: fill(into, state), candidate, together)
        return step, into
    marker, metadata = _settled(
        lambda: _marker_and_metadata(candidate, weights_only), candidate, together
    )
    if metadata is None:  # DeepSpeed's: every rank read the same marker
        raise _WrongFormat(checkpoint_deepspeed.wrong_format(candidate.path, marker["format"]))
    try:  # DCP's own collectives fail on every rank alike
        if into is not None:
            checkpoint_io.read_into(
                into, candidate.path, metadata, map_location=map_location, weights_only=weights_only
            )
            return candidate.step, into
        state = checkpoint_io.read_whole(
            candidate.path,
            metadata,
            marker.get("keys") or {},
            map_location=map_location,
            weights_only=weights_only,
        )
    except (Refused, Unreadable):
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to read means: try the one before
        raise Unreadable(checkpoint_ranks.describe(exc)) from exc
    return candidate.step, state


def _settled(read: Callable[[], T], candidate: Candidate, together: bool) -> T:
    """``read()`` on this rank alone, its failure as ``Refused``, ``Unreadable`` or ``_Gone``
    (the candidate removed since it was listed); with ``together``, the ranks go on only if
    none failed (else all raise the lowest failed rank's reason)."""
    problem: tuple[str, Any] | None = None
    value: T | None = None
    try:
        value = read()
    except Refused as exc:
        problem = ("refused", exc.names)
    except FileNotFoundError as exc:
        gone = storage_for(candidate.path).kind(candidate.path) == "missing"
        problem = ("gone", "") if gone else ("unreadable", checkpoint_ranks.describe(exc))
    except Unreadable as exc:
        problem = ("unreadable", str(exc))
    except Exception as exc:  # noqa: BLE001 - any failure to read means: try the one before
        problem = ("unreadable", checkpoint_ranks.describe(exc))
    if together:
        problem = checkpoint_ranks.agree(problem)
    if problem is None:
        return cast(T, value)
    kind, detail = problem
    if kind == "refused":
        raise Refused(detail)
    raise _Gone() if kind == "gone" else Unreadable(detail)


def _marker_and_metadata(candidate: Candidate, weights_only: bool) -> tuple[dict[str, Any], Any]:
    """The candidate's marker and DCP metadata (None for a checkpoint of DeepSpeed's format)."""
    marker = checkpoint_layout.read_marker(candidate)
    if marker["format"] == checkpoint_deepspeed.FORMAT:
        return marker, None
    return marker, checkpoint_io.read_metadata(candidate.path, weights_only=weights_only)


class _Gone(Exception):
    """A checkpoint removed since it was listed."""


class _WrongFormat(Exception):
    """A checkpoint of DeepSpeed's format: refused (the message says why and what loads it)."""


def _read_legacy(path: str, map_location: Any, weights_only: bool) -> tuple[int, Any]:
    saved = load_torch_file(path, map_location, weights_only=weights_only)
    if isinstance(saved, dict) and isinstance(saved.get("step"), int) and "state" in saved:
        return int(saved["step"]), saved["state"]
    raise Unreadable('not written by save_checkpoint (no "step" and "state")')


# -- shared ------------------------------------------------------------------------------------


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if checkpoint_ranks.distributed() else 1


def _require_checkpoint_dir() -> str:
    directory = checkpoint_dir()
    if directory is None:
        raise RuntimeError(
            "no checkpoint directory: pass checkpoint_dir=... to the launcher (shared storage "
            "every rank can reach, on a cluster)"
        )
    return directory
