"""Where the ranks run: pure functions from configuration and Spark conf to a placement.

Nothing here starts Spark or touches torch; the inputs are plain data (conf as a str->str
mapping, GPU addresses as strings) so every rule is tested table-driven.

Non-goals: discovering GPUs (``_spark`` and ``_gpus`` read them) or spawning anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparkdist._core.errors import ClusterError, ConfigError
from sparkdist._core.launch.config import LaunchConfig

TASK_GPU_KEY = "spark.task.resource.gpu.amount"
DRIVER_GPU_KEY = "spark.driver.resource.gpu.amount"
DYNAMIC_ALLOCATION_KEY = "spark.dynamicAllocation.enabled"
SSL_KEY = "spark.ssl.enabled"
AUTHENTICATE_KEY = "spark.authenticate"
#: pyspark's opt-out from its SSL refusal; we honour the same key so confs carry over.
TORCH_IGNORE_SSL_KEY = "pytorch.spark.distributor.ignoreSsl"
DEEPSPEED_IGNORE_SSL_KEY = "deepspeed.spark.distributor.ignoreSsl"

_GPU_ADDRESS = re.compile(r"^(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class Placement:
    """How the world is cut into Spark tasks (or, in local mode, one driver-side group).

    Attributes:
        num_tasks: Spark barrier tasks (1 in local mode).
        processes_per_task: ranks each task runs; rank = task index * this + local rank.
        use_gpu: whether ranks bind GPUs.
        driver_gpus: in local mode with GPUs, the addresses the ranks share (one per local rank).
    """

    num_tasks: int
    processes_per_task: int
    use_gpu: bool
    driver_gpus: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.num_tasks * self.processes_per_task


def place_local(config: LaunchConfig, driver_gpus: Sequence[str]) -> Placement:
    """Placement for local mode: every rank on the driver.

    Args:
        config: the validated launch config.
        driver_gpus: GPU addresses visible to the driver (CUDA ordinals as strings).
    """
    n = config.num_processes
    use_gpu = bool(driver_gpus) if config.use_gpu is None else config.use_gpu
    if not use_gpu:
        return Placement(num_tasks=1, processes_per_task=n, use_gpu=False)
    if not driver_gpus:
        raise ClusterError(
            "use_gpu=True but no GPU is visible on the driver (no CUDA device, or "
            f"{DRIVER_GPU_KEY} unset); pass use_gpu=False to train on CPU with gloo"
        )
    if n > len(driver_gpus):
        raise ClusterError(
            f"num_processes={n} but the driver has {len(driver_gpus)} GPU(s) "
            f"({', '.join(driver_gpus)}); pass num_processes<={len(driver_gpus)}, "
            "use_gpu=False, or local_mode=False to run on the cluster's executors"
        )
    return Placement(
        num_tasks=1, processes_per_task=n, use_gpu=True, driver_gpus=tuple(driver_gpus[:n])
    )


def place_on_cluster(config: LaunchConfig, conf: Mapping[str, str]) -> Placement:
    """Placement for Spark mode, from the session's conf.

    One barrier task per rank, or k ranks per task when ``spark.task.resource.gpu.amount`` is k.
    """
    n = config.num_processes
    gpus_per_task = _task_gpu_amount(conf, required=config.use_gpu is True)
    use_gpu = gpus_per_task > 0 if config.use_gpu is None else config.use_gpu
    if not use_gpu:
        return Placement(num_tasks=n, processes_per_task=1, use_gpu=False)
    if n % gpus_per_task:
        raise ConfigError(
            f"num_processes={n} is not a multiple of {TASK_GPU_KEY}={gpus_per_task}: each task "
            f"runs one rank per GPU; pass num_processes as a multiple of {gpus_per_task} or "
            f"set {TASK_GPU_KEY}=1"
        )
    return Placement(num_tasks=n // gpus_per_task, processes_per_task=gpus_per_task, use_gpu=True)


def shrink_to_slots(config: LaunchConfig, full: Placement, slots: int) -> Placement | None:
    """The largest placement of at most ``full``'s world that ``slots`` barrier slots hold, and
    at least ``config.min_processes`` ranks; None when the slots hold fewer (pure).

    A world stays a whole number of tasks: with k ranks per task (k GPUs per task) it shrinks
    by whole tasks, so the smallest it may be is ``min_processes`` rounded up to a multiple
    of k.

    Example:
        >>> config = LaunchConfig(num_processes=4, min_processes=2, local_mode=False)
        >>> shrink_to_slots(config, Placement(4, 1, False), 3).world_size
        3
    """
    tasks = min(full.num_tasks, max(0, slots))
    fewest_tasks = -(-config.smallest_world // full.processes_per_task)  # ceiling
    if tasks < fewest_tasks or tasks < 1:
        return None
    return Placement(tasks, full.processes_per_task, full.use_gpu, full.driver_gpus)


@dataclass(frozen=True)
class PysparkCount:
    """pyspark's constructor-time reading of the world (``TorchDistributor._get_num_tasks``).

    Attributes:
        num_processes: the world size, lowered to the driver's GPUs in local GPU mode.
        num_tasks: Spark tasks pyspark's ``num_tasks`` attribute reports (the world size, or
            the world size over ``spark.task.resource.gpu.amount``).
        warning: set when ``num_processes`` was lowered: the line to log.
    """

    num_processes: Any
    num_tasks: Any
    warning: str | None = None


def count_like_pyspark(
    num_processes: Any,
    *,
    local_mode: bool,
    use_gpu: bool,
    conf: Mapping[str, str],
    driver_gpus: Sequence[str] | None,
) -> PysparkCount:
    """What pyspark's ``TorchDistributor`` constructor decides, and refuses, from the conf.

    pyspark checks the GPU conf when the distributor is made (before ``num_processes`` itself)
    and raises ``RuntimeError``: here ``ClusterError`` (a ``RuntimeError``) with what to change.
    A ``num_processes`` that is not a positive int passes through untouched: the launch config
    refuses it next, as pyspark's own check comes after this one.

    Args:
        num_processes: the world size asked for.
        local_mode: ranks on the driver (True) or on executors.
        use_gpu: whether ranks bind GPUs.
        conf: the session's Spark conf (runtime conf first); in local mode, empty unless the
            driver's GPUs come from Spark (then ``spark.driver.resource.gpu.amount`` counts).
        driver_gpus: the driver's GPU addresses (local mode), None when there are none.
    """
    n = num_processes
    counted = isinstance(n, int) and not isinstance(n, bool)
    if not use_gpu:
        return PysparkCount(n, n)
    if not local_mode:
        raw = (conf.get(TASK_GPU_KEY) or "0").strip()
        try:
            amount = int(raw)
        except ValueError:
            raise ConfigError(
                f"{TASK_GPU_KEY}={raw!r} is not a whole number (pyspark reads it as an int); "
                f"set {TASK_GPU_KEY}=1 or pass use_gpu=False"
            ) from None
        if amount < 1:
            raise ClusterError(
                f"use_gpu=True but {TASK_GPU_KEY} is {'unset' if raw == '0' else raw}, so no "
                f"task gets a GPU; set {TASK_GPU_KEY}=1 (and spark.executor.resource.gpu.amount "
                "with a discovery script) or pass use_gpu=False"
            )
        if counted and amount > 1 and n % amount:
            raise ClusterError(
                f"num_processes={n} is not a multiple of {TASK_GPU_KEY}={amount}: each task "
                f"runs one rank per GPU; pass num_processes as a multiple of {amount} or set "
                f"{TASK_GPU_KEY}=1"
            )
        return PysparkCount(n, n // amount if counted else n)
    if not driver_gpus:
        raise ClusterError(
            "use_gpu=True but no GPU is visible on the driver (no CUDA device, or "
            f"{DRIVER_GPU_KEY} and its discovery script unset); pass use_gpu=False to train "
            "on CPU with gloo"
        )
    available = len(driver_gpus)
    driver_raw = conf.get(DRIVER_GPU_KEY)
    if driver_raw is not None:
        raw = driver_raw
        try:
            available = int(raw)
        except ValueError:
            raise ConfigError(
                f"{DRIVER_GPU_KEY}={raw!r} is not a whole number; set it to the driver's GPU count"
            ) from None
        if available < 1:
            raise ClusterError(
                f"use_gpu=True but {DRIVER_GPU_KEY}={raw}: the driver's GPUs are not given to "
                f"Spark; set {DRIVER_GPU_KEY} to their number or pass use_gpu=False"
            )
    if counted and n > available:
        warning = (
            f"num_processes={n} but the driver has {available} GPU(s) "
            f"({', '.join(driver_gpus[:available])}); num_processes was lowered to {available} "
            f"(as pyspark's TorchDistributor does); pass num_processes<={available} to silence "
            "this"
        )
        return PysparkCount(available, available, warning)
    return PysparkCount(n, n)


def _task_gpu_amount(conf: Mapping[str, str], *, required: bool) -> int:
    raw = conf.get(TASK_GPU_KEY)
    if raw is None or raw.strip() == "":
        if required:
            raise ConfigError(
                f"use_gpu=True but {TASK_GPU_KEY} is unset; set {TASK_GPU_KEY}=1 (and "
                "spark.executor.resource.gpu.amount with a discovery script) or pass "
                "use_gpu=False"
            )
        return 0
    try:
        amount = float(raw)
    except ValueError:
        raise ConfigError(f"{TASK_GPU_KEY}={raw!r} is not a number; set it to 1") from None
    if amount != int(amount) or amount < 0 or (required and amount < 1):
        raise ConfigError(
            f"{TASK_GPU_KEY}={raw} but each rank needs a whole GPU of its own; set "
            f"{TASK_GPU_KEY}=1 (or another whole number) or pass use_gpu=False"
        )
    return int(amount)


def check_cluster_conf(conf: Mapping[str, str], ignore_ssl_key: str) -> list[str]:
    """Refuse Spark confs under which a barrier stage cannot run; return warnings to log.

    Raises:
        ClusterError: dynamic allocation is on, or SSL is on without the opt-out key.
    """
    if _is_true(conf.get(DYNAMIC_ALLOCATION_KEY)):
        raise ClusterError(
            f"{DYNAMIC_ALLOCATION_KEY}=true, but Spark barrier stages need a fixed set of "
            f"executors; start the session with {DYNAMIC_ALLOCATION_KEY}=false"
        )
    warnings: list[str] = []
    master = conf.get("spark.master", "")
    if master and not master.startswith("local") and not _is_true(conf.get(AUTHENTICATE_KEY)):
        warnings.append(
            f"master {master!r} runs without {AUTHENTICATE_KEY}=true: anyone who can reach the "
            "cluster's ports can submit work to its executors; set spark.authenticate=true and "
            "spark.authenticate.secret (sparkdist's own channel is authenticated either way)"
        )
    ssl = check_ssl(conf, ignore_ssl_key)
    if ssl is not None:
        warnings.append(ssl)
    return warnings


def check_ssl(conf: Mapping[str, str], ignore_ssl_key: str) -> str | None:
    """Refuse SSL without the opt-out key (as pyspark does); with it, return the warning to log.

    Raises:
        ClusterError: ``spark.ssl.enabled=true`` and ``ignore_ssl_key`` is not true.
    """
    if not _is_true(conf.get(SSL_KEY)):
        return None
    if not _is_true(conf.get(ignore_ssl_key)):
        raise ClusterError(
            f"{SSL_KEY}=true, but the ranks' torch.distributed traffic is not encrypted; "
            f"to run anyway set {ignore_ssl_key}=true in the Spark conf "
            f'(spark.conf.set("{ignore_ssl_key}", "true") will do)'
        )
    return (
        f"{SSL_KEY}=true and {ignore_ssl_key}=true: model parameters and possibly "
        "training data travel between nodes unencrypted"
    )


def check_barrier_slots(needed: int, found: int, master: str) -> None:
    """Fail at once when the cluster cannot run every task of the barrier stage together."""
    if found < needed:
        raise ClusterError(
            f"the barrier stage needs {needed} task slots at once but the cluster "
            f"(master {master!r}) offers {found}; add executors or cores "
            "(spark.executor.instances, spark.executor.cores, GPU amounts), or lower "
            "num_processes"
        )


def estimate_barrier_slots(conf: Mapping[str, str]) -> int | None:
    """Barrier slots the conf implies, or None when it does not say (Spark Connect exposes no
    executor list, so this is all a Connect client can know before submitting)."""
    master = conf.get("spark.master", "")
    task_cpus = _positive_int(conf.get("spark.task.cpus")) or 1
    local = re.fullmatch(r"local(?:\[(\d+)(?:,\s*\d+)?\])?", master)
    if local:
        return (int(local.group(1)) if local.group(1) else 1) // task_cpus
    cluster = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if cluster:
        executors: int | None = int(cluster.group(1))
        cores: int | None = int(cluster.group(2))
    else:
        executors = _positive_int(conf.get("spark.executor.instances"))
        cores = _positive_int(conf.get("spark.executor.cores"))
    if executors is None or cores is None:
        return None
    per_executor = cores // task_cpus
    task_gpus = _positive_int(conf.get(TASK_GPU_KEY))
    executor_gpus = _positive_int(conf.get("spark.executor.resource.gpu.amount"))
    if task_gpus and executor_gpus:
        per_executor = min(per_executor, executor_gpus // task_gpus)
    return executors * per_executor


def _positive_int(value: str | None) -> int | None:
    try:
        number = int(float(value)) if value is not None else 0
    except ValueError:
        return None
    return number if number > 0 else None


def cuda_visible_devices(addresses: Sequence[str], inherited: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES value for Spark-assigned GPU addresses.

    Spark's addresses index the devices the executor can see; when the executor itself runs
    under a CUDA_VISIBLE_DEVICES mask, they index into that mask (as pyspark does).
    """
    bad = [a for a in addresses if not _GPU_ADDRESS.match(a)]
    if bad:
        raise ClusterError(
            f"GPU addresses {list(addresses)} are not all CUDA ordinals ({bad} are not); the "
            'discovery script must print integer addresses such as ["0", "1"]'
        )
    if not inherited:
        return ",".join(addresses)
    mask = [item.strip() for item in inherited.split(",") if item.strip()]
    try:
        return ",".join(mask[int(a)] for a in addresses)
    except IndexError:
        raise ClusterError(
            f"GPU addresses {list(addresses)} fall outside this executor's "
            f"CUDA_VISIBLE_DEVICES={inherited}; check the discovery script"
        ) from None


def _is_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() == "true"
