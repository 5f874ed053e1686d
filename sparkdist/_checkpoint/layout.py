"""The checkpoint directory's layout: step directories, their commit marker, which ones count,
making room for a step, and removing old ones; plain files, no torch. The same layout and rules
in a directory and on an object store (``checkpoint_dir="s3://..."``), through ``storage``:
there "directories" are key prefixes, modes do not apply, and nothing is renamed (the marker,
one PUT, is the commit).

Layout::

    <checkpoint_dir>/step-000000120/     0700, one per saved step: DCP's own format
        __0_0.distcp  __1_0.distcp ...   each rank's shards, 0600
        .metadata                        DCP's index of the shards
        COMMITTED                        written last: {"format": "dcp", "step": 120, ...}
    <checkpoint_dir>/step-000000130/     or DeepSpeed's format (``engine.save_checkpoint`` with
        mp_rank_00_model_states.pt       tag step-000000130): its files as DeepSpeed names them,
        zero_pp_rank_0_mp_rank_00_...    0600 once committed
        COMMITTED                        written last: {"format": "deepspeed", ...}
    <checkpoint_dir>/step-000000130.universal/   DeepSpeed's universal checkpoint converted
                                         from it, made by a load at another world size
    <checkpoint_dir>/zero_to_fp32.py     DeepSpeed's recovery scripts (it writes them there)
    <checkpoint_dir>/step-000000100.pt   a single-file checkpoint of earlier versions: read,
                                         never written nor removed

A step directory counts only with its marker. Nothing is removed that does not match these
names (a step directory holding anything else is left, and named); a universal conversion is
removed with its step.

Non-goals: what the shards hold and how they are written (``checkpoint_io``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from sparkdist._checkpoint.storage import LocalStorage, Storage, storage_for
from sparkdist._core.files import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, fsync_directory

logger = logging.getLogger("sparkdist")

MARKER = "COMMITTED"
#: The formats this version reads and writes (the marker's "format"): DCP's from state dicts,
#: DeepSpeed's own from an engine (``checkpoint_deepspeed``); each loads only its own.
READABLE_FORMATS = ("dcp", "deepspeed")
MAX_STEP = 10**9 - 1  # nine digits in the names

_STEP_DIR = re.compile(r"^step-(\d{9})$")
_LEGACY_FILE = re.compile(r"^step-(\d{9})\.pt$")
#: A universal conversion of a DeepSpeed checkpoint, or one being made (``.tmp``).
_UNIVERSAL_DIR = re.compile(r"^\.?step-(\d{9})\.universal(\.tmp)?$")
#: What a step directory holds that sparkdist (through DCP or DeepSpeed) wrote: nothing else is
#: removed. DeepSpeed's names: model and ZeRO states per rank, MoE experts, pipeline layers.
_OWN_FILE = re.compile(
    r"^(COMMITTED|\.COMMITTED\..*\.tmp|\.metadata(\.tmp)?|__\d+(_\d+\.distcp|\.metadata(\.tmp)?)"
    r"|((bf16_)?zero_pp_rank_\d+_)?mp_rank_\d+_(model|optim)_states\.pt"
    r"|expp_rank_\d+_mp_rank_\d+_optim_states\.pt|(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt"
    r"|layer_\d+-model_\d+-model_states\.pt)$"
)


class Unreadable(Exception):
    """A checkpoint that cannot be read; the message says why (for the warning)."""


@dataclass(frozen=True)
class Candidate:
    """A checkpoint that may be loaded: a committed step directory or an old single file."""

    step: int
    path: str
    legacy: bool  # a single-file checkpoint of earlier versions


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def universal_name(step: int) -> str:
    """The directory beside step ``step``'s that holds its universal conversion (DeepSpeed)."""
    return f"{step_name(step)}.universal"


# -- writing (global rank 0) -------------------------------------------------------------------


