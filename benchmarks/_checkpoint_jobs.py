"""What runs inside the ranks of ``checkpoint.py``: ``save_and_load``, one world size's job
(the saves in turns, the async save with training going on, then the loads, each checked), and
``load_resharded``, another world size's loads of that checkpoint. ``checkpoint.py`` says what
each save and load does and what the figures mean.

Each rank returns its own times; rank 0 also its memory (``_rank0_memory``). sparkdist ships
this module by value with the job (``_measure``, which it names, as local code), so nothing
here may need pickling of its own: the ctypes structure of ``mallinfo2`` is made in the rank.

Non-goals: the figures (``checkpoint.py`` takes the slowest rank's times and the medians).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from _measure import PeakSampler, Sampler

MB = 1 << 20
SAVES = ("dcp-sync", "dcp-async", "torch.save")
LOADS = ("dcp", "torch.load")
CACHES = ("warm", "cold")
#: The baseline's file, in ``<checkpoint_dir>-torchsave/`` (not in the checkpoint directory,
#: where ``load_checkpoint`` would take a ``step-*.pt`` for an old checkpoint).
BASELINE_FILE = "state.pt"


def _heap_in_use_mb() -> Callable[[], float]:
    """A function giving the bytes malloc has handed out, in MB (glibc's ``mallinfo2``).

    The structure is made here, in the rank: a ctypes class does not pickle.
    """

    class Mallinfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            ).split()
        ]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = Mallinfo2

    def in_use_mb() -> float:
        info = mallinfo2()
        return float(info.uordblks + info.hblkhd) / MB

    return in_use_mb


class _HeapPeak(Sampler):
    """malloc's peak bytes in use (MB) over a ``with`` block, sampled every 2 ms."""

    def __init__(self) -> None:
        super().__init__(0.002, "heap-peak")
        self._heap = _heap_in_use_mb()
        self.start_mb = self.mb = self._heap()

    def sample(self) -> None:
        self.mb = max(self.mb, self._heap())

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        self.sample()


@contextlib.contextmanager
def _rank0_memory(record: dict[str, Any]) -> Any:
    """Rank 0's peak ``VmRSS`` (``PeakSampler``) and malloc's peak bytes in use over the block,
    in MB, into ``record``; nothing on the other ranks."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        yield
        return
    heap = _HeapPeak()  # made first: its ctypes set-up is not part of the RSS peak
    with PeakSampler() as rss, heap:
        yield
    record["peak_rss_mb"] = rss.rss_mb - rss.start_rss_mb
    record["peak_heap_mb"] = heap.mb - heap.start_mb
    record["start_rss_mb"] = rss.start_rss_mb


def _storage(path: str) -> Any:
    """sparkdist's storage of ``path``: a directory, or the object store of a URL."""
    from sparkdist._checkpoint.storage import storage_for

    return storage_for(path)


def _on_store(path: str) -> bool:
    from sparkdist._checkpoint.storage import ObjectStorage

    return isinstance(_storage(path), ObjectStorage)


class _MarkerWatch:
    """Seconds from ``started`` until ``path`` exists (polled on a thread: every 2 ms on a
    disk, every 20 ms on a store, where each look is a request)."""

    def __init__(self, path: str, started: float) -> None:
        self._path, self._started = path, started
        self._storage = _storage(path)
        self._every_s = 0.02 if _on_store(path) else 0.002
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._poll, name="marker-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        deadline = self._started + 900
        while time.perf_counter() < deadline:
            if self._storage.kind(self._path) == "file":
                self.seconds = time.perf_counter() - self._started
                return
            time.sleep(self._every_s)

    def wait(self) -> float | None:
        self._thread.join()
        return self.seconds


def _directories() -> tuple[str, str]:
    """The run's checkpoint directory, and the baseline's beside it."""
    from sparkdist import runtime

    directory = runtime.checkpoint_dir()
    if directory is None:
        raise RuntimeError("no checkpoint_dir: the benchmark's jobs pass one")
    return directory, directory + "-torchsave"


def _model_and_optimizer(width: int, layers: int) -> tuple[Any, Any]:
    """The FSDP2 stack of Linear layers (every layer its own unit, then the root) and Adam."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from sparkdist import runtime

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    mesh = runtime.device_mesh()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _train_step(model: Any, optimizer: Any, batch: Any) -> float:
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(batch).pow(2).mean().backward()
    optimizer.step()
    return time.perf_counter() - started


def _sums(model: Any, optimizer: Any) -> list[float]:
    """Sums (float64) of the parameters and of Adam's exp_avg_sq over every rank's shards."""
    import torch
    import torch.distributed as dist

    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            sums[0] += param.to_local().double().sum()
            sums[1] += optimizer.state[param]["exp_avg_sq"].to_local().double().sum()
    dist.all_reduce(sums)
    return [float(x) for x in sums]


def _scale(model: Any, optimizer: Any) -> None:
    """Change the state in place (what a load must undo); cheaper than a training step."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.to_local().mul_(0.5)
            optimizer.state[param]["exp_avg_sq"].to_local().mul_(0.5)


def _same(got: list[float], want: list[float]) -> bool:
    return all(abs(g - w) <= 1e-9 * max(1.0, abs(w)) for g, w in zip(got, want, strict=True))


def _sharded(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _save(method: str, step: int, model: Any, optimizer: Any) -> dict[str, Any]:
    """One save by ``method`` (every rank): this rank's times, rank 0's memory."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from sparkdist import runtime
    from sparkdist._checkpoint.api import wait_for_pending_saves
    from sparkdist._core.files import replace_atomically

    directory, baseline = _directories()
    marker = _storage(directory).join(directory, f"step-{step:09d}", "COMMITTED")
    record: dict[str, Any] = {"method": method}
    dist.barrier()
    with _rank0_memory(record):
        started = time.perf_counter()
        watch = None
        if method == "dcp-async" and dist.get_rank() == 0:
            watch = _MarkerWatch(marker, started)
        if method == "torch.save":
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
            record["state_dict_s"] = time.perf_counter() - started
            if dist.get_rank() == 0:
                saved = {
                    "step": step,
                    "state": {"model": model_state, "optimizer": optimizer_state},
                }
                storage = _storage(baseline)
                path = storage.join(baseline, BASELINE_FILE)
                if _on_store(baseline):  # torch.save to a local file, then its upload
                    with tempfile.NamedTemporaryFile(suffix=".pt") as local:
                        torch.save(saved, local)
                        local.flush()
                        storage.fs.put_file(local.name, path)
                else:
                    replace_atomically(path, lambda f: torch.save(saved, f))
                del saved
            del model_state, optimizer_state
            dist.barrier()
        else:
            state = _sharded(model, optimizer)
            record["state_dict_s"] = time.perf_counter() - started
            runtime.save_checkpoint(state, step, async_=method == "dcp-async")
            del state
        record["blocked_s"] = time.perf_counter() - started
        if method == "dcp-async":
            waited = time.perf_counter()
            wait_for_pending_saves()  # what the next checkpoint call would wait for
            record["drain_s"] = time.perf_counter() - waited
            if watch is not None:
                record["committed_s"] = watch.wait()
    return record


def _overlap(step: int, steps: int, model: Any, optimizer: Any, batch: Any) -> dict[str, Any]:
    """Steps, an async save, steps with its write in flight, the wait for it."""
    import torch.distributed as dist

    from sparkdist import runtime
    from sparkdist._checkpoint.api import wait_for_pending_saves

    directory, _ = _directories()
    dist.barrier()
    quiet = [_train_step(model, optimizer, batch) for _ in range(steps)]
    saved = _sums(model, optimizer)  # what this save holds
    dist.barrier()
    started = time.perf_counter()
    watch = None
    if dist.get_rank() == 0:
        marker = _storage(directory).join(directory, f"step-{step:09d}", "COMMITTED")
        watch = _MarkerWatch(marker, started)
    runtime.save_checkpoint(_sharded(model, optimizer), step, async_=True)
    blocked_s = time.perf_counter() - started
    during = []  # (began, seconds): began from the call
    for _ in range(steps):
        during.append((time.perf_counter() - started, _train_step(model, optimizer, batch)))
    waited = time.perf_counter()
    wait_for_pending_saves()
    return {
        "method": "overlap",
        "blocked_s": blocked_s,
        "drain_s": time.perf_counter() - waited,
        "committed_s": watch.wait() if watch is not None else None,
        "quiet_steps": quiet,
        "during_steps": during,
        "saved": saved,
    }


def _files(directory: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


def _size_mb(directory: str) -> float:
    storage = _storage(directory)
    if _on_store(directory):
        return float(sum(storage.fs.du(directory, total=False).values())) / MB
    return sum(map(os.path.getsize, _files(directory))) / MB


def _drop_from_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # clean pages only are dropped (they are: every file was fsynced)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load(
    method: str, cache: str, model: Any, optimizer: Any, saved: list[float]
) -> dict[str, Any]:
    """One load by ``method`` into the live model and optimizer (every rank), checked."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    from sparkdist import runtime

    directory, baseline = _directories()
    rank = dist.get_rank()
    _scale(model, optimizer)
    record: dict[str, Any] = {"method": method, "cache": cache}
    record["changed"] = not _same(_sums(model, optimizer), saved)
    if cache == "cold" and rank == 0:
        _drop_from_page_cache(_files(directory if method == "dcp" else baseline))
    dist.barrier()
    with _rank0_memory(record):
        started = time.perf_counter()
        if method == "dcp":
            into = _sharded(model, optimizer)
            if runtime.load_checkpoint(into) is None:
                raise RuntimeError(f"no checkpoint in {directory}")
            set_state_dict(
                model, optimizer, model_state_dict=into["model"], optim_state_dict=into["optimizer"]
            )
            del into
        else:
            full: dict[str, Any] = {"model": {}, "optimizer": {}}
            if rank == 0:
                storage = _storage(baseline)
                path = storage.join(baseline, BASELINE_FILE)
                source = io.BytesIO(storage.read_bytes(path)) if _on_store(baseline) else path
                full = torch.load(source, map_location="cpu", weights_only=True)["state"]
            # Two calls: set_state_dict takes the other ranks' empty model_state_dict for
            # "optimizer only" and skips the model's broadcast there: rank 0 would wait forever.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_optimizer_state_dict(model, optimizer, full["optimizer"], options=options)
            set_model_state_dict(model, full["model"], options=options)
            del full
            dist.barrier()
        record["seconds"] = time.perf_counter() - started
    record["correct"] = _same(_sums(model, optimizer), saved)
    return record


def save_and_load(
    width: int, layers: int, batch_rows: int, runs: int, steps: int, caches: tuple[str, ...]
) -> dict[str, Any]:
    """One world size's job: the saves in turns, the save under training, then the loads
    (from each of ``caches``: a store has no page cache of ours to drop)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    directory, baseline = _directories()
    if rank == 0:
        _storage(baseline).make_dirs(baseline)
    model, optimizer = _model_and_optimizer(width, layers)
    batch = torch.randn(batch_rows, width, generator=torch.Generator().manual_seed(1 + rank))
    _train_step(model, optimizer, batch)  # Adam's state exists from here on
    trials: list[dict[str, Any]] = []
    saved: dict[str, list[float]] = {}  # the sums each kind's newest checkpoint holds
    step = 0
    for index in range(runs):
        for method in SAVES:
            step += 1
            if method == "torch.save":
                saved["torch.load"] = _sums(model, optimizer)
            trials.append({"run": index, **_save(method, step, model, optimizer)})
            if rank == 0 and method != "torch.save":  # keep the newest only (untimed)
                _remove_steps_but(directory, step)
        step += 1
        trials.append({"run": index, **_overlap(step, steps, model, optimizer, batch)})
        saved["dcp"] = trials[-1].pop("saved")
        if rank == 0:
            _remove_steps_but(directory, step)
    for index in range(runs):
        for cache in caches:
            for method in LOADS:
                trials.append(
                    {"run": index, **_load(method, cache, model, optimizer, saved[method])}
                )
    dist.barrier()
    return {
        "trials": trials,
        "saved": saved["dcp"],
        "held_mb": sum(p.to_local().numel() for p in model.parameters()) * 4 / MB,
        "checkpoint_mb": _size_mb(directory),
        "baseline_mb": _size_mb(baseline),
        "torch_threads": torch.get_num_threads(),
    }


def _remove_steps_but(directory: str, step: int) -> None:
    keep = f"step-{step:09d}"
    storage = _storage(directory)
    for name in storage.names(directory):
        if name.startswith("step-") and name != keep:
            with contextlib.suppress(OSError):
                storage.remove_tree(storage.join(directory, name))


def remove_all(directory: str) -> None:
    """The job's checkpoints and the baseline's, wherever they are (untimed)."""
    for path in (directory, directory + "-torchsave"):
        with contextlib.suppress(OSError):
            _storage(path).remove_tree(path)


def load_resharded(
    width: int, layers: int, runs: int, saved: list[float], caches: tuple[str, ...]
) -> dict[str, Any]:
    """The job of another world size: load the DCP checkpoint there (resharded), checked."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model, optimizer = _model_and_optimizer(width, layers)
    _sharded(model, optimizer)  # makes Adam's state (zeros) for the template, as in a restart
    trials = [
        {"run": index, **_load("dcp", cache, model, optimizer, saved)}
        for index in range(runs)
        for cache in caches
    ]
    dist.barrier()
    return {"trials": trials}
