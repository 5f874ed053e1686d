"""Checkpoint directories through ``torch.distributed.checkpoint`` (DCP): every rank writes its
own shards, a load reshards to the current world, an asynchronous save overlaps the next steps.

What this module adds to DCP: private files (0600, created so, whatever the umask; directories
0700), the ranks' collectives on the checkpoint group (``checkpoint_ranks``), one asynchronous
save in flight at a time (committed on its own thread once written; finished, or its failure
raised, by the next checkpoint call or the end of the run), and weights-only reading of DCP's
pickles (``checkpoint_pickles``: DCP's own reader unpickles ``.metadata`` and every non-tensor
entry with plain ``pickle``).

Non-goals: the directory layout and the commit marker (``checkpoint_layout``: this module
runs the ``prepare`` and ``commit`` it is given), which checkpoint to load (``checkpoints``),
DeepSpeed's own checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, cast

from sparkdist._checkpoint import ranks as checkpoint_ranks
from sparkdist._checkpoint.layout import Unreadable
from sparkdist._checkpoint.pickles import Refused, load_dcp_metadata, load_torch_file
from sparkdist._checkpoint.state import move_tensors, restore_keys
from sparkdist._checkpoint.storage import ObjectStorage, storage_for
from sparkdist._core.files import PRIVATE_FILE_MODE, make_private_dirs

# -- writing -----------------------------------------------------------------------------------


@dataclass
class _Pending:
    """The asynchronous save in flight: its step, final path, the thread that commits it."""

    step: int
    path: str
    thread: threading.Thread | None = None
    error: BaseException | None = None


_pending: _Pending | None = None


def save(
    state: dict[str, Any],
    *,
    step: int,
    prepare: Callable[[], tuple[str, str]],
    commit: Callable[[str], None],
    async_: bool,
) -> str:
    """Write ``state`` as a DCP checkpoint; every rank calls it (collective with a group).

    ``prepare()`` runs on global rank 0 first and says where to write and where the checkpoint
    ends up; ``commit(written_to)`` runs on global rank 0 once every rank's shards are on disk
    (DCP gathers each rank's write results on rank 0 before its ``save`` returns there), and
    the ranks meet after it, so none reads ahead of the marker. With ``async_`` the state is
    staged in host memory and written, then committed, on a thread while training goes on.

    Returns:
        The checkpoint's final path.
    """
    wait_for_pending_saves()
    from torch.distributed.checkpoint import state_dict_saver as saver
    from torch.distributed.checkpoint.api import CheckpointException

    _quiet_single_process_warnings()
    group = checkpoint_ranks.checkpoint_group()
    target, final = checkpoint_ranks.share_from_rank0(prepare)
    writer = _writer(target)
    try:
        if not async_:
            saver.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
        else:
            response = saver.async_save(
                state,
                storage_writer=writer,
                process_group=group,
                async_checkpointer_type=saver.AsyncCheckpointerType.THREAD,
                no_dist=group is None,
            )
    except CheckpointException as exc:
        failure = checkpoint_ranks.describe(exc)
        raise RuntimeError(
            f"checkpoint step {step} could not be written to {target}: {failure}"
        ) from checkpoint_ranks.cause(exc)
    if not async_:
        checkpoint_ranks.share_from_rank0(lambda: commit(target))
        return final
    global _pending
    upload = (
        response.upload_completion if isinstance(response, saver.AsyncSaveResponse) else response
    )
    _pending = pending = _Pending(step=step, path=final)

    def finish() -> None:  # on the thread: wait for the write, commit, meet
        try:
            upload.result()
        except BaseException as exc:  # noqa: BLE001 - kept for the next call to raise
            pending.error = exc  # DCP raised it on every rank alike: nobody waits to meet
            return
        try:
            checkpoint_ranks.share_from_rank0(lambda: commit(target))
        except BaseException as exc:  # noqa: BLE001 - kept for the next call to raise
            pending.error = exc

    pending.thread = threading.Thread(
        target=finish, name=f"sparkdist-checkpoint-{step}", daemon=True
    )
    _finish_saves_before_the_world_goes()
    pending.thread.start()
    return final


def _finish_saves_before_the_world_goes() -> None:
    """Make ``torch.distributed.destroy_process_group()`` finish the save in flight first.

    The save's thread meets the other ranks on the checkpoint group to commit; a function that
    ends as torch's examples do (``dist.barrier(); dist.destroy_process_group()``) would take
    that group away under it ("Group ... is not registered"), losing the step. So destroying
    the whole world waits for the save (and raises its failure, naming the step), as the next
    checkpoint call and the end of the run do. Installed once per process, on the first
    asynchronous save; destroying one sub-group leaves the checkpoint group alone.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    destroy = c10d.destroy_process_group
    if getattr(destroy, "finishes_checkpoints", False):
        return

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is c10d.GroupMember.WORLD:
            wait_for_pending_saves()
        destroy(group)

    destroy_process_group.finishes_checkpoints = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def wait_for_pending_saves() -> None:
    """Wait for the asynchronous save in flight to be written and committed; raise its failure,
    naming its step. Nothing to do (torch not imported) when there is none."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    if pending.thread is not None:
        pending.thread.join()
    if pending.error is not None:
        raise RuntimeError(
            f"the asynchronous save of checkpoint step {pending.step} ({pending.path}) "
            f"failed: {checkpoint_ranks.describe(pending.error)}"
        ) from checkpoint_ranks.cause(pending.error)


@functools.cache
def _private_file_system() -> type[Any]:
    from torch.distributed.checkpoint.filesystem import FileSystem

    class PrivateFileSystem(FileSystem):
        """DCP's local file system, creating directories 0700 and files 0600."""

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(path, flags, PRIVATE_FILE_MODE)
            with os.fdopen(fd, mode) as stream:
                os.fchmod(fd, PRIVATE_FILE_MODE)  # the umask may have taken bits away
                yield stream

        def mkdir(self, path: str | os.PathLike[str]) -> None:
            make_private_dirs(os.fspath(path))

    return PrivateFileSystem


def _writer(path: str) -> Any:
    """DCP's writer for ``path``: private files in a directory; fsspec's on an object store."""
    storage = storage_for(path)
    if isinstance(storage, ObjectStorage):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # sync_files: a stream of fsspec's has no descriptor, and DCP would then sync every
        # file system of the host (os.sync()); an object is durable once its upload returns.
        return FsspecWriter(path, sync_files=False, **storage.options)
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    writer = FileSystemWriter(path, sync_files=True)  # fsync every file it writes
    writer.fs = _private_file_system()()
    return writer


# -- reading -----------------------------------------------------------------------------------


def read_metadata(path: str, *, weights_only: bool) -> Any:
    """The DCP directory's ``.metadata``, read on this rank alone (``Refused`` for objects that
    ``weights_only`` does not build)."""
    storage = storage_for(path)
    data = storage.read_bytes(storage.join(path, ".metadata"))
    return load_dcp_metadata(data, weights_only=weights_only)


def read_into(
    into: dict[str, Any], path: str, metadata: Any, *, map_location: Any, weights_only: bool
) -> None:
    """Load the checkpoint at ``path`` into ``into`` in place, resharded to this world (DCP's
    ``load``; collective with a group). Raises ``Refused``, or ``Unreadable`` naming what
    could not be read (and on which rank)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    _quiet_single_process_warnings()
    group = checkpoint_ranks.checkpoint_group()
    planner = _planners()[0](weights_only=weights_only, map_location=map_location)
    try:
        load(
            into,
            storage_reader=_reader(path, metadata),
            planner=planner,
            process_group=group,
            no_dist=group is None,
        )
    except CheckpointException as exc:
        raise _read_error(exc) from checkpoint_ranks.cause(exc)


def read_whole(
    path: str, metadata: Any, notes: Mapping[str, Any], *, map_location: Any, weights_only: bool
) -> dict[str, Any]:
    """The whole checkpoint at ``path`` in this rank's memory, as it was saved (sharded tensors
    whole), without a template and without the other ranks; tensors are read on the CPU, then
    moved by ``map_location``."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _quiet_single_process_warnings()
    state: dict[str, Any] = {}
    planner = _planners()[1](weights_only=weights_only, map_location="cpu")
    try:
        _load_state_dict(state, _reader(path, metadata), no_dist=True, planner=planner)
    except CheckpointException as exc:
        raise _read_error(exc) from checkpoint_ranks.cause(exc)
    restore_keys(state, notes)
    return cast("dict[str, Any]", move_tensors(state, map_location))


