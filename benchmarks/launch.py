"""Launch time and failure latency: sparkdist beside pyspark's TorchDistributor and torchrun.

For a trivial 2-rank gloo job (``_jobs.all_reduce_rank``) this measures, in one run:

- ``launch_s``: wall time of ``run(fn)``, median of ``--runs`` after one warm-up, for
  sparkdist's ``Distributor(2, local_mode=..., use_gpu=False)`` and pyspark's
  ``TorchDistributor(num_processes=2, local_mode=..., use_gpu=False)``, in local mode, on
  ``local[2]`` and on ``local-cluster[2,1,1024]``; plain ``torchrun`` as a reference.
- ``failure_s``: from a rank raising (it writes ``time.time()`` just before) to the exception
  reaching the driver (``_jobs.fail_one_rank``; the other rank blocks in a collective).

Only one SparkContext can live in a process, so each Spark master runs in a child process (this
script re-invoked with ``--child``) that appends JSON records to a file; the parent prints one
JSON line per figure and a table. Usage (see benchmarks/README.md)::

    python benchmarks/launch.py                 # everything, 5 runs each
    python benchmarks/launch.py --quick         # smoke test: 2 runs, short failure guard
    python benchmarks/launch.py --modes local torchrun --runs 3

The timed launches come after a warm-up, so they show each launcher's steady, warm cost (for
sparkdist: its pool of pre-started workers); ``warmup`` is the session's first launch.

With the local mode, the table is followed by ``launch_phases.py``'s breakdown of a warm local
launch of 2 and of 8 ranks (``--no-phases`` skips it): where sparkdist's milliseconds go.

Non-goals: scaling, steady-state training or result-size figures (other benchmarks).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _jobs
from _harness import Bench, Options, append_records, classic_session, wait_for_executors
from _measure import (
    Figure,
    kill_tree,
    measure_failures,
    measure_launches,
    pickled_by_value,
    torchrun_command,
)
from _report import emit, launch_table, ratio_records

SCRIPT = "launch"
NUM_PROCESSES = 2
LOCAL_CLUSTER = "local-cluster[2,1,1024]"
#: --modes name -> (label in the output, the Spark master it runs under, local_mode).
MODES: dict[str, tuple[str, str | None, bool]] = {
    "local": ("local", "local[2]", True),  # pyspark's local mode needs an active session
    "local[2]": ("local[2]", "local[2]", False),
    "local-cluster": (LOCAL_CLUSTER, LOCAL_CLUSTER, False),
    "torchrun": ("local", None, True),  # no Spark: measured in the parent
}
#: Rank counts of the phase breakdown printed after the table (``launch_phases.py``), and the
#: fewest warm runs it takes the median of.
PHASE_RANKS, PHASE_MIN_RUNS = (2, 8), 5

OPTIONS = Options(
    __doc__,
    quick_help="smoke test: 2 runs, a 90 s guard on failing runs",
)
OPTIONS.add(
    "--runs",
    type=int,
    quick=(5, 2),
    help="timed runs per figure; launch times add one untimed warm-up",
)
OPTIONS.add(
    "--modes",
    nargs="+",
    choices=list(MODES),
    default=list(MODES),
    help="what to measure (default: all)",
)
OPTIONS.add(
    "--failure-timeout-s",
    type=float,
    quick=(180.0, 90.0),
    help="give up on a failing run after this long, in seconds",
)
OPTIONS.add(
    "--keep-logs",
    type=Path,
    metavar="DIR",
    help="copy each Spark child's output (rank lines, Spark logs) into DIR",
)
OPTIONS.add(
    "--no-phases",
    dest="phases",
    action="store_false",
    help="skip the phase breakdown of warm local launches (launch_phases.py), which "
    "runs with the local mode",
)


# --- the launchers -------------------------------------------------------------------------


def run_sparkdist(local_mode: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``sparkdist.Distributor(2, local_mode=..., use_gpu=False).run(fn, *args)``."""
    from sparkdist import Distributor

    return Distributor(NUM_PROCESSES, local_mode=local_mode, use_gpu=False).run(fn, *args)


