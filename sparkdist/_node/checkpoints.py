"""A run's checkpoints: one ``torch.save`` file per step in the launcher's ``checkpoint_dir``,
written atomically by global rank 0, read back newest first, weights only unless asked.

The implementation behind ``sparkdist.runtime``'s ``checkpoint_dir``, ``save_checkpoint`` and
``load_checkpoint`` (the public names, and what they promise, are documented there), so that
module stays the rank's small public surface. Telling a refused checkpoint (objects
``weights_only=True`` does not allow) from a damaged one reads the pickles without unpickling
anything.

Non-goals: sharded state (each rank's own shards: the user gathers it first or saves it under
names of their own); deciding which rank writes (the caller says).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Any

from sparkdist._core.env import CHECKPOINT_DIR_VAR
from sparkdist._core.files import replace_atomically

logger = logging.getLogger("sparkdist")

_CHECKPOINT_FILE = re.compile(r"^step-(\d{9})\.pt$")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: the step it was taken after, the saved state, and its file."""

    step: int
    state: Any
    path: str


# Users meet it as ``runtime.Checkpoint`` (the name it had before it moved here): its repr, help
# and pickles say so, and ``sparkdist.runtime`` re-exports it, so such pickles still load. Set
# after the decorator, which looks the class's module up in ``sys.modules`` while it works.
Checkpoint.__module__ = "sparkdist.runtime"


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory (``checkpoint_dir=`` of the launcher), or None."""
    return os.environ.get(CHECKPOINT_DIR_VAR) or None


def save(state: Any, step: int, *, writer: bool) -> str:
    """``runtime.save_checkpoint``: every rank calls it, only the ``writer`` writes; the ranks
    meet before (none runs ahead of a checkpoint being written) and after (none reads it early)
    when a process group is up."""
    import torch

    path = os.path.join(_require_checkpoint_dir(), f"step-{int(step):09d}.pt")
    _barrier()
    if writer:
        saved = {"step": int(step), "state": state}
        replace_atomically(path, lambda f: torch.save(saved, f))
    _barrier()
    return path


def load(map_location: Any = "cpu", *, weights_only: bool = True) -> Checkpoint | None:
    """``runtime.load_checkpoint``: the newest readable checkpoint, or None when there is none;
    an unreadable one is skipped with a warning, a refused one raises."""
    import torch

    directory = _require_checkpoint_dir()
    steps = sorted(
        (
            (int(m.group(1)), name)
            for name in os.listdir(directory)
            if (m := _CHECKPOINT_FILE.match(name))
        ),
        reverse=True,
    )
    unreadable: list[str] = []
    for _, name in steps:
        path = os.path.join(directory, name)
        try:
            saved = torch.load(path, map_location=map_location, weights_only=weights_only)
        except FileNotFoundError:
            continue  # removed since it was listed
        except Exception as exc:  # noqa: BLE001 - any failure to read means: try the one before
            refused = _refused_globals(path) if weights_only else []
            if refused:
                raise pickle.UnpicklingError(_refusal(path, refused)) from exc
            reason = _first_line(exc)
        else:
            if isinstance(saved, dict) and isinstance(saved.get("step"), int) and "state" in saved:
                return Checkpoint(step=int(saved["step"]), state=saved["state"], path=path)
            reason = 'not written by save_checkpoint (no "step" and "state")'
        logger.warning(
            "sparkdist: checkpoint %s cannot be read (%s); trying the checkpoint before it",
            path,
            reason,
        )
        unreadable.append(f"{path}: {reason}")
    if unreadable:
        raise RuntimeError(
            f"no checkpoint in {directory} can be read: " + "; ".join(unreadable) + ". Move "
            "these files away to start from scratch, or restore them from a copy"
        )
    return None


def _refusal(path: str, refused: list[str]) -> str:
    shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
    return (
        f"checkpoint {path} holds objects that load_checkpoint does not unpickle by default "
        f"({shown}): unpickling them can run any code, and anyone who can write "
        f"{os.path.dirname(path)} could have put them there. If you trust this file and "
        "everyone who can write that directory, call load_checkpoint(weights_only=False); or "
        "allow just these classes with torch.serialization.add_safe_globals([...]) before "
        "loading; or save only tensors, numbers, strings and plain containers (state_dict())"
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _refused_globals(path: str) -> list[str]:
    """The importable names (``module.name``) that the checkpoint's complete pickles use and
    ``torch.load(weights_only=True)`` does not allow; empty when there are none or when no
    pickle in the file is complete (a damaged file, not a refused one).

    Read without unpickling anything (``pickletools``), so a file that torch refuses can be
    told apart from one that is cut short.
    """
    try:
        if zipfile.is_zipfile(path):  # torch.save's format: the pickle is <archive>/data.pkl
            with zipfile.ZipFile(path) as archive:
                names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
                data = archive.read(names[0]) if names else b""
        else:  # torch's legacy format or a bare pickle: pickles one after another
            with open(path, "rb") as f:
                data = f.read()
    except (OSError, zipfile.BadZipFile, ValueError):
        return []
    return sorted(_globals_in_pickles(data) - _allowed_globals())


def _globals_in_pickles(data: bytes) -> set[str]:
    """Globals of every complete pickle at the start of ``data`` (one after another, as in
    torch's legacy format), up to the first that does not parse."""
    import pickletools

    found: set[str] = set()
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        names: set[str] = set()
        strings: list[str] = []  # string pushes, for STACK_GLOBAL's module and name
        memo: dict[int, str | None] = {}
        pushed: str | None = None
        try:
            for op, arg, _ in pickletools.genops(stream):
                if op.name in ("GLOBAL", "INST"):
                    names.add(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    names.add(".".join(strings[-2:]) if len(strings) >= 2 else "<unknown>")
                elif op.name == "MEMOIZE":
                    memo[len(memo)] = pushed
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int):
                    memo[arg] = pushed
                elif op.name in ("GET", "BINGET", "LONG_BINGET") and isinstance(arg, int):
                    value = memo.get(arg)
                    if value is not None:
                        strings.append(value)
                pushed = arg if isinstance(arg, str) and op.name.endswith(_STRING_OPS) else None
                if pushed is not None:
                    strings.append(pushed)
        except Exception:  # noqa: BLE001 - cut short or not a pickle: its names do not count
            break
        found |= names
    return found


_STRING_OPS = ("STRING", "UNICODE", "UNICODE8")


def _allowed_globals() -> set[str]:
    """What ``weights_only=True`` accepts: torch's own list plus ``add_safe_globals``."""
    try:
        from torch import _weights_only_unpickler as unpickler

        allowed = set(unpickler._get_allowed_globals())
        allowed |= set(unpickler._get_user_allowed_globals())  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - a torch without these: name every global
        return set()
    return allowed


def _require_checkpoint_dir() -> str:
    directory = checkpoint_dir()
    if directory is None:
        raise RuntimeError(
            "no checkpoint directory: pass checkpoint_dir=... to the launcher (shared storage "
            "every rank can reach, on a cluster)"
        )
    return directory


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
