"""The checkpoint functions of ``sparkdist.runtime`` (``checkpoint_dir``, ``save_checkpoint``,
``load_checkpoint``), defined here with their documentation and shown as
``sparkdist.runtime``'s; the work is ``api``'s.

Non-goals: the implementation (``api``, ``dcp``, ``deepspeed_engine``).
"""

from __future__ import annotations

from typing import Any

from sparkdist._checkpoint import api as _checkpoints
from sparkdist._checkpoint.api import Checkpoint
from sparkdist._core.world import global_rank

__all__ = ["Checkpoint", "checkpoint_dir", "load_checkpoint", "save_checkpoint"]


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory (``checkpoint_dir=`` of the launcher), or None."""
    return _checkpoints.checkpoint_dir()


def save_checkpoint(
    state: Any, step: int, *, async_: bool = False, keep_last: int | None = None
) -> str:
    """Save ``state`` as the checkpoint of ``step``: every rank writes its own shards.

    A collective call: every rank must call it, with its own ``state`` (a dict with str keys:
    DDP's ``model.state_dict()``, or FSDP2's sharded state from
    ``torch.distributed.checkpoint.state_dict.get_state_dict``). It writes through
    ``torch.distributed.checkpoint`` (DCP), all ranks in parallel, into
    ``<checkpoint_dir>/step-<step, 9 digits>/``: each rank's shards (``__<rank>_0.distcp``;
    tensors every rank holds alike, DDP's, are written once), DCP's ``.metadata``, and last a
    commit marker ``COMMITTED`` (JSON: format "dcp", step, world size, time) that global rank
    0 writes atomically (fsynced, renamed) once every rank's files are on disk. A directory
    without its marker is never loaded, and is cleared when that step is saved again; a
    committed checkpoint of the same step is replaced only once the new one is committed.
    Directories are 0700, files 0600, every file fsynced. Without a process group (a world of
    one, outside a launcher) the main process writes alone, and the others only return its
    path. The directory is DCP's format:
    ``torch.distributed.checkpoint.load`` reads it too. Keep ``state`` to tensors, numbers,
    strings and plain containers so that ``load_checkpoint`` reads it without
    ``weights_only=False``.

    DeepSpeed (``mode="deepspeed"``): pass the ``deepspeed.DeepSpeedEngine`` itself, or a dict
    holding the engine and your own entries (``{"engine": engine, "epoch": 3}``: DeepSpeed's
    ``client_state``, every rank holding the same). Every rank calls
    ``engine.save_checkpoint(<checkpoint_dir>, tag="step-<9 digits>")``, so the step directory
    holds DeepSpeed's own files (``zero_to_fp32.py`` reads it, given ``--tag step-<9 digits>``);
    DeepSpeed's ``latest`` file is not written. Then the same rule: made 0600/0700 and
    fsynced, and the marker (format "deepspeed", world sizes, ZeRO stage) written last by
    global rank 0; ``keep_last`` as above. ``async_`` is for state dicts only.

    Example:
        >>> state = {"model": model.state_dict(), "optim": optim.state_dict()}  # doctest: +SKIP
        >>> runtime.save_checkpoint(state, step, async_=True, keep_last=3)  # doctest: +SKIP
        >>> runtime.save_checkpoint({"engine": engine, "epoch": 3}, step)  # doctest: +SKIP

    Args:
        state: what to save, a dict with str keys (values with ``state_dict()``, such as a
            module, are saved as their state dict); or a DeepSpeed engine, alone or as one
            value of such a dict (the other values are its client state).
        step: the step it was taken after, 0 to 999999999.
        async_: return once the state is copied to host memory and write it while training
            goes on; its marker is written when the write finishes. The next
            ``save_checkpoint`` or ``load_checkpoint`` waits for it first, and so does the
            end of the rank's function; a failed write raises there, naming its step (that
            call does nothing else: call it again). One asynchronous save is in flight at a
            time.
        keep_last: after this checkpoint is committed, remove all but the newest
            ``keep_last`` committed checkpoints (never the one just written), and step
            directories left uncommitted before the newest one. Only sparkdist's own step
            directories are removed; old single-file checkpoints are kept. None keeps all.

    Returns:
        The checkpoint's directory.

    Raises:
        RuntimeError: no ``checkpoint_dir``; a writing rank failed (the message names it and
            its error); or something sparkdist did not write is in the way of the step's
            directory.
        TypeError: ``state`` is not a dict with str keys, holds more than one DeepSpeed
            engine, or ``step`` is not an int.
        ValueError: ``step`` or ``keep_last`` out of range; with an engine, ``async_=True``,
            a client state key DeepSpeed uses itself, or a decoupled DeepSpeed checkpoint
            engine.
    """
    return _checkpoints.save(
        state, step, writer=global_rank() == 0, async_=async_, keep_last=keep_last
    )


def load_checkpoint(
    into: Any = None, *, map_location: Any = "cpu", weights_only: bool = True
) -> Checkpoint | None:
    """The latest committed, readable checkpoint of this run's ``checkpoint_dir``, or None.

    With ``into``, the state dict to fill (the template DCP loads into, with the keys and
    shapes saved: ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)``'s,
    FSDP2's shards included, then ``set_state_dict``; an optimizer's own ``state_dict()``
    holds no state to fill before its first step), it is loaded in place, resharded to the
    current world size (a checkpoint written by 4 ranks loads on 2), and the returned
    ``Checkpoint.state`` is ``into``. This is a collective call when a process group is up:
    every rank calls it, and they load the same checkpoint. Without ``into``, this rank reads
    the whole state into memory on its own (sharded tensors whole, on the CPU, then moved by
    ``map_location``), as it was saved; fine for DDP-sized state.

    Only directories with their commit marker count; the newest step wins. A checkpoint that
    cannot be read (damaged, cut short, not sparkdist's) is skipped with a warning naming it,
    and the one before it is tried. Single-file checkpoints of earlier versions
    (``step-<9 digits>.pt``) are read too, the newest step of either kind winning.

    By default only tensors, state dicts, numbers, strings and plain containers are loaded
    (``torch.load(weights_only=True)`` for each saved object, DCP's metadata built from its
    own classes only): a checkpoint holding anything else is refused, because unpickling
    arbitrary objects can run arbitrary code, and anyone who can write the checkpoint
    directory could have put such a file there. ``weights_only=False`` loads full pickles
    (your own classes, say): pass it only if you trust the files and everyone who can write
    the directory. Allowing just your classes, with ``torch.serialization.add_safe_globals``,
    keeps the protection on.

    DeepSpeed: pass the engine (or the dict of the engine and client-state keys it was saved
    with) as ``into``; every rank calls it. The newest committed checkpoint must be DeepSpeed's
    (one saved from state dicts is refused, and a DeepSpeed one given to a state dict too), and
    ``engine.load_checkpoint`` loads it with its optimizer and scheduler state; the client
    state fills the dict's other keys, and ``Checkpoint.state`` is ``into``. At another world
    size (ZeRO stage 1 to 3), global rank 0 first converts it, once, to DeepSpeed's universal
    checkpoint (``step-<9 digits>.universal/`` beside it) and the engine loads that, resharded;
    what DeepSpeed cannot load (another ZeRO stage, tensor or pipeline parallelism at another
    size) is refused before the engine is touched, saying what would load it. With
    ``weights_only``, DeepSpeed's files may hold its own data classes too (its loss scaler, its
    ZeRO stage), nothing else.

    Example:
        >>> from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        >>> model_state, optim_state = get_state_dict(model, optim)  # doctest: +SKIP
        >>> state = {"model": model_state, "optim": optim_state}  # doctest: +SKIP
        >>> latest = runtime.load_checkpoint(state)  # in place, resharded  # doctest: +SKIP
        >>> if latest is not None:  # doctest: +SKIP
        ...     set_state_dict(model, optim, model_state_dict=state["model"],
        ...                    optim_state_dict=state["optim"])
        >>> start = 0 if latest is None else latest.step  # doctest: +SKIP
        >>> latest = runtime.load_checkpoint({"engine": engine, "epoch": 0})  # doctest: +SKIP

    Args:
        into: the state dict to load into, in place; None to read the whole state; a
            DeepSpeed engine, alone or in a dict with its client-state keys. A str,
            ``torch.device`` or callable here is taken as ``map_location`` (the first
            parameter of earlier versions).
        map_location: as for ``torch.load``; with ``into``, for the saved objects that are not
            tensors (tensors go where ``into``'s are).
        weights_only: False to unpickle any object (runs whatever code the files name).

    Raises:
        pickle.UnpicklingError: with ``weights_only=True``, the newest readable checkpoint
            holds other objects; the message names them and the ways to load it.
        RuntimeError: no ``checkpoint_dir``; checkpoints are there but none can be read; an
            asynchronous save failed (naming its step); or the newest checkpoint is of the
            other format (DeepSpeed's, state dicts'), or cannot load into this engine.
        TypeError: ``into`` is neither a dict, an engine nor a ``map_location``; or
            ``map_location`` with an engine.
    """
    return _checkpoints.load(into, map_location=map_location, weights_only=weights_only)


for _public in (checkpoint_dir, save_checkpoint, load_checkpoint):
    _public.__module__ = "sparkdist.runtime"
