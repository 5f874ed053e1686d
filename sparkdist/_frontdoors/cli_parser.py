"""The argparse side of the command line: commands, options, help with examples.

Non-goals: what the options do (``cli``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from sparkdist._core.launch.config import OPTIONS, CliKind, CliSpelling, Option, option

_RUN_EXAMPLES = """\
examples:
  # 2 ranks on this machine (one per GPU; CPU with gloo where there is none)
  sparkdist run -n 2 train.py --epochs 3 --lr 1e-3

  # arguments may also follow "--"; a module runs like python -m
  sparkdist run -n 2 -m mypackage.train -- --epochs 3

  # 8 GPUs as Spark barrier tasks on a standalone cluster, one GPU per task
  sparkdist run -n 8 --master spark://head:7077 \\
      --conf spark.executor.resource.gpu.amount=4 \\
      --conf spark.task.resource.gpu.amount=1 \\
      --conf spark.executor.resource.gpu.discoveryScript=/opt/sparkdist/getGpusResources.sh \\
      train.py

  # DeepSpeed ZeRO-2: each rank reads the config with sparkdist.runtime.deepspeed_config()
  # (a JSON file at $SPARKDIST_DEEPSPEED_CONFIG); the script also gets
  # "--deepspeed --deepspeed_config <path>" after its own arguments, as under pyspark
  sparkdist run -n 4 --deepspeed-config conf/deepspeed/zero2.json train.py

Options of sparkdist come before the script; everything after it is the script's.
Scripts and modules must exist (or be importable) at the same path on every executor.

exit status: 0 when every rank succeeded; else the exit code of the rank that failed first
(128+N when signal N killed it), 124 after --timeout, 130 after Ctrl-C, 2 for bad arguments,
1 otherwise.
"""

_DOCTOR_EXAMPLES = """\
examples:
  sparkdist doctor
  # judge the GPU conf you are about to use, not just spark-defaults.conf
  sparkdist doctor --properties-file conf/spark-defaults.conf
  sparkdist doctor --conf spark.task.resource.gpu.amount=1
  # can the cluster's nodes reach the driver and each other, on the right interface?
  sparkdist doctor --master spark://head:7077

Checks Java, that a local Spark session starts and runs a Python task, torch and its CUDA
build, the GPUs nvidia-smi lists, the Spark GPU scheduling conf, DeepSpeed and MLflow; with
--master, the network of that cluster's nodes, one line per node.

exit status: 0 when nothing a run needs is missing (no GPU on a CPU machine, no DeepSpeed or
no MLflow are notes, not problems); 1 when a PROBLEM row says what to fix.
"""

_TOP_EXAMPLES = """\
examples:
  sparkdist doctor
  sparkdist run -n 2 train.py -- --lr 1e-3
  sparkdist run --help
"""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every command (``--help`` shows examples for each)."""
    parser = argparse.ArgumentParser(
        prog="sparkdist",
        description="Launch PyTorch distributed training on Spark barrier tasks or locally.",
        epilog=_TOP_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from importlib.metadata import version

    __version__ = version("sparkdist")  # the package metadata: its one definition

    parser.add_argument("--version", action="version", version=f"sparkdist {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{run,doctor}", required=True)
    verbosity = argparse.ArgumentParser(add_help=False)
    verbosity.add_argument(
        "-v", "--verbose", action="store_true", help="log what sparkdist does (and tracebacks)"
    )
    _add_run(commands, verbosity)
    _add_doctor(commands, verbosity)
    return parser


def _add_run(commands: Any, verbosity: argparse.ArgumentParser) -> None:
    run = commands.add_parser(
        "run",
        parents=[verbosity],
        help="run a training script or module on N ranks",
        description="Run a training script (or module) on N ranks with torchrun's environment\n"
        "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT...), streaming each rank's\n"
        "output as [rank N] lines.",
        epilog=_RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for launch_option in OPTIONS:
        if launch_option.cli is not None:
            _add_option(run, launch_option, launch_option.cli)
        elif launch_option.name == "local_mode":
            where = run.add_mutually_exclusive_group()
            where.add_argument(
                "--local", action="store_true", help="run the ranks on this machine (the default)"
            )
            where.add_argument(
                "--master",
                metavar="URL",
                help="run the ranks as Spark barrier tasks on this master (spark://host:7077, "
                "yarn, k8s://https://host:443, local-cluster[2,1,1024]...)",
            )
            run.add_argument(
                "--conf",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="Spark conf for the session started on --master (repeatable)",
            )
        elif launch_option.name == "use_gpu":
            run.add_argument(
                "--cpu",
                action="store_true",
                help="train on CPU with gloo even where there are GPUs (default: GPUs where "
                "there are any)",
            )
        # An option with no spelling here is not offered, for the reason the parity test
        # (tests/unit/test_front_door_parity.py) gives: job sizes, say, with no pickled job.
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything and print the launch plan (ranks, nodes, GPUs, limits), then "
        "exit without starting a rank",
    )
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="TARGET is a module name: run it like python -m TARGET",
    )
    run.add_argument("target", metavar="TARGET", help="the training script (or module, with -m)")
    run.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments of the script (an optional -- may precede them)",
    )


