"""What a finished run hands back to the caller: values, and what the run looked like (each
rank's timeline, the nodes' system samples)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparkdist._core.errors import Attempt


@dataclass(frozen=True)
class RankTimeline:
    """One rank's life, in wall-clock seconds since the epoch.

    ``started_at`` and ``ended_at`` are its node's clock (spawn and exit, as its agent saw
    them); ``first_step_at`` and ``last_step_at`` the driver's, when its first and last
    ``runtime.report()`` arrived (None for a rank that never reported). On a cluster the two
    clocks agree only as far as the hosts' clocks do.

    Attributes:
        rank: the global rank.
        node: the node (Spark task) that ran it.
        host: the host it ran on.
        started_at: when it was spawned.
        ended_at: when it exited.
        first_step_at: when its first report arrived.
        last_step_at: when its last report arrived.
        steps: the last step it reported (its report count where it gave no step), or 0.
    """

    rank: int
    node: int
    host: str
    started_at: float
    ended_at: float
    first_step_at: float | None = None
    last_step_at: float | None = None
    steps: int = 0


@dataclass(frozen=True)
class SystemSample:
    """One node's system metrics at one time (see ``system_metrics_interval_s``).

    Attributes:
        node: the node (Spark task) sampled.
        host: its host.
        time: when, in wall-clock seconds since the epoch (the node's clock).
        metrics: values by MLflow's system-metric names without the ``system/`` prefix:
            ``cpu_utilization_percentage``, ``system_memory_usage_megabytes``,
            ``system_memory_usage_percentage``, ``ranks_memory_rss_megabytes`` (the ranks'
            process trees), and per GPU N of the node's ranks ``gpu_N_utilization_percentage``,
            ``gpu_N_memory_usage_megabytes``, ``gpu_N_memory_usage_percentage``,
            ``gpu_N_power_usage_watts``, ``gpu_N_power_usage_percentage``.
    """

    node: int
    host: str
    time: float
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class RunResult:
    """Every rank's result of one successful run.

    Attributes:
        values: each rank's return value, indexed by global rank (None for scripts).
        wall_times_s: seconds each rank's process ran, by global rank.
        hosts: the host each rank ran on, by global rank.
        run_id: the run's id (also each rank's TORCHELASTIC_RUN_ID; with replica groups,
            the whole run's, and each group's ranks have their group's own).
        mode: the launch mode's name ("ddp", "fsdp", "deepspeed").
        use_gpu: whether ranks were bound to GPUs.
        local_mode: whether ranks ran on the driver.
        num_tasks: Spark barrier tasks used (1 in local mode).
        dropped_lines: output lines that could not be forwarded to the driver in time.
        mode_settings: the mode and its main settings (e.g. {"mode": "deepspeed",
            "zero_stage": 2, "offload": False}).
        mlflow_run_id: the MLflow run the launch logged to, or None when tracking was off.
        last_metrics: the latest value of each metric passed to ``runtime.report()`` (by the
            lowest rank that reported, normally rank 0).
        timeline: each rank's ``RankTimeline`` (spawn, first step, last step, exit), by rank.
        system_samples: every node's ``SystemSample``s, oldest first (none when
            ``system_metrics_interval_s`` is 0, psutil is missing, or the run was shorter
            than one interval).
        attempts: every attempt, this successful one last, with the hosts it ran on and the
            root cause of each that failed (one entry without restarts).

    Example:
        >>> from sparkdist import Distributor
        >>> result = Distributor(2, use_gpu=False).run_all(lambda: 1)  # doctest: +SKIP
        >>> result.values
        [1, 1]
    """

    values: list[Any]
    wall_times_s: list[float]
    hosts: list[str]
    run_id: str
    mode: str
    use_gpu: bool
    local_mode: bool
    num_tasks: int
    dropped_lines: int = 0
    mode_settings: dict[str, Any] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)
    timeline: list[RankTimeline] = field(default_factory=list)
    system_samples: list[SystemSample] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.values)

    def save_report(self, path: str | os.PathLike[str]) -> str:
        """Draw the run as a small PNG: each rank's timeline, and every node's CPU, memory and
        GPU utilisation over time (needs matplotlib). A tracked run logs the same report to
        its MLflow run as ``sparkdist_report.png`` when it has system samples.

        Returns:
            The path written.

        Example:
            >>> result.save_report("run.png")  # doctest: +SKIP
            'run.png'
        """
        from sparkdist._core.run.report import render_report

        return render_report(self, os.fspath(path))
