"""Large jobs: name what made the pickled job big (shipping one as a file: ``_backends.job_file``).

A function that captured a dataset from the notebook (a closure variable, a global it uses, an
argument) is pickled with it, and every run copies it from the driver to every executor. Past
``job_size_warn_mb`` the launch logs one warning naming the largest captured objects and their
pickled sizes, and Spark mode ships the job through ``SparkContext.addFile`` (each executor
fetches it once, then ``SparkFiles.get`` finds it) instead of inside the Spark task. Past
``job_size_limit_mb`` the launch fails with ``ConfigError`` naming the same objects, instead of
an opaque serialization error deep inside Spark.

Non-goals: compressing or deduplicating captures; the fix is to load the data inside the
function (or to pass a DataFrame with ``spark_dataframe=``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import pickle
from typing import Any

from sparkdist._core.errors import ConfigError
from sparkdist._wire import payload as _payload
from sparkdist._wire.payload import Job

logger = logging.getLogger("sparkdist")

#: How many captured objects a message names.
NAMED = 5
#: Parts of one object looked at when naming what makes it big.
_CHILDREN = 200
_MB = 2**20


def check_job_size(
    job: Job, size: int, warn_mb: float, limit_mb: float, *, local_mode: bool = False
) -> bool:
    """Warn about (True) or refuse a job whose pickle is ``size`` bytes; False when small.

    Raises:
        ConfigError: past ``limit_mb``, naming the largest captured objects.
    """
    if size <= warn_mb * _MB:
        return False
    named = _describe(largest_captures(job))
    if size > limit_mb * _MB:
        raise ConfigError(
            f"the pickled job {job.name!r} is {_size(size)}, more than job_size_limit_mb="
            f"{limit_mb:g}, so it is not sent to the ranks. Largest captured objects: {named}. "
            "Load the data inside the function (from storage every executor can reach), or "
            "pass a Spark DataFrame with spark_dataframe=; or raise job_size_limit_mb"
        )
    logger.warning(
        "sparkdist: the pickled job %r is %s (job_size_warn_mb=%g); %s. Largest captured "
        "objects: %s. Load the data inside the function instead (from storage every "
        "executor can reach), or pass a Spark DataFrame with spark_dataframe=",
        job.name,
        _size(size),
        warn_mb,
        "every rank unpickles its own copy"
        if local_mode
        else "every run copies it to "
        "every executor (as a file, SparkContext.addFile, not inside the Spark task)",
        named,
    )
    return True


def largest_captures(job: Job) -> list[tuple[str, Any, int]]:
    """(where, object, pickled size) of the biggest objects the job carries, largest first.

    Roots are the function's closure variables, the globals it uses, its defaults, and the
    arguments; a root mostly made of one part (a dict holding one array) is named by that part.
    """
    roots: list[tuple[str, Any]] = []
    fn = job.fn
    while isinstance(fn, functools.partial):  # what a partial binds is captured too
        roots += [(f"argument {i} bound by functools.partial", a) for i, a in enumerate(fn.args)]
        roots += [
            (f"keyword argument {k!r} bound by functools.partial", v)
            for k, v in fn.keywords.items()
        ]
        fn = fn.func
    if fn is not None:
        roots += list(_payload._children(job.name, fn))
    roots += [(f"argument {i}", a) for i, a in enumerate(job.args)]
    roots += [(f"keyword argument {k!r}", v) for k, v in job.kwargs.items()]
    with _payload.pickling_like_a_job(job):
        sized = [(where, obj, _pickled_size(obj)) for where, obj in roots]
        sized.sort(key=lambda item: -item[2])
        return [_narrow(*item) for item in sized[:NAMED]]


def _narrow(where: str, obj: Any, size: int, depth: int = 0) -> tuple[str, Any, int]:
    """Name the part that makes up most of ``obj``, where one does (up to 4 levels down)."""
    if depth >= 4 or size < _MB:
        return where, obj, size
    best: tuple[str, Any, int] | None = None
    # A long sequence is the capture itself: naming its biggest element would mislead.
    for child_where, child in itertools.islice(_payload._children(where, obj), _CHILDREN):
        child_size = _pickled_size(child)
        if best is None or child_size > best[2]:
            best = (child_where, child, child_size)
    if best is not None and best[2] >= size / 2 and best[1] is not obj:
        return _narrow(*best, depth=depth + 1)
    return where, obj, size


class _Counter:
    """A file that only counts what is written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n


def _pickled_size(obj: Any) -> int:
    counter = _Counter()
    try:
        _payload._FilenameKeepingPickler(counter, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:  # noqa: BLE001 - dumps_job pickled the whole job; this part is tiny
        return 0
    return counter.size


def _describe(captures: list[tuple[str, Any, int]]) -> str:
    shown = [c for c in captures if c[2] >= _MB] or captures[:1]
    if not shown:
        return "none (the size is in the function's own code)"
    return "; ".join(f"{where} ({_type_name(obj)}, {_size(size)})" for where, obj, size in shown)


def _type_name(obj: Any) -> str:
    kind = type(obj)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _size(size: int) -> str:
    if size >= 2**30:
        return f"{size / 2**30:.2f} GB"
    return f"{size / _MB:.1f} MB"
