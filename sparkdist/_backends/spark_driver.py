"""The driver's questions to Spark: which session, its conf, its slots, where the driver is.

Both session kinds are served: a classic SparkSession (with a SparkContext) and a Spark Connect
session (a client of a remote Spark driver: no SparkContext, conf read key by key, no slot
count — it is estimated from the conf where the conf says enough).

Non-goals: the barrier stage itself (``_stage``); deciding placement (``_placement``).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from sparkdist._backends.session import active_session as active_session
from sparkdist._backends.session import get_or_create_session as get_or_create_session
from sparkdist._backends.session import is_connect
from sparkdist._core.env import DRIVER_HOST_VAR
from sparkdist._core.errors import ClusterError
from sparkdist._core.launch.config import DEFAULT_START_TIMEOUT_S
from sparkdist._core.launch.placement import check_barrier_slots, estimate_barrier_slots

logger = logging.getLogger("sparkdist")

#: Conf keys sparkdist reads; each is asked of the session's runtime conf (``spark.conf``: what
#: ``spark.conf.set`` changed, and on Connect the only conf there is).
CONF_KEYS = (
    "spark.master",
    "spark.task.resource.gpu.amount",
    "spark.driver.resource.gpu.amount",
    "spark.task.cpus",
    "spark.dynamicAllocation.enabled",
    "spark.ssl.enabled",
    "spark.authenticate",
    "spark.executor.instances",
    "spark.executor.cores",
    "spark.executor.resource.gpu.amount",
    "spark.driver.host",
    "pytorch.spark.distributor.ignoreSsl",
    "deepspeed.spark.distributor.ignoreSsl",
)


def spark_conf(session: Any, keys: Sequence[str] = ()) -> dict[str, str]:
    """The session's Spark conf as plain strings: the one place any mode reads it.

    The runtime conf (``spark.conf``) wins, as pyspark reads it, so ``spark.conf.set(
    "pytorch.spark.distributor.ignoreSsl", "true")`` counts; a classic session's start-up conf
    (``sparkContext.getConf()``) fills in the rest. Connect has no start-up conf to list: there
    the result holds ``CONF_KEYS`` and ``keys`` where set.

    Args:
        session: a classic or Spark Connect SparkSession.
        keys: more keys to read from the runtime conf (a custom SSL opt-out key, say).
    """
    conf: dict[str, str] = {}
    if not is_connect(session):
        conf = _startup_conf(session.sparkContext)
    for key in dict.fromkeys((*CONF_KEYS, *keys)):
        value = session.conf.get(key, None)
        if value is not None:
            conf[key] = str(value)
    return conf


#: Each live SparkContext's start-up conf. Spark fixes it when the context starts, and reading
#: it costs a Py4J round trip per entry: hundreds per launch, over 100 ms on a loaded machine.
_startup_confs: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def _startup_conf(context: Any) -> dict[str, str]:
    conf = _startup_confs.get(context)
    if conf is None:
        conf = {str(k): str(v) for k, v in context.getConf().getAll()}
        _startup_confs[context] = conf
    return dict(conf)


def driver_gpu_addresses(session: Any | None) -> list[str] | None:
    """GPU addresses Spark assigned to the driver, or None when Spark assigned none (always
    None on Connect: its driver is not this process)."""
    if session is None or is_connect(session):
        return None
    resources = session.sparkContext.resources
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else None


def driver_host(session: Any, conf: Mapping[str, str] | None = None) -> str:
    """The address executors reach this process at, for the control channel.

    Classic: Spark's own driver address. Connect: this client process is not Spark's driver;
    ``SPARKDIST_DRIVER_HOST`` (or ``SPARK_LOCAL_IP``) says which address to use, else this
    host's address. Executors that cannot reach it fall back to Spark's allGather.
    """
    if not is_connect(session):
        return (spark_conf(session) if conf is None else conf).get("spark.driver.host", "127.0.0.1")
    chosen = os.environ.get(DRIVER_HOST_VAR) or os.environ.get("SPARK_LOCAL_IP")
    if chosen:
        return chosen
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def wait_for_barrier_slots(
    session: Any,
    needed: int,
    wait_s: float = DEFAULT_START_TIMEOUT_S,
    conf: Mapping[str, str] | None = None,
    fewest: int | None = None,
) -> int:
    """Return the cluster's barrier slots once there are enough, or raise ClusterError.

    Executors register after the session starts (local-cluster, standalone, YARN, Kubernetes),
    slowly on a loaded machine, so a too-small count is re-read until it is enough, every
    executor the conf asks for has registered (the count is final), or ``wait_s`` (the run's
    ``start_timeout_s``) has passed. Spark's own check would wait minutes and name no numbers.
    An elastic run (``fewest``: the tasks of ``min_processes``) then takes what is there when
    that is at least ``fewest``.
    """
    if is_connect(session):
        # Connect exposes no executor list: estimate from the conf, else let Spark check.
        connect_conf = spark_conf(session)
        found = estimate_barrier_slots(connect_conf)
        if found is not None:
            check_barrier_slots(needed, found, connect_conf.get("spark.master", "?"))
        return needed if found is None else found
    conf = spark_conf(session) if conf is None else conf  # the caller's read of it, if any
    expected = expected_executors(conf)
    started = time.monotonic()
    said_waiting = False
    while True:
        counted = count_barrier_slots(session)
        if counted is None:  # a Spark without these internal APIs: let Spark check at submission
            return needed
        found, registered = counted
        waited_s = time.monotonic() - started
        if found >= needed:
            return found
        if (expected is not None and registered >= expected) or waited_s >= wait_s:
            if fewest is not None and found >= fewest:
                return found
            # An elastic run needs only its smallest world's tasks: say that number.
            least = needed if fewest is None else min(needed, fewest)
            raise barrier_slots_error(least, found, registered, expected, waited_s, conf)
        if not said_waiting and waited_s >= 5.0:
            said_waiting = True
            logger.info(
                "sparkdist: waiting for executors: %d of %s registered, %d of %d task slots "
                "(up to start_timeout_s=%g s)",
                registered,
                "?" if expected is None else expected,
                found,
                needed,
                wait_s,
            )
        time.sleep(0.2)  # executors register asynchronously; Python sees no event for it


def count_barrier_slots(session: Any) -> tuple[int, int] | None:
    """A classic session's barrier slots now and its registered executors, or None when this
    Spark does not say (the internal APIs are missing)."""
    try:
        jsc = session.sparkContext._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        found = int(jsc.maxNumConcurrentTasks(profile))
        # The status tracker lists the driver too. It learns of an executor after the
        # scheduler counts its slots, so "all registered" here means all counted there.
        registered = max(0, len(jsc.statusTracker().getExecutorInfos()) - 1)
    except Exception:
        logger.debug("sparkdist: cannot count barrier slots", exc_info=True)
        return None
    return found, registered


#: The conf keys that decide how many barrier slots a cluster has, in the order to show them.
SLOT_KEYS = (
    "spark.executor.instances",
    "spark.executor.cores",
    "spark.task.cpus",
    "spark.executor.resource.gpu.amount",
    "spark.task.resource.gpu.amount",
)


def expected_executors(conf: Mapping[str, str]) -> int | None:
    """How many executors the conf asks for (0 for a ``local`` master), None if it does not say.

    ``local-cluster[n,cores,memory]`` starts n; YARN and Kubernetes start
    ``spark.executor.instances``; a standalone master starts what its Workers can hold.
    """
    master = conf.get("spark.master", "")
    if re.fullmatch(r"local(\[.*\])?", master):
        return 0  # the driver runs the tasks: no executor will come
    cluster = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,.*\]", master)
    if cluster:
        return int(cluster.group(1))
    try:
        instances = int(conf.get("spark.executor.instances", ""))
    except ValueError:
        return None
    return instances if instances > 0 else None


def barrier_slots_error(
    needed: int,
    found: int,
    registered: int,
    expected: int | None,
    waited_s: float,
    conf: Mapping[str, str],
) -> ClusterError:
    """The error for a cluster with too few barrier slots: the counts, the settings, the fix."""
    master = conf.get("spark.master", "?")
    settings = ", ".join(f"{key}={conf.get(key, 'unset')}" for key in SLOT_KEYS)
    if expected == 0:
        task_cpus = conf.get("spark.task.cpus", "1")
        threads = needed * int(task_cpus) if task_cpus.isdigit() else needed
        return ClusterError(
            f"the barrier stage needs {needed} task slots at once but master {master!r} runs "
            f"{found} task(s) at once (spark.task.cpus={task_cpus}); use a master with more "
            f"threads (local[{threads}] or more) or lower num_processes"
        )
    if expected is None:
        counted = f"{registered} executor(s) registered after {waited_s:.1f} s"
    else:
        counted = f"{registered} of {expected} executors registered after {waited_s:.1f} s"
    if expected is not None and registered < expected:
        fix = (
            "executors are still starting or cannot start: raise start_timeout_s, or check that "
            "the cluster has room for them (the master's UI, the executors' logs)"
        )
    else:
        fix = (
            "add executors or cores (spark.executor.instances, spark.executor.cores, GPU "
            "amounts), or lower num_processes"
        )
    return ClusterError(
        f"the barrier stage needs {needed} task slots at once but the cluster offers {found}: "
        f"{counted} (master {master!r}, {settings}); {fix}"
    )


def task_executors(session: Any, job_group: str) -> dict[int, str]:
    """The executor each task of ``job_group``'s newest job's last stage ran on, by partition
    (a barrier stage's partition is its node); {} where Spark does not say."""
    context = session.sparkContext
    tracker = context.statusTracker()
    jobs = tracker.getJobIdsForGroup(job_group)
    job = tracker.getJobInfo(max(jobs)) if jobs else None
    stage = tracker.getStageInfo(max(job.stageIds)) if job is not None and job.stageIds else None
    if stage is None:
        return {}
    tasks = (
        context._jsc.sc().statusStore().taskList(stage.stageId, stage.currentAttemptId, 2**31 - 1)
    )
    executors: dict[int, str] = {}
    for i in range(tasks.size()):
        task = tasks.apply(i)
        executors[int(task.partitionId())] = str(task.executorId())
    return executors


def give_up_executors(session: Any, executor_ids: Collection[str]) -> list[str]:
    """Remove these of the application's executors that the scheduler still offers tasks
    (a cut-off one stays listed until ``spark.network.timeout``), and return their ids.

    The application's executor target is kept, so the cluster manager replaces them wherever it
    has room, the same host included once it is back: a later executor at that address is new
    capacity, not the one that failed. ``SparkContext.killExecutors`` would lower the target
    instead, and a standalone application's (unset until then) to 0 for good. Best effort: a
    developer API that a cluster manager may refuse.
    """
    context = session.sparkContext
    scheduler = context._jsc.sc().schedulerBackend()
    doomed = [i for i in sorted(executor_ids) if scheduler.isExecutorActive(i)]
    if not doomed:
        return []
    ids = context._jvm.PythonUtils.toSeq(doomed)
    # killExecutors(ids, adjustTargetNumExecutors, countFailures, force)
    killed = scheduler.killExecutors(ids, False, False, True)
    return [str(killed.apply(i)) for i in range(killed.size())]
