"""The driver's questions to Spark: which session, its conf, its slots, where the driver is.

Both session kinds are served: a classic SparkSession (with a SparkContext) and a Spark Connect
session (a client of a remote Spark driver: no SparkContext, conf read key by key, no slot
count — it is estimated from the conf where the conf says enough).

Non-goals: the barrier stage itself (``_stage``); deciding placement (``_placement``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from sparkdist._backends.session import active_session as active_session
from sparkdist._backends.session import get_or_create_session as get_or_create_session
from sparkdist._backends.session import is_connect
from sparkdist._core.placement import check_barrier_slots, estimate_barrier_slots

logger = logging.getLogger("sparkdist")

#: How long to wait for executors to register before declaring the cluster too small.
SLOT_WAIT_S = 20.0


#: Conf keys sparkdist reads; a Connect session is asked for each (no getAll there).
CONF_KEYS = (
    "spark.master",
    "spark.task.resource.gpu.amount",
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


def spark_conf(session: Any) -> dict[str, str]:
    """The session's Spark conf as plain strings (on Connect: the keys sparkdist reads)."""
    if not is_connect(session):
        return {str(k): str(v) for k, v in session.sparkContext.getConf().getAll()}
    conf = {}
    for key in CONF_KEYS:
        value = session.conf.get(key, None)
        if value is not None:
            conf[key] = str(value)
    return conf


def driver_gpu_addresses(session: Any | None) -> list[str] | None:
    """GPU addresses Spark assigned to the driver, or None when Spark assigned none (always
    None on Connect: its driver is not this process)."""
    if session is None or is_connect(session):
        return None
    resources = session.sparkContext.resources
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else None


def driver_host(session: Any) -> str:
    """The address executors reach this process at, for the control channel.

    Classic: Spark's own driver address. Connect: this client process is not Spark's driver;
    ``SPARKDIST_DRIVER_HOST`` (or ``SPARK_LOCAL_IP``) says which address to use, else this
    host's address. Executors that cannot reach it fall back to Spark's allGather.
    """
    if not is_connect(session):
        return str(session.sparkContext.getConf().get("spark.driver.host", "127.0.0.1"))
    chosen = os.environ.get("SPARKDIST_DRIVER_HOST") or os.environ.get("SPARK_LOCAL_IP")
    if chosen:
        return chosen
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def wait_for_barrier_slots(session: Any, needed: int, wait_s: float | None = None) -> int:
    """Return the cluster's barrier slots once there are enough, or raise ClusterError.

    Executors register after the session starts (local-cluster, standalone), so a too-small
    count is re-read for a few seconds before it is final; Spark's own check would wait minutes.
    """
    if is_connect(session):
        # Connect exposes no executor list: estimate from the conf, else let Spark check.
        found = estimate_barrier_slots(spark_conf(session))
        if found is not None:
            check_barrier_slots(needed, found, spark_conf(session).get("spark.master", "?"))
        return needed if found is None else found
    jsc = session.sparkContext._jsc.sc()
    deadline = time.monotonic() + (SLOT_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            profile = jsc.resourceProfileManager().defaultResourceProfile()
            found = int(jsc.maxNumConcurrentTasks(profile))
        except Exception:  # a Spark without this internal API: let Spark check at submission
            logger.debug("sparkdist: cannot count barrier slots", exc_info=True)
            return needed
        if found >= needed or time.monotonic() >= deadline:
            break
        time.sleep(0.1)  # executors register asynchronously; there is no event to wait on
    check_barrier_slots(needed, found, jsc.master())
    return found
