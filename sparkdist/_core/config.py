"""Launch configuration: one frozen record, validated once, before anything starts.

Non-goals: reading Spark conf (that is ``_placement``) or choosing GPUs (also ``_placement``).
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparkdist._core.errors import ConfigError
from sparkdist._core.versions import parse_requirements

#: Seconds a rank may take from spawn to joining the rendezvous before the run is aborted.
DEFAULT_START_TIMEOUT_S = 300.0
#: Pickled job sizes past which a launch warns (and ships the job as a file), or refuses.
DEFAULT_JOB_SIZE_WARN_MB = 100.0
DEFAULT_JOB_SIZE_LIMIT_MB = 2048.0


class Mode(str, enum.Enum):
    """How the ranks train. Every mode gets the full torchrun environment."""

    DDP = "ddp"
    FSDP = "fsdp"
    DEEPSPEED = "deepspeed"

    @classmethod
    def parse(cls, value: Mode | str) -> Mode:
        """Accept a member or its name in any case; refuse anything else clearly."""
        if isinstance(value, Mode):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        choices = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"mode={value!r} is not a launch mode; use one of {choices}")


@dataclass(frozen=True)
class LaunchConfig:
    """Everything that decides how a run is launched, already validated.

    Attributes:
        num_processes: total number of ranks (the world size).
        local_mode: True runs the ranks on the driver; False runs them as Spark barrier tasks.
        use_gpu: True binds one GPU per rank; False runs on CPU with gloo; None picks GPUs when
            there are any, CPU otherwise.
        mode: the launch mode.
        timeout_s: wall-clock limit for the whole run, or None for no limit.
        start_timeout_s: how long every rank may take to join the rendezvous.
        env: extra environment variables for every rank.
        gpu_type: when set, every rank's GPU must be of this type ("H100", "A10"...), checked
            on the hosts that run the ranks before any rank starts.
        deepspeed_config: the DeepSpeed config (already parsed; see ``load_deepspeed_config``),
            only with mode "deepspeed".
        max_restarts: how many times a failed run is restarted, whole world at once.
        checkpoint_dir: a directory every rank can reach (shared storage on a cluster), for
            ``runtime.save_checkpoint`` / ``runtime.load_checkpoint``.
        heartbeat_timeout_s: a rank that neither reports nor beats for this long (after it
            joined) is declared hung: its stack is dumped into its output and the run stops.
        mlflow: True/False turns MLflow tracking on/off; None follows SPARKDIST_MLFLOW (on
            unless it is 0).
        requirements: packages every host that runs ranks must have, as "name" (the driver's
            version) or "name==version"; checked before any rank starts (``_versions``).
        job_size_warn_mb: a pickled job past this size gets a warning naming its largest
            captured objects, and travels as a file in Spark mode (``_captures``).
        job_size_limit_mb: a pickled job past this size is refused (``ConfigError``).
    """

    num_processes: int = 1
    local_mode: bool = True
    use_gpu: bool | None = None
    mode: Mode = Mode.DDP
    timeout_s: float | None = None
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    env: Mapping[str, str] = field(default_factory=dict)
    gpu_type: str | None = None
    deepspeed_config: Mapping[str, Any] | None = None
    max_restarts: int = 0
    checkpoint_dir: str | None = None
    heartbeat_timeout_s: float | None = None
    mlflow: bool | None = None
    requirements: tuple[str, ...] = ()
    job_size_warn_mb: float = DEFAULT_JOB_SIZE_WARN_MB
    job_size_limit_mb: float = DEFAULT_JOB_SIZE_LIMIT_MB

    def __post_init__(self) -> None:
        _check_positive_int("num_processes", self.num_processes)
        for name in ("local_mode",):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.use_gpu is not None and not isinstance(self.use_gpu, bool):
            raise ConfigError(f"use_gpu must be True, False or None, got {self.use_gpu!r}")
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        if self.timeout_s is not None:
            _check_positive_seconds("timeout_s", self.timeout_s)
        _check_positive_seconds("start_timeout_s", self.start_timeout_s)
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise ConfigError("env must map environment variable names (str) to values (str)")
        object.__setattr__(self, "env", dict(self.env))
        if self.gpu_type is not None:
            if not isinstance(self.gpu_type, str) or not self.gpu_type.strip():
                raise ConfigError(
                    f"gpu_type must be a GPU model name such as 'H100', got {self.gpu_type!r}"
                )
            object.__setattr__(self, "gpu_type", self.gpu_type.strip().upper())
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, int)
            or (self.max_restarts < 0)
        ):
            raise ConfigError(
                f"max_restarts must be a whole number >= 0, got {self.max_restarts!r}"
            )
        if self.heartbeat_timeout_s is not None:
            _check_positive_seconds("heartbeat_timeout_s", self.heartbeat_timeout_s)
        if self.mlflow is not None and not isinstance(self.mlflow, bool):
            raise ConfigError(f"mlflow must be True, False or None, got {self.mlflow!r}")
        if self.checkpoint_dir is not None:
            if not isinstance(self.checkpoint_dir, (str, os.PathLike)):
                raise ConfigError(
                    f"checkpoint_dir must be a directory path, got {self.checkpoint_dir!r}"
                )
            object.__setattr__(self, "checkpoint_dir", os.path.abspath(self.checkpoint_dir))
        if self.deepspeed_config is not None and self.mode is not Mode.DEEPSPEED:
            raise ConfigError(
                f"deepspeed_config was given with mode={self.mode.value!r}; pass "
                "mode='deepspeed' (or drop deepspeed_config)"
            )
        object.__setattr__(self, "requirements", parse_requirements(self.requirements))
        _check_job_sizes(self.job_size_warn_mb, self.job_size_limit_mb)

    def mode_settings(self) -> dict[str, Any]:
        """The mode's settings worth showing in logs and results."""
        settings: dict[str, Any] = {"mode": self.mode.value}
        if self.deepspeed_config is not None:
            zero = self.deepspeed_config.get("zero_optimization", {})
            settings["zero_stage"] = zero.get("stage", 0) if isinstance(zero, Mapping) else None
            offload = isinstance(zero, Mapping) and any(
                isinstance(zero.get(k), Mapping) and zero[k].get("device") not in (None, "none")
                for k in ("offload_optimizer", "offload_param")
            )
            settings["offload"] = bool(offload)
        return settings


