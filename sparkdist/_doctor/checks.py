"""``sparkdist doctor``: is this machine ready to launch runs, and if not, what to change.

Each check is a function returning a ``Check`` (what was found and, for what is not fine, the
fix). Checks that only read data (versions, Spark conf, GPU lists) are pure so they are tested
table-driven.

What counts as a problem: what stops a run (no torch, no pyspark, no usable Java, a Spark
session that does not start, a conf Spark mode refuses, GPUs torch cannot use). No GPU on a CPU
machine, no DeepSpeed, no MLflow are notes: runs still work.

Non-goals: printing (the CLI prints ``format_checks`` and the ``progress`` lines), fixing
anything.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sparkdist._core.supported import describe
from sparkdist._doctor.network import CHECK_NAME, network_check
from sparkdist._doctor.network_probe import ClusterProbe
from sparkdist._doctor.progress import Progress, Silent
from sparkdist._doctor.ranges import in_range
from sparkdist._doctor.spark import (
    SPARK_PROBE_TIMEOUT_S,
    SparkProbe,
    check_gpu_conf,
    check_java,
    check_preemption_conf,
    check_pyspark,
    find_java,
    java_version_text,
)
from sparkdist._doctor.table import Check, Status
from sparkdist._node.host.gpus import Gpu, visible_gpus


@dataclass(frozen=True)
class TorchInfo:
    """What the installed torch can do (``version`` is empty when torch does not import)."""

    version: str = ""
    cuda: str | None = None
    cuda_available: bool = False
    device_count: int = 0
    distributed: bool = False
    nccl: bool = False
    error: str = ""


def run_checks(
    conf_overrides: Mapping[str, str] | None = None,
    properties_file: str | None = None,
    spark_timeout_s: float = SPARK_PROBE_TIMEOUT_S,
    progress: Progress | None = None,
    master: str | None = None,
) -> list[Check]:
    """Run every check and return them in table order.

    Args:
        conf_overrides: Spark conf to judge on top of spark-defaults.conf (``--conf``).
        properties_file: a Spark properties file to judge instead of spark-defaults.conf.
        spark_timeout_s: how long each Spark check (the session, the cluster network) may take.
        progress: told as each check starts and ends (the CLI prints it).
        master: a Spark master to run the cluster network probe on (``--master``), with the
            conf judged here; None to skip it.
    """
    from sparkdist._backends.session import read_properties, spark_defaults_path

    tell = progress if progress is not None else Silent()
    source = properties_file or spark_defaults_path()
    conf = dict(read_properties(source)) if source else {}  # a bad file fails before the JVM
    conf.update(conf_overrides or {})
    where = str(source) if source else "no spark-defaults.conf"
    if conf_overrides:
        where += " + --conf"
    python_check = _timed(tell, "python", check_python)
    pyspark_version = installed_version("pyspark")
    java = find_java(os.environ)
    java_check = _timed(
        tell,
        "java",
        lambda: check_java(java, java_version_text(java) if java else "", pyspark_version),
    )
    pyspark_check = _timed(tell, "pyspark", lambda: check_pyspark(pyspark_version))
    probe = None
    probe_started = time.monotonic()
    if pyspark_version and java_check.status is not Status.PROBLEM:
        # Started first, so the JVM boots while the other checks run.
        tell.started(
            "spark session",
            f"a local[1] session in a child process, up to {spark_timeout_s:.0f} s; the "
            "other checks run meanwhile",
        )
        probe = SparkProbe(spark_timeout_s)
    cluster: ClusterProbe | None = None
    try:
        if master is not None and probe is not None:
            tell.started(
                CHECK_NAME,
                f"a barrier job on {master} in a child process, up to {spark_timeout_s:.0f} s",
            )
            # The session reads spark-defaults.conf itself; a --properties-file it is handed.
            session_conf = conf if properties_file else dict(conf_overrides or {})
            cluster = ClusterProbe(master, session_conf, spark_timeout_s)
        tell.started("torch", "imports it")
        started = time.monotonic()
        torch = probe_torch()
        torch_check = check_torch(torch)
        tell.finished(torch_check, time.monotonic() - started)
        tell.started("gpus")
        started = time.monotonic()
        gpus = visible_gpus()
        gpus_check = check_gpus(gpus, torch, nvidia_smi=shutil.which("nvidia-smi") is not None)
        tell.finished(gpus_check, time.monotonic() - started)
        conf_check = _timed(
            tell, "spark gpu conf", lambda: check_gpu_conf(conf, where, gpus_here=bool(gpus))
        )
        preemption_check = _timed(
            tell, "preemption conf", lambda: check_preemption_conf(conf, where)
        )
        optional = [
            _timed(
                tell,
                "deepspeed",
                lambda: check_optional(
                    "deepspeed",
                    installed_version("deepspeed"),
                    "pip install deepspeed (needed only for --mode deepspeed)",
                ),
            ),
            _timed(
                tell,
                "mlflow",
                lambda: check_optional(
                    "mlflow",
                    installed_version("mlflow"),
                    "pip install mlflow (needed only to log the ranks' metrics to MLflow)",
                ),
            ),
        ]
        if probe is not None:
            if probe.running():  # everything else is done: say what the wait is for
                tell.waiting("spark session", time.monotonic() - probe_started)
            session = probe.check()
            tell.finished(session, time.monotonic() - probe_started)
        else:
            session = _timed(
                tell,
                "spark session",
                lambda: Check(
                    "spark session",
                    Status.PROBLEM,
                    "not tried: needs pyspark and Java",
                    "fix the pyspark and java rows above",
                ),
            )
        network = []
        if master is not None and cluster is None:
            network = [
                _timed(
                    tell,
                    CHECK_NAME,
                    lambda: Check(
                        CHECK_NAME,
                        Status.PROBLEM,
                        f"{master}: not tried: needs pyspark and Java",
                        "fix the pyspark and java rows above",
                    ),
                )
            ]
        if cluster is not None:
            if cluster.running():
                tell.waiting(CHECK_NAME, time.monotonic() - probe_started)
            network = [network_check(cluster.report())]
            tell.finished(network[0], time.monotonic() - probe_started)
    finally:
        if probe is not None:
            probe.kill()
        if cluster is not None:
            cluster.kill()
    return [
        python_check,
        java_check,
        pyspark_check,
        session,
        *network,
        torch_check,
        gpus_check,
        conf_check,
        preemption_check,
        *optional,
    ]


def _timed(tell: Progress, name: str, check: Callable[[], Check], note: str = "") -> Check:
    """Run one check, telling ``tell`` as it starts and ends."""
    tell.started(name, note)
    started = time.monotonic()
    result = check()
    tell.finished(result, time.monotonic() - started)
    return result


def installed_version(distribution: str) -> str | None:
    """The installed version of a package, without importing it (DeepSpeed's import is slow)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    return Check("python", Status.OK, f"{version} ({sys.executable})")


def probe_torch() -> TorchInfo:
    """Import torch here and ask what it was built with."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from a broken CUDA lib
        return TorchInfo(error=f"{type(exc).__name__}: {exc}")
    available = bool(torch.cuda.is_available())
    return TorchInfo(
        version=str(torch.__version__),
        cuda=torch.version.cuda,
        cuda_available=available,
        device_count=int(torch.cuda.device_count()) if available else 0,
        distributed=bool(dist.is_available()),
        nccl=bool(dist.is_available() and dist.is_nccl_available()),
    )


def check_torch(info: TorchInfo) -> Check:
    if not info.version:
        return Check(
            "torch",
            Status.PROBLEM,
            f"does not import ({info.error})",
            "pip install torch (a CUDA build on GPU machines: see pytorch.org/get-started)",
        )
    if not info.distributed:
        return Check(
            "torch",
            Status.PROBLEM,
            f"{info.version} was built without torch.distributed",
            "install an official torch build from PyPI or pytorch.org",
        )
    build = f"CUDA {info.cuda} build" if info.cuda else "CPU build (no CUDA)"
    backends = "gloo, nccl" if info.nccl else "gloo"
    return in_range(
        "torch", info.version, f"{describe('torch', info.version)}, {build}; backends: {backends}"
    )


def check_gpus(gpus: Sequence[Gpu], torch: TorchInfo, *, nvidia_smi: bool) -> Check:
    """The GPUs nvidia-smi lists (masked by CUDA_VISIBLE_DEVICES) and whether torch can use them."""
    if not gpus:
        why = "nvidia-smi lists none" if nvidia_smi else "nvidia-smi not found"
        return Check(
            "gpus",
            Status.NOTE,
            f"no GPU visible ({why}): ranks train on CPU with gloo",
            "nothing to do for CPU training; for GPUs install the NVIDIA driver (nvidia-smi) "
            "and a CUDA build of torch",
        )
    listing = f"{len(gpus)} GPU(s): " + ", ".join(f"{g.address} {g.name}" for g in gpus)
    if torch.version and not torch.cuda:
        return Check(
            "gpus",
            Status.PROBLEM,
            f"{listing}; but torch {torch.version} is a CPU build",
            "install a CUDA build of torch (pytorch.org/get-started), or pass --cpu",
        )
    if torch.version and not torch.cuda_available:
        return Check(
            "gpus",
            Status.PROBLEM,
            f"{listing}; but torch (CUDA {torch.cuda}) cannot use them",
            "update the NVIDIA driver to one that supports CUDA "
            f"{torch.cuda}, or install a torch built for an older CUDA",
        )
    return Check("gpus", Status.OK, listing)


def check_optional(name: str, version: str | None, fix: str) -> Check:
    if version is None:
        return Check(name, Status.NOTE, "not installed", fix)
    return in_range(name, version)
