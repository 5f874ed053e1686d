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
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import _jobs
from _measure import Figure, measure_failures, measure_launches
from _report import launch_table, machine_record, ratio_records

NUM_PROCESSES = 2
LOCAL_CLUSTER = "local-cluster[2,1,1024]"
#: --modes name -> (label in the output, the Spark master it runs under, local_mode).
MODES: dict[str, tuple[str, str | None, bool]] = {
    "local": ("local", "local[2]", True),  # pyspark's local mode needs an active session
    "local[2]": ("local[2]", "local[2]", False),
    "local-cluster": (LOCAL_CLUSTER, LOCAL_CLUSTER, False),
    "torchrun": ("local", None, True),  # no Spark: measured in the parent
}
DEFAULT_RUNS, QUICK_RUNS = 5, 2
DEFAULT_FAILURE_TIMEOUT_S, QUICK_FAILURE_TIMEOUT_S = 180.0, 90.0
#: Rank counts of the phase breakdown printed after the table (``launch_phases.py``), and the
#: fewest warm runs it takes the median of.
PHASE_RANKS, PHASE_MIN_RUNS = (2, 8), 5
#: Temp names must not start with "sparkdist-": the test suite counts those as leaked run dirs.
TEMP_PREFIX = "bench-launch-"


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


@contextlib.contextmanager
def pickled_by_value(module: ModuleType) -> Iterator[None]:
    """Make pyspark's cloudpickle ship ``module``'s functions by value.

    pyspark's torchrun workers cannot import the benchmark's modules; sparkdist ships them by
    value on its own (with its own cloudpickle), so it gets no such help.
    """
    from pyspark import cloudpickle as pyspark_cloudpickle

    pyspark_cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        pyspark_cloudpickle.unregister_pickle_by_value(module)  # type: ignore[no-untyped-call]


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
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc_per_node={NUM_PROCESSES}",
            _jobs.__file__,
            *job_args,
        ]
        self._running = subprocess.Popen(
            command,
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


def kill_tree(pid: int) -> None:
    """Kill process ``pid`` and every process under it (children first, then ``pid``)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.Error):
                proc.kill()


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


def start_session(master: str) -> Any:
    """A quiet SparkSession on ``master``, bound to loopback, with its executors registered."""
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master(master)
        .appName("sparkdist-benchmark-launch")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "lo")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    wait_for_executors(session, NUM_PROCESSES if master.startswith("local-cluster") else 0)
    return session


def wait_for_executors(session: Any, count: int, timeout_s: float = 120.0) -> None:
    """Block until ``count`` executors registered, so neither launcher pays for their start."""
    tracker = session.sparkContext._jsc.sc()
    deadline = time.monotonic() + timeout_s
    # The list includes the driver. Executors register with no event a Python caller can
    # wait on, hence the poll.
    while tracker.getExecutorMemoryStatus().size() < count + 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} executors did not register in {timeout_s:.0f} s")
        time.sleep(0.1)


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
    """Measure ``args.modes`` on the master ``args.child``; append a JSON record per figure."""
    session = start_session(args.child)
    try:
        for name in args.modes:
            figures = measure_mode(name, args.runs, args.failure_timeout_s, session)
            with args.results.open("a", encoding="utf-8") as out:
                out.writelines(json.dumps(f.to_record()) + "\n" for f in figures)
    finally:
        session.stop()


# --- the parent: torchrun, then one child per Spark master ---------------------------------


def spawn_child(
    master: str, modes: list[str], args: argparse.Namespace, workdir: Path, scratch: Path
) -> list[Figure]:
    """Run one Spark master's modes in a child process and return its figures.

    The child gets its own process group, killed once the child is done, so nothing either
    launcher started outlives it (stragglers are reported first).
    """
    tag = re.sub(r"\W+", "-", master).strip("-")
    results, log = workdir / f"{tag}.jsonl", workdir / f"{tag}.log"
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        master,
        "--modes",
        *modes,
        "--runs",
        str(args.runs),
        "--failure-timeout-s",
        str(args.failure_timeout_s),
        "--results",
        str(results),
    ]
    progress(f"{master}: measuring {', '.join(modes)}")
    with log.open("wb") as out:
        child = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=scratch, start_new_session=True
        )
        try:
            returncode: int | None = child.wait(
                timeout=child_budget_s(len(modes), args.runs, args.failure_timeout_s)
            )
        except subprocess.TimeoutExpired:
            returncode = None
        report_stragglers(child.pid, master)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    if returncode != 0:
        why = "ran out of time" if returncode is None else f"exited with {returncode}"
        progress(f"{master}: child {why}; the end of its output:\n{tail(log)}")
    if args.keep_logs:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        kept = args.keep_logs / log.name
        kept.write_bytes(log.read_bytes())
        progress(f"{master}: output kept in {kept}")
    if not results.exists():
        return []
    with results.open(encoding="utf-8") as lines:
        return [Figure.from_record(json.loads(line)) for line in lines]


def child_budget_s(num_modes: int, runs: int, failure_timeout_s: float) -> float:
    """A generous limit for one child: every trial's guard, plus JVM start and stop."""
    per_mode = 2 * (runs + 1) * 60 + 2 * runs * failure_timeout_s
    return 180 + per_mode * num_modes


def report_stragglers(pgid: int, master: str, grace_s: float = 10.0) -> None:
    """Report processes of the child's group still alive ``grace_s`` after the child ended.

    The grace covers the JVM, which exits on its own once its Python driver is gone.
    """
    import psutil

    group = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid != pgid and os.getpgid(proc.pid) == pgid:
                group.append(proc)
    _, alive = psutil.wait_procs(group, timeout=grace_s)
    stragglers = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            stragglers.append(f"  {proc.pid}: {' '.join(proc.cmdline())[:160]}")
    if stragglers:
        progress(
            f"{master}: {len(stragglers)} process(es) outlived the child by "
            f"{grace_s:.0f} s; killing them:\n" + "\n".join(stragglers)
        )


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def progress(message: str) -> None:
    print(f"[launch.py] {message}", file=sys.stderr, flush=True)


def collect(args: argparse.Namespace, workdir: Path, scratch: Path) -> list[Figure]:
    """Every figure asked for: torchrun in this process, each Spark master in a child.

    Children and torchrun run in ``scratch`` (their cwd and TMPDIR); ``workdir`` holds the
    children's results and logs.
    """
    figures: list[Figure] = []
    if "torchrun" in args.modes:
        progress("torchrun: measuring the reference")
        figures += measure_torchrun(args.runs, args.failure_timeout_s, scratch)
    by_master: dict[str, list[str]] = {}
    for name in args.modes:
        master = MODES[name][1]
        if master is not None:
            by_master.setdefault(master, []).append(name)
    for master, modes in by_master.items():
        figures += spawn_child(master, modes, args, workdir, scratch)
    return figures


def report_leftovers(scratch: Path) -> dict[str, int]:
    """What the launchers left in their cwd and TMPDIR, by name pattern, with counts.

    ``tempfile`` names end in 8 random characters; those become ``*`` (``tmp*``,
    ``torchelastic_*``), so 60 leaked directories read as one entry.
    """
    leftovers: dict[str, int] = {}
    for name in sorted(os.listdir(scratch)):
        pattern = re.sub(r"[a-z0-9_]{8}$", "*", name) if "." not in name else name
        leftovers[pattern] = leftovers.get(pattern, 0) + 1
    if leftovers:
        listed = ", ".join(f"{pattern} x{count}" for pattern, count in leftovers.items())
        progress(f"left behind in the launchers' cwd/TMPDIR: {listed}")
    return leftovers


def phase_tables(runs: int, scratch: Path) -> list[str]:
    """``launch_phases.py``'s breakdown of one warm local launch (``PHASE_RANKS`` ranks), each
    in a fresh driver process: where sparkdist's part of the figures above goes."""
    tables = []
    script = Path(__file__).with_name("launch_phases.py")
    for ranks in PHASE_RANKS:
        progress(f"phases: a warm local launch of {ranks} ranks, taken apart")
        command = [sys.executable, str(script), "--ranks", str(ranks), "--runs", str(runs)]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, cwd=scratch, timeout=600, check=False
            )
        except subprocess.TimeoutExpired:
            tables.append(f"launch_phases.py --ranks {ranks}: ran out of time")
            continue
        if done.returncode != 0:
            tables.append(f"launch_phases.py --ranks {ranks} failed:\n{done.stderr[-2000:]}")
        else:
            tables.append(done.stdout.strip())
    return tables


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help=f"timed runs per figure (default {DEFAULT_RUNS}, {QUICK_RUNS} with "
        "--quick); launch times add one untimed warm-up",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="what to measure (default: all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: {QUICK_RUNS} runs, a {QUICK_FAILURE_TIMEOUT_S:.0f} s "
        "guard on failing runs",
    )
    parser.add_argument(
        "--failure-timeout-s",
        type=float,
        default=None,
        help="give up on a failing run after this long (default "
        f"{DEFAULT_FAILURE_TIMEOUT_S:.0f} s)",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        metavar="DIR",
        help="copy each Spark child's output (rank lines, Spark logs) into DIR",
    )
    parser.add_argument(
        "--no-phases",
        dest="phases",
        action="store_false",
        help="skip the phase breakdown of warm local launches (launch_phases.py), which "
        "runs with the local mode",
    )
    parser.add_argument("--child", metavar="MASTER", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs is None:
        args.runs = QUICK_RUNS if args.quick else DEFAULT_RUNS
    if args.failure_timeout_s is None:
        args.failure_timeout_s = (
            QUICK_FAILURE_TIMEOUT_S if args.quick else DEFAULT_FAILURE_TIMEOUT_S
        )
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    # Loopback only: Spark's driver and executors, and every rank's gloo traffic.
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.child:
        run_child(args)
        return
    load_before, started = os.getloadavg(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX) as workdir:
        # The launchers' files (run dirs, an MLflow store in the cwd...) land in a scratch dir
        # of their own: nothing reaches the checkout, and what is left over gets reported.
        scratch = Path(workdir) / "scratch"
        scratch.mkdir()
        os.environ["TMPDIR"] = str(scratch)
        figures = collect(args, Path(workdir), scratch)
        phases = (
            phase_tables(max(args.runs, PHASE_MIN_RUNS), scratch)
            if args.phases and "local" in args.modes
            else []
        )
        leftovers = report_leftovers(scratch)
    records = [f.to_record() for f in figures] + ratio_records(figures)
    records.append(machine_record(load_before, time.monotonic() - started, leftovers))
    for record in records:
        print(json.dumps(record))
    print()
    print(launch_table(figures), flush=True)
    for table in phases:
        print(table, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
