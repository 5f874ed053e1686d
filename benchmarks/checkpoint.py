"""Checkpoints: sparkdist's DCP saves and loads against a plain rank-0 ``torch.save``, FSDP2.

The benchmark of ``runtime.save_checkpoint`` / ``load_checkpoint`` (on
``torch.distributed.checkpoint``). One local-mode job per world size (2 and 4 ranks, CPU, gloo):
``Distributor(n, use_gpu=False, mode="fsdp", checkpoint_dir=...)`` builds a stack of ``--width``
x ``--width`` ``Linear`` layers (``--model-mb`` of fp32 parameters, 200 MB by default), each
layer and the root wrapped in FSDP2's ``fully_shard``, trained with Adam. What is saved is the
model and the optimizer (Adam's exp_avg and exp_avg_sq: twice the parameters again), so about
3 x ``--model-mb`` per world, each rank holding its 1/n. In turns, ``--runs`` times:

- ``dcp-sync``: ``save_checkpoint({"model": m, "optimizer": o}, step)``, the state from
  ``get_state_dict(model, optimizer)`` (sharded): every rank writes its shards; it returns
  once rank 0 has committed the step;
- ``dcp-async``: the same with ``async_=True``: it returns once the state is copied to host
  memory; the write, then rank 0's ``COMMITTED`` marker, happen on a thread;
- ``torch.save`` (the baseline, what sparkdist did before): the full state gathered to rank 0
  (``get_state_dict(..., options=StateDictOptions(full_state_dict=True, cpu_offload=True))``),
  which ``torch.save``s ``{"step", "state"}`` to one file (a temporary name, fsync, rename,
  fsync of the directory: ``sparkdist._core.files.replace_atomically``, as the old sparkdist
  did) while the other ranks wait at a barrier;
- ``dcp-async`` with training going on: ``--steps`` training steps, the save, ``--steps``
  steps, then the wait for the write.

Then the loads, into the live model and optimizer: ``dcp`` (``load_checkpoint(into=
get_state_dict(model, optimizer))``, then ``set_state_dict``) and ``torch.load`` (rank 0
``torch.load(weights_only=True)``s the file, then ``set_optimizer_state_dict`` and
``set_model_state_dict`` with ``StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True)`` hand each rank its shards), from the page cache (``warm``: just
written) and from the disk (``cold``: rank 0 first drops the files' pages with ``posix_fadvise
DONTNEED``: only this benchmark's pages, no root needed). Before each load the state is scaled
in place; after it, the sums (float64, all ranks) of the parameters and of exp_avg_sq must be
those saved (``correct``). Last, one job per other world size loads the DCP checkpoint each
world wrote (4 ranks read 2's, 2 read 4's: resharded).

Figures (medians over the runs; times are the slowest rank's):

- ``blocked_s``: from before ``get_state_dict`` to the save's return (the baseline's: to the
  barrier): how long one save stops the training loop;
- ``committed_s`` (async): from the call to rank 0 seeing ``step-<N>/COMMITTED`` (polled every
  2 ms on a thread); ``drain_s``: what was left to wait for after the call returned;
- ``quiet_step_s`` / ``during_step_s``: rank 0's training step with no save in flight, and
  with the asynchronous write in flight (steps begun before the marker appeared);
- ``rank0_peak_rss_mb``: rank 0's peak ``VmRSS`` during the save (async: from the call to the
  commit) or the load, minus its ``VmRSS`` before: exact, read from ``VmHWM`` after resetting
  it through ``/proc/self/clear_refs``. Memory malloc freed earlier but kept can be reused
  without RSS growing, so ``rank0_peak_heap_mb`` also gives the peak of the bytes malloc has
  handed out (glibc's ``mallinfo2()``: in-use chunks plus mmapped blocks), sampled every 2 ms,
  minus that before: what the save really holds, whether or not RSS shows it.

Usage (see benchmarks/README.md)::

    python benchmarks/checkpoint.py --quick      # 24 MB model, 1 run (~20 s here)
    python benchmarks/checkpoint.py              # 200 MB model, 3 runs (~2 min here)
    python benchmarks/checkpoint.py --dir /dev/shm --world-sizes 2 --out checkpoint.json

Non-goals: GPUs (staging out of device memory is what ``async_`` saves most), DeepSpeed's own
checkpoints, remote storage.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _harness import (
    Bench,
    PeakSampler,
    append_records,
    emit,
    format_table,
    median,
    megabytes,
    ratio,
    rounded,
    seconds,
    times,
)

if TYPE_CHECKING:
    from typing_extensions import Self

SCRIPT = "checkpoint"
MB = 1 << 20
SAVES = ("dcp-sync", "dcp-async", "torch.save")
LOADS = ("dcp", "torch.load")
CACHES = ("warm", "cold")
DEFAULT_RUNS, QUICK_RUNS = 3, 1
DEFAULT_MODEL_MB, QUICK_MODEL_MB = 200.0, 24.0
DEFAULT_WIDTH, QUICK_WIDTH = 2048, 1024
#: The baseline's file, in ``<checkpoint_dir>-torchsave/`` (not in the checkpoint directory,
#: where ``load_checkpoint`` would take a ``step-*.pt`` for an old checkpoint).
BASELINE_FILE = "state.pt"


# --- inside a rank -------------------------------------------------------------------------


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


class _Peaks:
    """Rank 0's peak ``VmRSS`` (``PeakSampler``) and malloc's peak bytes in use, in MB."""

    def __init__(self) -> None:
        self._heap = _heap_in_use_mb()
        self._rss = PeakSampler()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="heap-peak", daemon=True)
        self.start_heap_mb = self.heap_mb = self._heap()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.heap_mb = max(self.heap_mb, self._heap())

    def __enter__(self) -> Self:
        self._rss.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.heap_mb = max(self.heap_mb, self._heap())
        self._rss.__exit__(*exc_info)

    def record(self) -> dict[str, float]:
        return {
            "peak_rss_mb": self._rss.rss_mb - self._rss.start_rss_mb,
            "peak_heap_mb": self.heap_mb - self.start_heap_mb,
            "start_rss_mb": self._rss.start_rss_mb,
        }


@contextlib.contextmanager
def _rank0_memory(record: dict[str, Any]) -> Any:
    """Rank 0's peaks over the block, into ``record``; nothing on the other ranks."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        yield
        return
    with _Peaks() as peaks:
        yield
    record.update(peaks.record())


