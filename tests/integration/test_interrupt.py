"""An interrupted run leaves nothing behind.

Whatever interrupts the thread waiting in ``run()`` / ``fn.distributed()`` (Ctrl-C, pytest-timeout's
``Failed`` raised from its SIGALRM handler, any exception raised into it, an exception from the
caller's own code after the ranks started) propagates unchanged, and by then every rank and
every process the ranks started is gone: children in the rank's process group, a child that
left it with setsid, and a daemon whose parent already exited. Each rank records the pids of its
tree (``start_trees``); the test interrupts from a timer thread once every tree is up and
measures, from the interrupt, how long the last recorded process lived.

Bounds: 2 s in local mode (measured on 2 cores: 0.04-0.07 s idle, up to 0.16 s at load 7), 5 s
through a local[2] Spark stage (measured: 0.1-0.4 s idle, up to 2.0 s at load 11-14; pyspark's
own Ctrl-C handler cancels the job first, and the driver still waits for every agent's bye).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from sparkdist import Distributor, TorchDistributor, distributed
from sparkdist._frontdoors.pytest_support import SESSION_MARKER_VAR, rank_processes
from tests.conftest import REPO, run_processes

#: Processes each rank records: itself, two 3-process trees, one orphaned daemon.
PER_RANK = 8
LOCAL_BOUND_S = 2.0
SPARK_BOUND_S = 5.0


def start_trees(out_dir: str) -> None:
    """A rank: start what a compile step or a data server would, record it all, then sleep.

    Two ``sh`` trees of three processes (grandchildren included): one in the rank's process
    group, one in a session of its own (``setsid``); and a daemon whose parent exits at once,
    so no tree walk reaches it (it records its own pid).
    """
    import json
    import os
    import subprocess
    import time

    import psutil

    daemon_file = os.path.join(out_dir, f"daemon-{os.getpid()}")
    children = [
        subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"]),
        subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"], start_new_session=True),
        subprocess.Popen(
            [
                "sh",
                "-c",
                # Written aside and renamed: the reader never sees the file half-written.
                f"setsid sh -c 'echo $$ > {daemon_file}.part && mv {daemon_file}.part"
                f" {daemon_file}.tmp; exec sleep 300' &",
            ]
        ),
    ]
    children[2].wait()  # the daemon's parent is gone: the daemon is an orphan now
    me = psutil.Process()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tree = [me, *me.children(recursive=True)]
        if len(tree) >= 7 and os.path.exists(daemon_file + ".tmp"):
            break
        time.sleep(0.01)
    with open(daemon_file + ".tmp") as f:
        tree.append(psutil.Process(int(f.read().strip())))
    record = [[p.pid, p.create_time()] for p in tree]
    path = os.path.join(out_dir, f"rank-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    time.sleep(300)


def recorded(out_dir: Path) -> list[tuple[int, float]]:
    found = []
    for path in out_dir.glob("rank-*.json"):
        found.extend((pid, created) for pid, created in json.loads(path.read_text()))
    return found


def wait_for_trees(out_dir: Path, ranks: int, timeout_s: float = 120.0) -> bool:
    """Until every rank recorded its tree (a file event), or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(list(out_dir.glob("rank-*.json"))) >= ranks:
            return True
        time.sleep(0.01)
    return False


def alive(procs: list[tuple[int, float]]) -> list[int]:
    """Which of ``procs`` still run (same pid and start time; a zombie has ended)."""
    living = []
    for pid, created in procs:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                living.append(pid)
        except psutil.NoSuchProcess:
            pass
    return living


def last_gone_after(procs: list[tuple[int, float]], since: float, limit_s: float = 20.0) -> float:
    """Seconds from ``since`` (monotonic) until none of ``procs`` runs; kills and fails the
    test past ``limit_s``."""
    deadline = since + limit_s
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.005)
    survivors = alive(procs)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes of the ranks survived the interrupt: {survivors}"
    return time.monotonic() - since


class Interrupter:
    """Once every rank recorded its tree, interrupts the main thread from a timer thread."""

    def __init__(self, out_dir: Path, ranks: int, signum: int = signal.SIGINT) -> None:
        self.out_dir, self.ranks, self.signum = out_dir, ranks, signum
        self.at: float | None = None
        self.procs: list[tuple[int, float]] = []
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Interrupter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=5)

    def _run(self) -> None:
        wait_for_trees(self.out_dir, self.ranks)  # on a timeout, interrupt anyway: no hang
        self.procs = recorded(self.out_dir)
        self.at = time.monotonic()
        assert self._main is not None
        signal.pthread_kill(self._main, self.signum)


