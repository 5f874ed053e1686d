"""Where checkpoints are kept: a directory (local, or mounted on every host) or an object store
(``s3://``, ``gs://``, ``abfss://``... through fsspec). One small interface that the layout,
retention, DCP and the reach check go through, so the commit rules are written once.

The difference that matters: a directory renames atomically, an object store does not (a
"rename" there is a copy and a delete). So on a store nothing is renamed: a step is written
where it ends up, and its marker (one PUT, which is atomic) is the commit (``layout``).

Credentials are never given here: the backend finds each host's own (environment, instance
profile, service account). The settings that are not secret (``storage_options``) come with
the run in ``SPARKDIST_STORAGE_OPTIONS``.

Non-goals: which names the layout uses and when it writes what (``layout``); what is refused
before a run starts (``_core.object_store``).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import shutil
import urllib.parse
from typing import Any, BinaryIO, Literal

from sparkdist._core.env import STORAGE_OPTIONS_VAR
from sparkdist._core.files import (
    PRIVATE_DIR_MODE,
    fsync_directory,
    make_private_dirs,
    replace_atomically,
)
from sparkdist._core.object_store import decode_options, scheme_of

Kind = Literal["missing", "dir", "file", "other"]


class Storage(abc.ABC):
    """A directory tree's operations; paths are strings as ``join`` builds them."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    @abc.abstractmethod
    def kind(self, path: str) -> Kind:
        raise NotImplementedError

    @abc.abstractmethod
    def names(self, directory: str) -> list[str]:
        """The entries directly in ``directory`` (FileNotFoundError when it is not there)."""
        raise NotImplementedError

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes:
        raise NotImplementedError

    @abc.abstractmethod
    def write_whole(self, path: str, data: bytes) -> None:
        """Write ``path`` whole: readers see the old content, or none, or all of the new."""
        raise NotImplementedError

    @abc.abstractmethod
    def remove_file(self, path: str) -> None:
        """Remove one file; one already gone is not an error."""
        raise NotImplementedError

    @abc.abstractmethod
    def remove_empty_dir(self, path: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def make_dirs(self, path: str) -> None:
        raise NotImplementedError


class LocalStorage(Storage):
    """A directory on this host's file systems: private modes, fsync, atomic renames."""

    def kind(self, path: str) -> Kind:
        if os.path.islink(path):
            return "other"
        if os.path.isdir(path):
            return "dir"
        if os.path.isfile(path):
            return "file"
        return "other" if os.path.lexists(path) else "missing"

    def names(self, directory: str) -> list[str]:
        return os.listdir(directory)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_whole(self, path: str, data: bytes) -> None:
        def write(f: BinaryIO) -> None:
            f.write(data)

        replace_atomically(path, write)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def remove_empty_dir(self, path: str) -> None:
        os.rmdir(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path)

    def make_dirs(self, path: str) -> None:
        make_private_dirs(path)

    def make_dir(self, path: str) -> None:
        """One new private directory (``FileExistsError`` when it is there)."""
        os.mkdir(path, PRIVATE_DIR_MODE)
        os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode passes through the umask

    def rename(self, path: str, new_path: str) -> None:
        os.rename(path, new_path)

    def sync_dir(self, path: str) -> None:
        """Make the entries just made or renamed in ``path`` durable."""
        fsync_directory(path)


class ObjectStorage(Storage):
    """An object store through fsspec. "Directories" are key prefixes: one exists while an
    object is under it. Every listing is asked of the store (fsspec caches listings, and other
    hosts write)."""

    def __init__(self, url: str, options: dict[str, Any], *, fresh: bool = False) -> None:
        """``fresh``: a client of its own, which finds this host's credentials as they are now
        (fsspec otherwise shares one instance per settings in a process)."""
        from fsspec.core import url_to_fs

        self.options = options
        extra = {"skip_instance_cache": True} if fresh else {}
        self.fs, _ = url_to_fs(url, **options, **extra)

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def _fresh(self) -> Any:
        self.fs.invalidate_cache()
        return self.fs

    def kind(self, path: str) -> Kind:
        fs = self._fresh()
        if fs.isfile(path):
            return "file"
        return "dir" if fs.isdir(path) else "missing"

    def names(self, directory: str) -> list[str]:
        fs = self._fresh()
        entries = fs.ls(directory, detail=False)
        names = [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]
        own = directory.rstrip("/").rsplit("/", 1)[-1]
        return [n for n in names if n and n != own]  # some stores list the prefix itself

    def read_bytes(self, path: str) -> bytes:
        return bytes(self._fresh().cat_file(path))

    def write_whole(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)  # one PUT: an object appears whole or not at all

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def remove_empty_dir(self, path: str) -> None:
        # A prefix goes with its last object. Stores that keep directories (SeaweedFS, a
        # hierarchical-namespace ADLS account) drop one when its key "<prefix>/" is deleted; on
        # the others that key is not there, and deleting it does nothing.
        with contextlib.suppress(Exception):
            self.fs.rm_file(path.rstrip("/") + "/")

    def remove_tree(self, path: str) -> None:
        fs = self._fresh()
        files = fs.find(path)
        if files:
            fs.rm(files)
        self.remove_empty_dir(path)

    def make_dirs(self, path: str) -> None:
        """Nothing to make: a prefix exists once an object is written under it."""


def storage_for(directory: str, options: str | None = None, *, fresh: bool = False) -> Storage:
    """The storage that holds ``directory``: a URL's store, or this host's file systems.
    ``options``: the store's settings as JSON (default: this process's
    ``SPARKDIST_STORAGE_OPTIONS``); ``fresh``: a store client of its own (``ObjectStorage``)."""
    if scheme_of(directory) is None:
        return LOCAL
    if options is None:
        options = os.environ.get(STORAGE_OPTIONS_VAR, "")
    # The URL's root (scheme and authority): some backends read settings from it (adlfs, the
    # account of "abfss://container@account.dfs.core.windows.net/...").
    root = urllib.parse.urlsplit(directory)._replace(path="", query="", fragment="").geturl()
    if fresh:
        return ObjectStorage(root, decode_options(options), fresh=True)
    return _object_storage(root, options)


LOCAL = LocalStorage()


@functools.cache
def _object_storage(root: str, options: str) -> ObjectStorage:
    """One fsspec file system per store and settings in a process (its connections are kept)."""
    return ObjectStorage(root, decode_options(options))
