"""The ``sparkdist`` command line (also ``python -m sparkdist``).

``sparkdist run`` launches a training script or module on N ranks, here or as Spark barrier
tasks, and exits with the exit code of the rank that failed first, so job schedulers see
failures; ``sparkdist doctor`` says whether this machine is ready and what to fix.

The CLI only parses: arguments become a ``RunRequest`` (the run's ``LaunchConfig``, built by
``build_config`` from the flags generated off ``_core.config.OPTIONS``, plus the script and the
Spark master), which ``execute`` hands to ``Distributor``. It prints (rank output is printed by
the engine as ``[rank N] line``); library modules never do.

Exit codes of ``run``: 0 when every rank succeeded; the exit code of the rank that failed first
(128+N when signal N killed it); 124 when ``--timeout`` passed; 130 after Ctrl-C; 143 after
SIGTERM (the run drained first: ``Launch.wait``); 2 for bad arguments or configuration; 1 for
anything else that stopped the run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparkdist._core.errors import (
    ConfigError,
    RunTimeoutError,
    SparkdistError,
    WorkerFailedError,
)
from sparkdist._core.launch.config import (
    OPTION_NAMES,
    OPTIONS,
    CliKind,
    LaunchConfig,
    Mode,
    build_config,
)
from sparkdist._frontdoors.cli_parser import build_parser, cli_flag, script_args

if TYPE_CHECKING:
    from sparkdist.distributor import Distributor

EXIT_OTHER = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # what timeout(1) exits with
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


@dataclass(frozen=True)
class RunRequest:
    """A parsed ``sparkdist run``: everything ``execute`` needs, already validated.

    Attributes:
        target: the script path, or the module name when ``module`` is True.
        config: the run's launch configuration (every launch option, checked).
        module: run ``target`` as ``python -m target``.
        script_args: the script's command-line arguments.
        master: the Spark master URL, or None to run on this machine.
        spark_conf: Spark conf for the session started on ``master``.
    """

    target: str
    config: LaunchConfig = field(default_factory=LaunchConfig)
    module: bool = False
    script_args: tuple[str, ...] = ()
    master: str | None = None
    spark_conf: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code."""
    args = build_parser().parse_args(argv)
    logger = logging.getLogger("sparkdist")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        if args.command == "doctor":
            return _doctor(args)
        return execute(run_request(args))
    except ConfigError as exc:
        _error(str(exc))
        return EXIT_USAGE
    finally:
        # main() may be called in-process (tests, notebooks): leave logging as it was.
        logger.removeHandler(handler)
        logger.setLevel(saved_level)


def run_request(args: argparse.Namespace) -> RunRequest:
    """Turn parsed ``run`` arguments into a RunRequest.

    Raises:
        ConfigError: the arguments contradict each other or a file is unusable.
    """
    from sparkdist._backends.session import parse_assignment

    spark_conf = dict(parse_assignment(item, "--conf") for item in args.conf)
    if spark_conf and args.master is None:
        raise ConfigError(
            "--conf sets the Spark conf of the session started on --master, but the run is "
            "local; add --master URL, or drop --conf"
        )
    if not args.module and not os.path.isfile(args.target):
        raise ConfigError(
            f"the script {args.target!r} does not exist (from {os.getcwd()}); give its path, or "
            "pass -m to run a module"
        )
    # The flags generated from the table land under the options' own names, and only when given.
    options: dict[str, Any] = {name: getattr(args, name) for name in OPTION_NAMES if name in args}
    for option in OPTIONS:  # --env, --storage-option: KEY=VALUE items into one mapping
        if option.cli and option.cli.kind is CliKind.ASSIGNMENTS and option.name in options:
            flag = option.cli.flags[-1]
            options[option.name] = dict(parse_assignment(i, flag) for i in options[option.name])
    if args.master is not None:
        options["local_mode"] = False
    if args.cpu:
        options["use_gpu"] = False
    if "deepspeed_config" in options:
        mode = options.get("mode", Mode.DEEPSPEED.value)
        if mode != Mode.DEEPSPEED.value:
            raise ConfigError(
                f"--deepspeed-config applies to --mode deepspeed, not --mode {mode}; drop one"
            )
        options["mode"] = Mode.DEEPSPEED.value
    try:
        config = build_config(**options)  # every value checked before Spark or a rank starts
    except ConfigError as exc:
        raise type(exc)(_with_flag(str(exc))) from exc
    return RunRequest(
        target=args.target,
        config=config,
        module=args.module,
        script_args=script_args(args.script_args),
        master=args.master,
        spark_conf=spark_conf,
        dry_run=args.dry_run,
    )