class Raised(BaseException):
    """Not an Exception, as pytest-timeout's ``Failed`` is not."""


@pytest.fixture
def raise_on_sigusr1() -> Callable[[type[BaseException]], None]:
    """Install a SIGUSR1 handler that raises the given exception in the main thread."""
    previous = signal.getsignal(signal.SIGUSR1)

    def install(kind: type[BaseException]) -> None:
        def handler(signum: int, frame: object) -> None:
            raise kind("raised into the waiting thread")

        signal.signal(signal.SIGUSR1, handler)

    yield install
    signal.signal(signal.SIGUSR1, previous)


def _measure(
    tmp_path: Path, signum: int, run: Callable[[], object], expected: type[BaseException]
) -> pytest.ExceptionInfo[BaseException]:
    with Interrupter(tmp_path, 2, signum) as interrupter, pytest.raises(expected) as info:
        run()
    assert interrupter.at is not None and len(interrupter.procs) == 2 * PER_RANK
    returned_after = time.monotonic() - interrupter.at
    # run() returned only once everything was gone.
    assert not alive(interrupter.procs), "run() returned while processes of the ranks lived"
    gone_after = last_gone_after(interrupter.procs, interrupter.at)
    print(f"interrupt -> run() raised {returned_after:.3f} s, last process gone {gone_after:.3f} s")
    assert gone_after <= LOCAL_BOUND_S
    assert not run_processes()
    return info


def test_ctrl_c_in_distributor_run(tmp_path):
    def run() -> object:
        return Distributor(2, use_gpu=False).run(start_trees, str(tmp_path))

    info = _measure(tmp_path, signal.SIGINT, run, KeyboardInterrupt)
    assert info.type is KeyboardInterrupt


def test_base_exception_in_torch_distributor_run(tmp_path, raise_on_sigusr1):
    raise_on_sigusr1(Raised)

    def run() -> object:
        return TorchDistributor(2, local_mode=True, use_gpu=False).run(start_trees, str(tmp_path))

    info = _measure(tmp_path, signal.SIGUSR1, run, Raised)
    assert type(info.value) is Raised and str(info.value) == "raised into the waiting thread"


def test_exception_in_decorated_function(tmp_path, raise_on_sigusr1):
    raise_on_sigusr1(LookupError)
    fn = distributed(gpus=2, use_gpu=False)(start_trees)
    info = _measure(tmp_path, signal.SIGUSR1, lambda: fn.distributed(str(tmp_path)), LookupError)
    assert type(info.value) is LookupError


def test_async_handle_cancel_returns_once_everything_is_gone(tmp_path):
    fn = distributed(gpus=2, use_gpu=False)(start_trees)
    run = fn.distributed_async(str(tmp_path))
    assert wait_for_trees(tmp_path, 2)
    procs = recorded(tmp_path)
    started = time.monotonic()
    assert run.cancel() is True
    returned_after = time.monotonic() - started
    assert not alive(procs), "cancel() returned while processes of the ranks lived"
    print(f"cancel() returned after {returned_after:.3f} s")
    assert returned_after <= LOCAL_BOUND_S
    with pytest.raises(concurrent.futures.CancelledError):
        run.result(timeout=10)
    assert run.cancel() is False  # already over


