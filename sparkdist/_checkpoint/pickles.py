"""What ``runtime.load_checkpoint`` unpickles, and what it refuses, named without unpickling.

Three kinds of pickle reach a loading rank: an old single-file checkpoint (``torch.save``),
the non-tensor entries of a ``torch.distributed.checkpoint`` (DCP) directory (each one a
``torch.save`` of its value), and the directory's ``.metadata`` (a plain pickle of DCP's own
dataclasses, which DCP would read with ``pickle.load``). With ``weights_only=True`` the first two
go through ``torch.load(weights_only=True)`` and the metadata through an unpickler that builds
only DCP's metadata classes; whatever they refuse is named by reading the pickle's opcodes
(``pickletools``), so a refused checkpoint is told apart from a damaged one and nothing in it
runs.

Non-goals: which checkpoint to load (``checkpoints``), reading DCP's files (``checkpoint_io``).
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from typing import IO, Any


class Refused(Exception):
    """A pickle that ``weights_only=True`` does not load: ``names`` are the globals it would
    call (``module.name``). Picklable, so DCP can carry it from the rank that met it."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(names)
        self.names = names


def refusal(path: str, refused: list[str]) -> str:
    """The message of a refused checkpoint: what it holds, why, and the ways to load it."""
    shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
    return (
        f"checkpoint {path} holds objects that load_checkpoint does not unpickle by default "
        f"({shown}): unpickling them can run any code, and anyone who can write "
        f"{os.path.dirname(path)} could have put them there. If you trust this file and "
        "everyone who can write that directory, call load_checkpoint(weights_only=False); or "
        "allow just these classes with torch.serialization.add_safe_globals([...]) before "
        "loading; or save only tensors, numbers, strings and plain containers (state_dict())"
    )


def load_torch_file(source: str | IO[bytes], map_location: Any, *, weights_only: bool) -> Any:
    """``torch.load`` of a file or stream; a refusal of ``weights_only=True`` raises ``Refused``
    naming the globals, any other failure raises as ``torch.load`` does."""
    import torch

    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        refused = _refused_globals(source) if weights_only else []
        if refused:
            raise Refused(refused) from exc
        raise


