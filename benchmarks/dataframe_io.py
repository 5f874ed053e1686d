"""Training on a Spark DataFrame: a rank's memory against its partition size, and rows/s.

Issue 5's benchmark. A synthetic table (``id``, ``label`` long, ``features`` array<float> of
``--width`` values; ~(4 * width + 20) bytes a row) is written once as Parquet, one file per rank,
on a ``local[2]`` session; ``--size-mb`` sets the data per rank (several sizes show whether
memory grows with the partition). Then two ranks read it three ways, each its own
``Distributor(2, local_mode=False, use_gpu=False)`` run:

- ``dataset``: ``run_all(fn, spark_dataframe=spark.read.parquet(path))``; each rank iterates
  ``DataLoader(sparkdist.data.partition_dataset(["features", "label"]),
  batch_size=--batch-size, num_workers=--loader-workers)``;
- ``table``: the same stage; each rank cuts ``sparkdist.data.partition_table()`` into batches
  of the same size and turns the columns into tensors (``torch.from_numpy``): sparkdist's data
  path without the per-row Dataset;
- ``parquet`` (the baseline): no DataFrame; rank r reads Parquet file r with
  ``pyarrow.parquet.ParquetFile.iter_batches`` into the same tensors.

Figures per reader and size (rank 0's; ``rank_rows`` says how many rows it read):

- ``rows_per_s``: rows into the loop (tensors in hand) per second of the loop;
- ``rank_peak_rss_mb`` / ``rank_peak_anon_mb``: the rank process's peak ``VmRSS`` (its reset
  high-water mark) / ``RssAnon`` (sampled every 5 ms) over the loop, minus its value when the
  function started.
  ``VmRSS`` counts the resident pages of the memory-mapped partition file (page cache the kernel
  may drop); ``RssAnon`` is memory the process owns: bounded means this stays flat as the
  partition grows;
- ``writer_peak_rss_mb`` / ``writer_peak_anon_mb``: the peak of Spark's Python worker processes
  (where each barrier task streams its partition to disk) during the run, sampled every 20 ms
  from the driver;
- ``run_s``: the driver's ``run_all`` wall time (for ``dataset``/``table``: Parquet scan,
  shuffle to one partition per rank, Arrow IPC files, launch and the loop).

Usage (see benchmarks/README.md)::

    python benchmarks/dataframe_io.py --quick                  # 16 MB per rank, 1 run
    python benchmarks/dataframe_io.py                          # 64 and 256 MB per rank, 2 runs
    python benchmarks/dataframe_io.py --size-mb 1024 --runs 1  # the 1 GiB partition (~3 GB disk)

Non-goals: Spark Connect (the tests cover the DataFrame path there), local-cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from _dataframe_io_jobs import read_rows
from _harness import Bench, Options, append_records, classic_session
from _measure import PeakSampler, Sampler
from _report import emit, median, megabytes, rounded, seconds, table, times

SCRIPT = "dataframe_io"
NUM_PROCESSES = 2
MB = 1 << 20
READERS = ("dataset", "table", "parquet")

OPTIONS = Options(__doc__, quick_help="16 MB per rank, 1 round")
OPTIONS.add("--runs", type=int, quick=(2, 1), help="rounds per size")
OPTIONS.add(
    "--size-mb",
    type=float,
    nargs="+",
    quick=([64, 256], [16]),
    help="data per rank in MB of 2^20 bytes (1024: issue 5's 1 GiB partition)",
)
OPTIONS.add("--width", type=int, default=64, help="floats per features array")
OPTIONS.add("--batch-size", type=int, default=256)
OPTIONS.add(
    "--loader-workers",
    type=int,
    default=0,
    help="DataLoader num_workers for the dataset reader (default 0)",
)


# --- the child (a local[2] driver) ---------------------------------------------------------


class WorkerSampler(Sampler):
    """Peak VmRSS / RssAnon (MB) of Spark's Python workers below ``jvm_pid``, on a thread."""

    def __init__(self, jvm_pid: int, interval_s: float = 0.02) -> None:
        import psutil

        super().__init__(interval_s, "worker-sampler")
        self._jvm = psutil.Process(jvm_pid)
        self.rss_mb = self.anon_mb = 0.0

    def sample(self) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            for proc in self._jvm.children(recursive=True):
                with contextlib.suppress(psutil.Error, OSError, ValueError):
                    if "pyspark.daemon" not in " ".join(proc.cmdline()):
                        continue  # ranks, the zygote and its spares have other names
                    rss, anon = PeakSampler(proc.pid).read()
                    self.rss_mb, self.anon_mb = max(self.rss_mb, rss), max(self.anon_mb, anon)