def _with_flag(message: str) -> str:
    """Say which flag a refused option came from: "--env: env sets RANK, ..."."""
    for name in OPTION_NAMES:
        if message.startswith(f"{name}: "):
            return f"{cli_flag(name)}: {message[len(name) + 2 :]}"
        if message.startswith(name) and message[len(name) : len(name) + 1] in (" ", "=", "["):
            return f"{cli_flag(name)}: {message}"
    return message


def make_distributor(request: RunRequest) -> Distributor:
    """The Distributor for a request's config (no session, nothing started)."""
    from sparkdist.distributor import Distributor

    return Distributor(**request.config.as_options())


def execute(request: RunRequest) -> int:
    """Run the request and return the command's exit code (messages go to stderr)."""
    if request.module:
        # `python -m` imports from the current directory; the `sparkdist` script does not have
        # it on sys.path, and local ranks import from the driver's sys.path.
        sys.path.insert(0, os.getcwd())
    session = None
    try:
        distributor = make_distributor(request)  # bad values fail before Spark starts
        if request.master is not None:
            from sparkdist._backends.session import create_session

            session = distributor.spark = create_session(request.master, request.spark_conf)
        if request.dry_run:
            from sparkdist._wire.payload import Job, TargetKind
            from sparkdist.distributor import make_job

            job = (
                Job(kind=TargetKind.MODULE, target=request.target, argv=request.script_args)
                if request.module
                else make_job(request.target, request.script_args, {})
            )
            print(distributor._plan(job).describe())
            return 0
        if request.module:
            distributor._run_module(request.target, *request.script_args)
        else:
            distributor.run_all(request.target, *request.script_args)
        return 0
    except KeyboardInterrupt:
        _error("interrupted; every rank was stopped")
        return EXIT_INTERRUPTED
    except SparkdistError as exc:
        _error(str(exc))
        return exit_code_of(exc)
    except Exception as exc:  # noqa: BLE001 - Spark/py4j failing to start: a message, no trace
        _error(f"{type(exc).__name__}: {exc}")
        return EXIT_OTHER
    finally:
        if session is not None:
            session.stop()


def exit_code_of(error: BaseException) -> int:
    """The command's exit code for an error that ended the run."""
    if isinstance(error, WorkerFailedError):
        code = error.root_cause.exit_code
        if code is None or code == 0 or code > 255:
            return EXIT_OTHER
        return 128 - code if code < 0 else code  # killed by signal N: 128+N, as shells say
    if isinstance(error, RunTimeoutError):
        return EXIT_TIMEOUT
    if isinstance(error, ConfigError):
        return EXIT_USAGE
    return EXIT_OTHER


def _doctor(args: argparse.Namespace) -> int:
    from sparkdist._backends.session import parse_assignment
    from sparkdist._doctor.checks import run_checks
    from sparkdist._doctor.progress import ProgressPrinter
    from sparkdist._doctor.spark import SPARK_PROBE_TIMEOUT_S
    from sparkdist._doctor.table import format_checks, has_problem

    overrides = dict(parse_assignment(item, "--conf") for item in args.conf)
    checks = run_checks(
        overrides,
        args.properties_file,
        args.spark_timeout if args.spark_timeout is not None else SPARK_PROBE_TIMEOUT_S,
        progress=ProgressPrinter(sys.stderr),  # each check as it starts and ends: the
        master=args.master,  # session check alone can take a minute
    )
    print(format_checks(checks))  # the table, then the one-line verdict, on stdout
    return 1 if has_problem(checks) else 0


def _error(message: str) -> None:
    print(f"sparkdist: error: {message}", file=sys.stderr)
    if logging.getLogger("sparkdist").isEnabledFor(logging.DEBUG) and sys.exc_info()[0]:
        traceback.print_exc(file=sys.stderr)
