"""pyspark's launchers, by pyspark's names: ``TorchDistributor`` and ``DeepspeedTorchDistributor``.

Swapping ``from pyspark.ml.torch.distributor import TorchDistributor`` (or pyspark's
``DeepspeedTorchDistributor``) for sparkdist's is enough: the same constructor and defaults,
the same checks of the Spark conf when the distributor is made (raising ``RuntimeError``s:
``ClusterError``), the same instance attributes, the same warnings on a logger named after the
class, and ``run(train_object, *args, **kwargs)``. Where pyspark is wrong sparkdist differs on
purpose; docs/launching.md lists every such difference, and tests/compat runs both classes side
by side.

Non-goals: the engine (``Distributor``, which these subclass); pyspark's private methods other
than ``_train_on_dataframe``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from sparkdist._backends import spark_driver
from sparkdist._core.errors import ConfigError, ConfigTypeError, SparkdistError
from sparkdist._core.launch.config import Mode
from sparkdist._core.launch.placement import (
    DEEPSPEED_IGNORE_SSL_KEY,
    TORCH_IGNORE_SSL_KEY,
    check_ssl,
    count_like_pyspark,
)
from sparkdist._core.run.result import RunResult
from sparkdist._core.tracebacks import for_the_user
from sparkdist._engine.start import launch
from sparkdist._node.host.gpus import visible_gpus
from sparkdist._wire.payload import Job
from sparkdist.distributor import Distributor, TrainObject, make_job

__all__ = ["DeepspeedTorchDistributor", "TorchDistributor"]


class TorchDistributor(Distributor):
    """Drop-in for ``pyspark.ml.torch.distributor.TorchDistributor``.

    Same constructor, defaults and attributes (``num_processes``, ``local_mode``, ``use_gpu``,
    ``spark``, ``is_remote``, ``is_spark_local_master``, ``ssl_conf``, ``num_tasks``,
    ``input_params``, ``logger``). The Spark conf is checked when the distributor is made, as
    pyspark does: ``use_gpu=True`` on a cluster without ``spark.task.resource.gpu.amount``, or
    with a ``num_processes`` that amount does not divide, raises ``ClusterError`` (a
    ``RuntimeError``); in local mode, more processes than the driver has GPUs logs a warning
    and lowers ``num_processes``. ``run`` returns rank 0's value and raises when a rank fails.
    Unlike pyspark's, local mode needs no SparkSession.

    Args:
        num_processes: the world size.
        local_mode: True runs the ranks on the driver, False as one Spark barrier stage.
        use_gpu: one GPU per rank (True) or CPU with gloo (False).
        _ssl_conf: the Spark conf key that lets a run go on with ``spark.ssl.enabled=true``.

    Raises:
        ClusterError: the Spark conf cannot give the ranks GPUs (a ``RuntimeError``).
        ConfigError: an argument or a GPU amount is not usable (a ``ValueError``).

    Example:
        >>> from sparkdist import TorchDistributor
        >>> TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        ...     "train.py", "--lr", "1e-3")  # doctest: +SKIP
    """

    # pyspark's attributes are plain instance attributes that code may also set; these
    # class-level names shadow Distributor's read-only properties, so an instance holds its own.
    num_processes: Any = None
    local_mode: Any = None
    use_gpu: Any = None

    _TORCH_SSL_CONF = TORCH_IGNORE_SSL_KEY

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        _ssl_conf: str = TORCH_IGNORE_SSL_KEY,
    ) -> None:
        self._set_up(num_processes, local_mode, use_gpu, _ssl_conf)

    def _set_up(
        self,
        num_processes: Any,
        local_mode: Any,
        use_gpu: Any,
        ssl_conf: str,
        *,
        mode: Mode = Mode.DDP,
        deepspeed_config: Any = None,
        check_counts: Callable[[], None] | None = None,
    ) -> None:
        # pyspark's order: session, conf checks (RuntimeError), then num_processes (ValueError).
        self.is_remote = _is_remote()
        self.spark = _session(local_mode=bool(local_mode))
        conf = spark_driver.spark_conf(self.spark, (ssl_conf,)) if self.spark is not None else {}
        master = conf.get("spark.master", "")
        self.is_spark_local_master = master == "local" or master.startswith("local[")
        self.logger = _class_logger(type(self).__name__)
        gpu_conf, driver_gpus = _driver_gpus(self.spark, conf, bool(local_mode), bool(use_gpu))
        count = count_like_pyspark(
            num_processes,
            local_mode=bool(local_mode),
            use_gpu=bool(use_gpu),
            conf=conf if not local_mode else gpu_conf,
            driver_gpus=driver_gpus,
        )
        if count.warning is not None:
            self.logger.warning(count.warning)
        if check_counts is not None:
            check_counts()
        Distributor.__init__(
            self,
            count.num_processes,
            local_mode=bool(local_mode),
            use_gpu=bool(use_gpu),
            mode=mode,
            deepspeed_config=deepspeed_config,
            spark=self.spark,
        )
        self._ignore_ssl_key = ssl_conf
        self.num_processes = count.num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.num_tasks = count.num_tasks
        self.ssl_conf = ssl_conf
        self.input_params = self._input_params()

    def _input_params(self) -> dict[str, Any]:
        return {
            "num_processes": self.num_processes,
            "local_mode": self.local_mode,
            "use_gpu": self.use_gpu,
            "num_tasks": self.num_tasks,
        }

    def run(self, train_object: TrainObject, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object`` on every rank; return rank 0's value (None for a script).

        Args:
            train_object: a function (``args``/``kwargs`` are its arguments) or the path of a
                Python script (``args`` become its command-line arguments, as strings).

        Raises:
            ConfigError: ``train_object`` or its arguments cannot be used (a ``ValueError``).
            ClusterError: the cluster cannot host the run (SSL on without the opt-out, say).
            WorkerFailedError: a rank failed (a ``RuntimeError``).
        """
        return self._launch(train_object, args, kwargs, None).values[0]

    def _train_on_dataframe(
        self,
        train_function: Callable[..., Any],
        spark_dataframe: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """pyspark's private DataFrame entry point: each task's ranks get its partition.

        Inside ``train_function`` both ``sparkdist.data`` and pyspark's
        ``pyspark.ml.torch.distributor._get_spark_partition_data_loader`` read this rank's rows.
        """
        return self._launch(train_function, args, kwargs, spark_dataframe).values[0]

    def _launch(
        self,
        train_object: TrainObject,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        dataframe: Any,
    ) -> RunResult:
        where = (
            f"local training with {self.config.num_processes} processes"
            if self.config.local_mode
            else f"distributed training with {self.config.num_processes} executor processes"
        )
        try:
            job: Job = make_job(train_object, args, dict(kwargs))
            if not self.config.local_mode:
                # pyspark says this on its class's logger at every run; the engine's own
                # check (the same function) refuses the run when the opt-out is missing.
                session = self.spark if self.spark is not None else _session(local_mode=False)
                warning = check_ssl(
                    spark_driver.spark_conf(session, (self.ssl_conf,)), self.ssl_conf
                )
                if warning is not None:
                    self.logger.warning(warning)
            self.logger.info("Started %s", where)
            result = launch(
                self.config,
                job,
                session=self.spark,
                ignore_ssl_key=self.ssl_conf,
                dataframe=dataframe,
            )
        except SparkdistError as error:
            # The message says what failed, the cause stays; our own frames would bury both.
            raise for_the_user(error) from error.__cause__
        self.logger.info("Finished %s", where)
        return result


class DeepspeedTorchDistributor(TorchDistributor):
    """Drop-in for ``pyspark.ml.deepspeed.deepspeed_distributor.DeepspeedTorchDistributor``.

    Runs ``numGpus * nnodes`` ranks in mode "deepspeed" (``numGpus=True`` counts as 1, as in
    pyspark). ``deepspeedConfig`` (a dict or the path of a JSON file) is checked on the driver
    when the distributor is made, shipped to every rank as a file (removed after the run),
    appended to a script's arguments as ``--deepspeed --deepspeed_config <path>`` (as pyspark
    does), and, unlike pyspark, readable from a function too:
    ``sparkdist.runtime.deepspeed_config()``. Without a GPU, ranks use DeepSpeed's CPU
    accelerator (``DS_ACCELERATOR=cpu``) and gloo. Attributes are TorchDistributor's plus
    ``deepspeed_config`` and ``cleanup_deepspeed_conf``, as in pyspark.

    Args:
        numGpus: ranks per node.
        nnodes: nodes; the world is ``numGpus * nnodes`` ranks.
        localMode: True runs the ranks on the driver, False as one Spark barrier stage.
        useGpu: one GPU per rank (True) or CPU with gloo (False).
        deepspeedConfig: the DeepSpeed config, a dict or the path of a JSON file, or None.

    Raises:
        ClusterError: the Spark conf cannot give the ranks GPUs (a ``RuntimeError``).
        ConfigError: a count or the config is not usable (a ``ValueError``).

    Example:
        >>> from sparkdist import DeepspeedTorchDistributor
        >>> DeepspeedTorchDistributor(numGpus=2, useGpu=False,
        ...     deepspeedConfig="conf/deepspeed/zero2.json").run(train)  # doctest: +SKIP
    """

    _DEEPSPEED_SSL_CONF = DEEPSPEED_IGNORE_SSL_KEY

    def __init__(
        self,
        numGpus: int = 1,
        nnodes: int = 1,
        localMode: bool = True,
        useGpu: bool = True,
        deepspeedConfig: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    ) -> None:
        num_processes = numGpus * nnodes  # pyspark's product: True counts as 1

        def check_counts() -> None:
            for name, value in (("numGpus", numGpus), ("nnodes", nnodes)):
                if not isinstance(value, int):
                    raise ConfigTypeError(
                        f"{name} must be a positive integer, got {type(value).__name__} {value!r}"
                    )
                if value <= 0:
                    raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        self.deepspeed_config = deepspeedConfig
        self._set_up(
            num_processes,
            localMode,
            useGpu,
            DEEPSPEED_IGNORE_SSL_KEY,
            mode=Mode.DEEPSPEED,
            deepspeed_config=deepspeedConfig,
            check_counts=check_counts,
        )
        self.cleanup_deepspeed_conf = False

    def _input_params(self) -> dict[str, Any]:
        return {"deepspeed_config": self.deepspeed_config, **super()._input_params()}


def _is_remote() -> bool:
    """pyspark's ``is_remote()``: whether this process runs Spark Connect (False without
    pyspark)."""
    try:
        from pyspark.sql.utils import is_remote
    except ImportError:
        return False
    return bool(is_remote())


def _session(*, local_mode: bool) -> Any | None:
    """pyspark's ``SparkSession.active()`` (the thread's session, else the default one).

    Local mode needs none (None when there is none); on a cluster one is created if none is
    active, as ``Distributor`` does.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        session = None
    else:
        try:
            session = SparkSession.active()
        except Exception:  # pyspark's "no active or default session": ours starts one
            session = None
    if session is None and not local_mode:
        session = spark_driver.get_or_create_session()
    return session


def _driver_gpus(
    session: Any | None, conf: Mapping[str, str], local_mode: bool, use_gpu: bool
) -> tuple[Mapping[str, str], list[str] | None]:
    """Local GPU mode: the driver's GPUs (Spark's driver resources of a classic session, else
    this machine's), and the conf that counts them (Spark's, only when they come from Spark)."""
    if not (local_mode and use_gpu):
        return {}, None
    from_spark = spark_driver.driver_gpu_addresses(session)
    if from_spark is not None:
        return conf, from_spark
    return {}, [gpu.address for gpu in visible_gpus()] or None


def _class_logger(name: str) -> logging.Logger:
    """The logger pyspark's distributors use: named after the class, at INFO, printing to
    stderr when nothing else in the process would print it."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    if not (logger.handlers or logging.getLogger().handlers):
        logger.addHandler(logging.StreamHandler(sys.stderr))
    return logger
