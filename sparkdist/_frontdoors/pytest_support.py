"""The machinery behind sparkdist's pytest plugin (``sparkdist.pytest_plugin``).

Four parts, each usable without pytest's hooks: which Spark master a test session uses
(``resolve_master``), the session's SparkSession (``SparkSessions``: one SparkContext per
process, reused when one is already active, stopped only if we started it; its conf is
``pytest_spark_conf``'s), the processes of this session's runs (``rank_processes``: a
per-session environment marker, which every rank and every warm-pool zygote inherits, keeps
other sessions' processes out), and what CUDA this machine offers (``cuda_devices``, decided
without importing torch).

Everything heavy (pyspark, psutil, the launcher) is imported inside the function that needs it:
pytest imports the plugin in every session of every project installed next to sparkdist.

Non-goals: pytest hooks, options and fixtures (``pytest_plugin``); launching (``_launcher``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparkdist._backends.session import create_session
from sparkdist._core.env import PYTEST_SESSION_VAR, RUN_ID_VAR, ZYGOTE_VAR
from sparkdist._frontdoors.pytest_spark_conf import QUIET_LOG4J2, session_conf
from sparkdist._node.host.gpus import visible_gpus
from sparkdist._node.pool.zygote import RANK_NAME_PREFIX, SPARE_NAME

#: Environment variable naming the pytest session a run belongs to. Set in the pytest process
#: (and passed to every rank), so the leak check never counts another session's processes.
SESSION_MARKER_VAR = PYTEST_SESSION_VAR
#: ``ZYGOTE_VAR`` is set in the environment of a warm pool's zygote (``_pool``); its parked
#: children are named ``SPARE_NAME`` until they become ranks.

DEFAULT_MASTER = "local[2]"
CLUSTER_MASTER = "local-cluster[2,1,1024]"
MASTER_ALIASES = {"local": DEFAULT_MASTER, "cluster": CLUSTER_MASTER}
#: Seconds one distributed run of a test may take before every rank is stopped.
DEFAULT_TIMEOUT_S = 120.0
#: Seconds the leak check waits for processes that are already on their way out.
LEFTOVER_GRACE_S = 2.0

# -- the Spark master ---------------------------------------------------------------------------


def is_cluster_master(master: str) -> bool:
    """Whether ``master`` runs executors in processes of their own (not plain ``local[n]``)."""
    return not re.fullmatch(r"local(\[[^\]]*\])?", master.strip())


def resolve_master(requested: str | None, wants_cluster: bool) -> str:
    """The session's one Spark master.

    Args:
        requested: ``--sparkdist-spark-master`` / ini ``sparkdist_spark_master`` ("local" and
            "cluster" are short for ``local[2]`` and ``local-cluster[2,1,1024]``), or None.
        wants_cluster: whether a test selected for this session is marked ``spark_cluster``.

    Only one SparkContext can live in a process, and switching masters mid-session would leave
    session-scoped fixtures built on ``spark`` holding a stopped session; so one master serves
    the whole session, and a ``spark_cluster`` test makes it a local-cluster.
    """
    if requested:
        return MASTER_ALIASES.get(requested.strip(), requested.strip())
    return CLUSTER_MASTER if wants_cluster else DEFAULT_MASTER


def parse_spark_conf(lines: list[str]) -> dict[str, str]:
    """``key=value`` lines (ini ``sparkdist_spark_conf``) as a dict; refuse anything else."""
    conf = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"sparkdist_spark_conf: {line!r} is not a key=value line; write e.g. "
                "spark.sql.shuffle.partitions=2"
            )
        conf[key.strip()] = value.strip()
    return conf


class SparkSessionConflict(RuntimeError):
    """A SparkContext for another master, which the plugin did not start, is active."""


class SparkSessions:
    """The test session's SparkSession: created on first use and stopped at the end.

    A session already active in this process (a conftest's, say) is reused when its master is
    the one wanted, and is never stopped by us; one for another master is refused, because a
    process holds only one SparkContext.
    """

    def __init__(self, master: str, extra_conf: Mapping[str, str] | None = None) -> None:
        self.master = master
        self.extra_conf = dict(extra_conf or {})
        self._owned: Any | None = None
        self._log_dir: str | None = None

    @property
    def owns_session(self) -> bool:
        return self._owned is not None and _alive(self._owned)

    def get(self) -> Any:
        """The SparkSession for ``self.master``: the active one, or a new quiet one."""
        from pyspark import SparkContext
        from pyspark.sql import SparkSession

        if self.owns_session:
            return self._owned
        active = SparkContext._active_spark_context
        if active is not None:
            if active.master != self.master:
                raise SparkSessionConflict(
                    f"a SparkSession for master {active.master!r}, not started by sparkdist's "
                    f"pytest plugin, is active in this process, and the plugin's is "
                    f"{self.master!r}; a process holds only one SparkContext. Stop that one "
                    f"first, or run pytest with --sparkdist-spark-master={active.master!r} to "
                    "reuse it"
                )
            return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
        self._owned = self._create()
        return self._owned

    def _create(self) -> Any:
        # Loopback only: the driver, its block manager and (local-cluster) the executors.
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        if self._log_dir is None:
            # Not "sparkdist-*": that prefix marks a run's directory.
            self._log_dir = tempfile.mkdtemp(prefix="sparkdist_pytest-log4j2-")
        log_conf = os.path.join(self._log_dir, "log4j2.properties")
        with open(log_conf, "w", encoding="utf-8") as f:
            f.write(QUIET_LOG4J2)
        conf = session_conf(self.master, log_conf, self.extra_conf)
        return create_session(self.master, conf, app_name="sparkdist-pytest", log_level="ERROR")

    def stop(self) -> None:
        """Stop the session if we started it (a session we reused is left alone)."""
        owned, self._owned = self._owned, None
        if owned is not None and _alive(owned):
            owned.stop()
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None


def _alive(session: Any) -> bool:
    return getattr(session.sparkContext, "_jsc", None) is not None


# -- processes and run directories left behind ------------------------------------------------


@dataclass(frozen=True)
class RankProcess:
    """A live process of one of this session's runs."""

    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.command[:160]}"