def write_parquet(session: Any, path: Path, rows_per_rank: int, width: int) -> list[str]:
    """The synthetic table, one Parquet file per rank; returns the files in rank order."""
    frame = session.range(0, rows_per_rank * NUM_PROCESSES, numPartitions=NUM_PROCESSES)
    frame = frame.selectExpr(
        "id",
        "cast(pmod(hash(id), 10) as long) as label",
        # Deterministic noise (Parquet cannot shrink it much): hash(id, i) scaled to [-1, 1).
        f"transform(sequence(0, {width - 1}), i -> cast(hash(id, i) / 2147483648.0 as float))"
        " as features",
    )
    frame.write.mode("overwrite").parquet(str(path))
    files = sorted(str(p) for p in path.glob("part-*.parquet"))
    if len(files) != NUM_PROCESSES:
        raise RuntimeError(f"expected {NUM_PROCESSES} Parquet files, got {files}")
    return files


def run_child(args: argparse.Namespace) -> None:
    from sparkdist import Distributor

    session = classic_session(
        "local[2]",
        "sparkdist-benchmark-dataframe-io",
        Path.cwd(),
        {
            "spark.driver.memory": "2g",
            "spark.sql.shuffle.partitions": str(NUM_PROCESSES),
        },
    )
    jvm_pid = session.sparkContext._gateway.proc.pid
    distributor = Distributor(NUM_PROCESSES, local_mode=False, use_gpu=False)
    row_bytes = 4 * args.width + 20
    try:
        # Warm-up on a tiny table of the same shape: the executors' Python workers and pools,
        # and every code path (Parquet scan, shuffle, Arrow, JIT) the timed runs take.
        tiny = Path.cwd() / "warm-up.parquet"
        try:
            files = write_parquet(session, tiny, 500, args.width)
            for reader in READERS:
                frame = session.read.parquet(str(tiny)) if reader != "parquet" else None
                distributor.run_all(
                    read_rows,
                    reader,
                    args.batch_size,
                    args.width,
                    args.loader_workers,
                    files,
                    spark_dataframe=frame,
                )
        finally:
            _remove_tree(tiny)
        for size_mb in args.size_mb:
            rows_per_rank = int(size_mb * MB / row_bytes)
            path = Path.cwd() / f"table-{size_mb:g}mb.parquet"
            with contextlib.ExitStack() as cleanup:
                cleanup.callback(_remove_tree, path)
                started = time.perf_counter()
                files = write_parquet(session, path, rows_per_rank, args.width)
                append_records(
                    args.results,
                    [
                        {
                            "kind": "parquet_written",
                            "size_mb": size_mb,
                            "rows_per_rank": rows_per_rank,
                            "seconds": time.perf_counter() - started,
                            "file_mb": [os.path.getsize(f) / MB for f in files],
                        }
                    ],
                )
                for index in range(args.runs):
                    for reader in READERS:
                        frame = session.read.parquet(str(path)) if reader != "parquet" else None
                        with WorkerSampler(jvm_pid) as writers:
                            began = time.perf_counter()
                            values = distributor.run_all(
                                read_rows,
                                reader,
                                args.batch_size,
                                args.width,
                                args.loader_workers,
                                files,
                                spark_dataframe=frame,
                            ).values
                            run_s = time.perf_counter() - began
                        append_records(
                            args.results,
                            [
                                {
                                    "kind": "read",
                                    "reader": reader,
                                    "size_mb": size_mb,
                                    "round": index,
                                    "run_s": run_s,
                                    "rank0": values[0],
                                    "rank_rows": [v["rows"] for v in values],
                                    "writer_rss_mb": writers.rss_mb,
                                    "writer_anon_mb": writers.anon_mb,
                                }
                            ],
                        )
    finally:
        session.stop()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# --- the parent ----------------------------------------------------------------------------


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    written = {s["size_mb"]: s for s in samples if s["kind"] == "parquet_written"}
    reads = [s for s in samples if s["kind"] == "read"]
    figures = []
    for size_mb in sorted(written):
        base = written[size_mb]
        figures.append(
            {
                "figure": "parquet_written",
                "size_mb": size_mb,
                "rows_per_rank": base["rows_per_rank"],
                "seconds": rounded(base["seconds"], 2),
                "file_mb": [rounded(f, 1) for f in base["file_mb"]],
            }
        )
        for reader in READERS:
            trials = [s for s in reads if s["size_mb"] == size_mb and s["reader"] == reader]
            if not trials:
                continue
            rank0 = [t["rank0"] for t in trials]
            figures.append(
                {
                    "figure": "dataframe_read",
                    "reader": reader,
                    "size_mb": size_mb,
                    "rows_per_s": rounded(median([r["rows"] / r["loop_s"] for r in rank0]), 0),
                    "loop_s": rounded(median([r["loop_s"] for r in rank0]), 3),
                    "run_s": rounded(median([t["run_s"] for t in trials]), 3),
                    "rank_rows": trials[0]["rank_rows"],
                    "rank_peak_rss_mb": rounded(
                        median([r["rss_peak_mb"] - r["rss_start_mb"] for r in rank0]), 1
                    ),
                    "rank_peak_anon_mb": rounded(
                        median([r["anon_peak_mb"] - r["anon_start_mb"] for r in rank0]), 1
                    ),
                    "rank_start_rss_mb": rounded(median([r["rss_start_mb"] for r in rank0]), 1),
                    "writer_peak_rss_mb": rounded(median([t["writer_rss_mb"] for t in trials]), 1),
                    "writer_peak_anon_mb": rounded(
                        median([t["writer_anon_mb"] for t in trials]), 1
                    ),
                    "runs_rows_per_s": [rounded(r["rows"] / r["loop_s"], 0) for r in rank0],
                    "torch_threads": rank0[0]["torch_threads"],
                }
            )
    by = {(f["reader"], f["size_mb"]): f for f in figures if f["figure"] == "dataframe_read"}
    for (reader, size_mb), f in list(by.items()):
        base = by.get(("parquet", size_mb))
        if reader != "parquet" and base and base["rows_per_s"]:
            figures.append(
                {
                    "figure": "rows_per_s_ratio",
                    "reader": f"{reader}/parquet",
                    "size_mb": size_mb,
                    "value": rounded(f["rows_per_s"] / base["rows_per_s"], 3),
                }
            )
    return figures


