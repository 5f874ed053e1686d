"""sparkdist's pytest plugin: test distributed training code on a laptop, with no GPU or cluster.

Installing sparkdist registers it (the ``pytest11`` entry point ``sparkdist``); nothing to copy
into a conftest. It offers:

- ``spark``: one quiet SparkSession for the whole test session (``local[2]``, this interpreter
  on the executors, loopback only, no UI, no progress bars), stopped at the end. A session
  already active for the same master is reused, and never stopped by the plugin.
- ``distributed``: ``run = distributed(n=2)`` then ``run(fn, *args, **kwargs)`` returns every
  rank's value, ordered by rank; CPU ranks (gloo), a time limit per run so a hung rank fails the
  test instead of hanging CI, and a check after the test that no process of its runs is left.
- ``no_rank_leftovers``: that check alone, for tests that launch with ``Distributor`` directly.
- markers ``gpu`` and ``multi_gpu(n)`` (skipped, with the reason, where CUDA or n GPUs are
  missing) and ``spark_cluster`` (the test's runs go to a ``local-cluster`` master).
- ``--sparkdist-mode=spark``: every ``distributed`` run becomes a Spark barrier stage on the
  ``spark`` session, so one suite covers local and Spark mode. ``--sparkdist-spark-master``,
  ``--sparkdist-timeout`` and the ini keys of the same names (plus ``sparkdist_spark_conf``,
  ``key=value`` lines) tune the rest.

Example::

    def train(scale):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        return dist.get_rank() * scale

    def test_every_rank_trains(distributed):
        run = distributed(n=2)
        assert run(train, 10) == [0, 10]

The leak check recognises this session's processes by an environment marker
(``SPARKDIST_PYTEST_SESSION``, fresh per session) that every rank inherits, so processes of
other pytest sessions on the same machine are never counted or killed.

Non-goals: fixtures for the project's own test suite (``tests/conftest.py``), which also loads
this plugin: the plugin adds the names ``spark``, ``distributed`` and ``no_rank_leftovers`` and
the markers above, and starts nothing unless a test asks for them.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from sparkdist._frontdoors import pytest_support as support

if TYPE_CHECKING:
    from sparkdist._core.run.result import RunResult

__all__ = ["DistributedRunner", "RunnerFactory"]

MODES = ("local", "spark")
#: How long past its timeout_s a run may take to stop before the runner gives up on it.
_STOP_MARGIN_S = 90.0


@dataclass
class _State:
    """What the plugin knows about this pytest session."""

    session_marker: str
    previous_marker: str | None
    mode: str
    requested_master: str | None
    timeout_s: float
    spark_conf: dict[str, str]
    master: str = support.DEFAULT_MASTER
    sessions: support.SparkSessions | None = None

    def spark_sessions(self) -> support.SparkSessions:
        if self.sessions is None:
            self.sessions = support.SparkSessions(self.master, self.spark_conf)
        return self.sessions


_STATE = pytest.StashKey[_State]()


# -- options, markers, collection ---------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sparkdist", "sparkdist: distributed training tests")
    group.addoption(
        "--sparkdist-mode",
        choices=MODES,
        default=None,
        help="run the tests' `distributed` runs on this machine (local, the default) or as "
        "Spark barrier stages on the `spark` session (spark). ini: sparkdist_mode",
    )
    group.addoption(
        "--sparkdist-spark-master",
        default=None,
        metavar="MASTER",
        help=f"master of the `spark` fixture ('local' = {support.DEFAULT_MASTER}, 'cluster' = "
        f"{support.CLUSTER_MASTER}; default local, or cluster when a selected test is "
        "marked spark_cluster). ini: sparkdist_spark_master",
    )
    group.addoption(
        "--sparkdist-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"limit of each `distributed` run (default {support.DEFAULT_TIMEOUT_S:g}); a run "
        "past it fails its test and every rank is stopped. ini: sparkdist_timeout",
    )
    parser.addini("sparkdist_mode", "local or spark (see --sparkdist-mode)", default="local")
    parser.addini("sparkdist_spark_master", "see --sparkdist-spark-master", default="")
    parser.addini(
        "sparkdist_timeout", "see --sparkdist-timeout", default=str(support.DEFAULT_TIMEOUT_S)
    )
    parser.addini(
        "sparkdist_spark_conf",
        "extra Spark conf of the `spark` fixture, key=value lines",
        type="linelist",
        default=[],
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (skipped, with the reason, where there is none)"
    )
    config.addinivalue_line("markers", "multi_gpu(n): needs n CUDA GPUs (skipped where fewer)")
    config.addinivalue_line(
        "markers", "multihost: runs in a multi-host lab (the sparkdist_cluster fixture)"
    )
    config.addinivalue_line(
        "markers",
        "spark_cluster: runs its `distributed` runs in Spark "
        "mode on a local-cluster master (separate executor JVMs)",
    )
    mode = config.getoption("sparkdist_mode") or str(config.getini("sparkdist_mode")).strip()
    if mode not in MODES:
        raise pytest.UsageError(f"sparkdist_mode = {mode!r}; use one of {', '.join(MODES)}")
    timeout = config.getoption("sparkdist_timeout")
    if timeout is None:
        try:
            timeout = float(str(config.getini("sparkdist_timeout")))
        except ValueError:
            timeout = -1.0
    if not timeout > 0:
        raise pytest.UsageError("sparkdist_timeout must be a positive number of seconds")
    try:
        spark_conf = support.parse_spark_conf(list(config.getini("sparkdist_spark_conf")))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    requested = (
        config.getoption("sparkdist_spark_master")
        or str(config.getini("sparkdist_spark_master")).strip()
        or None
    )
    # A fresh marker for every session, nested ones included: a pytest run started by a test
    # must not count as (or be killed by) the session that started it.
    state = _State(
        session_marker=uuid.uuid4().hex,
        previous_marker=os.environ.get(support.SESSION_MARKER_VAR),
        mode=mode,
        requested_master=requested,
        timeout_s=float(timeout),
        spark_conf=spark_conf,
        master=support.resolve_master(requested, wants_cluster=False),
    )
    os.environ[support.SESSION_MARKER_VAR] = state.session_marker
    config.stash[_STATE] = state


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    if state.sessions is not None:
        state.sessions.stop()
    if state.previous_marker is None:
        os.environ.pop(support.SESSION_MARKER_VAR, None)
    else:
        os.environ[support.SESSION_MARKER_VAR] = state.previous_marker


def pytest_report_header(config: pytest.Config) -> str | None:
    state = config.stash[_STATE]
    if state.mode == "local" and state.requested_master is None:
        return None
    master = state.requested_master or (
        f"{support.DEFAULT_MASTER} ({support.CLUSTER_MASTER} with spark_cluster tests)"
    )
    return f"sparkdist: distributed runs in {state.mode} mode, Spark master {master}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, with the reason, the tests this machine or session cannot run."""
    state = config.stash[_STATE]
    cuda: support.CudaDevices | None = None
    for item in items:
        needed = 0
        if item.get_closest_marker("gpu") is not None:
            needed = 1
        multi = item.get_closest_marker("multi_gpu")
        if multi is not None:
            try:
                needed = max(needed, support.gpu_marker_count(multi.args, multi.kwargs))
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: {exc}") from exc
        if needed:
            cuda = cuda or support.cuda_devices()  # nvidia-smi runs once, only if needed
            what = "a CUDA GPU" if needed == 1 else f"{needed} CUDA GPUs"
            if cuda.count == 0:
                item.add_marker(pytest.mark.skip(reason=f"needs {what}: {cuda.why_none}"))
            elif cuda.count < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {what}, {cuda.count} visible here"))
        if (
            item.get_closest_marker("spark_cluster") is not None
            and state.requested_master
            and not support.is_cluster_master(state.master)
        ):
            item.add_marker(
                pytest.mark.skip(
                    reason=f"marked spark_cluster, but this session's Spark master is "
                    f"{state.master!r} (--sparkdist-spark-master); use 'cluster' or drop "
                    "the option"
                )
            )


