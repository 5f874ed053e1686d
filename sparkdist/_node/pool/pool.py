"""Starting a rank's process: forked from a warm zygote (``zygote``) when one is available,
spawned cold otherwise. Both give the agent the same ``RankProcess`` interface.

A zygote is a process that imported torch once; it is keyed by what shapes a rank's imports
(the interpreter and the import-time variables of the rank's environment: ``PYTHONPATH``,
``LD_PRELOAD``...), so concurrent runs that differ there get zygotes of their own. Every rank
forked from a zygote holds a lease on it: a zygote is only ever closed with no lease (never under
a run in flight), at most ``MAX_ZYGOTES`` are kept (the least recently used idle one makes room;
when all are busy a run starts its ranks cold), and they end with their owner (each watches its
stdin). A zygote that fails to answer a spawn request is retired (closed when its last rank
ends) and only the rank that asked starts cold: a failed fork never touches another run. Set
``SPARKDIST_WORKER_POOL=0`` to always spawn cold.

Non-goals: what a rank does once started (``worker``); the zygote's side (``zygote``).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping

from sparkdist._core.env import WORKER_POOL_VAR
from sparkdist._core.files import sweep_dead_owners
from sparkdist._node.pool.rank_process import ColdProcess, RankProcess, StartStop, StartStopped
from sparkdist._node.pool.zygote import PREPARED_ARG
from sparkdist._node.pool.zygote_client import (
    FORK_ANSWER_TIMEOUT_S as FORK_ANSWER_TIMEOUT_S,
)
from sparkdist._node.pool.zygote_client import (
    IMPORT_VARS,
    POOL_DIR_KIND,
    ZYGOTE_START_TIMEOUT_S,
    Zygote,
    ZygoteKey,
    prepares_restarts,
)

logger = logging.getLogger("sparkdist")

POOL_VAR = WORKER_POOL_VAR
#: Zygotes kept at once (each holds an imported torch: a few hundred MB, shared with its ranks).
MAX_ZYGOTES = 3
#: How often a start waiting on another thread's zygote start looks at the agent's stop.
_STOP_POLL_S = 0.05


def start_rank(
    env: Mapping[str, str],
    ctrl_fds: tuple[int, int],
    shipped_code: str | None = None,
    stop: StartStop | None = None,
) -> RankProcess:
    """Start one rank with ``env``; ``ctrl_fds`` are its command-read and notes-write ends,
    whose numbers ``env`` already names (they are renumbered when the rank is forked).

    ``shipped_code`` is the run's unpacked code directory at the front of ``PYTHONPATH``: the
    rank adds it to ``sys.path`` itself, so it does not make a zygote of its own.

    Raises:
        StartStopped: ``stop`` (the agent's) was set while the zygote had not answered.
    """
    zygote = _lease(zygote_key(env, shipped_code), env, stop or StartStop())
    if zygote is not None:
        try:
            return zygote.fork(env, ctrl_fds, stop)
        except StartStopped:
            # It owes an answer nobody reads (and may be frozen): no rank of a later start
            # waits on it; the rank it may still fork ends with it.
            _retire(zygote, "a stopped start gave up waiting for its answer")
            _release(zygote)
            raise
        except OSError as exc:
            logger.warning("sparkdist: the warm worker pool failed (%s); starting a rank cold", exc)
            _retire(zygote, str(exc))
            _release(zygote)
    if stop is not None:
        stop.check()  # stopped while the zygote failed: nothing is started in its place
    return ColdProcess(env, ctrl_fds)


def warm(env: Mapping[str, str]) -> threading.Thread | None:
    """Start, on a daemon thread, the zygote a rank with ``env`` would fork from, and leave it
    idle in the pool (nothing to do where it runs, or with the pool off); returns at once.

    For a process that will run ranks later (an executor's Python worker a restart may land
    on): its first rank then forks instead of waiting seconds for the zygote's imports."""
    if not _pool_enabled():
        return None
    key = zygote_key(env)
    with _lock:
        if key in _zygotes or key in _starting:
            return None

    def start() -> None:
        try:
            zygote = _lease(key, env, StartStop())
        except Exception:  # noqa: BLE001 - only a head start: a rank starts it if need be
            logger.debug("sparkdist: warming the worker pool failed", exc_info=True)
            return
        if zygote is not None:
            _release(zygote)  # idle, kept: the next rank of this key leases it

    thread = threading.Thread(target=start, name="sparkdist-warm-pool", daemon=True)
    thread.start()
    return thread


def zygote_key(env: Mapping[str, str], shipped_code: str | None = None) -> ZygoteKey:
    """What makes zygotes differ: the interpreter, ``env``'s ``IMPORT_VARS``, and whether its
    ranks' run checkpoints (``prepares_restarts``: a zygote that imported more)."""
    values = {name: env.get(name, "") for name in IMPORT_VARS}
    if shipped_code:
        entries = values["PYTHONPATH"].split(os.pathsep)
        values["PYTHONPATH"] = os.pathsep.join(e for e in entries if e != shipped_code)
    prepared = (PREPARED_ARG,) if prepares_restarts(env) else ()
    return (sys.executable, *(f"{name}={value}" for name, value in values.items()), *prepared)


# -- the pool: zygotes by key, leased per rank ------------------------------------------------

_zygotes: dict[ZygoteKey, Zygote] = {}
#: Zygotes out of the pool that still serve a rank: closed at their last lease's end, or by
#: ``shutdown`` (so no zygote of this process outlives it, whatever its ranks do).
_retired: set[Zygote] = set()
_starting: dict[ZygoteKey, threading.Event] = {}
_lock = threading.Lock()
_swept = False


def _pool_enabled() -> bool:
    return os.environ.get(POOL_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def _lease(key: ZygoteKey, import_env: Mapping[str, str], stop: StartStop) -> Zygote | None:
    """A live zygote for ``key`` with one more lease, started if need be; None: start cold.

    Raises:
        StartStopped: the agent's stop came while the zygote was starting (nothing started).
    """
    global _swept
    if not _pool_enabled():
        return None
    while True:
        with _lock:
            zygote = _zygotes.get(key)
            if zygote is not None and not zygote.alive():
                _forget(zygote)
                zygote = None
            if zygote is not None:
                zygote.leases += 1
                zygote.last_used = time.monotonic()
                return zygote
            starting = _starting.get(key)
            if starting is None:
                if not _make_room():
                    return None  # every zygote serves a run in flight: this run starts cold
                starting = _starting[key] = threading.Event()
                sweep, _swept = not _swept, True
                break
        # Another thread is starting this key's zygote: wait for it, then look again (in
        # slices: the agent's stop must end this wait too).
        deadline = time.monotonic() + ZYGOTE_START_TIMEOUT_S
        while not starting.wait(_STOP_POLL_S):
            stop.check()
            if time.monotonic() > deadline:
                return None
    # This thread starts it, outside the lock: other keys' runs go on meanwhile.
    zygote = None
    try:
        if sweep:
            sweep_dead_owners(POOL_DIR_KIND)  # zygote directories of killed drivers
        zygote = Zygote(key, import_env, on_rank_end=_release, on_stuck=_retire, stop=stop)
    except OSError as exc:
        logger.warning("sparkdist: no warm worker pool (%s); starting ranks cold", exc)
    finally:  # a stopped start too (StartStopped goes on up): nobody waits on it any more
        with _lock:
            del _starting[key]
            starting.set()
            if zygote is not None:
                zygote.leases = 1
                _zygotes[key] = zygote
    return zygote


def _make_room() -> bool:
    """Close the least recently used idle zygote if the pool is full (under ``_lock``).

    Returns:
        Whether a new zygote may start.
    """
    if len(_zygotes) + len(_starting) < MAX_ZYGOTES:
        return True
    idle = [z for z in _zygotes.values() if z.leases == 0]
    if not idle:
        return False
    _forget(min(idle, key=lambda z: z.last_used))
    return True


def _forget(zygote: Zygote) -> None:
    """Drop ``zygote`` from the pool (under ``_lock``); closed now if idle, else at its last
    lease's end."""
    if _zygotes.get(zygote.key) is zygote:
        del _zygotes[zygote.key]
    zygote.retired = True
    if zygote.leases == 0:
        zygote.close()
    else:
        _retired.add(zygote)


def _retire(zygote: Zygote, why: str) -> None:
    """Stop forking from ``zygote`` (it failed a request); it ends when its ranks have."""
    with _lock:
        if not zygote.retired:
            logger.warning("sparkdist: retiring a warm-pool zygote: %s", why)
            _forget(zygote)


def _release(zygote: Zygote) -> None:
    """One rank of ``zygote`` ended (or was never forked)."""
    with _lock:
        zygote.leases -= 1
        if zygote.retired and zygote.leases == 0:
            _retired.discard(zygote)
            zygote.close()


def zygote_count() -> int:
    """How many zygotes this process keeps now (for tests and the soak)."""
    with _lock:
        return len(_zygotes)


def shutdown() -> None:
    """Stop this process's warm pool, retired zygotes that still serve a rank included (and
    their ranks with them); it also ends on its own when this process exits."""
    with _lock:
        zygotes = [*_zygotes.values(), *_retired]
        _zygotes.clear()
        _retired.clear()
    for zygote in zygotes:
        zygote.retired = True
        zygote.close()


atexit.register(shutdown)
