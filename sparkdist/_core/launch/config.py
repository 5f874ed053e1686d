"""Launch configuration: one table of options, one frozen record, validated once.

Every front door (``Distributor``, ``@distributed``, ``sparkdist run``, the pytest plugin's
``distributed`` fixture) spells the options its own way and hands them, under their names
here, to ``build_config``: the one place where user-facing values (a mode's name, a DeepSpeed
config file, ``env=None``...) become a ``LaunchConfig``, which checks everything before any
process starts. ``OPTIONS`` is the one definition of each option (name, default, one-line
help, the command line's spelling): the CLI's flags and help are generated from it, and
``tests/unit/test_front_door_parity.py`` fails when a door offers, names or defaults an option
differently.

Non-goals: reading Spark conf or choosing GPUs (``placement``); the rank's environment
(``env``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparkdist._core.env import check_user_env
from sparkdist._core.errors import ConfigError, ConfigTypeError
from sparkdist._core.launch.checks import (
    CPU_OVERSUBSCRIBE_FACTOR,
    check_bool,
    check_job_sizes,
    check_local_cpu_ranks,
    check_positive_int,
    check_positive_seconds,
    checkpoint_directory,
    load_deepspeed_config,
    requirement_list,
    shown,
)
from sparkdist._core.launch.gpu_type import GPUType
from sparkdist._core.launch.replica_groups import check_replica_groups
from sparkdist._core.object_store import check_storage_options, scheme_of
from sparkdist._core.run.stragglers import (
    DEFAULT_STRAGGLER_FRACTION as DEFAULT_STRAGGLER_FRACTION,  # re-exported: an option's default
)
from sparkdist._core.run.stragglers import (
    DEFAULT_STRAGGLER_WINDOW_S as DEFAULT_STRAGGLER_WINDOW_S,
)
from sparkdist._core.versions import parse_requirements

#: Seconds a rank may take from spawn to joining the rendezvous before the run is aborted.
DEFAULT_START_TIMEOUT_S = 300.0
#: Pickled job sizes past which a launch warns (and ships the job as a file), or refuses.
DEFAULT_JOB_SIZE_WARN_MB = 100.0
DEFAULT_JOB_SIZE_LIMIT_MB = 2048.0
#: Seconds between two system samples (CPU, memory, GPUs) of every node; 0 turns them off.
DEFAULT_SYSTEM_METRICS_INTERVAL_S = 10.0
#: Seconds from a preemption notice (SIGTERM) to the stop of ranks still running: under
#: Kubernetes' 30 s between SIGTERM and SIGKILL, so a checkpoint written at once fits.
DEFAULT_PREEMPTION_GRACE_S = 25.0
#: Seconds a larger world must fit the cluster, in a row, before an elastic run below its
#: world drains and restarts at it: long enough that a host flapping back for a moment costs
#: no drain, short against the hours a shrunk run would otherwise run small.
DEFAULT_GROW_AFTER_S = 60.0


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
        error = ConfigError if isinstance(value, str) else ConfigTypeError
        raise error(f"mode={value!r} is not a launch mode; use one of {choices}")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Everything that decides how a run is launched, already validated.

    Build it with ``build_config`` from user-facing values; each attribute is the option of the
    same name in ``OPTIONS`` (see there, and ``Distributor``, for what it does).

    Attributes:
        num_processes: total number of ranks (the world size) every attempt asks for.
        min_processes: the smallest world a restart may start with when the cluster has lost
            capacity (elastic runs); None means ``num_processes`` (a fixed world).
        grow_after_s: an elastic run below ``num_processes`` drains (as for a preemption) and
            restarts at a larger world once that world has fitted the cluster this long in a
            row; None never grows. Growing needs ``checkpoint_dir``.
        local_mode: True runs the ranks on the driver; False runs them as Spark barrier tasks.
        use_gpu: True binds one GPU per rank; False runs on CPU with gloo; None picks GPUs when
            there are any, CPU otherwise.
        mode: the launch mode.
        timeout_s: wall-clock limit for the whole run, or None for no limit.
        start_timeout_s: how long every rank may take to join the rendezvous.
        env: extra environment variables for every rank (none the launcher sets itself).
        gpu_type: when set, every rank's GPU must be of this type ("H100", "A10"...), checked
            on the hosts that run the ranks before any rank starts.
        deepspeed_config: the DeepSpeed config (already parsed; see ``load_deepspeed_config``),
            only with mode "deepspeed".
        max_restarts: how many times a failed run is restarted, whole world at once (with
            ``replica_groups``, how many times each group is relaunched).
        checkpoint_dir: an absolute directory path every rank can reach (shared storage on a
            cluster), for ``runtime.save_checkpoint`` / ``runtime.load_checkpoint``; a
            ``file://`` URL or Databricks' ``dbfs:/`` (its ``/dbfs`` mount) is taken, any other
            URL refused (``checks.checkpoint_directory``).
        storage_options: settings of an object-store ``checkpoint_dir`` that are not secret
            (``endpoint_url``, ``region_name``, ``profile``...), as fsspec's backend takes them;
            credentials are refused (each host finds its own: ``_core.object_store``).
        heartbeat_timeout_s: a rank that neither reports nor beats for this long (after it
            joined) is declared hung: its stack is dumped into its output and the run stops.
            It is also the silence limit of each node's link to the driver (10 s when unset):
            a node silent that long is lost, and a node that hears nothing from the driver
            that long ends its ranks (docs/restarts.md, host faults).
        preemption_grace_s: after a preemption notice (SIGTERM to a rank, an agent or the
            driver), how long the ranks have to save and return before those still running
            are stopped (docs/restarts.md, preemption).
        mlflow: True/False turns MLflow tracking on/off; None follows SPARKDIST_MLFLOW (on
            unless it is 0).
        requirements: packages every host that runs ranks must have, as "name" (the driver's
            version) or "name==version"; checked before any rank starts (``versions``).
        job_size_warn_mb: a pickled job past this size gets a warning naming its largest
            captured objects, and travels as a file in Spark mode (``captures``).
        job_size_limit_mb: a pickled job past this size is refused (``ConfigError``).
        allow_oversubscribe: allow more local CPU ranks than ``CPU_OVERSUBSCRIBE_FACTOR`` per
            core of the driver.
        system_metrics_interval_s: seconds between two samples of every node's CPU, memory and
            GPUs (MLflow ``system/...`` metrics, ``RunResult.system_samples``); 0 turns it off.
        straggler_fraction: a rank whose steps/s stay below this fraction of the median for
            ``straggler_window_s`` is named a straggler (0 turns detection off).
        straggler_window_s: how long a rank must stay behind to be named.
        replica_groups: how many torchft replica groups the ranks form (``num_processes`` /
            ``replica_groups`` ranks each), each its own barrier stage; a lost group is
            relaunched (up to ``max_restarts`` times, per group) while the others go on.
        min_replica_groups: the fewest live groups a step may be taken with (the Lighthouse's
            quorum floor).
    """

    num_processes: int = 1
    min_processes: int | None = None
    grow_after_s: float | None = DEFAULT_GROW_AFTER_S
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
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    heartbeat_timeout_s: float | None = None
    preemption_grace_s: float = DEFAULT_PREEMPTION_GRACE_S
    mlflow: bool | None = None
    requirements: tuple[str, ...] = ()
    job_size_warn_mb: float = DEFAULT_JOB_SIZE_WARN_MB
    job_size_limit_mb: float = DEFAULT_JOB_SIZE_LIMIT_MB
    allow_oversubscribe: bool = False
    system_metrics_interval_s: float = DEFAULT_SYSTEM_METRICS_INTERVAL_S
    straggler_fraction: float = DEFAULT_STRAGGLER_FRACTION
    straggler_window_s: float = DEFAULT_STRAGGLER_WINDOW_S
    replica_groups: int = 1
    min_replica_groups: int = 1

    def __post_init__(self) -> None:
        check_positive_int("num_processes", self.num_processes)
        if self.min_processes is not None:
            check_positive_int("min_processes", self.min_processes)
            if self.min_processes > self.num_processes:
                raise ConfigError(
                    f"min_processes={self.min_processes} is more than num_processes="
                    f"{self.num_processes}; pass min_processes between 1 and {self.num_processes}"
                    " (the smallest world a restart may shrink to), or leave it unset"
                )
        check_replica_groups(
            num_processes=self.num_processes,
            replica_groups=self.replica_groups,
            min_replica_groups=self.min_replica_groups,
            min_processes=self.min_processes,
            mode=Mode.parse(self.mode).value,
        )
        for name in ("local_mode", "allow_oversubscribe"):
            check_bool(name, getattr(self, name), optional=False)
        for name in ("use_gpu", "mlflow"):
            check_bool(name, getattr(self, name), optional=True)
        self._set("mode", Mode.parse(self.mode))
        if self.timeout_s is not None:
            check_positive_seconds("timeout_s", self.timeout_s)
        check_positive_seconds("start_timeout_s", self.start_timeout_s)
        self._set("env", check_user_env(self.env))
        if self.gpu_type is not None:
            self._set("gpu_type", str(GPUType.parse(self.gpu_type).value))
            if self.use_gpu is False:
                raise ConfigError(
                    f"gpu_type={self.gpu_type!r} asks for GPUs but use_gpu=False asks for CPU; "
                    "drop one of them"
                )
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise ConfigTypeError(
                f"max_restarts must be a whole number >= 0, got {shown(self.max_restarts)}"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be a whole number >= 0, got {self.max_restarts}")
        if self.heartbeat_timeout_s is not None:
            check_positive_seconds("heartbeat_timeout_s", self.heartbeat_timeout_s)
        check_positive_seconds("preemption_grace_s", self.preemption_grace_s)
        if self.checkpoint_dir is not None:
            self._set("checkpoint_dir", checkpoint_directory(self.checkpoint_dir))
        self._set("storage_options", check_storage_options(self.storage_options))
        if self.storage_options and scheme_of(self.checkpoint_dir or "") is None:
            raise ConfigError(
                f"storage_options (settings {', '.join(sorted(self.storage_options))}) are the "
                "settings of an object store, but checkpoint_dir="
                f"{self.checkpoint_dir!r} is not an object-store URL; pass "
                "checkpoint_dir='s3://bucket/prefix' (gs://, abfss://...) or drop storage_options"
            )
        if self.grow_after_s is not None:
            check_positive_seconds("grow_after_s", self.grow_after_s)
            if self.min_processes is not None and self.checkpoint_dir is None:
                raise ConfigError(
                    f"min_processes={self.min_processes} with grow_after_s={self.grow_after_s:g}"
                    " grows the run back by draining it to a checkpoint and restarting from it, "
                    "which needs checkpoint_dir; pass checkpoint_dir (storage every rank "
                    "reaches), or grow_after_s=None to stay at the smaller world"
                )
        if self.deepspeed_config is not None:
            if not isinstance(self.deepspeed_config, Mapping):
                raise ConfigTypeError(
                    f"deepspeed_config must be a dict here (build_config reads a file path), "
                    f"got {shown(self.deepspeed_config)}"
                )
            if self.mode is not Mode.DEEPSPEED:
                raise ConfigError(
                    f"deepspeed_config was given with mode={self.mode.value!r}; pass "
                    "mode='deepspeed' (or drop deepspeed_config)"
                )
        self._set("requirements", parse_requirements(requirement_list(self.requirements)))
        check_job_sizes(self.job_size_warn_mb, self.job_size_limit_mb)
        _check_number("system_metrics_interval_s", self.system_metrics_interval_s, "seconds, >= 0")
        _check_number("straggler_fraction", self.straggler_fraction, "in [0, 1)", below=1.0)
        check_positive_seconds("straggler_window_s", self.straggler_window_s)
        check_local_cpu_ranks(
            self.num_processes,
            local_mode=self.local_mode,
            use_gpu=self.use_gpu,
            allow_oversubscribe=self.allow_oversubscribe,
        )

    @property
    def grows(self) -> bool:
        """Whether an attempt below ``num_processes`` grows back when capacity returns."""
        return self.min_processes is not None and self.grow_after_s is not None

    @property
    def smallest_world(self) -> int:
        """The fewest ranks an attempt may run with: ``min_processes``, else the whole world."""
        return self.num_processes if self.min_processes is None else self.min_processes

    def as_options(self) -> dict[str, Any]:
        """The options, by name, that ``build_config`` (or ``Distributor``) turns back into an
        equal config."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalising in __post_init__ of a frozen record

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


def _check_number(name: str, value: Any, accepted: str, below: float = math.inf) -> None:
    """Refuse anything but a finite int or float with 0 <= value < ``below``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a number ({accepted}), got {shown(value)}")
    if not (math.isfinite(value) and 0 <= value < below):
        raise ConfigError(f"{name} must be a number {accepted}, got {value!r}")


# -- the options table ---------------------------------------------------------------------------


class CliKind(enum.Enum):
    """How ``sparkdist run`` reads an option from the command line."""

    COUNT = "count"  # --flag N, a whole number >= 0
    POSITIVE_COUNT = "positive count"  # --flag N, a whole number >= 1
    SECONDS = "seconds"  # --flag SECONDS, a positive number
    SECONDS_OR_NEVER = "seconds or never"  # --flag SECONDS, or --flag never: None
    NUMBER = "number"  # --flag X, a number >= 0
    TEXT = "text"  # --flag VALUE, taken as it is
    CHOICE = "choice"  # --flag NAME, one of CliSpelling.choices
    ASSIGNMENTS = "assignments"  # --flag KEY=VALUE, repeatable, into a dict
    TEXTS = "texts"  # --flag VALUE, repeatable, into a list
    SWITCH = "switch"  # --flag / --no-flag: True / False; neither: the default
    FLAG = "flag"  # --flag: True


@dataclass(frozen=True)
class CliSpelling:
    """An option's flags on ``sparkdist run`` (generated by ``_frontdoors.cli_parser``).

    Attributes:
        flags: the flags, long one last ("-n", "--num-processes").
        kind: how the value is read.
        metavar: the value's placeholder in ``--help``.
        choices: the accepted values, for ``CliKind.CHOICE``.
        note: what the command line adds to the option's help.
    """

    flags: tuple[str, ...]
    kind: CliKind
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Option:
    """One launch option: the ``LaunchConfig`` field, and how the front doors offer it.

    Attributes:
        name: the ``LaunchConfig`` field, and the keyword of ``Distributor``, ``@distributed``
            and the pytest fixture (the decorator says ``gpus`` and ``remote`` for the first two).
        help: one line saying what it does, for every door's help.
        cli: its spelling on ``sparkdist run``, or None where the command line spells it by hand
            (``--local``/``--master``, ``--cpu``) or does not offer it (see the parity test).
        default_text: the default as ``--help`` says it, when the value alone would not.
    """

    name: str
    help: str
    cli: CliSpelling | None = None
    default_text: str | None = None

    @property
    def default(self) -> Any:
        """The default, as ``LaunchConfig`` defines it (the one definition)."""
        return _FIELD_DEFAULTS[self.name]

    def help_with_default(self) -> str:
        """The help line with its default, as ``--help`` shows it."""
        text = self.help + (f"; {self.cli.note}" if self.cli and self.cli.note else "")
        said = self.default_text
        default = self.default
        if said is None and not (
            default is None or isinstance(default, bool) or default in ((), {})
        ):
            if isinstance(default, enum.Enum):
                said = str(default.value)
            else:
                said = f"{default:g}" if isinstance(default, float) else str(default)
        return f"{text} (default: {said})" if said else text


def _cli(*flags: str, kind: CliKind, metavar: str | None = None, **more: Any) -> CliSpelling:
    return CliSpelling(flags=flags, kind=kind, metavar=metavar, **more)


#: The one definition of every launch option, in the order ``--help`` lists them.
OPTIONS: tuple[Option, ...] = (
    Option(
        "num_processes",
        "number of ranks (the world size), one per GPU where there are GPUs",
        _cli("-n", "--num-processes", kind=CliKind.POSITIVE_COUNT, metavar="N"),
    ),
    Option(
        "min_processes",
        "elastic runs: a restart after a lost host may start with fewer ranks, down to this many",
        _cli("--min-processes", kind=CliKind.POSITIVE_COUNT, metavar="N"),
        default_text="num_processes (a fixed world)",
    ),
    Option(
        "grow_after_s",
        "elastic runs: once more ranks have fitted this many seconds in a row, drain and grow",
        _cli("--grow-after", kind=CliKind.SECONDS_OR_NEVER, metavar="SECONDS|never"),
    ),
    Option(
        "local_mode",
        "run the ranks on this machine (True) or as one Spark barrier stage (False)",
    ),
    Option(
        "use_gpu",
        "one GPU per rank (True), CPU with gloo and every GPU hidden (False), or GPUs where "
        "there are any (None)",
    ),
    Option(
        "mode",
        "how the ranks train: ddp, fsdp or deepspeed",
        _cli(
            "--mode",
            kind=CliKind.CHOICE,
            choices=tuple(m.value for m in Mode),
            note="deepspeed when --deepspeed-config is given",
        ),
    ),
    Option(
        "timeout_s",
        "stop every rank and fail the run after this many seconds",
        _cli("--timeout", kind=CliKind.SECONDS, metavar="SECONDS", note="exit status 124"),
        default_text="no limit",
    ),
    Option(
        "start_timeout_s",
        "fail when a rank has not joined the rendezvous within this many seconds",
        _cli("--start-timeout", kind=CliKind.SECONDS, metavar="SECONDS"),
    ),
    Option(
        "env",
        "extra environment variables of every rank, but none sparkdist sets (RANK, MASTER_ADDR...)",
        _cli("--env", kind=CliKind.ASSIGNMENTS, metavar="KEY=VALUE", note="repeatable"),
    ),
    Option(
        "gpu_type",
        "require this GPU model (H100, A100...) wherever ranks run; checked before any starts",
        _cli("--gpu-type", kind=CliKind.TEXT, metavar="TYPE"),
    ),
    Option(
        "deepspeed_config",
        "the DeepSpeed config of mode deepspeed: a JSON file such as conf/deepspeed/zero2.json "
        "(in Python, also a dict)",
        _cli(
            "--deepspeed-config", kind=CliKind.TEXT, metavar="FILE", note="implies --mode deepspeed"
        ),
    ),
    Option(
        "max_restarts",
        "restart every rank up to this many times after a failure",
        _cli("--max-restarts", kind=CliKind.COUNT, metavar="N"),
    ),
    Option(
        "checkpoint_dir",
        "directory every rank can reach, for runtime.save_checkpoint / load_checkpoint",
        _cli("--checkpoint-dir", kind=CliKind.TEXT, metavar="DIR"),
    ),
    Option(
        "storage_options",
        "settings of an object-store checkpoint_dir that are not secret (endpoint_url...)",
        _cli("--storage-option", kind=CliKind.ASSIGNMENTS, metavar="KEY=VALUE", note="repeatable"),
    ),
    Option(
        "heartbeat_timeout_s",
        "seconds without runtime.report()/heartbeat() to call a rank hung; a node's link limit",
        _cli("--heartbeat-timeout", kind=CliKind.SECONDS, metavar="SECONDS"),
        default_text="never (link: 10 s)",
    ),
    Option(
        "preemption_grace_s",
        "after a preemption notice (SIGTERM), seconds the ranks have to save and return",
        _cli("--preemption-grace", kind=CliKind.SECONDS, metavar="SECONDS"),
    ),
    Option(
        "mlflow",
        "track the run in MLflow, or not",
        _cli("--mlflow", kind=CliKind.SWITCH),
        default_text="on unless SPARKDIST_MLFLOW=0",
    ),
    Option(
        "requirements",
        "packages every host that runs ranks must have: 'numpy' (the driver's version) or "
        "'pandas==2.2.0'",
        _cli("--requirement", kind=CliKind.TEXTS, metavar="SPEC", note="repeatable"),
    ),
    Option(
        "job_size_warn_mb",
        "warn past this pickled job size in MB, naming its largest captured objects",
    ),
    Option(
        "job_size_limit_mb",
        "refuse a pickled job past this size in MB",
    ),
    Option(
        "allow_oversubscribe",
        f"allow more than {CPU_OVERSUBSCRIBE_FACTOR} local CPU ranks per core of this machine",
        _cli("--allow-oversubscribe", kind=CliKind.FLAG),
    ),
    Option(
        "system_metrics_interval_s",
        "sample every node's CPU, memory and GPUs this often, for MLflow and the result; 0: off",
        _cli("--system-metrics-interval", kind=CliKind.NUMBER, metavar="SECONDS"),
    ),
    Option(
        "straggler_fraction",
        "name a rank whose steps/s stay below this fraction of the median a straggler; 0: off",
        _cli("--straggler-fraction", kind=CliKind.NUMBER, metavar="FRACTION"),
    ),
    Option(
        "straggler_window_s",
        "how long a rank must stay below straggler_fraction of the median to be named",
        _cli("--straggler-window", kind=CliKind.SECONDS, metavar="SECONDS"),
    ),
    Option(
        "replica_groups",
        "split the ranks into this many torchft replica groups; a lost one is relaunched alone",
        _cli("--replica-groups", kind=CliKind.POSITIVE_COUNT, metavar="R"),
    ),
    Option(
        "min_replica_groups",
        "the fewest live torchft replica groups a step may be taken with",
        _cli("--min-replica-groups", kind=CliKind.POSITIVE_COUNT, metavar="R"),
    ),
)

_FIELD_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if callable(f.default_factory) else f.default
    for f in dataclasses.fields(LaunchConfig)
}
#: Option names, in table order.
OPTION_NAMES: tuple[str, ...] = tuple(row.name for row in OPTIONS)


def option(name: str) -> Option:
    """The table's row for ``name``."""
    return _BY_NAME[name]


_BY_NAME = {o.name: o for o in OPTIONS}


def build_config(**options: Any) -> LaunchConfig:
    """Turn user-facing option values (the table's names) into a validated ``LaunchConfig``.

    Every front door calls this with the options it was given, under the table's names; an
    option left out takes its default. What users write is accepted as the doors document it:
    a mode's name in any case, a ``GPUType`` or its name, a DeepSpeed config file's path,
    ``env=None``, ``requirements=None``, a path object for ``checkpoint_dir``.

    Raises:
        ConfigTypeError: an unknown option, or a value of the wrong type.
        ConfigError: a value out of range, or options that contradict each other.

    Example:
        >>> build_config(num_processes=2, mode="FSDP", env=None).mode
        <Mode.FSDP: 'fsdp'>
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ConfigTypeError(
            f"unknown launch option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(OPTION_NAMES)}"
        )
    values = dict(options)
    for name in ("env", "requirements", "storage_options"):
        if name in values and values[name] is None:
            values[name] = option(name).default
    if "deepspeed_config" in values:
        values["deepspeed_config"] = load_deepspeed_config(values["deepspeed_config"])
    return LaunchConfig(**values)
