"""What a finished run hands back to the caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunResult:
    """Every rank's result of one successful run.

    Attributes:
        values: each rank's return value, indexed by global rank (None for scripts).
        wall_times_s: seconds each rank's process ran, by global rank.
        hosts: the host each rank ran on, by global rank.
        run_id: the run's id (also each rank's TORCHELASTIC_RUN_ID).
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

    @property
    def world_size(self) -> int:
        return len(self.values)
