"""What crosses process boundaries: the Job going out, the Outcome coming back.

Both are frozen dataclasses pickled with cloudpickle. When a job does not pickle, the error names
the object that would not (a lock, a SparkSession captured from the notebook...) and where it was
found, instead of cloudpickle's bare message.

Non-goals: transport. Files, Spark rows and pipes are the callers' business.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import importlib
import io
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from sparkdist._core.errors import ConfigError, RankFailure
from sparkdist._shipping.origin import is_local_module


class TargetKind(str, enum.Enum):
    """What a rank runs."""

    FUNCTION = "function"
    SCRIPT = "script"
    MODULE = "module"


@dataclass(frozen=True)
class Job:
    """The work every rank runs.

    Attributes:
        kind: function, script path or module name.
        fn: the function (kind FUNCTION).
        args: positional arguments of the function.
        kwargs: keyword arguments of the function.
        target: the script path or module name (kinds SCRIPT and MODULE).
        argv: command-line arguments of the script or module.
    """

    kind: TargetKind
    fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: str = ""
    argv: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """A short human name for logs and errors."""
        if self.kind is TargetKind.FUNCTION:
            return getattr(self.fn, "__qualname__", None) or repr(self.fn)
        return self.target


@dataclass(frozen=True)
class Outcome:
    """How one rank ended, as its agent saw it.

    Attributes:
        rank: global rank.
        host: host it ran on.
        exit_code: process exit code (negative: killed by that signal).
        wall_time_s: seconds from spawn to exit.
        value_bytes: the return value pickled by the worker (None on failure or abort): the
            bytes, or (on the node, and in local mode all the way to the driver) the
            ``ValueFile`` it was written to, which pickles as those bytes. Unpickle it with
            ``loads``.
        failure: why it failed, when it failed on its own.
        aborted: True when sparkdist killed it because the run was ending.
        ended_at: wall-clock time (time.time()) its agent saw it exit; orders failures when
            the driver did not hear of them as they happened.
        output: (stream, line) pairs kept by a node that could not stream them to the driver
            (detached from its control channel); empty otherwise.
    """

    rank: int
    host: str
    exit_code: int | None
    wall_time_s: float
    value_bytes: bytes | ValueFile | None = None
    failure: RankFailure | None = None
    aborted: bool = False
    ended_at: float = 0.0
    output: tuple[tuple[str, str], ...] = ()


class ValueFile:
    """A rank's pickled return value, still in the file the rank wrote.

    ``loads`` unpickles it straight from the file: a large value is read once, into the
    object it becomes, never held as bytes beside it (the driver's peak stays about one copy
    of the value, not two). The file is held open, so it can still be read once its run
    directory is gone. Pickling a ValueFile (an Outcome on its way out of a Spark task)
    pickles the bytes, so the other side gets plain ``bytes``.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: io.BufferedReader | None = open(path, "rb")  # held open: see above
        self._lock = threading.Lock()

    def load(self) -> Any:
        """The value, unpickled from the file; the file is closed afterwards."""
        with self._lock:
            file = self._opened()
            try:
                file.seek(0)
                return cloudpickle.load(file)
            finally:
                self._close()

    def read_bytes(self) -> bytes:
        """The pickled value, as bytes (the file stays open)."""
        with self._lock:
            file = self._opened()
            file.seek(0)
            return file.read()

    def close(self) -> None:
        """Let go of the file (also when the value is never read: a failed run)."""
        with self._lock:
            self._close()

    def _opened(self) -> io.BufferedReader:
        if self._file is None:
            raise ValueError(f"the value file {self.path} was already read and closed")
        return self._file

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return bytes, (self.read_bytes(),)

    def __del__(self) -> None:
        file = getattr(self, "_file", None)
        if file is not None:
            file.close()

    def __repr__(self) -> str:
        return f"ValueFile({self.path!r})"


# Pickling functions by value is process-global state in cloudpickle; runs started from two
# threads must not unregister each other's modules mid-dump.
_BY_VALUE_LOCK = threading.Lock()


def dumps_job(job: Job, on_object: Callable[[Any], None] | None = None) -> bytes:
    """Pickle a job, shipping the function's own (non-installed) module by value.

    A function defined in a notebook, a test module or a script next to the driver cannot be
    imported by name on an executor, so its module is pickled by value; installed packages are
    always pickled by reference. ``on_object``, when given, sees every object the pickler
    reduces (``_shipping.ModuleRecorder`` notes the modules the job needs by name).

    Raises:
        ConfigError: naming the object inside the job that cannot be pickled.
    """
    with pickling_like_a_job(job):
        try:
            buffer = io.BytesIO()
            if on_object is None:
                _FilenameKeepingPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(job)
            else:
                _RecordingPickler(buffer, on_object, protocol=pickle.HIGHEST_PROTOCOL).dump(job)
            return buffer.getvalue()
        except Exception as exc:
            where, culprit = _find_unpicklable(job)
            raise ConfigError(_unpicklable_message(job, where, culprit, exc)) from exc


@contextlib.contextmanager
def pickling_like_a_job(job: Job) -> Iterator[None]:
    """Within this block, cloudpickle treats the job's function module as ``dumps_job`` does:
    by value (unless it is an installed package). Also used to measure captured objects."""
    module = _module_to_ship(job.fn) if job.fn is not None else None
    with _BY_VALUE_LOCK:
        registered = False
        if module is not None:
            try:
                cloudpickle.register_pickle_by_value(module)
                registered = True
            except ValueError:
                pass
        try:
            yield
        finally:
            if registered and module is not None:
                cloudpickle.unregister_pickle_by_value(module)


