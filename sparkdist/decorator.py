"""``@distributed``: the shape of Databricks' serverless GPU API, on sparkdist's engine.

Code written for the serverless API runs here by changing only the imports::

    from sparkdist import distributed       # was: from serverless_gpu import distributed
    from sparkdist import runtime as rt     # was: from serverless_gpu import runtime as rt

``@distributed(gpus=N, ...)`` turns a function into a ``DistributedFunction``: calling it still
runs the function in this process, as rank 0 of a world of one; ``.distributed(...)`` runs it on
N ranks and returns every rank's value; ``.distributed_async(...)`` starts the same run and hands
back a ``DistributedRun`` at once, for sweeps (the handle ``Distributor.run_async`` returns too).
Both go through the engine behind ``Distributor``, so failures (``WorkerFailedError``), output
streaming and cleanup are the same.

Non-goals: provisioning GPUs (the driver or the Spark cluster has them), snapshotting pip
environments (the launch's system metrics are ``system_metrics_interval_s``'s), Ray
(``@ray_launch``), decorating methods.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

from sparkdist._core.errors import ConfigError, ConfigTypeError, SparkdistError
from sparkdist._core.launch.checks import check_launchable
from sparkdist._core.launch.config import (
    DEFAULT_GROW_AFTER_S,
    DEFAULT_JOB_SIZE_LIMIT_MB,
    DEFAULT_JOB_SIZE_WARN_MB,
    DEFAULT_PREEMPTION_GRACE_S,
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_STRAGGLER_FRACTION,
    DEFAULT_STRAGGLER_WINDOW_S,
    DEFAULT_SYSTEM_METRICS_INTERVAL_S,
    LaunchConfig,
    Mode,
    build_config,
)
from sparkdist._core.launch.gpu_type import GPUType
from sparkdist._core.launch.placement import TASK_GPU_KEY
from sparkdist._core.tracebacks import for_the_user
from sparkdist._engine.handle import DistributedRun, every_value
from sparkdist._engine.start import StartedRun, start
from sparkdist._tracking.mlflow_store import prewarm
from sparkdist.distributor import make_job

__all__ = ["DistributedFunction", "DistributedRun", "GPUType", "distributed"]

logger = logging.getLogger("sparkdist")

P = ParamSpec("P")
R = TypeVar("R")

#: ``distributed``'s parameters that are not launch options under the table's names.
_NOT_OPTIONS = frozenset({"gpus", "remote", "spark"})


def distributed(
    gpus: int,
    gpu_type: GPUType | str | None = None,
    remote: bool = False,
    *,
    min_processes: int | None = None,
    grow_after_s: float | None = DEFAULT_GROW_AFTER_S,
    use_gpu: bool | None = None,
    mode: Mode | str = Mode.DDP,
    timeout_s: float | None = None,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    deepspeed_config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    heartbeat_timeout_s: float | None = None,
    preemption_grace_s: float = DEFAULT_PREEMPTION_GRACE_S,
    mlflow: bool | None = None,
    requirements: Sequence[str] | None = None,
    job_size_warn_mb: float = DEFAULT_JOB_SIZE_WARN_MB,
    job_size_limit_mb: float = DEFAULT_JOB_SIZE_LIMIT_MB,
    allow_oversubscribe: bool = False,
    system_metrics_interval_s: float = DEFAULT_SYSTEM_METRICS_INTERVAL_S,
    straggler_fraction: float = DEFAULT_STRAGGLER_FRACTION,
    straggler_window_s: float = DEFAULT_STRAGGLER_WINDOW_S,
    replica_groups: int = 1,
    min_replica_groups: int = 1,
    spark: Any | None = None,
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]:
    """Make a function launchable on ``gpus`` processes, as Databricks' serverless GPU API does.

    Every argument is checked here, when the decorator is applied, so a wrong one fails at
    definition time rather than at launch.

    Args:
        gpus: the total number of processes (the world size), one per GPU where there are GPUs.
        gpu_type: the GPU model every rank must get (a ``GPUType`` or its name in any case);
            checked against the device names of the hosts that run the ranks before any rank
            starts, raising ``ClusterError`` naming what was asked and what was found. None (the
            default) checks nothing, and where there is no GPU the ranks run on CPU with gloo
            (one warning per launch says so).
        remote: False runs the ranks as processes on the driver; True runs them as one Spark
            barrier stage on the cluster's executors.
        use_gpu: as on ``Distributor``: None (the default) uses GPUs where there are any,
            False forces CPU (and silences the CPU warning), True requires GPUs.
        mode: "ddp" (default), "fsdp" or "deepspeed".
        timeout_s: stop every rank and raise ``RunTimeoutError`` after this many seconds.
        start_timeout_s: raise ``RendezvousError`` if a rank has not joined by then.
        env: extra environment variables for every rank (not the ones sparkdist sets).
        min_processes, grow_after_s, deepspeed_config, max_restarts, checkpoint_dir,
            storage_options, heartbeat_timeout_s, mlflow,
            preemption_grace_s, requirements, job_size_warn_mb, job_size_limit_mb,
            allow_oversubscribe, system_metrics_interval_s, straggler_fraction,
            straggler_window_s, replica_groups, min_replica_groups: as on ``Distributor``.
        spark: the SparkSession to use (default: the active one). It is not pickled with the
            function; an unpickled function uses the active session.

    Returns:
        A decorator that wraps a function in a ``DistributedFunction``.

    Raises:
        ConfigError: an argument is wrong (``gpus < 1``, an unknown ``gpu_type``, ...), the
            decorator is used bare (``@distributed`` without ``gpus``), or the function is
            already decorated; ``ConfigTypeError`` (also a ``TypeError``) for a value of the
            wrong type, or a generator or ``async def`` function.

    Example:
        >>> from sparkdist import distributed, runtime
        >>> @distributed(gpus=2)
        ... def train(lr):
        ...     return runtime.get_global_rank(), lr
        >>> train(0.1)  # a plain call: in this process, a world of one
        (0, 0.1)
        >>> train.distributed(0.1)  # doctest: +SKIP
        [(0, 0.1), (1, 0.1)]
    """
    # Every keyword but ``spark`` is an option of the table (``_core.config.OPTIONS``); gpus and
    # remote are its num_processes and (not) local_mode, spelled as Databricks' API does.
    options = {name: value for name, value in locals().items() if name not in _NOT_OPTIONS}
    if callable(gpus):
        name = getattr(gpus, "__name__", "the function")
        raise ConfigError(
            f"@distributed needs the number of processes: write @distributed(gpus=2) above "
            f"def {name}, not a bare @distributed"
        )
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        error = (
            ConfigError if isinstance(gpus, int) and not isinstance(gpus, bool) else ConfigTypeError
        )
        raise error(
            f"gpus must be a positive integer (the total number of processes), got {gpus!r}; "
            "e.g. @distributed(gpus=2)"
        )
    if not isinstance(remote, bool):
        raise ConfigTypeError(
            f"remote must be True (Spark barrier tasks) or False (processes on the driver), "
            f"got {remote!r}"
        )
    config = build_config(num_processes=gpus, local_mode=not remote, **options)

    def decorate(fn: Callable[P, R]) -> DistributedFunction[P, R]:
        if isinstance(fn, DistributedFunction):
            raise ConfigError(
                f"{fn.__name__} is already decorated with @distributed(gpus={fn.gpus}); keep "
                "one @distributed decorator (its arguments set the launch)"
            )
        if not callable(fn):
            raise ConfigError(
                f"@distributed decorates a function, got {type(fn).__name__}; to run a script, "
                "use sparkdist.Distributor(...).run('train.py', ...)"
            )
        check_launchable(fn)  # a generator or async def function could never be launched
        return DistributedFunction(fn, config, spark)

    return decorate


class DistributedFunction(Generic[P, R]):
    """A function decorated with ``@distributed``: a plain call, or a launch on every rank.

    It keeps the function's name, qualified name, module and docstring, and pickles: by name
    where its module can be imported (like any module-level function), otherwise by value
    with the function's code (a notebook, ``__main__``, or a module registered with
    ``cloudpickle.register_pickle_by_value``).

    Attributes:
        config: the launch configuration the decorator's arguments made.
        spark: the SparkSession given to the decorator, or None (then the active one is used).

    Example:
        >>> from sparkdist import distributed
        >>> @distributed(gpus=3)
        ... def rank_squared():
        ...     import os
        ...     return int(os.environ["RANK"]) ** 2
        >>> rank_squared.distributed()  # doctest: +SKIP
        [0, 1, 4]
        >>> run = rank_squared.distributed_async()  # doctest: +SKIP
        >>> run.result(timeout=60)  # doctest: +SKIP
        [0, 1, 4]
    """

    __wrapped__: Callable[P, R]
    __name__: str
    __qualname__: str

    def __init__(self, fn: Callable[P, R], config: LaunchConfig, spark: Any | None = None) -> None:
        functools.update_wrapper(self, fn)
        # Set after update_wrapper, which copies the function's __dict__ onto this object.
        self.config = config
        self.spark = spark
        prewarm(config.mlflow)  # mlflow's imports overlap whatever comes before a launch

    @property
    def gpus(self) -> int:
        """The number of processes a launch runs."""
        return self.config.num_processes

    @property
    def gpu_type(self) -> GPUType | None:
        """The GPU model every rank must get, or None for no check."""
        return GPUType(self.config.gpu_type) if self.config.gpu_type is not None else None

    @property
    def remote(self) -> bool:
        """True when launches run as Spark barrier tasks, False when on the driver."""
        return not self.config.local_mode

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the function in this process, as rank 0 of a world of one (no launch).

        For the duration of the call the process has torchrun's variables for a one-rank world
        (``RANK=0``, ``WORLD_SIZE=1``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``,
        ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT=0``), so a function that calls
        ``torch.distributed.init_process_group()`` runs unchanged: rank 0 binds its store on a
        port the OS picks, and no other rank needs to find it. The variables are put back
        afterwards, and a default process group the call left open is destroyed, so the next
        call can start one again. Inside a world that already exists (``RANK`` or
        ``WORLD_SIZE`` set: a sparkdist rank, torchrun) the function is called as is.
        """
        with _one_rank_world():
            return self.__wrapped__(*args, **kwargs)

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run the function on every rank with these arguments; block until every rank ends.

        Returns:
            Every rank's return value, indexed by global rank.

        Raises:
            ConfigError, ClusterError: before any rank starts (an unpicklable argument, too
                few slots, a ``gpu_type`` mismatch...).
            WorkerFailedError: a rank failed; every other rank has been stopped.
            RendezvousError: a rank did not join within ``start_timeout_s``.
            RunTimeoutError: the run took longer than ``timeout_s``.
            KeyboardInterrupt: after Ctrl-C stopped every rank (any exception raised into the
                waiting thread, a test timeout's say, likewise).
        """
        try:
            return list(self._start(args, kwargs).wait().values)
        except SparkdistError as error:
            # The message says what failed, the cause stays; our own frames would bury both.
            raise for_the_user(error) from error.__cause__

    def distributed_async(self, *args: P.args, **kwargs: P.kwargs) -> DistributedRun[list[R]]:
        """Start the function on every rank and return at once, for sweeps and side-by-side runs.

        Anything that can fail before a rank starts raises here, as in ``distributed``; what
        happens after that is reported by the handle's ``result``.

        Returns:
            A ``DistributedRun`` (the handle ``Distributor.run_async`` returns too):
            ``result(timeout=None)`` waits for the list of values by rank, ``run_result()``
            for the whole ``RunResult``, ``done()`` polls, ``cancel()`` stops every rank,
            ``mlflow_run_id`` names the run's MLflow run.

        Example:
            >>> runs = [train.distributed_async(lr=lr) for lr in (0.1, 0.01)]  # doctest: +SKIP
            >>> [run.result()[0] for run in runs]  # doctest: +SKIP
        """
        return DistributedRun(self._start(args, kwargs), every_value)

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StartedRun:
        launch = start(self.config, make_job(self.__wrapped__, args, kwargs), session=self.spark)
        with launch.cancel_on_exception():  # a failing log handler must not orphan the ranks
            self._warn_if_cpu(launch)
        return launch

    def _warn_if_cpu(self, launch: StartedRun) -> None:
        if (
            self.config.use_gpu is None
            and self.config.gpu_type is None
            and not launch.placement.use_gpu
        ):
            where = (
                f"{TASK_GPU_KEY} is unset or 0, so Spark tasks get no GPU"
                if self.remote
                else "no GPU is visible on the driver"
            )
            logger.warning(
                "sparkdist: %s runs on %d CPU process(es) with gloo: %s; pass use_gpu=False "
                "to choose CPU explicitly and silence this warning",
                self.__qualname__,
                self.gpus,
                where,
            )

    def __repr__(self) -> str:
        gpu_type = self.config.gpu_type
        return (
            f"<DistributedFunction {self.__module__}.{self.__qualname__} gpus={self.gpus} "
            f"gpu_type={gpu_type!r} remote={self.remote}>"
        )

    def __reduce__(self) -> str | tuple[Any, ...]:
        if _reachable_by_name(self):
            return self.__qualname__
        # By value: the plain function (cloudpickle ships its code) and the frozen config. The
        # SparkSession is a live handle to this driver's JVM and stays behind.
        return (_rebuild, (self.__wrapped__, self.config))


#: torchrun's variables for a world of one, set around a plain call. MASTER_PORT=0: the only
#: rank binds its store on a port the OS picks and keeps it, so there is no free-port race.
_ONE_RANK_WORLD = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "0",
}
#: Would make rank 0 connect to a store an agent hosts instead of binding its own.
_AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
_world_lock = threading.Lock()
_world_depth = 0  # plain calls in flight that share the one-rank variables
_world_saved: dict[str, str | None] = {}


@contextlib.contextmanager
def _one_rank_world() -> Iterator[None]:
    """torchrun's environment for a world of one around a plain call; restored afterwards.

    Concurrent or nested plain calls share the variables: the first sets them, the last puts
    the previous values back. A default process group opened under them is destroyed at the
    end (torch.distributed is only looked at when the call imported it).
    """
    global _world_depth
    with _world_lock:
        if _world_depth == 0 and ("RANK" in os.environ or "WORLD_SIZE" in os.environ):
            owns_world = False  # already a rank of some world: leave it as it is
        else:
            owns_world = True
            if _world_depth == 0:
                names = (*_ONE_RANK_WORLD, _AGENT_STORE_VAR)
                _world_saved.clear()
                _world_saved.update({name: os.environ.get(name) for name in names})
                os.environ.pop(_AGENT_STORE_VAR, None)
                os.environ.update(_ONE_RANK_WORLD)
            _world_depth += 1
    group_was_open = owns_world and _default_group_open()
    try:
        yield
    finally:
        if owns_world:
            if not group_was_open and _default_group_open():
                import torch.distributed as dist

                dist.destroy_process_group()
            with _world_lock:
                _world_depth -= 1
                if _world_depth == 0:
                    for name, value in _world_saved.items():
                        if value is None:
                            os.environ.pop(name, None)
                        else:
                            os.environ[name] = value
                    _world_saved.clear()


def _default_group_open() -> bool:
    dist = sys.modules.get("torch.distributed")
    if dist is None:  # never imported: nothing can be open, and importing torch costs seconds
        return False
    return bool(dist.is_available() and dist.is_initialized())


def _rebuild(fn: Callable[P, R], config: LaunchConfig) -> DistributedFunction[P, R]:
    """Unpickle a DistributedFunction that travelled by value."""
    return DistributedFunction(fn, config)


def _reachable_by_name(wrapper: DistributedFunction[Any, Any]) -> bool:
    """Whether ``module.qualname`` finds this very object, so pickle can refer to it by name.

    Not for ``__main__`` or for modules that cloudpickle (ours or pyspark's copy) was told to
    ship by value: the process that unpickles cannot import those, which is why they travel by
    value in the first place.
    """
    module_name = wrapper.__module__
    if not module_name or module_name == "__main__" or "<locals>" in wrapper.__qualname__:
        return False
    if _registered_by_value(module_name):
        return False
    target: Any = sys.modules.get(module_name)
    for part in wrapper.__qualname__.split("."):
        target = getattr(target, part, None)
    return target is wrapper


def _registered_by_value(module_name: str) -> bool:
    prefixes = {".".join(module_name.split(".")[:i]) for i in range(1, module_name.count(".") + 2)}
    for pickler in ("cloudpickle", "pyspark.cloudpickle"):
        # Only a cloudpickle already loaded can have a registry; importing one here would
        # load pyspark for nothing.
        registry = getattr(sys.modules.get(pickler), "list_registry_pickle_by_value", None)
        if registry is not None and prefixes & set(registry()):
            return True
    return False