def prepare(directory: str, step: int) -> tuple[str, str]:
    """Before the ranks write: the directory to write to, and the checkpoint's final one.

    In a directory, a committed checkpoint of this step stays until the new one is committed
    beside it (in ``.step-<N>.replacing``); an uncommitted one (a crash's) is cleared first. An
    object store renames nothing, so there the step is rewritten in place: its marker goes
    first, so a reader never takes the step while it is half rewritten (the older steps stay).
    """
    storage = storage_for(directory)
    storage.make_dirs(directory)
    name = step_name(step)
    final = storage.join(directory, name)
    kind = storage.kind(final)
    if kind not in ("missing", "dir"):
        raise RuntimeError(
            f"{final} is in the way of checkpoint step {step}: it is not a directory sparkdist "
            "wrote; move it away, then save again"
        )
    if not isinstance(storage, LocalStorage):
        _clear(storage, final)
        return final, final
    replacing = storage.join(directory, f".{name}.replacing")
    _clear(storage, replacing)  # an earlier replacement's leftover
    if kind == "missing":
        target = final
    elif storage.kind(storage.join(final, MARKER)) == "file":
        target = replacing
    else:
        _clear(storage, final)
        target = final
    storage.make_dir(target)
    return target, final


def commit(directory: str, written_to: str, final: str, marker: dict[str, Any]) -> None:
    """Once every rank's shards are written: the marker, last and atomically (in a directory:
    fsync, rename, fsync of the directory; on a store: one PUT); a checkpoint it replaces
    swapped out, then removed, and with it any universal conversion of that step.

    Between the two renames of a replacement no directory of that step exists (the older
    checkpoints still do); the new one is complete and committed before the first.
    """
    storage = storage_for(directory)
    storage.write_whole(storage.join(written_to, MARKER), json.dumps(marker).encode())
    if isinstance(storage, LocalStorage):
        if written_to != final:
            aside = storage.join(directory, f".{os.path.basename(final)}.replaced")
            _clear(storage, aside)
            storage.rename(final, aside)
            storage.rename(written_to, final)
            storage.sync_dir(directory)
            _remove(storage, aside)
        storage.sync_dir(directory)  # the step directory's own entry
    # A universal conversion of this step is of a checkpoint it replaced (or its leftover).
    remove_tree(storage.join(directory, universal_name(int(marker["step"]))))


def seal(path: str) -> None:
    """Make a tree that another writer filled (DeepSpeed, which writes with the umask) private
    and durable before it is committed: files 0600 (0700 where the owner may run them),
    directories 0700, every file and directory fsynced. Links are left alone."""
    for root, dirs, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            if os.path.islink(file):
                continue
            executable = os.lstat(file).st_mode & stat.S_IXUSR
            os.chmod(file, PRIVATE_DIR_MODE if executable else PRIVATE_FILE_MODE)
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), PRIVATE_DIR_MODE)
        fsync_directory(root)
    os.chmod(path, PRIVATE_DIR_MODE)


def retain(directory: str, keep_last: int, written: int) -> None:
    """Keep the newest ``keep_last`` committed checkpoints and the one just ``written``; remove
    older committed ones, and uncommitted step directories older than the newest commit."""
    storage = storage_for(directory)
    entries = [
        (step, path, storage.kind(storage.join(path, MARKER)) == "file")
        for step, path in _dirs(storage, directory)
    ]
    committed = sorted((step for step, _, done in entries if done), reverse=True)
    keep = set(committed[:keep_last]) | {written}
    newest = committed[0] if committed else None
    for step, path, done in entries:
        if step in keep or (not done and (newest is None or step > newest)):
            continue
        _remove(storage, path)
    for name in storage.names(directory):  # universal conversions of the steps removed
        match = _UNIVERSAL_DIR.match(name)
        if match and int(match.group(1)) not in keep:
            remove_tree(storage.join(directory, name))