def pytest_collection_finish(session: pytest.Session) -> None:
    """One master for the whole session: local-cluster if a selected test needs one."""
    state = session.config.stash[_STATE]
    wants_cluster = any(item.get_closest_marker("spark_cluster") for item in session.items)
    state.master = support.resolve_master(state.requested_master, wants_cluster)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session", name="spark")
def spark_fixture(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The test session's SparkSession (quiet ``local[2]`` by default), stopped at the end.

    Reuses a session already active in this process for the same master, and then leaves it
    running; ``--sparkdist-spark-master`` picks another master.
    """
    sessions = request.config.stash[_STATE].spark_sessions()
    try:
        session = sessions.get()
    except ImportError as exc:
        pytest.fail(
            f"the spark fixture needs pyspark ({exc}); pip install 'sparkdist[spark]'",
            pytrace=False,
        )
    except support.SparkSessionConflict as exc:
        pytest.fail(str(exc), pytrace=False)
    yield session
    sessions.stop()


@pytest.fixture(scope="session", name="sparkdist_cluster")
def sparkdist_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A factory of multi-host labs: ``sparkdist_cluster(hosts=3)`` is a running ``LabCluster``.

    Each lab is ``hosts`` hosts plus the driver's, every one its own network, mount and UTS
    namespace on one bridge, inside a single ``unshare`` holder (no route out of the machine,
    nothing survives it), with a Spark standalone cluster on them and a driver program that
    runs code you send it. Tests asking the same shape share one lab; inject faults with
    ``cluster.lab.kill_host(...)``, ``cut``/``heal``, and bring a host back with
    ``cluster.restart_host(...)``. Skipped, with the reason, where the machine cannot hold one
    (docs/testing.md).
    """
    from sparkdist._frontdoors.lab_fixture import ClusterFactory

    factory = ClusterFactory(tmp_path_factory.mktemp("sparkdist-lab"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(name="no_rank_leftovers")
def no_rank_leftovers_fixture(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the test: no process of this session's runs is alive (survivors are killed)."""
    yield
    survivors = support.reap_rank_processes(request.config.stash[_STATE].session_marker)
    if survivors:
        listing = "\n".join(f"  {proc}" for proc in survivors)
        pytest.fail(
            f"{len(survivors)} process(es) of a distributed run outlived the test "
            f"(now killed):\n{listing}",
            pytrace=False,
        )


@pytest.fixture(name="distributed")
def distributed_fixture(
    request: pytest.FixtureRequest, no_rank_leftovers: None
) -> Iterator[RunnerFactory]:
    """A factory of runners: ``run = distributed(n=2)``, then ``run(fn, *args, **kwargs)``.

    ``distributed(n=None, *, timeout_s=None, use_gpu=None, local_mode=None, **options)``:

    - ``n``: the world size (default: the test's ``multi_gpu(n)``, else 2).
    - ``timeout_s``: limit of each run (default ``--sparkdist-timeout``, 120 s).
    - ``use_gpu``: default False (CPU, every GPU hidden; use gloo), True in ``gpu`` and
      ``multi_gpu`` tests.
    - ``local_mode``: default True, False under ``--sparkdist-mode=spark`` or ``spark_cluster``.
    - ``options``: any other ``Distributor`` option (``mode``, ``env``, ``heartbeat_timeout_s``,
      ``max_restarts``...); ``mlflow`` defaults to False here (pass True to track the run).
      The session is the ``spark`` fixture's, so there is no ``spark=``.
    """
    state = request.config.stash[_STATE]
    node = request.node
    gpu_marked = node.get_closest_marker("gpu") is not None
    multi = node.get_closest_marker("multi_gpu")
    spark_mode = state.mode == "spark" or node.get_closest_marker("spark_cluster") is not None
    if spark_mode:
        request.getfixturevalue("spark")  # start Spark in the set-up, not inside a run's time
    factory = RunnerFactory(
        num_processes=support.gpu_marker_count(multi.args, multi.kwargs) if multi else 2,
        timeout_s=state.timeout_s,
        use_gpu=gpu_marked or multi is not None,
        local_mode=not spark_mode,
        session_marker=state.session_marker,
        spark=lambda: request.getfixturevalue("spark"),
    )
    yield factory
    run_ids = [run_id for runner in factory.runners for run_id in runner.run_ids]
    deadline = time.monotonic() + support.LEFTOVER_GRACE_S
    while support.run_directories(run_ids) and time.monotonic() < deadline:
        time.sleep(0.05)  # an agent on an executor may still be removing its directory
    left = support.run_directories(run_ids)
    if left:
        pytest.fail(f"run directories were left behind: {', '.join(left)}", pytrace=False)


# -- the runner ------------------------------------------------------------------------------


class RunnerFactory:
    """What the ``distributed`` fixture returns: ``distributed(n=2, **options)`` makes a runner.

    The fixture's own defaults (a test's world, time limit, CPU or GPU, local or Spark mode)
    come from the test's markers and the session's options; every other launch option is
    ``Distributor``'s, under its own name, checked by ``build_config``.

    Attributes:
        num_processes, timeout_s, use_gpu, local_mode: the fixture's defaults for this test.
        runners: every runner made so far, oldest first.
    """

    def __init__(
        self,
        *,
        num_processes: int,
        timeout_s: float,
        use_gpu: bool,
        local_mode: bool,
        session_marker: str,
        spark: Callable[[], Any],
    ) -> None:
        self.num_processes = num_processes
        self.timeout_s = timeout_s
        self.use_gpu = use_gpu
        self.local_mode = local_mode
        self._session_marker = session_marker
        self._spark = spark
        self.runners: list[DistributedRunner] = []

    def __call__(
        self,
        n: int | None = None,
        *,
        timeout_s: float | None = None,
        use_gpu: bool | None = None,
        local_mode: bool | None = None,
        **options: Any,
    ) -> DistributedRunner:
        """A runner of ``n`` ranks; None keeps the fixture's default of each argument."""
        from sparkdist._core.errors import ConfigTypeError

        for name, instead in _SPELLED_OTHERWISE.items():
            if name in options:
                raise ConfigTypeError(f"distributed(...) does not take {name}=: {instead}")
        local_mode = self.local_mode if local_mode is None else local_mode
        runner = DistributedRunner(
            self.num_processes if n is None else n,
            local_mode=local_mode,
            spark=None if local_mode else self._spark(),
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            use_gpu=self.use_gpu if use_gpu is None else use_gpu,
            session_marker=self._session_marker,
            options=options,
        )
        self.runners.append(runner)
        return runner


#: Options the fixture spells its own way, and what to write instead.
_SPELLED_OTHERWISE = {
    "num_processes": "the world size is n, e.g. distributed(n=4)",
    "spark": "runs in Spark mode use the spark fixture's session (--sparkdist-spark-master "
    "chooses its master)",
}


class DistributedRunner:
    """``run(fn, *args, **kwargs)``: every rank's return value, as a list ordered by rank.

    Built by the ``distributed`` fixture; each call is one run of ``num_processes`` ranks with
    ``timeout_s`` as its limit (``RunTimeoutError`` once it passes, every rank stopped).

    Attributes:
        config: the launch configuration of every run.
        spark: the session of Spark-mode runs (None in local mode).
        num_processes: the world size.
        local_mode: True when ranks run as processes of this machine's pytest process; False
            when they run as one Spark barrier stage.
        last_result: the ``RunResult`` of the latest successful call (None before one).
        run_ids: the id of every run this runner started, oldest first.
    """

    def __init__(
        self,
        num_processes: int,
        *,
        local_mode: bool,
        spark: Any | None,
        timeout_s: float,
        use_gpu: bool | None,
        session_marker: str,
        options: Mapping[str, Any],
    ) -> None:
        from sparkdist._core.env import check_user_env
        from sparkdist._core.launch.config import build_config

        env = check_user_env(options.get("env") or {})  # the user's env, checked as theirs
        env[support.SESSION_MARKER_VAR] = session_marker
        # Tests track to MLflow only when they ask to (mlflow=True): no mlflow.db in the
        # working directory, no MLflow start-up in every test.
        options = {"mlflow": False, **options, "env": env}
        # build_config checks every option (and refuses unknown ones) before anything starts.
        self.config = build_config(
            num_processes=num_processes,
            local_mode=local_mode,
            use_gpu=use_gpu,
            timeout_s=timeout_s,
            **options,
        )
        self.spark = spark
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.timeout_s = timeout_s
        self.last_result: RunResult | None = None
        self.run_ids: list[str] = []

    def __call__(self, train_object: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``train_object`` (a function, or a script's path) on every rank."""
        __tracebackhide__ = True
        return list(self.run_all(train_object, *args, **kwargs).values)

    def run_all(self, train_object: Any, *args: Any, **kwargs: Any) -> RunResult:
        """Like calling the runner, but return the whole ``RunResult``."""
        __tracebackhide__ = True
        from sparkdist._core.errors import RunTimeoutError, SparkdistError
        from sparkdist._engine.start import start
        from sparkdist.distributor import make_job

        run = start(self.config, make_job(train_object, args, kwargs), session=self.spark)
        self.run_ids.append(run.run_id)
        try:
            # The engine enforces timeout_s itself; the margin only guards against a stop
            # that does not end (it waits up to a minute for agents to report).
            result = run.result(timeout=self.timeout_s + _STOP_MARGIN_S)
        except RunTimeoutError:
            raise RunTimeoutError(
                f"the run exceeded timeout_s={self.timeout_s}; every rank was stopped. Raise "
                "it with distributed(..., timeout_s=...) or --sparkdist-timeout"
            ) from None
        except SparkdistError as exc:
            # The engine's frames (a supervisor thread's) say nothing about the test; the
            # message carries the failing rank's own traceback.
            raise exc.with_traceback(None) from exc.__cause__
        except TimeoutError as exc:
            run.cancel(f"the run did not stop within {_STOP_MARGIN_S:g} s of its timeout_s")
            raise TimeoutError(
                f"run {run.run_id} did not stop within {_STOP_MARGIN_S:g} s after its "
                f"timeout_s={self.timeout_s}; its ranks were cancelled"
            ) from exc
        except BaseException as exc:  # Ctrl-C, pytest-timeout's Failed: no rank outlives it
            run.cancel(f"the test run was interrupted ({type(exc).__name__})")
            raise
        self.last_result = result
        return result
