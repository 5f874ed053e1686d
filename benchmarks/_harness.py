"""What the benchmark scripts share: loopback settings, a scratch directory, one child process
per driver (each in its own process group, checked for stragglers), leftovers, JSON lines and
an aligned table.

Every script follows ``launch.py``'s shape: the parent sets the environment, creates a scratch
directory (the children's cwd and ``TMPDIR``), runs each kind of driver (a Spark master, a
Connect session, a fresh local driver) as this script re-invoked with ``--child KIND
--results FILE``, then prints one JSON line per figure and a table. The children append JSON
records to ``FILE``; their output goes to a log whose tail is shown when they fail.

Non-goals: what is measured (each script), ``launch.py``'s own figures (``_measure``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _report import machine_record

if TYPE_CHECKING:
    from typing_extensions import Self

#: Every process a benchmark starts inherits this marker (with a fresh value per benchmark run),
#: so processes that outlive a child are found by their environment, whichever session or
#: process group they moved to (sparkdist's zygote and ranks start sessions of their own).
MARKER_VAR = "SPARKDIST_BENCHMARK_RUN"
#: torchrun runs with this subdirectory of the scratch dir as TMPDIR, so what it leaves
#: (``torchelastic_*``) is told apart from what sparkdist leaves.
TORCHRUN_TMP = "torchrun-tmp"


def set_loopback_env() -> None:
    """Keep every byte on loopback and tracking off; executors use this interpreter."""
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["SPARKDIST_MLFLOW"] = "0"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def progress(script: str, message: str) -> None:
    print(f"[{script}] {message}", file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def seconds(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} MB"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned; the last one left ragged."""
    table = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    return "\n".join(
        (
            "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True))
            + "  "
            + row[-1]
        ).rstrip()
        for row in table
    )


