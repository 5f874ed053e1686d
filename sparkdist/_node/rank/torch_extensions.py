"""Torch's JIT-built extensions on a node: stale build locks, and DeepSpeed's CPU comm op.

``torch.utils.cpp_extension`` builds an op (DeepSpeed's ``fused_adam``, ``cpu_adam``, its CPU
shared-memory comm op, ...) in ``<root>/<op>/`` while holding ``<root>/<op>/lock``: the file is
created exclusively and its descriptor stays open until the build ends. Every other process
that wants the op waits for that file to disappear, with no timeout. A build killed midway (a
test timeout, Ctrl-C, the OOM killer) never removes it, so every later run waits forever.
:func:`clear_stale_locks` removes such a lock: one that no process holds open, that no process
works in (ninja and the compiler run inside the op's directory), and that is older than a few
seconds.

DeepSpeed's CPU accelerator JIT-builds its shared-memory comm op (``deepspeed_shm_comm``, a
minute or more on 2 cores) in ``deepspeed.init_distributed`` (so also in
``deepspeed.initialize``), in every rank, before any training. :func:`skip_unbuilt_cpu_comm_op`
keeps that build out of a run: when the op is not already built on this node, DeepSpeed is told
the op is unavailable and its collectives go straight to torch.distributed (gloo), which is what
it does wherever the op cannot be built. Once built (:data:`BUILD_SHM_COMM_COMMAND`), it is used.

Non-goals: building ops; judging locks of processes this one cannot see (another PID namespace
sharing the cache directory): the age limit is the only guard there.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("sparkdist")

#: The file torch's FileBaton holds while it builds an op.
LOCK_NAME = "lock"
#: A lock younger than this is left alone whatever the process table says (seconds).
MIN_LOCK_AGE_S = 10.0
#: DeepSpeed's name for its CPU shared-memory comm op (ShareMemCommBuilder.NAME).
SHM_COMM_OP = "deepspeed_shm_comm"
#: Builds DeepSpeed's CPU shared-memory comm op once, outside any run, so runs use it.
BUILD_SHM_COMM_COMMAND = (
    'DS_ACCELERATOR=cpu python -c "from deepspeed.accelerator import get_accelerator; '
    "get_accelerator().create_op_builder('ShareMemCommBuilder').load()\""
)


def extensions_root(env: Mapping[str, str]) -> Path:
    """The folder torch builds JIT extensions under, as torch finds it.

    ``$TORCH_EXTENSIONS_DIR`` when set; else ``<cache>/torch_extensions`` (``<cache>``:
    ``$XDG_CACHE_HOME``, else ``~/.cache``), under which torch adds one folder per Python and
    accelerator build (``py311_cpu``, ``py311_cu124``): see :func:`build_root`.
    """
    explicit = env.get("TORCH_EXTENSIONS_DIR")
    if explicit is not None:
        return Path(explicit)
    home = env.get("HOME") or os.path.expanduser("~")
    cache = env.get("XDG_CACHE_HOME", os.path.join(home, ".cache"))
    return Path(cache) / "torch_extensions"


def build_root(env: Mapping[str, str], torch_build: str) -> Path:
    """The folder that holds one folder per built op for this interpreter and torch build.

    Args:
        env: the process environment.
        torch_build: torch's accelerator tag: ``"cpu"``, ``"cu124"``, ``"rocm62"``.
    """
    root = extensions_root(env)
    if env.get("TORCH_EXTENSIONS_DIR") is not None:
        return root
    abiflags = getattr(sys, "abiflags", "")
    return root / f"py{sys.version_info.major}{sys.version_info.minor}{abiflags}_{torch_build}"


def op_is_built(root: Path, name: str) -> bool:
    """Whether ``root`` (see :func:`build_root`) holds a finished build of op ``name``."""
    return (root / name / f"{name}.so").is_file()


def find_locks(root: Path) -> list[Path]:
    """Every build lock under ``root``: ``root/<op>/lock`` and ``root/<py>_<build>/<op>/lock``."""
    if not root.is_dir():
        return []
    return sorted({*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")})


@dataclass(frozen=True)
class ProcessView:
    """What the visible processes are doing with files: what they hold open, where they work."""

    open_files: frozenset[str]
    working_dirs: frozenset[str]


def live_processes(proc: Path = Path("/proc")) -> ProcessView:
    """Files held open and working directories of every process this one may inspect.

    Processes of other users (unreadable) and processes that exit during the scan are skipped.
    """
    open_files: set[str] = set()
    working_dirs: set[str] = set()
    try:
        pids = [entry for entry in os.listdir(proc) if entry.isdigit()]
    except OSError:
        return ProcessView(frozenset(), frozenset())
    for pid in pids:
        try:
            working_dirs.add(os.readlink(proc / pid / "cwd"))
        except OSError:
            pass
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                open_files.add(os.readlink(proc / pid / "fd" / fd))
            except OSError:
                pass
    return ProcessView(frozenset(open_files), frozenset(working_dirs))


def stale_locks(
    locks: Iterable[Path], processes: ProcessView, now: float, min_age_s: float = MIN_LOCK_AGE_S
) -> list[Path]:
    """The locks a killed build left: old enough, held open by no process, no process inside.

    Args:
        locks: lock files (see :func:`find_locks`); one that is gone by now is skipped.
        processes: what live processes hold open and where they work (:func:`live_processes`).
        now: the current time (``time.time()``), to compare with each lock's mtime.
        min_age_s: locks younger than this are never stale.
    """
    stale = []
    for lock in locks:
        try:
            modified = lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if now - modified < min_age_s:
            continue
        real = os.path.realpath(lock)
        if real in processes.open_files:
            continue  # the building process holds its lock open until the build ends
        build_dir = os.path.dirname(real)
        if any(d == build_dir or d.startswith(build_dir + os.sep) for d in processes.working_dirs):
            continue  # ninja or the compiler still runs in the op's directory
        stale.append(lock)
    return stale


def clear_stale_locks(root: Path | None = None, min_age_s: float = MIN_LOCK_AGE_S) -> list[Path]:
    """Remove the build locks killed builds left under ``root``; return what was removed.

    Each removal is logged as a warning naming the file. ``root`` defaults to the extensions
    folder of this process's environment (:func:`extensions_root`).
    """
    root = extensions_root(os.environ) if root is None else root
    locks = find_locks(root)
    if not locks:
        return []  # the common case: no process table scan
    removed = []
    for lock in stale_locks(locks, live_processes(), time.time(), min_age_s):
        try:
            # Checked again right before removing: another rank may have removed it and a new
            # build taken a fresh lock at the same path since the scan.
            if time.time() - lock.stat().st_mtime < min_age_s:
                continue
            lock.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning(
                "sparkdist: %s is a torch extension build lock that no process holds (a build "
                "killed midway left it) and it cannot be removed (%s); every build of that op "
                "waits for it forever: remove it with  rm %s",
                lock,
                exc,
                shlex.quote(str(lock)),
            )
            continue
        logger.warning(
            "sparkdist: removed %s: a torch extension build lock that no process holds "
            "(a build killed midway left it; every later build of that op would wait for it "
            "forever)",
            lock,
        )
        removed.append(lock)
    return removed


def torch_build_tag() -> str:
    """torch's accelerator tag for extension folders: ``cpu``, ``cu<ver>`` or ``rocm<ver>``."""
    import torch

    if torch.version.hip is not None:
        return f"rocm{torch.version.hip.replace('.', '')}"
    if torch.version.cuda is not None:
        return f"cu{torch.version.cuda.replace('.', '')}"
    return "cpu"


