"""The launcher: ``Distributor``, and ``make_job``, which every front door shares.

Everything fronts one engine (``_engine.launch``). pyspark's ``TorchDistributor`` and its
DeepSpeed kin live in ``_pyspark_compat`` (they subclass ``Distributor``, so imports run from
there to here; ``sparkdist`` exports them). They keep pyspark's signatures, checks and
attributes so swapping the import is enough, and differ where pyspark is wrong: ``run``
returns rank 0's value (pyspark's local mode returns whichever rank finished last) and raises
``WorkerFailedError`` when a rank fails (pyspark reports a failing script as success);
docs/launching.md lists every difference.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sparkdist._core.errors import ConfigError, SparkdistError
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
    Mode,
    build_config,
)
from sparkdist._core.launch.placement import TORCH_IGNORE_SSL_KEY
from sparkdist._core.launch.plan import LaunchPlan
from sparkdist._core.run.result import RunResult
from sparkdist._core.tracebacks import for_the_user
from sparkdist._engine.handle import DistributedRun, rank0_value
from sparkdist._engine.prepare import prepare
from sparkdist._engine.start import launch, start
from sparkdist._tracking.mlflow_store import prewarm
from sparkdist._wire.payload import Job, TargetKind

TrainObject = Callable[..., Any] | str | os.PathLike[str]
#: ``Distributor.__init__``'s parameters that are not launch options.
_NOT_OPTIONS = frozenset({"self", "spark"})


class Distributor:
    """Runs a training function or script on ``num_processes`` ranks, one per GPU.

    Local mode runs the ranks as processes on the driver; Spark mode runs them as one Spark
    barrier stage (one task per rank, or k ranks per task when
    ``spark.task.resource.gpu.amount`` is k). Every rank gets torchrun's environment, so the
    function calls ``torch.distributed.init_process_group()`` exactly as under torchrun.

    Args:
        num_processes: the world size.
        min_processes: make the run elastic: a restart after a lost host (``max_restarts``)
            starts with as many ranks as the cluster's slots then hold, between this and
            ``num_processes``, instead of failing for want of slots; below it the restart
            waits up to ``start_timeout_s`` for capacity. Ranks see the attempt's
            ``WORLD_SIZE`` and ``runtime.requested_world_size()``. None (the default): every
            attempt has ``num_processes`` ranks.
        grow_after_s: an elastic run that runs below ``num_processes`` grows back: once the
            cluster has held a larger world (up to ``num_processes``) for this many seconds in
            a row, every rank drains as for a preemption (``runtime.should_stop()`` at the same
            step, a checkpoint of that step) and the run restarts at the larger world, without
            using ``max_restarts``. Needs ``checkpoint_dir``; None never grows (60 s by default).
        local_mode: True runs on the driver; False runs on the cluster's executors.
        use_gpu: True binds each rank to a GPU; False runs on CPU (gloo) with every GPU hidden;
            None (the default) uses GPUs when there are any and CPU otherwise.
        mode: "ddp" (default), "fsdp" or "deepspeed".
        timeout_s: stop every rank and raise ``RunTimeoutError`` after this many seconds.
        start_timeout_s: raise ``RendezvousError`` if a rank has not joined by then.
        env: extra environment variables for every rank, names to strings; the variables
            sparkdist sets itself (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
            ``CUDA_VISIBLE_DEVICES``, ``TORCHELASTIC_*``...) are refused.
        deepspeed_config: with mode="deepspeed", the DeepSpeed config as a dict or the path of
            a JSON file; every rank can read it (``runtime.deepspeed_config()``), and a script
            target gets ``--deepspeed --deepspeed_config <path>`` after its own arguments.
        max_restarts: restart the whole world this many times after a failure (each rank
            sees ``TORCHELASTIC_RESTART_COUNT`` / ``runtime.restart_count()``); the final
            error lists every attempt's root cause.
        checkpoint_dir: a directory every rank can reach (shared storage on a cluster) for
            ``runtime.save_checkpoint`` / ``runtime.load_checkpoint``, so restarts resume; or
            an object-store URL (``s3://bucket/prefix``, ``gs://``, ``abfss://``...) read and
            written through fsspec, each host with its own credentials.
        storage_options: an object-store ``checkpoint_dir``'s settings that are not secret,
            as its fsspec backend takes them (``{"endpoint_url": ..., "region_name": ...}``);
            credentials are refused: each host uses its own (environment, instance profile).
        heartbeat_timeout_s: declare a rank hung when, after joining, it goes this long
            without ``runtime.report()`` or ``runtime.heartbeat()``: its Python stack is
            dumped into its output and the run stops with ``WorkerFailedError``.
        preemption_grace_s: after a preemption notice (SIGTERM to a rank, to an agent's
            process, or to the driver while it waits in ``run``), how many seconds the ranks
            have to save a checkpoint and return (``runtime.should_stop()`` says when); those
            still running then are stopped. A preempted run restarts from its checkpoint
            without using ``max_restarts``; a SIGTERM to the driver ends the run instead.
        gpu_type: require this GPU model ("H100", ``GPUType.A100``...) on every host that runs
            a rank; checked before any rank starts (``ClusterError`` naming both otherwise).
        mlflow: False turns MLflow tracking off, True turns it on; None (the default) follows
            ``SPARKDIST_MLFLOW`` (on unless it is 0). When on, the run gets an MLflow run (the
            active one, ``MLFLOW_RUN_ID``'s, or a new one in ``MLFLOW_TRACKING_URI``, by default
            ``sqlite:///mlflow.db``) whose id every rank has in ``MLFLOW_RUN_ID``; without the
            mlflow package the run goes on and one line says tracking is off.
        requirements: packages every host that runs ranks must have, checked before any rank
            starts: "numpy" means the driver's version, "pandas==2.2.0" that version. Python
            (same major.minor), torch, cloudpickle, sparkdist (and deepspeed in mode
            "deepspeed") are always compared with the driver's in Spark mode; local mode runs
            the driver's own interpreter and checks only the pinned entries. A difference
            raises ``ClusterError`` with a table of host, package, wanted and found versions.
        job_size_warn_mb: past this pickled size (the function with everything it captured,
            and its arguments) the launch warns, naming the largest captured objects, and
            Spark mode ships the job as a file (``SparkContext.addFile``) rather than inside
            the Spark task.
        job_size_limit_mb: past this pickled size the launch fails with ``ConfigError``
            naming the largest captured objects.
        allow_oversubscribe: allow more than 4 local CPU ranks per core of the driver (refused
            otherwise, with ``ConfigError``, before anything starts). Local GPU ranks are
            bounded by the driver's GPUs whatever this says.
        system_metrics_interval_s: every node samples its CPU %, host memory, the ranks' memory
            (RSS of their process trees) and, with NVML, each of its ranks' GPUs (utilisation,
            memory, power) this often; the samples become MLflow ``system/node_N/...`` metrics
            and ``RunResult.system_samples``. 0 turns sampling off; without psutil it is off.
        straggler_fraction: a rank whose steps per second (``runtime.report()``) stay below
            this fraction of the median rank's for ``straggler_window_s`` is named in a
            warning line and an MLflow tag, with its node and GPU, once per episode; 0 turns
            detection off.
        straggler_window_s: how long, in seconds, a rank must stay behind to be named.
        replica_groups: split the ranks into this many torchft replica groups of
            ``num_processes / replica_groups`` ranks, each its own barrier stage (local mode:
            its own processes) with its ranks numbered inside the group, and one torchft
            Lighthouse on the driver for the run. A group that loses a host or a rank is
            relaunched (``max_restarts`` times per group) while the others go on; it heals from
            a live peer. Ranks build torchft's ``Manager`` with
            ``runtime.torchft_manager_kwargs(pg)`` and average with
            ``runtime.average_gradients`` (docs/modes.md). Needs ``sparkdist[torchft]``.
        min_replica_groups: the fewest live replica groups a step may be taken with (the
            Lighthouse's quorum floor).
        spark: the SparkSession to use (default: the active one; Spark mode creates one if
            there is none, local mode needs none). A Spark Connect session works too.

    Raises:
        ConfigError: an option is refused, naming it, the value and what is accepted, before
            anything starts (``ConfigTypeError``, also a ``TypeError``, for a wrong type).

    Example:
        >>> from sparkdist import Distributor
        >>> def train(scale):
        ...     import torch.distributed as dist
        ...     dist.init_process_group("gloo")
        ...     return dist.get_rank() * scale
        >>> Distributor(2, use_gpu=False).run_all(train, 10).values  # doctest: +SKIP
        [0, 10]
    """

    _ignore_ssl_key = TORCH_IGNORE_SSL_KEY

    def __init__(
        self,
        num_processes: int = 1,
        *,
        min_processes: int | None = None,
        grow_after_s: float | None = DEFAULT_GROW_AFTER_S,
        local_mode: bool = True,
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
        gpu_type: str | None = None,
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
    ) -> None:
        # Every keyword but ``spark`` is an option of the table (``_core.config.OPTIONS``), under
        # its own name: build_config checks and normalises them all, in one place.
        options = {name: value for name, value in locals().items() if name not in _NOT_OPTIONS}
        self.config = build_config(**options)
        self.spark = spark
        prewarm(self.config.mlflow)  # mlflow's imports overlap whatever comes before run()

    @property
    def num_processes(self) -> int:
        return self.config.num_processes

    @property
    def local_mode(self) -> bool:
        return self.config.local_mode

    @property
    def use_gpu(self) -> bool | None:
        return self.config.use_gpu

    def run(
        self,
        train_object: TrainObject,
        *args: Any,
        spark_dataframe: Any | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``train_object`` on every rank and return rank 0's return value.

        Args:
            train_object: a function (pickled with cloudpickle; ``args``/``kwargs`` are its
                arguments) or the path of a Python script (``args`` become its command-line
                arguments; ``kwargs`` are refused).
            spark_dataframe: train on this Spark DataFrame (Spark mode only): the barrier
                stage itself reads it, one partition per task, and each rank reads its own
                rows with ``sparkdist.data`` (nothing is collected on the driver).

        Returns:
            What rank 0 returned (None for a script).

        Raises:
            ConfigError: ``train_object`` is not usable, before anything starts (a generator
                or ``async def`` function: ``ConfigTypeError``).
            WorkerFailedError: a rank raised, exited non-zero or was killed.
        """
        return self.run_all(train_object, *args, spark_dataframe=spark_dataframe, **kwargs).values[
            0
        ]

    def run_all(
        self,
        train_object: TrainObject,
        *args: Any,
        spark_dataframe: Any | None = None,
        **kwargs: Any,
    ) -> RunResult:
        """Like ``run``, but return a ``RunResult`` with every rank's value in rank order."""
        try:
            return launch(
                self.config,
                make_job(train_object, args, kwargs),
                session=self.spark,
                ignore_ssl_key=self._ignore_ssl_key,
                dataframe=spark_dataframe,
            )
        except SparkdistError as error:
            # The message says what failed, the cause stays; our own frames would bury both.
            raise for_the_user(error) from error.__cause__

    def run_async(
        self,
        train_object: TrainObject,
        *args: Any,
        spark_dataframe: Any | None = None,
        **kwargs: Any,
    ) -> DistributedRun[Any]:
        """Start ``train_object`` on every rank and return at once: ``run`` without the wait.

        Takes what ``run`` takes. Anything that can fail before a rank starts raises here, as
        in ``run``; what happens after that is reported by the handle. The handle is the one
        ``@distributed``'s ``distributed_async`` returns, so sweeps read the same with either.

        Returns:
            A ``DistributedRun``: ``result(timeout=None)`` waits and returns what ``run`` would
            (rank 0's value), ``run_result()`` the whole ``RunResult`` (every rank's value, as
            ``run_all``), ``done()`` polls, ``cancel()`` stops every rank and everything they
            started, ``mlflow_run_id`` names the run's MLflow run.

        Raises:
            ConfigError, ClusterError: before any rank starts, as ``run`` raises them.

        Example:
            >>> runs = [Distributor(2).run_async(train, lr) for lr in (0.1, 0.01)]  # doctest: +SKIP
            >>> [run.result(timeout=600) for run in runs]  # rank 0's values  # doctest: +SKIP
        """
        try:
            started = start(
                self.config,
                make_job(train_object, args, kwargs),
                session=self.spark,
                ignore_ssl_key=self._ignore_ssl_key,
                dataframe=spark_dataframe,
            )
        except SparkdistError as error:
            raise for_the_user(error) from error.__cause__  # as ``run`` raises it
        return DistributedRun(started, rank0_value)

    def _train_on_dataframe(
        self,
        train_function: Callable[..., Any],
        spark_dataframe: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """pyspark's private ``TorchDistributor._train_on_dataframe``, for compatibility:
        ``run(train_function, *args, spark_dataframe=spark_dataframe, **kwargs)``."""
        return self.run(train_function, *args, spark_dataframe=spark_dataframe, **kwargs)

    def _plan(self, job: Job) -> LaunchPlan:
        """Everything ``run`` would do with ``job``, decided and checked, nothing started (the
        CLI's ``--dry-run``)."""
        return prepare(
            self.config, job, session=self.spark, ignore_ssl_key=self._ignore_ssl_key
        ).plan

    def _run_module(self, module: str, *argv: str) -> RunResult:
        """Run ``python -m module argv...`` on every rank (the CLI's ``-m``)."""
        job = Job(kind=TargetKind.MODULE, target=module, argv=tuple(argv))
        try:
            return launch(self.config, job, session=self.spark, ignore_ssl_key=self._ignore_ssl_key)
        except SparkdistError as error:
            # The message says what failed, the cause stays; our own frames would bury both.
            raise for_the_user(error) from error.__cause__


def make_job(train_object: TrainObject, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Job:
    """Turn ``run``'s arguments into a Job, refusing what cannot work before anything starts."""
    if isinstance(train_object, (str, os.PathLike)):
        path = Path(os.fspath(train_object))
        if not path.is_file():
            raise ConfigError(
                f"train_object {str(path)!r} is not an existing file; pass a callable or the "
                "path of a Python script"
            )
        if kwargs:
            raise ConfigError(
                f"keyword arguments ({', '.join(sorted(kwargs))}) cannot be passed to a script; "
                "pass them as command-line strings in args, e.g. run('train.py', '--lr', '0.1')"
            )
        return Job(
            kind=TargetKind.SCRIPT, target=str(path.resolve()), argv=tuple(str(a) for a in args)
        )
    if callable(train_object):
        check_launchable(train_object)
        return Job(kind=TargetKind.FUNCTION, fn=train_object, args=tuple(args), kwargs=kwargs)
    raise ConfigError(
        f"train_object must be a callable or the path of a Python script, got "
        f"{type(train_object).__name__}"
    )


__all__ = ["Distributor", "make_job"]
