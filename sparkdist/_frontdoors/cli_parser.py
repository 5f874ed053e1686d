"""The argparse side of the command line: commands, options, help with examples.

Non-goals: what the options do (``cli``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from sparkdist._core.config import Mode

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

Checks Java, that a local Spark session starts and runs a Python task, torch and its CUDA
build, the GPUs nvidia-smi lists, the Spark GPU scheduling conf, DeepSpeed and MLflow.

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
    from sparkdist import __version__

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
    run.add_argument(
        "-n",
        "--num-processes",
        type=_positive_int,
        default=1,
        metavar="N",
        help="number of ranks, one per GPU (default: 1)",
    )
    run.add_argument(
        "--mode",
        choices=[m.value for m in Mode],
        default=None,
        help="how the ranks train (default: ddp, or deepspeed with --deepspeed-config)",
    )
    run.add_argument(
        "--deepspeed-config",
        metavar="FILE",
        help="DeepSpeed JSON config (e.g. conf/deepspeed/zero2.json); implies --mode deepspeed",
    )
    where = run.add_mutually_exclusive_group()
    where.add_argument(
        "--local", action="store_true", help="run the ranks on this machine (the default)"
    )
    where.add_argument(
        "--master",
        metavar="URL",
        help="run the ranks as Spark barrier tasks on this master (spark://host:7077, yarn, "
        "k8s://https://host:443, local-cluster[2,1,1024]...)",
    )
    run.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Spark conf for the session started on --master (repeatable)",
    )
    run.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for every rank (repeatable)",
    )
    run.add_argument(
        "--cpu", action="store_true", help="train on CPU with gloo even where there are GPUs"
    )
    run.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="stop every rank and exit 124 after this long (default: no limit)",
    )
    run.add_argument(
        "--start-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="fail when a rank has not started within this long (default: 300)",
    )
    run.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="restart every rank up to N times after a failure (default: 0)",
    )
    run.add_argument(
        "--gpu-type",
        metavar="TYPE",
        help="require this GPU model (H100, A100...) wherever ranks run; checked before start",
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
        help="how long the Spark session check may take (default: 120)",
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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value