def skip_unbuilt_cpu_comm_op(env: Mapping[str, str]) -> bool:
    """On DeepSpeed's CPU accelerator, keep its comm op from being built inside this run.

    When ``DS_ACCELERATOR`` is ``cpu`` and the shared-memory comm op is not built on this node,
    mark it unavailable in DeepSpeed's table of compatible ops (the table ``deepspeed.comm``
    consults before building it), so collectives use torch.distributed directly. Returns whether
    it did; without DeepSpeed it does nothing (the user's own import reports that).
    """
    if env.get("DS_ACCELERATOR") != "cpu":
        return False
    if op_is_built(build_root(env, torch_build_tag()), SHM_COMM_OP):
        return False
    try:
        import deepspeed.ops
    except Exception:  # noqa: BLE001 - the user's `import deepspeed` raises it where it belongs
        return False
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    logger.info(
        "sparkdist: DeepSpeed's CPU shared-memory comm op is not built here, so collectives use "
        "gloo directly; to use it, build it once: %s",
        BUILD_SHM_COMM_COMMAND,
    )
    return True


def prepare_deepspeed_rank(env: Mapping[str, str]) -> None:
    """What a DeepSpeed rank does before the user's code: no waiting on a dead build's lock,
    no op build inside the run."""
    clear_stale_locks(extensions_root(env))
    skip_unbuilt_cpu_comm_op(env)
