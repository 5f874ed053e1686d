"""Where a module comes from: installed (every host is expected to have it) or local code.

The one definition used everywhere the answer matters: pickling a function's module by value
(``_wire.payload``), shipping local modules with the job (``_shipping.code``) and giving local
ranks the driver's import path (``_engine.launch``). A module is *installed* when its files lie
under the interpreter's installed locations (standard library, site-packages, the prefixes of
a venv) or a distribution provides its top-level name (an editable install); anything else
loaded from a file is *local*: a notebook's helpers, a test module, a script's neighbours.

Non-goals: deciding what to pack (``_shipping.code``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import site
import sys
import sysconfig


@functools.lru_cache(maxsize=1)
def installed_roots() -> frozenset[str]:
    """Where installed packages and the standard library live (a venv's prefix included)."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("purelib", "platlib", "stdlib", "platstdlib") if key in paths}
    roots |= set(getattr(site, "getsitepackages", list)())
    try:
        roots.add(site.getusersitepackages())
    except AttributeError:
        pass
    roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return frozenset(os.path.realpath(root) for root in roots if root)


def is_installed_path(path: str) -> bool:
    """Whether ``path`` (a file or directory) lies under an installed location."""
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root + os.sep) for root in installed_roots())


@functools.lru_cache(maxsize=1)
def installed_top_level_names() -> frozenset[str]:
    """Import names that installed distributions provide (editable installs included).

    Cached for the process: an install that is not under the installed locations (an editable
    one) only becomes importable after the interpreter restarts anyway.
    """
    try:
        return frozenset(importlib.metadata.packages_distributions())
    except Exception:  # noqa: BLE001 - a broken distribution must not stop a launch
        return frozenset()


def is_local_module(module_name: str) -> bool:
    """True for ``__main__`` and loaded modules that are not installed (see the module doc)."""
    if module_name == "__main__":
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or not path:
        return False  # built in, namespace package, or not loaded: nothing to ship
    if module_name.split(".")[0] in installed_top_level_names():
        return False
    return not is_installed_path(path)
