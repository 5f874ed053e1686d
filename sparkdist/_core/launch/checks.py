"""Checks of launch option values, each refusing with the parameter, the value and what is
accepted (``ConfigTypeError`` for a value of the wrong type, ``ConfigError`` otherwise).

Pure apart from reading a DeepSpeed config file and the driver's CPU count.

Non-goals: the options themselves (``config``); the rank's environment (``env``).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from sparkdist._core import object_store
from sparkdist._core.errors import ConfigError, ConfigTypeError

#: Local CPU ranks per core of the driver past which a launch is refused unless
#: ``allow_oversubscribe=True``: far past it, ranks mostly wait for a core and a typo
#: (``num_processes=800``) would start hundreds of interpreters.
CPU_OVERSUBSCRIBE_FACTOR = 4


def check_launchable(fn: Any) -> None:
    """Refuse a training callable that cannot run as a rank's function.

    A generator function or an ``async def`` function (or an object whose ``__call__`` is one)
    would only hand each rank a generator or a coroutine that nothing runs.

    Raises:
        ConfigTypeError: ``fn`` is one of those.
    """
    target = fn
    if not (inspect.isfunction(fn) or inspect.ismethod(fn) or _is_partial(fn)):
        target = type(fn).__call__  # an object whose __call__ is the function
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target):
        raise ConfigTypeError(
            f"{name} is an async def function: each rank would only create a coroutine and "
            "never run it; launch a plain def that runs it, e.g. def train(): "
            "return asyncio.run(atrain())"
        )
    if inspect.isgeneratorfunction(target):
        raise ConfigTypeError(
            f"{name} is a generator function (it yields): each rank would return an unstarted "
            "generator; make it return its values, e.g. return list(...)"
        )


def _is_partial(fn: Any) -> bool:
    return isinstance(fn, functools.partial)


def load_deepspeed_config(
    value: Mapping[str, Any] | str | os.PathLike[str] | None,
) -> dict[str, Any] | None:
    """Read and check a DeepSpeed config given as a dict or the path of a JSON file.

    Raises:
        ConfigTypeError: ``value`` is neither a mapping nor a path.
        ConfigError: the file is missing or unreadable, is not JSON, or is not a JSON object;
            or the dict cannot be written as JSON.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        try:
            return dict(json.loads(json.dumps(value)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"deepspeed_config must hold only JSON values (numbers, strings, lists, dicts): "
                f"{exc}"
            ) from exc
    path = check_path("deepspeed_config", value, "a dict or the path of a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(
            f"deepspeed_config: cannot read the DeepSpeed config {path!r}: {exc.strerror}; pass "
            "an existing JSON file or a dict"
        ) from exc
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            f"deepspeed_config: the DeepSpeed config {path!r} is not valid JSON: {exc}"
        ) from exc
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"deepspeed_config: the DeepSpeed config {path!r} must be a JSON object, not "
            f"{type(parsed).__name__}"
        )
    return parsed


def shown(value: Any) -> str:
    """A value as a message shows it: its type, then its repr."""
    return f"{type(value).__name__} {value!r}"