@dataclass(frozen=True)
class _Process:
    pid: int
    ppid: int
    name: str
    env: Mapping[str, str]
    command: str


def rank_processes(session_marker: str) -> list[RankProcess]:
    """Live processes of runs started in the pytest session ``session_marker``.

    A cold-started rank (and whatever it starts) has a run id and this session's marker in its
    environment. A rank forked by a warm pool's zygote shows the zygote's environment instead,
    so it is found by its process name ("sparkdist-r<rank>") or as a descendant of one of this
    session's zygotes (a zygote and its parked spares belong to the pool, not to a run, and are
    not counted). Processes of other sessions on the machine never match.
    """
    table = _process_table()
    ours = {p.pid: p for p in table if p.env.get(SESSION_MARKER_VAR) == session_marker}
    found = {
        pid: p
        for pid, p in ours.items()
        if RUN_ID_VAR in p.env or p.name.startswith(RANK_NAME_PREFIX)
    }
    # A forked rank shows its zygote's environment too: the zygote is the one whose parent
    # does not.
    in_pool = {
        pid for pid, p in ours.items() if p.env.get(ZYGOTE_VAR) == "1" and RUN_ID_VAR not in p.env
    }
    zygotes = [pid for pid in in_pool if ours[pid].ppid not in in_pool]
    children: dict[int, list[_Process]] = {}
    for proc in table:
        children.setdefault(proc.ppid, []).append(proc)
    # A zygote's child still under the zygote's own name was forked a moment ago and has not
    # named itself a spare yet: it belongs to the pool too.
    pending = [
        child for pid in zygotes for child in children.get(pid, []) if child.name != ours[pid].name
    ]
    while pending:
        proc = pending.pop()
        if proc.name == SPARE_NAME:
            continue
        found.setdefault(proc.pid, proc)
        pending.extend(children.get(proc.pid, []))
    # A forked process's command line is still the zygote's: say what it is instead.
    return [
        RankProcess(
            p.pid,
            p.command
            if RUN_ID_VAR in p.env
            else f"{p.name}, forked by the warm worker pool ({p.command})",
        )
        for p in sorted(found.values(), key=lambda p: p.pid)
    ]