def load_deepspeed_config(
    value: Mapping[str, Any] | str | os.PathLike[str] | None,
) -> dict[str, Any] | None:
    """Read and check a DeepSpeed config given as a dict or the path of a JSON file.

    Raises:
        ConfigError: the file is missing or unreadable, is not JSON, or is not a JSON object;
            or the dict cannot be written as JSON.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        try:
            return dict(json.loads(json.dumps(value)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"deepspeed_config must hold only JSON values (numbers, strings, lists, dicts): "
                f"{exc}"
            ) from exc
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(
            f"deepspeed_config must be a dict or the path of a JSON file, got "
            f"{type(value).__name__}"
        )
    path = os.fspath(value)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the DeepSpeed config {path!r}: {exc.strerror}; pass an existing JSON "
            "file or a dict"
        ) from exc
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"the DeepSpeed config {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"the DeepSpeed config {path!r} must be a JSON object, not {type(parsed).__name__}"
        )
    return parsed


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_job_sizes(warn_mb: Any, limit_mb: Any) -> None:
    for name, value in (("job_size_warn_mb", warn_mb), ("job_size_limit_mb", limit_mb)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ConfigError(f"{name} must be a positive number of megabytes, got {value!r}")
    if warn_mb > limit_mb:
        raise ConfigError(
            f"job_size_warn_mb={warn_mb:g} is above job_size_limit_mb={limit_mb:g}; the warning "
            "must come before the limit"
        )


def _check_positive_seconds(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