def check_path(name: str, value: Any, accepted: str = "a path") -> str:
    """``value`` as a text path: a str or os.PathLike is required (``accepted`` says what)."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise ConfigTypeError(f"{name} must be {accepted} (str or os.PathLike), got {shown(value)}")
    path = os.fspath(value)
    if isinstance(path, bytes) or not path:
        raise ConfigTypeError(f"{name} must be a non-empty text path, got {value!r}")
    return path


#: Where Databricks mounts DBFS on its driver and workers (``dbfs:/x`` is ``/dbfs/x`` there).
DBFS_MOUNT = "/dbfs"


def checkpoint_directory(value: Any) -> str:
    """``checkpoint_dir`` as the ranks use it: an absolute directory, or an object-store URL.

    A path (or a ``file://`` URL) becomes absolute; ``dbfs:/x`` is Databricks' ``/dbfs/x``
    where that mount exists. Any other URL stays a URL (sparkdist never turns one into a local
    folder: ``os.path.abspath("s3://b/run")`` is a folder named "s3:" on a disk that goes away
    with the cluster), read and written through fsspec; its backend must be installed here.

    Raises:
        ConfigTypeError: not a text path.
        ConfigError: a scheme fsspec does not know or cannot use, a backend not installed, or
            ``dbfs:/`` where DBFS is not mounted.
    """
    path = check_path("checkpoint_dir", value, "a directory path or URL")
    scheme = object_store.scheme_of(path)
    if scheme is None:
        return os.path.abspath(path)
    if scheme == "file":
        parsed = urllib.parse.urlparse(path)
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(
                f"checkpoint_dir={path!r} names the host {parsed.netloc!r}; a file:// URL must "
                "name a path on every host (file:///shared/ckpt)"
            )
        return os.path.abspath(urllib.parse.unquote(parsed.path))
    if scheme == "dbfs":
        mounted = os.path.join(DBFS_MOUNT, path[len("dbfs:") :].lstrip("/"))
        if os.path.isdir(DBFS_MOUNT):
            return mounted
        raise ConfigError(
            f"checkpoint_dir={path!r} is a Databricks DBFS URL, but {DBFS_MOUNT} (Databricks' "
            "mount of DBFS) is not here; on Databricks pass a /Volumes/... path, elsewhere a "
            "directory every host mounts"
        )
    object_store.check_backend(path, scheme)
    return scheme + path[len(scheme) :].rstrip("/")  # "S3://b/k" as fsspec knows it: "s3://b/k"


def requirement_list(value: Any) -> tuple[Any, ...]:
    """``requirements=`` as a tuple of entries (each checked by ``versions.parse_requirements``)."""
    if isinstance(value, str):
        raise ConfigTypeError(
            f"requirements must be a list of package names, got the string {value!r}; write "
            f"requirements=[{value!r}]"
        )
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise ConfigTypeError(
            f"requirements must be a list of package names, e.g. ['numpy', 'pandas==2.2.0'], "
            f"got {shown(value)}"
        )
    return tuple(value)


def check_bool(name: str, value: Any, *, optional: bool) -> None:
    """Refuse anything but True/False (and None when ``optional``); 1 and "yes" included."""
    if isinstance(value, bool) or (optional and value is None):
        return
    accepted = "True, False or None" if optional else "True or False"
    raise ConfigTypeError(f"{name} must be {accepted}, got {shown(value)}")


def check_positive_int(name: str, value: Any) -> None:
    """Refuse anything but an int >= 1 (True included)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be a positive integer, got {shown(value)}")
    if value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def check_positive_number(name: str, value: Any, unit: str) -> None:
    """Refuse anything but a finite int or float > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a positive number of {unit}, got {shown(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number of {unit}, got {value!r}")


def check_positive_seconds(name: str, value: Any) -> None:
    """Refuse anything but a finite number of seconds > 0."""
    check_positive_number(name, value, "seconds")


def check_job_sizes(warn_mb: Any, limit_mb: Any) -> None:
    """Both sizes positive, and the warning at or below the limit."""
    for name, value in (("job_size_warn_mb", warn_mb), ("job_size_limit_mb", limit_mb)):
        check_positive_number(name, value, "megabytes")
    if warn_mb > limit_mb:
        raise ConfigError(
            f"job_size_warn_mb={warn_mb:g} is above job_size_limit_mb={limit_mb:g}; the warning "
            "must come before the limit"
        )


def check_local_cpu_ranks(
    num_processes: int, *, local_mode: bool, use_gpu: bool | None, allow_oversubscribe: bool
) -> None:
    """Refuse more local CPU ranks than the driver can sensibly run, unless asked for.

    GPU ranks are bounded by the driver's GPUs instead (``placement.place_local``, before any
    rank starts): two ranks cannot share a GPU under NCCL, so no option lifts that bound.
    """
    if not local_mode or use_gpu is True or allow_oversubscribe:
        return
    cores = os.cpu_count() or 1
    most = CPU_OVERSUBSCRIBE_FACTOR * cores
    if num_processes > most:
        raise ConfigError(
            f"num_processes={num_processes} local CPU ranks is more than "
            f"{CPU_OVERSUBSCRIBE_FACTOR} per core of this driver ({cores} core(s), so at most "
            f"{most}); pass num_processes<={most}, local_mode=False to run on the cluster, or "
            "allow_oversubscribe=True (sparkdist run --allow-oversubscribe) if you mean it"
        )