def table_of(figures: list[dict[str, Any]]) -> str:
    ratios = {
        (f["reader"].split("/")[0], f["size_mb"]): f["value"]
        for f in figures
        if f["figure"] == "rows_per_s_ratio"
    }
    written = {f["size_mb"]: f for f in figures if f["figure"] == "parquet_written"}
    rows = []
    for f in (f for f in figures if f["figure"] == "dataframe_read"):
        rows.append(
            {
                "per rank": f"{f['size_mb']:g} MB",
                "reader": f["reader"],
                "rows/s": f"{f['rows_per_s']:,.0f}",
                "vs parquet": times(ratios.get((f["reader"], f["size_mb"]))),
                "loop": seconds(f["loop_s"]),
                "run": seconds(f["run_s"]),
                "rank +RSS": megabytes(f["rank_peak_rss_mb"]),
                "rank +anon": megabytes(f["rank_peak_anon_mb"]),
                "writer RSS": megabytes(f["writer_peak_rss_mb"]),
                "writer anon": megabytes(f["writer_peak_anon_mb"]),
                "notes": f"rows/rank {f['rank_rows']}; "
                f"rank RSS at start {f['rank_start_rss_mb']:.0f} MB; "
                f"parquet written in {written[f['size_mb']]['seconds']:.1f} s",
            }
        )
    return table(rows)


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv, positive=("runs", "size_mb"))
    if args.child:
        run_child(args)
        return
    budget_s = 600 + sum(args.size_mb) * args.runs * 3.0
    with Bench(SCRIPT) as bench:
        samples = bench.child("local[2]", OPTIONS.forward(args), budget_s=budget_s)
    figures = summarize(samples)
    machine = bench.machine(
        runs=args.runs,
        width=args.width,
        batch_size=args.batch_size,
        loader_workers=args.loader_workers,
    )
    emit([*figures, machine], table_of(figures))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