def load_dcp_metadata(data: bytes, *, weights_only: bool) -> Any:
    """A DCP directory's ``.metadata`` (its bytes): with ``weights_only``, only DCP's metadata
    classes (and what ``add_safe_globals`` allows) are built; anything else raises ``Refused``
    before a single object is made."""
    if not weights_only:
        return pickle.loads(data)
    allowed = _metadata_globals()
    refused = sorted(_globals_in_pickles(data) - set(allowed))
    if refused:
        raise Refused(refused)
    return _RestrictedUnpickler(io.BytesIO(data), allowed).load()


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that finds only the globals it was given (the pickle docs' "restricting
    globals"): ``.metadata`` cannot call anything else."""

    def __init__(self, stream: IO[bytes], allowed: dict[str, Any]) -> None:
        super().__init__(stream)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get(f"{module}.{name}")
        if found is None:
            raise Refused([f"{module}.{name}"])
        return found


def _metadata_globals() -> dict[str, Any]:
    """The globals a DCP ``.metadata`` pickle names: DCP's metadata dataclasses, paths, torch's
    sizes, dtypes and layouts; plus what the user allowed with ``add_safe_globals``."""
    import pathlib

    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    found: dict[str, Any] = {}
    classes: list[Any] = [
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        torch.Size,
        torch.serialization._get_layout,
    ]
    for cls in classes:
        found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    found["pathlib.PosixPath"] = pathlib.PosixPath  # the name older Pythons pickle it under
    try:
        from torch import _weights_only_unpickler as unpickler

        for name, value in unpickler._get_allowed_globals().items():
            if isinstance(value, torch.dtype):
                found[name] = value
        found.update(unpickler._get_user_allowed_globals())  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - a torch without these: DCP's classes only
        pass
    return found


def check_file(path: str) -> None:
    """Raise ``Refused`` unless the ``torch.save`` file at ``path`` names only globals that
    ``weights_only=True`` allows: for a file that another reader unpickles in full (DeepSpeed
    reads its own files with ``weights_only=False``). Strict where ``_refused_globals`` only
    names: a file that is not torch's zip format, a pickle that does not parse to its end, or
    a ``STACK_GLOBAL`` whose names are not the strings pushed just before it, is refused too.
    Reads the archive's pickle only, not its tensors."""
    import pickletools

    try:
        with zipfile.ZipFile(path) as archive:  # raises BadZipFile for torch's legacy format
            [name] = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            data = archive.read(name)
    except (zipfile.BadZipFile, ValueError) as exc:
        raise Refused([f"<not torch's zip format: {exc}>"]) from None
    names: set[str] = set()
    memo: dict[int, str | None] = {}
    recent: list[str | None] = []  # what the ops just before pushed (None: not a string)
    try:
        for op, arg, _ in pickletools.genops(data):
            kind = op.name
            if kind in ("GLOBAL", "INST"):
                names.add(str(arg).replace(" ", "."))
            elif kind == "STACK_GLOBAL":
                if len(recent) < 2 or recent[-1] is None or recent[-2] is None:
                    raise Refused(["<STACK_GLOBAL of names computed in the pickle>"])
                names.add(f"{recent[-2]}.{recent[-1]}")
            if kind.endswith(_STRING_OPS):
                recent.append(str(arg))
            elif kind in ("GET", "BINGET", "LONG_BINGET") and isinstance(arg, int):
                recent.append(memo.get(arg))
            elif kind == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif kind in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int):
                memo[arg] = recent[-1] if recent else None
            else:
                recent = []  # any other op: the stack's top is no longer known
    except Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - a pickle that does not parse is not checked
        raise Refused([f"<a pickle that does not parse: {exc}>"]) from None
    refused = sorted(names - _allowed_globals())
    if refused:
        raise Refused(refused)


def check_tree(path: str) -> None:
    """``check_file`` of every ``.pt`` file under ``path``, DeepSpeed's data classes allowed;
    ``pickle.UnpicklingError`` (``refusal``'s message) for the first it refuses."""
    import torch

    with torch.serialization.safe_globals(deepspeed_data_classes()):
        for root, _, names in sorted(os.walk(path)):
            for name in sorted(n for n in names if n.endswith(".pt")):
                file = os.path.join(root, name)
                try:
                    check_file(file)
                except Refused as exc:
                    raise pickle.UnpicklingError(refusal(file, exc.names)) from None


def deepspeed_data_classes() -> list[Any]:
    """The classes DeepSpeed's own checkpoint files hold besides tensors and containers (its
    loss scaler, ZeRO stage, fragment addresses): data, allowed beside torch's list."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class WeightsOnlyReads:
    """DeepSpeed's torch checkpoint engine with its reads through ``torch.load(weights_only=
    True)`` (its own use ``weights_only=False``); anything else it does, it does as it was."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        try:
            return load_torch_file(path, map_location, weights_only=True)
        except Refused as exc:
            raise pickle.UnpicklingError(refusal(path, exc.names)) from None


def _refused_globals(source: str | IO[bytes]) -> list[str]:
    """The importable names (``module.name``) that the complete pickles of a ``torch.save``
    file or stream use and ``torch.load(weights_only=True)`` does not allow; empty when there
    are none or when no pickle in it is complete (a damaged file, not a refused one)."""
    try:
        if isinstance(source, str):
            with open(source, "rb") as f:
                data = f.read()
        else:
            source.seek(0)
            data = source.read()
        if zipfile.is_zipfile(io.BytesIO(data)):  # torch.save's format: <archive>/data.pkl
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
                data = archive.read(names[0]) if names else b""
        # else torch's legacy format or a bare pickle: pickles one after another
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