#: Launch options the command line spells by hand, with the flags that set them.
HAND_SPELLED = {"local_mode": ("--local", "--master"), "use_gpu": ("--cpu",)}


def _add_option(parser: argparse.ArgumentParser, option: Option, cli: CliSpelling) -> None:
    """One table option as argparse flags; absent from the namespace unless given, so the
    table's default applies (``build_config``)."""
    common: dict[str, Any] = {
        "dest": option.name,
        "default": argparse.SUPPRESS,
        "help": option.help_with_default(),
    }
    if cli.metavar is not None:
        common["metavar"] = cli.metavar
    kind = cli.kind
    if kind is CliKind.SWITCH:
        parser.add_argument(*cli.flags, action=argparse.BooleanOptionalAction, **common)
    elif kind is CliKind.FLAG:
        parser.add_argument(*cli.flags, action="store_const", const=True, **common)
    elif kind in (CliKind.ASSIGNMENTS, CliKind.TEXTS):
        parser.add_argument(*cli.flags, action="append", **common)
    elif kind is CliKind.CHOICE:
        parser.add_argument(*cli.flags, choices=list(cli.choices), **common)
    else:
        parser.add_argument(*cli.flags, type=_READERS[kind], **common)


def cli_flag(name: str) -> str:
    """The long flag that sets launch option ``name`` on ``sparkdist run``."""
    cli = option(name).cli
    if cli is None:
        return HAND_SPELLED.get(name, ("(not offered)",))[-1]
    return cli.flags[-1]


def _add_doctor(commands: Any, verbosity: argparse.ArgumentParser) -> None:
    doctor = commands.add_parser(
        "doctor",
        parents=[verbosity],
        help="check that this machine can launch runs, and say what to fix",
        description="Check what sparkdist needs and print a table: OK, NOTE (optional, runs\n"
        "still work) or PROBLEM, with the fix.",
        epilog=_DOCTOR_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Spark conf to judge on top of spark-defaults.conf (repeatable)",
    )
    doctor.add_argument(
        "--properties-file",
        metavar="FILE",
        help="judge this Spark properties file instead of spark-defaults.conf",
    )
    doctor.add_argument(
        "--spark-timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="how long each Spark check (the session, the cluster network) may take (default: 120)",
    )
    doctor.add_argument(
        "--master",
        metavar="URL",
        help="also run a short barrier job on this master (spark://host:7077, yarn, ...) and "
        "check each node's address, interface, host name and reach to the driver and task 0",
    )


def script_args(raw: Sequence[str]) -> tuple[str, ...]:
    """The script's arguments, without the "--" that may separate them from sparkdist's.

    argparse drops that "--" itself on some Python versions and keeps it on others; drop it
    exactly once either way.
    """
    args = list(raw)
    if _REMAINDER_KEEPS_SEPARATOR and args[:1] == ["--"]:
        args = args[1:]
    return tuple(args)


def _remainder_keeps_separator() -> bool:
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("target")
    probe.add_argument("rest", nargs=argparse.REMAINDER)
    return bool(probe.parse_args(["t", "--", "x"]).rest[:1] == ["--"])


_REMAINDER_KEEPS_SEPARATOR = _remainder_keeps_separator()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _text(text: str) -> str:
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return value


def _seconds_or_never(text: str) -> float | None:
    return None if text.strip().lower() == "never" else _positive_float(text)


_READERS = {
    CliKind.COUNT: _non_negative_int,
    CliKind.POSITIVE_COUNT: _positive_int,
    CliKind.SECONDS: _positive_float,
    CliKind.SECONDS_OR_NEVER: _seconds_or_never,
    CliKind.NUMBER: _non_negative_float,
    CliKind.TEXT: _text,
}
