"""Local code travels with the job: modules the function needs that are not installed packages.

A training function often uses a module that exists only next to the notebook or the driver
script (a ``helpers.py``, a project directory on the driver's ``sys.path``). The function itself
is pickled by value (``_payload``), but what it refers to by name, and what its code imports
when it runs, must be importable on every executor. This module finds those modules and packs
their sources into a zip that travels inside the ``AgentSpec``; each agent unpacks it into its
run directory and puts that directory first on its ranks' ``PYTHONPATH``, so the driver's copy
wins exactly as it did on the driver, before the job is unpickled.

What is found, while the job is pickled (``ModuleRecorder`` is the pickler's hook):

- modules the pickle refers to by name: a module object, or a function or class pickled by
  reference (``from helpers import clean`` in the notebook, a dataclass instance argument...);
- modules imported by the code pickled by value (``import helpers`` inside the function, or in
  a nested function), scanned from the bytecode's ``IMPORT_NAME`` instructions;
- then, transitively, what the shipped files import (parsed with ``ast``, never executed).

A name is shipped when it resolves (``importlib.util.find_spec``, which imports nothing for a
top-level name) to ``.py`` sources outside the interpreter's installed locations, and no
installed distribution provides it. A single module ships as its file; a package ships as every
``.py`` file under its directory. Installed packages, the standard library, compiled
extensions and sparkdist itself never ship.

Non-goals: data files next to the code (only ``.py`` sources travel), modules imported by a
computed name (``importlib.import_module(name)``), installing packages (see ``_versions`` for
checking them, and the README for shipping a whole environment with ``spark.archives``).
"""

from __future__ import annotations

import ast
import dis
import importlib.machinery
import importlib.metadata
import importlib.util
import io
import logging
import os
import sys
import types
import zipfile
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import cloudpickle

from sparkdist._core.errors import ConfigError
from sparkdist._shipping.origin import (
    installed_top_level_names,
    is_installed_path,
)

logger = logging.getLogger("sparkdist")

#: The most source (uncompressed) that ships with one job.
CODE_LIMIT_BYTES = 64 * 2**20
#: Directories under a shipped package that are never walked.
_SKIPPED_DIRS = {"__pycache__", "site-packages", "node_modules"}


class ModuleRecorder:
    """The job pickler's hook: notes every module the pickled job will need by name.

    Called with each object the pickler reduces (memoised objects and plain data are not
    passed), before cloudpickle decides how to pickle it.
    """

    def __init__(self) -> None:
        self.names: set[str] = set()
        self._by_value: frozenset[str] | None = None
        self._scanned: set[int] = set()

    def __call__(self, obj: Any) -> None:
        try:
            self._note(obj)
        except Exception:  # a failing hook must never fail the pickling of the job
            logger.debug("sparkdist: could not inspect %r for local modules", obj, exc_info=True)

    def _note(self, obj: Any) -> None:
        if isinstance(obj, types.FunctionType):
            if self._pickled_by_value(obj):
                self._scan(obj.__code__, obj.__globals__.get("__package__"))
            else:
                self.names.add(obj.__module__)
        elif isinstance(obj, type):
            module = getattr(obj, "__module__", None)
            if isinstance(module, str) and not self._registered(module):
                self.names.add(module)
        elif isinstance(obj, types.ModuleType) and not self._registered(obj.__name__):
            self.names.add(obj.__name__)

    def _registered(self, module: str) -> bool:
        """Whether cloudpickle ships ``module`` by value (this dump registered it)."""
        if self._by_value is None:
            self._by_value = frozenset(cloudpickle.list_registry_pickle_by_value())
        parts = module.split(".")
        return any(".".join(parts[:i]) in self._by_value for i in range(1, len(parts) + 1))

    def _pickled_by_value(self, fn: types.FunctionType) -> bool:
        # cloudpickle's rule: by reference only when the function can be looked up by its
        # module and qualified name, and that module is not registered to ship by value.
        module = getattr(fn, "__module__", None)
        if not isinstance(module, str) or module == "__main__" or self._registered(module):
            return True
        target: Any = sys.modules.get(module)
        for part in fn.__qualname__.split("."):
            target = getattr(target, part, None)
        return target is not fn

    def _scan(self, code: types.CodeType, package: Any) -> None:
        if id(code) in self._scanned:
            return
        self._scanned.add(id(code))
        for name, level in code_imports(code):
            if level:
                if not isinstance(package, str) or not package:
                    continue
                try:
                    name = importlib.util.resolve_name("." * level + name, package)
                except (ImportError, ValueError):
                    continue
            self.names.add(name)


def code_imports(code: types.CodeType) -> Iterator[tuple[str, int]]:
    """(module, level) of every import statement in ``code`` and the code nested in it."""
    previous: list[Any] = [None, None]
    for instruction in dis.get_instructions(code):
        if instruction.opname == "IMPORT_NAME" and isinstance(instruction.argval, str):
            # The level is the constant loaded two instructions before (then the fromlist).
            level = previous[0] if isinstance(previous[0], int) else 0
            yield instruction.argval, level
        previous = [previous[1], instruction.argval]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_imports(const)


@dataclass(frozen=True)
class _Local:
    """One top-level module or package to ship: its files as (path on disk, name in zip)."""

    name: str
    files: tuple[tuple[str, str], ...]

    @property
    def size(self) -> int:
        return sum(os.path.getsize(path) for path, _ in self.files)