def _process_table() -> list[_Process]:
    """Every live (non-zombie) process: psutil's view, or /proc's where psutil is missing."""
    try:
        import psutil  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return _process_table_from_proc()
    table = []
    for proc in psutil.process_iter(["pid", "ppid", "name", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                env: Mapping[str, str] = proc.environ()
            except psutil.AccessDenied:  # another user's: never ours
                env = {}
            table.append(
                _Process(
                    proc.pid,
                    proc.info["ppid"] or 0,
                    proc.info["name"] or "",
                    env,
                    " ".join(proc.cmdline()) or proc.info["name"] or "",
                )
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return table


def _process_table_from_proc() -> list[_Process]:
    """The same from /proc (Linux); elsewhere, without psutil, nothing is seen."""
    table = []
    for entry in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(entry, "stat"), "rb") as f:
                stat = f.read()
            name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
            state, ppid = stat[stat.rindex(b")") + 1 :].split()[:2]
            if state == b"Z":
                continue
            try:
                with open(os.path.join(entry, "environ"), "rb") as f:
                    pairs = (item.partition(b"=") for item in f.read().split(b"\0") if item)
                    env = {
                        k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs
                    }
            except PermissionError:
                env = {}
            with open(os.path.join(entry, "cmdline"), "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            table.append(
                _Process(int(os.path.basename(entry)), int(ppid), name, env, command or name)
            )
        except (OSError, ValueError, IndexError):
            continue
    return table


def reap_rank_processes(
    session_marker: str, grace_s: float = LEFTOVER_GRACE_S
) -> list[RankProcess]:
    """Wait up to ``grace_s`` for this session's run processes to end; kill and return the rest.

    Only processes that carry ``session_marker`` are ever killed.
    """
    deadline = time.monotonic() + grace_s
    survivors = rank_processes(session_marker)
    while survivors and time.monotonic() < deadline:
        time.sleep(0.05)  # processes being killed by their agent have no event to wait on
        survivors = rank_processes(session_marker)
    for proc in survivors:  # the list was just read, so these pids are still ours
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    return survivors


def run_directories(run_ids: list[str]) -> list[str]:
    """Run directories of these runs still on disk (the agent removes its own when it ends)."""
    tmp = tempfile.gettempdir()
    pattern = os.path.join(tmp, "sparkdist-{}-*")
    return sorted(d for run_id in run_ids for d in glob.glob(pattern.format(run_id)))


# -- CUDA -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaDevices:
    """How many CUDA GPUs tests may use here, and when none, why."""

    count: int
    why_none: str = ""


def cuda_devices() -> CudaDevices:
    """The CUDA GPUs usable by tests, found with nvidia-smi; torch is not imported."""
    if shutil.which("nvidia-smi") is None:
        return CudaDevices(0, "no NVIDIA GPU here (nvidia-smi not found)")
    gpus = visible_gpus()
    if not gpus:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        if mask is not None:
            return CudaDevices(0, f"no GPU visible (CUDA_VISIBLE_DEVICES={mask!r})")
        return CudaDevices(0, "nvidia-smi lists no GPU")
    problem = _torch_cuda_problem()
    if problem is not None:
        return CudaDevices(0, problem)
    return CudaDevices(len(gpus))


def _torch_cuda_problem() -> str | None:
    """Why the installed torch cannot use CUDA, read from torch/version.py without importing."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "torch is not installed"
    for location in spec.submodule_search_locations:
        try:
            with open(os.path.join(location, "version.py"), encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        cuda = re.search(r"^cuda\b[^=\n]*=\s*(.+)$", text, re.MULTILINE)
        if cuda is not None and cuda.group(1).strip() == "None":
            version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.MULTILINE)
            name = version.group(1) if version else "?"
            return f"this torch ({name}) is a CPU-only build"
    return None


def gpu_marker_count(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The n of ``@pytest.mark.multi_gpu(n)`` (or ``n=...``); ValueError if it is missing."""
    value = kwargs.get("n", args[0] if args else None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"@pytest.mark.multi_gpu needs the number of GPUs as a positive integer, e.g. "
            f"@pytest.mark.multi_gpu(2); got {value!r}"
        )
    return value
