"""DeepSpeed's own checkpoints on an object store. DeepSpeed reads and writes local files only,
so every host stages steps in a private local directory of its own, the *mirror* of the run's
``checkpoint_dir``: a save is written there by DeepSpeed and uploaded by one rank per host; a
load is downloaded there first (by one rank per host) and DeepSpeed reads it from there. The
layout and the commit rule stay the store's (``layout``): global rank 0 writes the marker once
every host's upload succeeded, so a step cut short on any host is never loaded. The mirror is
emptied after each save and load: a host keeps no copy of the store.

Non-goals: which checkpoint loads and how (``deepspeed_engine``, ``universal``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Callable

from sparkdist._checkpoint import ranks as checkpoint_ranks
from sparkdist._checkpoint.storage import ObjectStorage, storage_for
from sparkdist._core.env import RUN_ID_VAR
from sparkdist._core.files import PRIVATE_FILE_MODE, make_private_dirs


def is_on_store(directory: str) -> bool:
    return isinstance(storage_for(directory), ObjectStorage)


def mirror_of(url: str) -> str:
    """This host's private staging directory for ``url`` in this run (made if need be)."""
    seed = f"{os.environ.get(RUN_ID_VAR, '')}:{url}"
    name = f"sparkdist-deepspeed-{hashlib.sha256(seed.encode()).hexdigest()[:16]}"
    path = os.path.join(tempfile.gettempdir(), name)
    make_private_dirs(path)
    return path


def on_each_host(action: Callable[[], None]) -> None:
    """Run ``action`` on one rank per host (its ``LOCAL_RANK`` 0), after every rank got here,
    and go on together: its failure on any host raises on every rank, naming the host. A
    collective call."""
    checkpoint_ranks.agree(None)  # every rank's own part is done (its files written)
    problem = None
    if os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - a backend's errors are its own classes
            problem = f"{checkpoint_ranks.describe(exc)} (on host {socket.gethostname()})"
    problem = checkpoint_ranks.agree(problem)
    if problem is not None:
        raise RuntimeError(problem)


def upload(mirror: str, tag: str, url: str) -> None:
    """This host's files of step ``tag`` (in ``mirror``) to ``url``; the mirror emptied."""
    upload_tree(os.path.join(mirror, tag), url)
    remove(mirror)


def upload_tree(local: str, url: str) -> None:
    """Every file under ``local`` to the same relative names under ``url``."""
    storage = storage_for(url)
    assert isinstance(storage, ObjectStorage)
    for root, _, names in os.walk(local):
        for name in names:
            path = os.path.join(root, name)
            parts = os.path.relpath(path, local).split(os.sep)
            storage.fs.put_file(path, storage.join(url, *parts))


def download_tree(url: str, local: str) -> None:
    """Every object under ``url`` into ``local`` (private files), unless it is there already."""
    if os.path.isdir(local):
        return  # this host's copy: rank 0's host fetched it to choose
    storage = storage_for(url)
    assert isinstance(storage, ObjectStorage)
    fs = storage.fs
    fs.invalidate_cache()
    root = fs._strip_protocol(url).rstrip("/") + "/"
    staging = local + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    make_private_dirs(staging)
    for remote in map(str, fs.find(url)):
        if not remote.startswith(root) or remote.endswith("/"):
            continue  # a directory entry of a store that keeps them: no object
        target = os.path.join(staging, *remote[len(root) :].split("/"))
        make_private_dirs(os.path.dirname(target))
        fs.get_file(remote, target)
        os.chmod(target, PRIVATE_FILE_MODE)
    os.rename(staging, local)  # whole or not at all: a download cut short is not taken


def empty(mirror: str) -> None:
    """Nothing stale in ``mirror``, which stays private (0700: DeepSpeed writes with the
    umask, so the directory is what keeps its files from other users)."""
    remove(mirror)
    make_private_dirs(mirror)


def remove(mirror: str) -> None:
    shutil.rmtree(mirror, ignore_errors=True)