def pack_local_code(names: Iterable[str], *, visible_dirs: Iterable[str] = ()) -> bytes | None:
    """Zip the sources of the local modules among ``names`` and what they import, or None.

    Args:
        names: module names the job refers to (``ModuleRecorder.names``).
        visible_dirs: ``sys.path`` entries the ranks already have (local mode's
            ``PYTHONPATH``): modules found there are left where they are.

    Raises:
        ConfigError: the sources add up to more than ``CODE_LIMIT_BYTES``, naming the largest.
    """
    visible = {os.path.realpath(d) for d in visible_dirs}
    pending = {name.split(".")[0] for name in names if name}
    done: set[str] = set()
    found: list[_Local] = []
    while pending:
        name = pending.pop()
        done.add(name)
        local = _find_local(name, visible)
        if local is None:
            continue
        found.append(local)
        for path, _ in local.files:
            pending |= _imported_names(path) - done
    if not found:
        return None
    total = sum(local.size for local in found)
    if total > CODE_LIMIT_BYTES:
        biggest = ", ".join(
            f"{local.name} ({_mb(local.size)})"
            for local in sorted(found, key=lambda x: -x.size)[:5]
        )
        raise ConfigError(
            f"the local modules the function uses add up to {_mb(total)} of source, more than "
            f"sparkdist ships with a job ({_mb(CODE_LIMIT_BYTES)}): {biggest}. Install the "
            "large ones on the executors as a package (pip install, or a cluster library), "
            "which is never shipped, or ship a packed environment with spark.archives"
        )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for local in sorted(found, key=lambda x: x.name):
            for path, arcname in local.files:
                archive.write(path, arcname)
    logger.debug(
        "sparkdist: shipping local code: %s", ", ".join(sorted(local.name for local in found))
    )
    return buffer.getvalue()


def _find_local(name: str, visible: set[str]) -> _Local | None:
    if (
        name in ("__main__", "sparkdist")
        or name in sys.builtin_module_names
        or (name in getattr(sys, "stdlib_module_names", ()))
    ):
        return None
    spec = _spec_of(name)
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or ())
    if locations:
        locations = [os.path.realpath(p) for p in locations if os.path.isdir(p)]
    elif spec.origin and os.path.isfile(spec.origin):
        locations = [os.path.realpath(spec.origin)]
    if not locations or any(is_installed_path(p) for p in locations):
        return None
    if all(os.path.dirname(p) in visible for p in locations):
        return None
    if name in installed_top_level_names():
        return None  # an editable install, say: installed, so never shipped
    if spec.submodule_search_locations is None:
        if not locations[0].endswith(".py"):
            logger.warning(
                "sparkdist: module %r (%s) is compiled, so it cannot travel with the job; "
                "install it on the executors",
                name,
                locations[0],
            )
            return None
        return _Local(name, ((locations[0], f"{name}.py"),))
    files = tuple(
        (path, f"{name}/{os.path.relpath(path, location)}".replace(os.sep, "/"))
        for location in locations
        for path in _sources_under(location)
    )
    return _Local(name, files)


def _spec_of(name: str) -> importlib.machinery.ModuleSpec | None:
    module = sys.modules.get(name)
    if module is not None:
        spec = getattr(module, "__spec__", None)
        if spec is None and getattr(module, "__file__", None):
            return importlib.util.spec_from_file_location(name, module.__file__)
        return spec
    try:
        return importlib.util.find_spec(name)  # a top-level name: finds, imports nothing
    except (ImportError, ValueError):
        return None


def _sources_under(directory: str) -> Iterator[str]:
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in _SKIPPED_DIRS
            and not d.startswith(".")
            and not os.path.exists(os.path.join(root, d, "pyvenv.cfg"))
        )
        for file in sorted(files):
            if file.endswith(".py"):
                yield os.path.join(root, file)


def _imported_names(path: str) -> set[str]:
    """Top-level names a source file imports (absolute imports only; never executed)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB" if size >= 2**20 else f"{size / 2**10:.0f} KB"


# -- the agent's side ------------------------------------------------------------------------

#: The directory, inside an agent's run directory, the shipped code is unpacked into.
CODE_DIR_NAME = "code"


def unpack_code(run_dir: str, code_zip: bytes) -> str:
    """Unpack the shipped sources into ``run_dir`` and return the directory to import from."""
    target = os.path.join(run_dir, CODE_DIR_NAME)
    with zipfile.ZipFile(io.BytesIO(code_zip)) as archive:
        archive.extractall(target)  # zipfile drops absolute paths and ".." from names
    return target


def put_code_first(env: MutableMapping[str, str], code_dir: str | None) -> None:
    """Make ``code_dir`` the first entry of a rank's ``PYTHONPATH`` (so of its ``sys.path``,
    before the job is unpickled; subprocesses and spawned DataLoader workers inherit it)."""
    if code_dir is None:
        return
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = code_dir + (os.pathsep + rest if rest else "")


def shipped_names(code_zip: bytes | None) -> list[str]:
    """The top-level modules and packages in a code zip (for logs and tests)."""
    if code_zip is None:
        return []
    with zipfile.ZipFile(io.BytesIO(code_zip)) as archive:
        names = {name.split("/")[0] for name in archive.namelist()}
    return sorted(name.removesuffix(".py") for name in names)