def _dirs(storage: Storage, directory: str) -> list[tuple[int, str]]:
    found = []
    for name in storage.names(directory):
        match = _STEP_DIR.match(name)
        path = storage.join(directory, name)
        if match and storage.kind(path) == "dir":
            found.append((int(match.group(1)), path))
    return found


def _clear(storage: Storage, path: str) -> None:
    """Remove a step directory sparkdist wrote (the marker first, so a removal cut short leaves
    an uncommitted one); refuse one holding anything else."""
    kind = storage.kind(path)
    if kind == "missing":
        return
    if kind != "dir":
        raise RuntimeError(f"{path} is not a directory sparkdist wrote; move it away")
    names = storage.names(path)
    others = sorted(n for n in names if not _OWN_FILE.match(n))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise RuntimeError(
            f"{path} holds files sparkdist did not write ({shown}); move them away, then save again"
        )
    for name in sorted(names, key=lambda n: n != MARKER):
        storage.remove_file(storage.join(path, name))
    storage.remove_empty_dir(path)


def _remove(storage: Storage, path: str) -> None:
    try:
        _clear(storage, path)
    except (OSError, RuntimeError) as exc:
        logger.warning("sparkdist: checkpoint %s was not removed: %s", path, exc)


def remove_tree(path: str) -> None:
    """Remove a directory tree sparkdist made under one of its own names (a universal
    conversion: DeepSpeed names its files after the model's parameters), if it is there."""
    storage = storage_for(path)
    kind = storage.kind(path)
    if kind == "missing":
        return
    if kind != "dir":
        logger.warning("sparkdist: %s is not a directory sparkdist made; left as it is", path)
        return
    try:
        storage.remove_tree(path)
    except OSError as exc:
        logger.warning("sparkdist: %s was not removed: %s", path, exc)


# -- reading -----------------------------------------------------------------------------------


def candidates(directory: str, options: str | None = None) -> list[Candidate]:
    """Committed step directories and old single files, newest step first (a directory before
    a file of the same step); none when the directory is not there yet. ``options``: an object
    store's settings as JSON (``storage.storage_for``)."""
    storage = storage_for(directory, options)
    try:
        names = storage.names(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = storage.join(directory, name)
        if (match := _STEP_DIR.match(name)) and storage.kind(storage.join(path, MARKER)) == "file":
            found.append(Candidate(int(match.group(1)), path, legacy=False))
        elif match := _LEGACY_FILE.match(name):
            found.append(Candidate(int(match.group(1)), path, legacy=True))
    return sorted(found, key=lambda c: (c.step, not c.legacy), reverse=True)


def newest_step(directory: str, options: str | None = None) -> int | None:
    """The newest committed (or old single-file) checkpoint's step, None when there is none or
    the directory cannot be read here (the driver asks, to tell a run's progress: it may have
    no credentials of the store, whose backend raises errors of its own)."""
    try:
        found = candidates(directory, options)
    except Exception:  # noqa: BLE001 - not seen from here is all the driver needs to know
        return None
    return found[0].step if found else None


def read_marker(candidate: Candidate, options: str | None = None) -> dict[str, Any]:
    """The step directory's commit marker, checked (``Unreadable`` says what is wrong).
    ``options``: as for ``candidates`` (the driver has no ``SPARKDIST_STORAGE_OPTIONS``)."""
    storage = storage_for(candidate.path, options)
    data = storage.read_bytes(storage.join(candidate.path, MARKER))
    try:
        marker = json.loads(data)
    except ValueError:
        raise Unreadable("its commit marker is not JSON") from None
    if not isinstance(marker, dict) or marker.get("step") != candidate.step:
        raise Unreadable(f"its commit marker does not name step {candidate.step}")
    if marker.get("format") not in READABLE_FORMATS:
        raise Unreadable(
            f"its commit marker names format {marker.get('format')!r}, which this version of "
            f"sparkdist does not read (it reads {', '.join(READABLE_FORMATS)})"
        )
    return marker