class _MarkerWatch:
    """Seconds from ``started`` until ``path`` exists (polled every 2 ms on a thread)."""

    def __init__(self, path: str, started: float) -> None:
        self._path, self._started = path, started
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._poll, name="marker-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        deadline = self._started + 900
        while time.perf_counter() < deadline:
            if os.path.exists(self._path):
                self.seconds = time.perf_counter() - self._started
                return
            time.sleep(0.002)

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
    marker = os.path.join(directory, f"step-{step:09d}", "COMMITTED")
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
                path = os.path.join(baseline, BASELINE_FILE)
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
        watch = _MarkerWatch(os.path.join(directory, f"step-{step:09d}", "COMMITTED"), started)
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
                path = os.path.join(baseline, BASELINE_FILE)
                full = torch.load(path, map_location="cpu", weights_only=True)["state"]
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
    width: int, layers: int, batch_rows: int, runs: int, steps: int
) -> dict[str, Any]:
    """One world size's job: the saves in turns, the save under training, then the loads."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    directory, baseline = _directories()
    if rank == 0:
        os.makedirs(baseline, mode=0o700, exist_ok=True)
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
        for cache in CACHES:
            for method in LOADS:
                trials.append(
                    {"run": index, **_load(method, cache, model, optimizer, saved[method])}
                )
    dist.barrier()
    return {
        "trials": trials,
        "saved": saved["dcp"],
        "held_mb": sum(p.to_local().numel() for p in model.parameters()) * 4 / MB,
        "checkpoint_mb": sum(map(os.path.getsize, _files(directory))) / MB,
        "baseline_mb": sum(map(os.path.getsize, _files(baseline))) / MB,
        "torch_threads": torch.get_num_threads(),
    }


def _remove_steps_but(directory: str, step: int) -> None:
    keep = f"step-{step:09d}"
    for name in os.listdir(directory):
        if name.startswith("step-") and name != keep:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def load_resharded(width: int, layers: int, runs: int, saved: list[float]) -> dict[str, Any]:
    """The job of another world size: load the DCP checkpoint there (resharded), checked."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model, optimizer = _model_and_optimizer(width, layers)
    _sharded(model, optimizer)  # makes Adam's state (zeros) for the template, as in a restart
    trials = [
        {"run": index, **_load("dcp", cache, model, optimizer, saved)}
        for index in range(runs)
        for cache in CACHES
    ]
    dist.barrier()
    return {"trials": trials}


