"""A node's system metrics: CPU, memory and GPUs, sampled on a thread of the agent.

Every ``interval_s`` (``system_metrics_interval_s``; 0 turns it off) the agent's sampler reads
with psutil the node's CPU utilisation since the last sample, its host memory in use, and the
resident memory of its ranks' process trees (each rank and everything it started), and with
NVML (``nvidia-ml-py``) each of its ranks' GPUs: utilisation, memory in use, power draw. The
values are named as MLflow's own system metrics (``cpu_utilization_percentage``,
``system_memory_usage_megabytes``, ``gpu_0_utilization_percentage``...; megabytes of 10^6
bytes, as MLflow's) and travel to the driver as one droppable ``Sample`` message.

Sampling never fails a run: without psutil the sampler is off (one debug line); without NVML,
a driver or GPUs there are no GPU fields; a metric a GPU does not support is left out; a rank
that exited between listing and reading is skipped. The first sample comes one interval after
the start, so the CPU figure always covers a whole interval.

Non-goals: sending (``outbox``), naming nodes in MLflow or judging the numbers (``_tracking``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from sparkdist._node.agent.ranks import RankHandle
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._wire.protocol import Sample

logger = logging.getLogger("sparkdist")

#: MLflow's system metrics count megabytes of 10^6 bytes.
MEGABYTE = 1e6
#: How long ``stop`` waits for a sample being read to finish.
STOP_TIMEOUT_S = 5.0


@contextlib.contextmanager
def sampling(
    spec: AgentSpec, ranks: Mapping[int, RankHandle], send: Callable[[Sample], None]
) -> Iterator[NodeSampler | None]:
    """Sample this node, whose ranks are ``ranks``, while the block runs (nothing when the
    interval is 0 or psutil is missing); the sampler stops, and sends nothing more, before
    the block's end returns."""
    sampler = NodeSampler(
        spec.node_rank,
        spec.system_metrics_interval_s,
        lambda: [rank.proc.pid for rank in list(ranks.values())],
        send,
        gpus=spec.gpu_addresses,
    )
    started = sampler.start()
    try:
        yield sampler if started else None
    finally:
        sampler.stop()