def run_pyspark(local_mode: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """pyspark's ``TorchDistributor(num_processes=2, local_mode=..., use_gpu=False).run``."""
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(
        num_processes=NUM_PROCESSES, local_mode=local_mode, use_gpu=False
    )
    with pickled_by_value(_jobs):
        return distributor.run(fn, *args)


class Torchrun:
    """Plain ``torchrun --standalone --nnodes=1 --nproc_per_node=2 _jobs.py ...``.

    Remembers the run in flight, so one the benchmark gave up on can be killed (``kill``) with
    its workers, which torchrun starts in sessions of their own.
    """

    def __init__(self, cwd: Path) -> None:
        self._cwd = cwd
        self._running: subprocess.Popen[str] | None = None

    def run(self, *job_args: str) -> None:
        """Run ``_jobs.py job_args...``; raise RuntimeError with the output if it fails."""
        self._running = subprocess.Popen(
            torchrun_command(NUM_PROCESSES, _jobs.__file__, *job_args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            cwd=self._cwd,
        )
        output, _ = self._running.communicate()
        if self._running.returncode != 0:
            raise RuntimeError(f"torchrun exited with {self._running.returncode}:\n{output}")

    def kill(self) -> None:
        """Kill the run in flight, if any, with every process it started."""
        if self._running is not None and self._running.poll() is None:
            kill_tree(self._running.pid)


def measure_torchrun(runs: int, failure_timeout_s: float, cwd: Path) -> list[Figure]:
    """The torchrun reference: launch time and failure latency of the same job."""
    torchrun = Torchrun(cwd)
    return [
        *measure_launches(
            "local", {"torchrun": lambda: torchrun.run("all_reduce")}, runs, torchrun.kill
        ),
        *measure_failures(
            "local",
            {"torchrun": lambda stamp: torchrun.run("fail", stamp)},
            runs,
            failure_timeout_s,
            torchrun.kill,
        ),
    ]


# --- a child process: one Spark master -----------------------------------------------------


def kill_abandoned_runs(session: Any) -> None:
    """After a timeout: cancel every Spark job, kill this process's children but the JVM.

    In local mode pyspark's torchrun (and sparkdist's workers) are children of this process;
    in Spark mode the cancelled tasks take their processes down.
    """
    import psutil

    session.sparkContext.cancelAllJobs()
    jvm_pid = session.sparkContext._gateway.proc.pid
    for child in psutil.Process().children():
        if child.pid != jvm_pid:
            kill_tree(child.pid)


def measure_mode(name: str, runs: int, failure_timeout_s: float, session: Any) -> list[Figure]:
    """Both launchers in one mode: launch times, then failure latencies."""
    label, _, local_mode = MODES[name]

    def cleanup() -> None:
        kill_abandoned_runs(session)

    launches = {
        "sparkdist": lambda: run_sparkdist(local_mode, _jobs.all_reduce_rank),
        "pyspark": lambda: run_pyspark(local_mode, _jobs.all_reduce_rank),
    }
    failing = {
        "sparkdist": lambda stamp: run_sparkdist(local_mode, _jobs.fail_one_rank, stamp),
        "pyspark": lambda stamp: run_pyspark(local_mode, _jobs.fail_one_rank, stamp),
    }
    return [
        *measure_launches(label, launches, runs, cleanup),
        *measure_failures(label, failing, runs, failure_timeout_s, cleanup),
    ]


def run_child(args: argparse.Namespace) -> None:
    """Measure ``args.modes`` on the master ``args.child``; append a JSON record per figure.

    The session keeps sparkdist's tracking as users get it, and waits for its executors to
    register, so neither launcher pays for their start.
    """
    session = classic_session(args.child, "sparkdist-benchmark-launch", tracking=True)
    wait_for_executors(session, NUM_PROCESSES if args.child.startswith("local-cluster") else 0)
    try:
        for name in args.modes:
            figures = measure_mode(name, args.runs, args.failure_timeout_s, session)
            append_records(args.results, [f.to_record() for f in figures])
    finally:
        session.stop()


# --- the parent: torchrun, then one child per Spark master ---------------------------------


def child_budget_s(num_modes: int, runs: int, failure_timeout_s: float) -> float:
    """A generous limit for one child: every trial's guard, plus JVM start and stop."""
    per_mode = 2 * (runs + 1) * 60 + 2 * runs * failure_timeout_s
    return 180 + per_mode * num_modes


def collect(args: argparse.Namespace, bench: Bench) -> list[Figure]:
    """Every figure asked for: torchrun in this process, each Spark master in a child."""
    figures: list[Figure] = []
    if "torchrun" in args.modes:
        bench.note("torchrun: measuring the reference")
        figures += measure_torchrun(args.runs, args.failure_timeout_s, bench.scratch)
    by_master: dict[str, list[str]] = {}
    for name in args.modes:
        master = MODES[name][1]
        if master is not None:
            by_master.setdefault(master, []).append(name)
    for master, modes in by_master.items():
        bench.note(f"{master}: measuring {', '.join(modes)}")
        argv = ["--modes", *modes, "--runs", str(args.runs)]
        argv += ["--failure-timeout-s", str(args.failure_timeout_s)]
        budget_s = child_budget_s(len(modes), args.runs, args.failure_timeout_s)
        figures += map(Figure.from_record, bench.child(master, argv, budget_s))
    return figures


def phase_tables(runs: int, bench: Bench) -> list[str]:
    """``launch_phases.py``'s breakdown of one warm local launch (``PHASE_RANKS`` ranks), each
    in a fresh driver process: where sparkdist's part of the figures above goes."""
    tables = []
    script = Path(__file__).with_name("launch_phases.py")
    for ranks in PHASE_RANKS:
        bench.note(f"phases: a warm local launch of {ranks} ranks, taken apart")
        command = [sys.executable, str(script), "--ranks", str(ranks), "--runs", str(runs)]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, cwd=bench.scratch, timeout=600, check=False
            )
        except subprocess.TimeoutExpired:
            tables.append(f"launch_phases.py --ranks {ranks}: ran out of time")
            continue
        if done.returncode != 0:
            tables.append(f"launch_phases.py --ranks {ranks} failed:\n{done.stderr[-2000:]}")
        else:
            tables.append(done.stdout.strip())
    return tables


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv)
    if args.child:
        run_child(args)
        return
    # sparkdist runs with MLflow tracking as users get it (on, the store in the scratch dir).
    with Bench(SCRIPT, tracking=True, keep_logs=args.keep_logs) as bench:
        figures = collect(args, bench)
        phases = []
        if args.phases and "local" in args.modes:
            phases = phase_tables(max(args.runs, PHASE_MIN_RUNS), bench)
    records = [f.to_record() for f in figures] + ratio_records(figures)
    emit([*records, bench.machine()], launch_table(figures))
    for table in phases:
        print(table, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