def _code_reduce_keeping_filename(code: types.CodeType) -> Any:
    """cloudpickle's code reducer, but the file name survives, so a rank's traceback shows
    where the user's function lives (and its source lines where that file exists)."""
    constructor, args = _CLOUDPICKLE_CODE_REDUCE(code)
    args = tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)
    return constructor, args


_CLOUDPICKLE_CODE_REDUCE = cloudpickle.Pickler.dispatch_table.get(types.CodeType)


class _FilenameKeepingPickler(cloudpickle.Pickler):  # type: ignore[misc]
    if _CLOUDPICKLE_CODE_REDUCE is not None:
        dispatch_table = collections.ChainMap(
            {types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        torch = sys.modules.get("torch")
        classes = getattr(torch, "classes", None) if torch is not None else None
        if classes is not None and type(classes) is not types.ModuleType:
            # torch.classes is a pseudo-module that does not pickle; cloudpickle ships it as a
            # "submodule" of torch whenever a by-value function reads any attribute called
            # `classes`. Refer to it by name instead: the rank imports torch anyway. (Set
            # before the C pickler's init, which reads the table once.)
            self.dispatch_table = collections.ChainMap(
                {type(classes): _torch_classes_reduce}, type(self).dispatch_table
            )
        super().__init__(*args, **kwargs)


class _RecordingPickler(_FilenameKeepingPickler):
    """Also hands every object it reduces to a hook, before cloudpickle decides how."""

    def __init__(self, file: Any, on_object: Callable[[Any], None], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._on_object = on_object

    def reducer_override(self, obj: Any) -> Any:
        self._on_object(obj)
        return super().reducer_override(obj)


def _torch_classes_reduce(_: Any) -> tuple[Any, tuple[str]]:
    return importlib.import_module, ("torch.classes",)


def release_values(outcomes: Iterable[Outcome]) -> None:
    """Let go of the value files of ``outcomes`` whose values will not be read (a failed run):
    an error's traceback would otherwise keep them, and their disk space, for its lifetime."""
    for outcome in outcomes:
        if isinstance(outcome.value_bytes, ValueFile):
            outcome.value_bytes.close()


def loads(data: bytes | ValueFile) -> Any:
    """Unpickle bytes (or a ``ValueFile``) produced by this package (never bytes read from a
    socket)."""
    if isinstance(data, ValueFile):
        return data.load()
    return cloudpickle.loads(data)


def _module_to_ship(fn: Callable[..., Any]) -> types.ModuleType | None:
    name = getattr(fn, "__module__", None)
    if not name or name == "__main__" or name.split(".")[0] == "sparkdist":
        return None
    return sys.modules[name] if is_local_module(name) else None


def _unpicklable_message(job: Job, where: str, culprit: Any, exc: Exception) -> str:
    if culprit is None:
        return f"could not pickle {job.name!r} to send it to the ranks: {exc}"
    kind = f"{type(culprit).__module__}.{type(culprit).__qualname__}"
    return (
        f"could not pickle {job.name!r} to send it to the ranks: {where} is a {kind}, which "
        f"cannot be pickled ({type(exc).__name__}: {exc}). Create it inside the function (or "
        "pass plain data it is built from as an argument) instead of capturing it from the "
        "driver"
    )


def _find_unpicklable(job: Job) -> tuple[str, Any]:
    """Depth-first search for the innermost object that does not pickle."""
    roots: list[tuple[str, Any]] = []
    if job.fn is not None:
        roots.append((job.name, job.fn))
    roots += [(f"argument {i}", a) for i, a in enumerate(job.args)]
    roots += [(f"keyword argument {k!r}", v) for k, v in job.kwargs.items()]
    for where, obj in roots:
        found = _search(where, obj, depth=0, seen=set())
        if found is not None:
            return found
    return "", None


def _search(where: str, obj: Any, depth: int, seen: set[int]) -> tuple[str, Any] | None:
    if id(obj) in seen or depth > 6:
        return None
    seen.add(id(obj))
    if _pickles(obj):
        return None
    for child_where, child in _children(where, obj):
        found = _search(child_where, child, depth + 1, seen)
        if found is not None:
            return found
    return where, obj


def _children(where: str, obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            try:
                yield f"variable {name!r} captured by {obj.__qualname__}", cell.cell_contents
            except ValueError:
                continue
        for name in _global_names(code):
            if name in obj.__globals__:
                yield f"global {name!r} used by {obj.__qualname__}", obj.__globals__[name]
        for i, default in enumerate(obj.__defaults__ or ()):
            yield f"default argument {i} of {obj.__qualname__}", default
    elif isinstance(obj, types.MethodType):
        yield f"{where}.__self__", obj.__self__
        yield f"{where}.__func__", obj.__func__
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{where}[{key!r}]", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, item in enumerate(obj):
            yield f"{where}[{i}]", item
    elif is_local_module(type(obj).__module__) and hasattr(obj, "__dict__"):
        # Look inside the user's own objects only: "argument 0.lock" helps, while a walk
        # through a SparkSession's internals would end at some lock deep inside py4j.
        for key, value in vars(obj).items():
            yield f"{where}.{key}", value


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _pickles(obj: Any) -> bool:
    try:
        cloudpickle.dump(obj, io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return False
    return True