class NodeSampler:
    """One node's sampler (see the module docstring).

    Args:
        node: the node's index, carried in every sample.
        interval_s: seconds between two samples; 0 or less: never start.
        rank_pids: the pids of the node's ranks, asked at every sample.
        send: takes each ``Sample`` (the outbox's droppable lane).
        gpus: the ranks' GPU addresses, comma-separated (NVML indices or UUIDs), or None.
    """

    def __init__(
        self,
        node: int,
        interval_s: float,
        rank_pids: Callable[[], Sequence[int]],
        send: Callable[[Sample], None],
        gpus: str | None = None,
    ) -> None:
        self.node = node
        self.interval_s = interval_s
        self.rank_pids = rank_pids
        self.send = send
        self.gpus = [g.strip() for g in (gpus or "").split(",") if g.strip()]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._psutil: Any = None
        self._nvml: Any = None
        self._handles: list[tuple[str, Any]] = []  # (name in metrics, NVML handle)

    def start(self) -> bool:
        """Start sampling on a daemon thread; False when off (interval 0, no psutil)."""
        if self.interval_s <= 0:
            return False
        try:
            import psutil
        except ImportError:
            logger.debug(
                "sparkdist: psutil is not installed; no system metrics from node %d (pip install "
                "'sparkdist[metrics]')",
                self.node,
            )
            return False
        self._psutil = psutil
        self._thread = threading.Thread(
            target=self._run, name=f"sparkdist-sampler-{self.node}", daemon=True
        )
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop sampling; returns once no sample can be sent any more."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)

    def open(self) -> None:
        """Prime the CPU counter and open NVML for the ranks' GPUs (on the sampler's thread:
        NVML's start-up is not the agent's to wait for)."""
        self._psutil.cpu_percent(interval=None)  # the next call covers the time since now
        if self.gpus:
            self._handles = self._open_gpus()

    def sample(self) -> dict[str, float]:
        """One sample's metrics, now."""
        psutil = self._psutil
        memory = psutil.virtual_memory()
        used = memory.used  # as MLflow's own monitor has it
        metrics = {
            "cpu_utilization_percentage": float(psutil.cpu_percent(interval=None)),
            "system_memory_usage_megabytes": used / MEGABYTE,
            "system_memory_usage_percentage": 100.0 * used / memory.total,
            "ranks_memory_rss_megabytes": self._ranks_rss() / MEGABYTE,
        }
        for name, handle in self._handles:
            metrics.update(self._gpu_metrics(name, handle))
        return metrics

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None

    # -- the sampler's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.open()
            while not self._stop.wait(self.interval_s):
                try:
                    metrics = self.sample()
                except Exception:  # noqa: BLE001 - a sample lost, never the run
                    logger.debug("sparkdist: a system sample failed", exc_info=True)
                    continue
                if self._stop.is_set():
                    return  # the agent is saying bye: nothing after it
                self.send(Sample(self.node, time.time(), metrics, ",".join(self.gpus)))
        except Exception:  # noqa: BLE001 - sampling is an extra: it ends, the run goes on
            logger.debug("sparkdist: system sampling stopped", exc_info=True)
        finally:
            self.close()

    def _ranks_rss(self) -> int:
        """Resident bytes of the ranks' process trees (a page shared by two counts twice)."""
        psutil = self._psutil
        roots = list(self.rank_pids())
        if not roots:
            return 0
        # One pass over the process table for every tree, not one per rank.
        children: dict[int, list[Any]] = collections.defaultdict(list)
        by_pid: dict[int, Any] = {}
        for proc in psutil.process_iter(["ppid"]):
            by_pid[proc.pid] = proc
            children[proc.info["ppid"]].append(proc)
        total, seen = 0, set()
        todo = [by_pid[pid] for pid in roots if pid in by_pid]
        while todo:
            proc = todo.pop()
            if proc.pid in seen:
                continue
            seen.add(proc.pid)
            todo.extend(children.get(proc.pid, ()))
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass  # ended since the listing, or not ours to read
        return total

    def _open_gpus(self) -> list[tuple[str, Any]]:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no nvidia-ml-py, no driver, no GPU: no GPU fields
            logger.debug("sparkdist: NVML is not available; no GPU metrics", exc_info=True)
            return []
        self._nvml = pynvml
        handles = []
        for position, address in enumerate(self.gpus):
            try:
                if address.isdigit():
                    handle = pynvml.nvmlDeviceGetHandleByIndex(int(address))
                else:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(address)
            except Exception:  # noqa: BLE001 - a GPU NVML does not know: left out
                logger.debug("sparkdist: NVML has no GPU %r", address, exc_info=True)
                continue
            handles.append((f"gpu_{address if address.isdigit() else position}", handle))
        return handles

    def _gpu_metrics(self, name: str, handle: Any) -> dict[str, float]:
        """What NVML tells of one GPU; a reading the GPU does not support is left out."""
        nvml, metrics = self._nvml, {}
        with contextlib.suppress(Exception):
            utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            metrics[f"{name}_utilization_percentage"] = float(utilization)
        with contextlib.suppress(Exception):
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            metrics[f"{name}_memory_usage_megabytes"] = memory.used / MEGABYTE
            metrics[f"{name}_memory_usage_percentage"] = 100.0 * memory.used / memory.total
        with contextlib.suppress(Exception):
            milliwatts = nvml.nvmlDeviceGetPowerUsage(handle)
            metrics[f"{name}_power_usage_watts"] = milliwatts / 1000
            limit = nvml.nvmlDeviceGetEnforcedPowerLimit(handle)
            metrics[f"{name}_power_usage_percentage"] = 100.0 * milliwatts / limit
        return metrics