def test_a_failing_callback_on_the_callers_side_stops_the_ranks(tmp_path):
    """The decorator logs a warning after the ranks started; a log handler that raises (on
    the caller's thread) must not leave them running."""

    class Failing(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise RuntimeError("the log handler failed")

    handler = Failing(level=logging.WARNING)
    logging.getLogger("sparkdist").addHandler(handler)
    try:
        fn = distributed(gpus=2)(start_trees)  # no use_gpu=: a CPU run logs a warning
        with pytest.raises(RuntimeError, match="the log handler failed"):
            fn.distributed(str(tmp_path))
    finally:
        logging.getLogger("sparkdist").removeHandler(handler)
    assert not alive(recorded(tmp_path))
    # A rank whose fork the stop interrupted (the zygote forked it, its answer went unread)
    # never ran the function and ends itself when its control pipe closes, milliseconds
    # later: allow it that, not more (known window, see docs/architecture.md: warm pool).
    deadline = time.monotonic() + 1.0
    while run_processes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not run_processes()


INNER_TEST = textwrap.dedent("""
    import os, signal, time
    from pathlib import Path

    from sparkdist import Distributor
    from test_interrupt_helpers import start_trees

    OUT = Path(os.environ["INTERRUPT_OUT"])
    # Warm the pool at collection, outside the timeout: the ranks then start in well under it.
    Distributor(1, use_gpu=False).run(int)

    def test_times_out():
        previous = signal.getsignal(signal.SIGALRM)  # pytest-timeout's handler

        def stamp_then_fail(signum, frame):
            (OUT / "alarm").write_text(repr(time.monotonic()))
            previous(signum, frame)  # raises pytest's Failed

        signal.signal(signal.SIGALRM, stamp_then_fail)
        try:
            Distributor(2, use_gpu=False).run(start_trees, str(OUT))
        except BaseException as exc:
            kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
            (OUT / "raised").write_text(f"{time.monotonic()!r} {kind}")
            raise

    def test_holds_the_session_open():
        # The outer test looks for survivors while this session still lives (its end would
        # end the ranks anyway); it writes "release" when done.
        (OUT / "waiting").write_text("")
        deadline = time.monotonic() + 60
        while not (OUT / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
""")


def test_pytest_timeout_signal_method_leaves_no_rank(tmp_path):
    inner = tmp_path / "inner"
    out = tmp_path / "out"
    inner.mkdir()
    out.mkdir()
    (inner / "pytest.ini").write_text("[pytest]\n")
    (inner / "test_interrupt_inner.py").write_text(INNER_TEST)
    (inner / "test_interrupt_helpers.py").write_text(inspect.getsource(start_trees))
    marker = uuid.uuid4().hex  # this inner session's processes, and only these
    env = {
        **os.environ,
        SESSION_MARKER_VAR: marker,
        "INTERRUPT_OUT": str(out),
        "PYTHONPATH": os.pathsep.join([str(inner), str(REPO)]),
    }
    inner_pytest = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
         "--timeout", "5", "--timeout-method", "signal", str(inner)],
        cwd=inner, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (out / "waiting").exists() and inner_pytest.poll() is None:
            assert time.monotonic() < deadline, "the inner session never reached its 2nd test"
            time.sleep(0.02)
        assert (out / "waiting").exists(), inner_pytest.communicate(timeout=30)[0]
        procs = recorded(out)
        assert len(procs) == 2 * PER_RANK
        alarm = float((out / "alarm").read_text())
        raised_at, kind = (out / "raised").read_text().split()
        assert kind == "Failed" or kind.endswith(".Failed")
        assert not alive(procs), "the timed-out run() returned while its processes lived"
        assert not rank_processes(marker)
        raised_after = float(raised_at) - alarm
        print(f"SIGALRM -> run() raised (everything gone) {raised_after:.3f} s")
        assert raised_after <= LOCAL_BOUND_S
    finally:
        (out / "release").write_text("")
        output, _ = inner_pytest.communicate(timeout=120)
        # The outer session's leak check cannot see the inner session's processes.
        for pid in alive(recorded(out)) + [p.pid for p in rank_processes(marker)]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert "1 failed, 1 passed" in output, output
    assert "Timeout" in output


@pytest.mark.spark
def test_ctrl_c_in_a_spark_run_ends_the_ranks_on_the_executors(tmp_path, spark_local):
    def run() -> object:
        return Distributor(2, local_mode=False, use_gpu=False, spark=spark_local).run(
            start_trees, str(tmp_path)
        )

    with Interrupter(tmp_path, 2) as interrupter, pytest.raises(KeyboardInterrupt):
        run()
    assert interrupter.at is not None and len(interrupter.procs) == 2 * PER_RANK
    returned_after = time.monotonic() - interrupter.at
    gone_after = last_gone_after(interrupter.procs, interrupter.at)
    print(f"interrupt -> run() raised {returned_after:.3f} s, last process gone {gone_after:.3f} s")
    assert gone_after <= SPARK_BOUND_S
    # The stage was not left running: the next run gets both slots at once.
    assert Distributor(2, local_mode=False, use_gpu=False, spark=spark_local).run(int) == 0