def _read_error(exc: BaseException) -> Exception:
    """DCP's failure of a read: the refusal inside it, or its first rank's error in one line."""
    refused = checkpoint_ranks.find(exc, Refused)
    return refused if refused is not None else Unreadable(checkpoint_ranks.describe(exc))


def _reader(path: str, metadata: Any) -> Any:
    """DCP's file reader, given the metadata already read (safely) instead of unpickling it."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    storage = storage_for(path)
    base: type[FileSystemReader] = FileSystemReader
    if isinstance(storage, ObjectStorage):  # fsspec's reader (and imports) only for a store
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        base = FsspecReader

    class _Reader(base):  # type: ignore[misc,valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    if isinstance(storage, ObjectStorage):
        return _Reader(path, **storage.options)
    return _Reader(path)


@functools.cache
def _planners() -> tuple[type[Any], type[Any]]:
    """DCP's load planners (into a template; rebuilding from the metadata) with the non-tensor
    entries read by ``torch.load(weights_only=...)``: DCP's own use ``weights_only=False``."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        _EmptyStateDictLoadPlanner,
    )

    def load_bytes(planner: Any, read_item: Any, value: io.BytesIO) -> None:
        obj = load_torch_file(
            cast(IO[bytes], value), planner.map_location, weights_only=planner.weights_only
        )
        if planner.flatten_state_dict:
            path = planner.mappings[read_item.dest_index.fqn]
            set_element(planner.original_state_dict, path, obj)
        else:
            planner.state_dict[read_item.dest_index.fqn] = obj

    class IntoPlanner(DefaultLoadPlanner):
        def __init__(self, *, weights_only: bool, map_location: Any) -> None:
            super().__init__()
            self.weights_only, self.map_location = weights_only, map_location

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            load_bytes(self, read_item, value)

    class WholePlanner(_EmptyStateDictLoadPlanner):
        def __init__(self, *, weights_only: bool, map_location: Any) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.weights_only, self.map_location = weights_only, map_location

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            load_bytes(self, read_item, value)

    return IntoPlanner, WholePlanner


def _quiet_single_process_warnings() -> None:
    # DCP warns at every save and load without a process group ("assuming the intent is to
    # save in a single process"): that is the point here (a world of one), on any thread.
    warnings.filterwarnings(
        "ignore", message=r"torch\.distributed is (disabled|unavailable)", category=UserWarning
    )