def append_records(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """A child's way to hand figures to its parent (appended as they are measured)."""
    with path.open("a", encoding="utf-8") as out:
        out.writelines(json.dumps(record) + "\n" for record in records)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


@dataclass
class Bench:
    """One benchmark run in the parent: its scratch directory, children and final report.

    Use as a context manager; ``scratch`` is every child's cwd and ``TMPDIR``.
    """

    script: str
    workdir: Path = field(init=False)
    scratch: Path = field(init=False)
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    load_before: tuple[float, float, float] = field(default_factory=os.getloadavg)
    started: float = field(default_factory=time.monotonic)
    stragglers: dict[str, int] = field(default_factory=dict)
    leftovers: dict[str, int] = field(default_factory=dict)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> Self:
        set_loopback_env()
        self.workdir = Path(
            self._stack.enter_context(tempfile.TemporaryDirectory(prefix=f"bench-{self.script}-"))
        )
        # Whatever the launchers write (run dirs, Spark's local dirs, an MLflow store in the
        # cwd) lands here: nothing reaches the checkout, and what is left over is reported.
        self.scratch = self.workdir / "scratch"
        self.scratch.mkdir()
        os.environ["TMPDIR"] = str(self.scratch)
        tempfile.tempdir = None
        os.environ[MARKER_VAR] = self.marker
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.leftovers = report_leftovers(self.script, self.scratch)
        finally:
            self._stack.close()

    def note(self, message: str) -> None:
        progress(self.script, message)

    def child(
        self,
        kind: str,
        argv: Sequence[str],
        budget_s: float,
        env: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Run this script again as ``--child kind argv...``; return the records it wrote.

        The child runs in its own process group with ``scratch`` as cwd and TMPDIR. Once it
        exits (or runs out of ``budget_s``), every process still carrying this run's marker
        gets 10 s to exit (the JVM exits on its own once its Python driver is gone) and is
        then reported and killed.
        """
        tag = re.sub(r"\W+", "-", kind).strip("-") + f"-{time.monotonic_ns()}"
        results, log = self.workdir / f"{tag}.jsonl", self.workdir / f"{tag}.log"
        command = [
            sys.executable,
            os.path.abspath(sys.argv[0]),
            "--child",
            kind,
            "--results",
            str(results),
            *argv,
        ]
        self.note(f"{kind}: child started")
        started = time.monotonic()
        with log.open("wb") as out:
            child = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.scratch,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
            try:
                returncode: int | None = child.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                returncode = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        survivors = kill_stragglers(self.marker)
        if survivors:
            self.note(
                f"{kind}: {len(survivors)} process(es) outlived the child by 10 s, "
                "killed:\n" + "\n".join(survivors)
            )
            self.stragglers[kind] = self.stragglers.get(kind, 0) + len(survivors)
        if returncode != 0:
            why = "ran out of time" if returncode is None else f"exited with {returncode}"
            self.note(f"{kind}: child {why}; the end of its output:\n{tail(log)}")
        else:
            self.note(f"{kind}: child done in {time.monotonic() - started:.1f} s")
        return read_records(results)

    def machine(self, **extra: Any) -> dict[str, Any]:
        """``_report.machine_record`` plus the stragglers, the 1/5/15-minute loads and extras."""
        record = machine_record(self.load_before, time.monotonic() - self.started, self.leftovers)
        record["loadavg_before"] = [round(x, 2) for x in self.load_before]
        record["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        record["stragglers"] = dict(self.stragglers)
        record.update(extra)
        return record


def emit(records: Sequence[Mapping[str, Any]], table: str, title: str = "") -> None:
    """Print the JSON lines, then the table (stdout); progress went to stderr."""
    for record in records:
        print(json.dumps(record))
    print()
    if title:
        print(title)
    print(table, flush=True)


def kill_stragglers(marker: str, grace_s: float = 10.0) -> list[str]:
    """Processes (not this one) carrying ``marker``: wait ``grace_s``, kill, describe them."""
    import psutil

    own = {os.getpid()}
    marked = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in own:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARKER_VAR) == marker:
                marked.append(proc)
    _, alive = psutil.wait_procs(marked, timeout=grace_s)
    described = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            described.append(f"  {proc.pid} {proc.name()}: {' '.join(proc.cmdline())[:160]}")
            proc.kill()
    return described


def report_leftovers(script: str, scratch: Path) -> dict[str, int]:
    """What the children left in their cwd/TMPDIR, by name pattern (random tails as ``*``)."""
    leftovers: dict[str, int] = {}
    names = sorted(os.listdir(scratch))
    if TORCHRUN_TMP in names:  # torchrun's own TMPDIR: its contents are listed, not the dir
        names.remove(TORCHRUN_TMP)
        names += [f"{TORCHRUN_TMP}/{n}" for n in sorted(os.listdir(scratch / TORCHRUN_TMP))]
    for name in names:
        # tempfile names end in 8 random characters: "torchelastic_*", "tmp*".
        # Spark's directories end in a UUID: "blockmgr-*".
        pattern = re.sub(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "*", name)
        pattern = re.sub(r"^(tmp|.*[_-])[a-z0-9_]{8}$", r"\1*", pattern)
        leftovers[pattern] = leftovers.get(pattern, 0) + 1
    if leftovers:
        listed = ", ".join(f"{pattern} x{count}" for pattern, count in leftovers.items())
        progress(script, f"left behind in the children's cwd/TMPDIR: {listed}")
    return leftovers


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


class PeakSampler:
    """A process's peak ``VmRSS`` and ``RssAnon`` (MB) over a ``with`` block.

    ``RssAnon`` is memory the process owns; ``VmRSS`` also counts resident pages of mapped files
    (page cache a memory-mapped Arrow file brings in, which the kernel can drop at will). The RSS
    peak is exact where the kernel lets us reset the process's high-water mark (``VmHWM``, by
    writing 5 to ``/proc/PID/clear_refs``); ``RssAnon`` has no high-water mark, so it is sampled
    on a daemon thread every ``interval_s`` (a spike shorter than that can be missed).

    Example::

        with PeakSampler() as peak:
            work()
        peak.rss_mb, peak.anon_mb, peak.start_rss_mb
    """

    def __init__(self, pid: int | None = None, interval_s: float = 0.005) -> None:
        import threading

        self._proc = f"/proc/{pid or os.getpid()}"
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-sampler", daemon=True)
        self._hwm_reset = False
        self.start_rss_mb = self.start_anon_mb = 0.0
        self.rss_mb = self.anon_mb = 0.0

    def read(self) -> tuple[float, float]:
        """The current (VmRSS, RssAnon) in MB."""
        values = self._status()
        return values.get("VmRSS:", 0.0), values.get("RssAnon:", 0.0)

    def _status(self) -> dict[str, float]:
        values = {}
        with open(f"{self._proc}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(("VmRSS:", "RssAnon:", "VmHWM:")):
                    key, amount, _ = line.split()
                    values[key] = int(amount) / 1024
        return values

    def _sample(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                rss, anon = self.read()
                self.rss_mb, self.anon_mb = max(self.rss_mb, rss), max(self.anon_mb, anon)
            self._stop.wait(self._interval_s)

    def __enter__(self) -> Self:
        try:
            with open(f"{self._proc}/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")  # VmHWM := VmRSS
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        self.start_rss_mb, self.start_anon_mb = self.read()
        self.rss_mb, self.anon_mb = self.start_rss_mb, self.start_anon_mb
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError, ValueError):
            values = self._status()
            peak = values.get("VmHWM:", 0.0) if self._hwm_reset else 0.0
            self.rss_mb = max(self.rss_mb, values.get("VmRSS:", 0.0), peak)
            self.anon_mb = max(self.anon_mb, values.get("RssAnon:", 0.0))


@contextlib.contextmanager
def timer() -> Iterator[list[float]]:
    """``with timer() as elapsed: ...``; then ``elapsed[0]`` is the wall time in seconds."""
    elapsed: list[float] = []
    started = time.perf_counter()
    try:
        yield elapsed
    finally:
        elapsed.append(time.perf_counter() - started)


def classic_session(
    master: str, app: str, scratch: Path | None = None, conf: Mapping[str, str] | None = None
) -> Any:
    """A quiet classic SparkSession on loopback (executors use this interpreter).

    With ``scratch``, Spark's local dirs (shuffle files, block manager) and the JVM's temp dir
    go there, so whatever Spark leaves behind is seen by the leftover report.
    """
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.pyspark.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "lo")
        .config("spark.executorEnv.SPARKDIST_MLFLOW", "0")
    )
    if scratch is not None:
        builder = builder.config("spark.local.dir", str(scratch)).config(
            "spark.driver.extraJavaOptions", f"-Djava.io.tmpdir={scratch}"
        )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


@dataclass
class TorchrunResult:
    """One finished ``torchrun`` call: exit status, merged output, wall time."""

    returncode: int | None  # None: it ran out of time and was killed with its workers
    output: str
    wall_s: float


def run_torchrun(
    nproc: int,
    script: str,
    *script_args: str,
    timeout_s: float = 300.0,
    cwd: str | os.PathLike[str] | None = None,
) -> TorchrunResult:
    """``torchrun --standalone --nnodes=1 --nproc_per_node=nproc script args...``.

    torchrun starts its workers in sessions of their own, so a run that outlives ``timeout_s``
    is killed process tree first. Its TMPDIR is ``TORCHRUN_TMP`` under ``cwd`` (default: this
    process's cwd).
    """
    import psutil

    tmpdir = Path(cwd or os.getcwd()) / TORCHRUN_TMP
    tmpdir.mkdir(exist_ok=True)

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        script,
        *script_args,
    ]
    started = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        cwd=cwd,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(process.pid)
            for proc in [*root.children(recursive=True), root]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        output, _ = process.communicate()
        returncode = None
    return TorchrunResult(returncode, output, time.perf_counter() - started)