# --- the child (a local-mode driver) -------------------------------------------------------


def _combine(
    world_size: int, written_by: int, values: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One record per trial: the slowest rank's times, rank 0's memory and steps."""
    records = []
    for index, rank0 in enumerate(values[0]["trials"]):
        each = [value["trials"][index] for value in values]
        record = {"kind": "trial", "world_size": world_size, "written_by": written_by, **rank0}
        for key in ("blocked_s", "state_dict_s", "drain_s", "seconds"):
            if key in rank0:
                record[key] = max(trial[key] for trial in each)
        for key in ("correct", "changed"):
            if key in rank0:
                record[key] = all(trial[key] for trial in each)
        records.append(record)
    return records


def run_child(args: argparse.Namespace) -> None:
    from sparkdist import Distributor

    root = Path(args.dir) if args.dir else Path.cwd()

    def directory(world_size: int) -> Path:
        return root / f"sparkdist-benchmark-checkpoints-{world_size}-{os.getpid()}"

    def distributor(world_size: int, written_by: int) -> Any:
        return Distributor(
            world_size,
            use_gpu=False,
            mode="fsdp",
            checkpoint_dir=str(directory(written_by)),
            timeout_s=args.timeout_s,
        )

    saved: dict[int, list[float]] = {}
    try:
        for n in args.world_sizes:
            began = time.perf_counter()
            values = (
                distributor(n, n)
                .run_all(save_and_load, args.width, args.layers, args.batch, args.runs, args.steps)
                .values
            )
            job = {
                "kind": "job",
                "world_size": n,
                "run_s": round(time.perf_counter() - began, 1),
                "held_mb": [round(value["held_mb"], 1) for value in values],
                "checkpoint_mb": round(values[0]["checkpoint_mb"], 1),
                "baseline_mb": round(values[0]["baseline_mb"], 1),
                "torch_threads": values[0]["torch_threads"],
            }
            append_records(args.results, [job, *_combine(n, n, values)])
            saved[n] = values[0]["saved"]
        for written_by in args.world_sizes:
            for n in args.world_sizes:
                if n != written_by:
                    job = distributor(n, written_by)
                    values = job.run_all(
                        load_resharded, args.width, args.layers, args.runs, saved[written_by]
                    ).values
                    append_records(args.results, _combine(n, written_by, values))
    finally:
        for n in args.world_sizes:
            shutil.rmtree(directory(n), ignore_errors=True)
            shutil.rmtree(f"{directory(n)}-torchsave", ignore_errors=True)


# --- the parent ----------------------------------------------------------------------------


def _median(trials: list[dict[str, Any]], key: str, digits: int = 4) -> float | None:
    return rounded(median([t[key] for t in trials if t.get(key) is not None]), digits)


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (world size, method); the overlap; loads per cache; ratios to the baseline."""
    trials = [s for s in samples if s["kind"] == "trial"]
    figures: list[dict[str, Any]] = [
        {"figure": "job", **{k: v for k, v in s.items() if k != "kind"}}
        for s in samples
        if s["kind"] == "job"
    ]
    memory = ("peak_rss_mb", "peak_heap_mb", "start_rss_mb")
    for n in sorted({t["world_size"] for t in trials}):
        blocked: dict[str, float | None] = {}
        for method in SAVES:
            kept = [t for t in trials if t["world_size"] == n and t["method"] == method]
            blocked[method] = _median(kept, "blocked_s")
            figures.append(
                {
                    "figure": "save",
                    "world_size": n,
                    "method": method,
                    "blocked_s": blocked[method],
                    "runs": [rounded(t["blocked_s"]) for t in kept],
                    **{
                        key: _median(kept, key)
                        for key in ("state_dict_s", "committed_s", "drain_s")
                    },
                    **{f"rank0_{key}": _median(kept, key, 1) for key in memory},
                }
            )
        for method in ("dcp-sync", "dcp-async"):
            figures.append(
                {
                    "figure": "blocked_ratio",
                    "world_size": n,
                    "method": f"{method}/torch.save",
                    "value": rounded(ratio(blocked[method], blocked["torch.save"]), 3),
                }
            )
        overlap = [t for t in trials if t["world_size"] == n and t["method"] == "overlap"]
        quiet = [s for t in overlap for s in t["quiet_steps"]]
        during = [
            s
            for t in overlap
            for began, s in t["during_steps"]
            if t["committed_s"] is None or began < t["committed_s"]
        ]
        figures.append(
            {
                "figure": "async_overlap",
                "world_size": n,
                **{key: _median(overlap, key) for key in ("blocked_s", "committed_s", "drain_s")},
                "quiet_step_s": rounded(median(quiet)),
                "during_step_s": rounded(median(during)),
                "steps": {"quiet": len(quiet), "during": len(during)},
                "during_vs_quiet": rounded(ratio(median(during), median(quiet)), 3),
            }
        )
    worlds = sorted(
        {(t["world_size"], t["written_by"]) for t in trials if "cache" in t},
        key=lambda pair: (pair[0] != pair[1], pair),
    )
    for n, written_by in worlds:
        for method in LOADS:
            for cache in CACHES:
                kept = _loads(trials, n, written_by, method, cache)
                if not kept:
                    continue
                value = _median(kept, "seconds")
                base = _median(_loads(trials, n, n, "torch.load", cache), "seconds")
                correct = sum(t["correct"] and t["changed"] for t in kept)
                figures.append(
                    {
                        "figure": "load",
                        "world_size": n,
                        "written_by": written_by,
                        "method": method,
                        "cache": cache,
                        "seconds": value,
                        "runs": [rounded(t["seconds"]) for t in kept],
                        "vs_torch_load": rounded(ratio(value, base), 3),
                        **{f"rank0_{k}": _median(kept, k, 1) for k in memory},
                        "correct": f"{correct}/{len(kept)}",
                    }
                )
    return figures


def _loads(
    trials: list[dict[str, Any]], n: int, written_by: int, method: str, cache: str
) -> list[dict[str, Any]]:
    key = (n, written_by, method, cache)
    return [
        t for t in trials if (t["world_size"], t["written_by"], t["method"], t.get("cache")) == key
    ]


def tables(figures: list[dict[str, Any]]) -> str:
    ratios = {
        (f["world_size"], f["method"]): f["value"]
        for f in figures
        if f["figure"] == "blocked_ratio"
    }
    overlaps = {f["world_size"]: f for f in figures if f["figure"] == "async_overlap"}
    rows = []
    for f in (f for f in figures if f["figure"] == "save"):
        n, method = f["world_size"], f["method"]
        note = f"state dict {seconds(f['state_dict_s'])}"
        if method == "dcp-async":
            note += f"; {seconds(f['drain_s'])} left to wait after the call"
        rows.append(
            (
                str(n),
                method,
                seconds(f["blocked_s"]),
                times(ratios.get((n, f"{method}/torch.save"), 1.0)),
                seconds(f["committed_s"]),
                megabytes(f["rank0_peak_rss_mb"]),
                megabytes(f["rank0_peak_heap_mb"]),
                note,
            )
        )
        if method == "dcp-async" and n in overlaps:
            o = overlaps[n]
            rows.append(
                (
                    str(n),
                    "dcp-async, training",
                    seconds(o["blocked_s"]),
                    "-",
                    seconds(o["committed_s"]),
                    "-",
                    "-",
                    f"step {seconds(o['quiet_step_s'])} without a save, "
                    f"{seconds(o['during_step_s'])} while it writes "
                    f"({times(o['during_vs_quiet'])}; "
                    f"steps overlapping the write: {o['steps']['during']})",
                )
            )
    header = ("ranks", "save", "loop blocked", "vs torch.save", "committed after")
    saves = format_table((*header, "rank-0 +RSS", "rank-0 +heap", "notes"), rows)
    by = {
        (f["world_size"], f["written_by"], f["method"], f["cache"]): f
        for f in figures
        if f["figure"] == "load"
    }
    rows = []
    for n, written_by, method in dict.fromkeys(key[:3] for key in by):
        warm, cold = (by.get((n, written_by, method, cache), {}) for cache in CACHES)
        rows.append(
            (
                f"{written_by} -> {n}",
                method,
                seconds(warm.get("seconds")),
                seconds(cold.get("seconds")),
                f"{times(warm.get('vs_torch_load'))} / {times(cold.get('vs_torch_load'))}",
                megabytes(cold.get("rank0_peak_rss_mb")),
                megabytes(cold.get("rank0_peak_heap_mb")),
                f"correct {warm.get('correct', '-')} warm, {cold.get('correct', '-')} cold",
            )
        )
    header = ("written -> read by", "load", "warm cache", "cold cache", "vs torch.load")
    loads = format_table((*header, "rank-0 +RSS", "rank-0 +heap", "notes"), rows)
    return f"{saves}\n\n{loads}"


def _filesystem(path: Path) -> str | None:
    """``df``'s file system type and mount point of ``path``."""
    done = subprocess.run(
        ["df", "--output=fstype,target", str(path)], capture_output=True, text=True, check=False
    )
    lines = done.stdout.splitlines()
    return " on ".join(lines[1].split()) if done.returncode == 0 and len(lines) > 1 else None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help=f"saves and loads of each kind (default {DEFAULT_RUNS}, {QUICK_RUNS} with --quick)",
    )
    parser.add_argument(
        "--model-mb",
        type=float,
        default=None,
        help=f"fp32 parameters in MB (default {DEFAULT_MODEL_MB:g}, {QUICK_MODEL_MB:g} with "
        "--quick); Adam's state doubles it again",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"the layers' width (default {DEFAULT_WIDTH}, {QUICK_WIDTH} with --quick)",
    )
    parser.add_argument("--batch", type=int, default=16, help="rows per training step")
    parser.add_argument(
        "--steps", type=int, default=2, help="training steps before and after the async save"
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--dir", help="where the checkpoints go (default: the scratch directory, under TMPDIR)"
    )
    parser.add_argument("--out", type=Path, help="also write the records to this JSON file")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="each job's timeout_s")
    parser.add_argument("--quick", action="store_true", help="a 24 MB model, 1 run")
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs is None:
        args.runs = QUICK_RUNS if args.quick else DEFAULT_RUNS
    if args.model_mb is None:
        args.model_mb = QUICK_MODEL_MB if args.quick else DEFAULT_MODEL_MB
    if args.width is None:
        args.width = QUICK_WIDTH if args.quick else DEFAULT_WIDTH
    if min(args.runs, args.width, args.steps, *args.world_sizes) < 1 or args.model_mb <= 0:
        parser.error("--runs, --model-mb, --width, --steps and --world-sizes must be positive")
    if args.layers is None:
        per_layer = 4 * (args.width * args.width + args.width)
        args.layers = max(1, round(args.model_mb * MB / per_layer))
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    argv_child = [
        *("--runs", str(args.runs), "--width", str(args.width), "--layers", str(args.layers)),
        *("--batch", str(args.batch), "--steps", str(args.steps)),
        *("--timeout-s", str(args.timeout_s), "--world-sizes", *map(str, args.world_sizes)),
        *(("--dir", os.path.abspath(args.dir)) if args.dir else ()),
    ]
    parameters_mb = args.layers * (args.width * args.width + args.width) * 4 / MB
    with Bench(SCRIPT) as bench:
        where = Path(os.path.abspath(args.dir)) if args.dir else bench.scratch
        filesystem = _filesystem(where)
        bench.note(
            f"{args.layers} x Linear({args.width}, {args.width}): {parameters_mb:.0f} MB of "
            f"parameters, {3 * parameters_mb:.0f} MB with Adam's; checkpoints in {where} "
            f"({filesystem})"
        )
        jobs = len(args.world_sizes) ** 2
        samples = bench.child("local", argv_child, budget_s=120 + jobs * args.timeout_s)
    figures = summarize(samples)
    records = [
        *figures,
        bench.machine(
            runs=args.runs,
            width=args.width,
            layers=args.layers,
            batch=args.batch,
            steps=args.steps,
            parameters_mb=round(parameters_mb, 1),
            saved_mb=round(3 * parameters_mb, 1),
            checkpoint_dir=str(where),
            checkpoint_fs=filesystem,
        ),
    ]
    emit(records, tables(figures))
    if args.out:
        args.out.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    if not any(f["figure"] == "save" and f["blocked_s"] for f in figures):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
