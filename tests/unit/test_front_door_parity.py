"""Every launch option of the table (``_core.config.OPTIONS``) reaches every front door.

The doors: ``Distributor``, ``@distributed``, ``sparkdist run``, the pytest plugin's
``distributed`` fixture. Each test reads what a door offers (its signature, or the CLI parser's
actions) and fails when an option is missing from one door, unknown to the table, defaulted or
documented differently, or accepted but not carried into the ``LaunchConfig`` — unless it is on
one of the exception lists below, each entry with its reason. Nothing is launched.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from sparkdist import ConfigError, Distributor, distributed
from sparkdist._core.errors import ConfigTypeError
from sparkdist._core.launch.config import OPTION_NAMES, OPTIONS, CliKind, LaunchConfig, build_config
from sparkdist._frontdoors.cli_parser import HAND_SPELLED, build_parser
from sparkdist._frontdoors.pytest_support import DEFAULT_TIMEOUT_S, SESSION_MARKER_VAR
from sparkdist.cli import run_request
from sparkdist.pytest_plugin import RunnerFactory

REPO = Path(__file__).resolve().parents[2]
DOORS = ("distributor", "decorator", "cli", "fixture")

#: Door parameters that are not launch configuration, and why.
DOOR_ONLY = {
    "spark": "a live SparkSession handle: it stays on the driver and is never pickled or "
    "compared, so it is not part of LaunchConfig",
}

#: (door, option): why the door does not offer the option. Nothing else may be missing.
NOT_OFFERED = {
    ("cli", "job_size_warn_mb"): "sparkdist run launches a script or a module by path or name, "
    "never a pickled function, so there is no job size to watch",
    ("cli", "job_size_limit_mb"): "as job_size_warn_mb: no pickled function, no job size",
    ("cli", "spark"): "a session object cannot be given on a command line; --master URL and "
    "--conf KEY=VALUE start the session instead",
    ("fixture", "spark"): "runs in Spark mode use the spark fixture's session, whose master "
    "--sparkdist-spark-master chooses",
}

#: (door, option): why the door's default differs from the table's. Nothing else may differ.
OWN_DEFAULTS = {
    ("decorator", "num_processes"): "gpus is required, as in Databricks' serverless GPU API",
    ("fixture", "num_processes"): "2, or n of @pytest.mark.multi_gpu(n): a world of one tests "
    "nothing distributed",
    ("fixture", "timeout_s"): "--sparkdist-timeout (120 s): a hung rank fails its test instead "
    "of hanging CI",
    ("fixture", "use_gpu"): "False (True in gpu and multi_gpu tests): a test must not depend on "
    "finding a GPU",
    ("fixture", "mlflow"): "False: no mlflow.db and no MLflow start-up in every test",
    ("fixture", "env"): f"{SESSION_MARKER_VAR} is added, so the leak check finds the runs' "
    "processes",
}

#: How a door spells an option, where not by the option's own name.
SPELLINGS = {
    "decorator": {"num_processes": "gpus", "local_mode": "remote"},
    "fixture": {"num_processes": "n"},
}

#: The CLI's arguments that say what to run (or only to plan it), not how: no launch option.
CLI_OWN = {"help", "verbose", "module", "target", "script_args", "conf", "dry_run"}
#: The CLI's hand-written flags (dest -> option), from cli_parser.HAND_SPELLED.
CLI_HAND_DESTS = {"master": "local_mode", "local": "local_mode", "cpu": "use_gpu"}

#: A value other than the default for each option, as users write it; companions are other
#: options some doors need for the value to be valid.
EXAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "num_processes": (3, {}),
    "min_processes": (2, {"num_processes": 3, "checkpoint_dir": "/shared/checkpoints"}),
    "grow_after_s": (
        30.0,
        {"num_processes": 3, "min_processes": 2, "checkpoint_dir": "/shared/checkpoints"},
    ),
    "local_mode": (False, {}),
    "use_gpu": (False, {}),
    "mode": ("fsdp", {}),
    "timeout_s": (42.0, {}),
    "start_timeout_s": (17.0, {}),
    "env": ({"NCCL_DEBUG": "INFO"}, {}),
    "gpu_type": ("h100", {"use_gpu": True}),
    "deepspeed_config": (str(REPO / "conf/deepspeed/zero2.json"), {"mode": "deepspeed"}),
    "max_restarts": (2, {}),
    "checkpoint_dir": ("/shared/checkpoints", {}),
    "storage_options": (
        {"endpoint_url": "http://127.0.0.1:8333"},
        {"checkpoint_dir": "s3://bucket/run"},
    ),
    "heartbeat_timeout_s": (9.0, {}),
    "preemption_grace_s": (12.0, {}),
    "mlflow": (True, {}),
    "requirements": (["numpy", "pandas==2.2.0"], {}),
    "job_size_warn_mb": (5.0, {}),
    "job_size_limit_mb": (4096.0, {}),
    "allow_oversubscribe": (True, {}),
    "system_metrics_interval_s": (0.0, {}),
    "straggler_fraction": (0.5, {}),
    "straggler_window_s": (5.0, {}),
    "replica_groups": (2, {"num_processes": 4}),
    "min_replica_groups": (2, {"num_processes": 3, "replica_groups": 3}),
}


def _run_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["run"]


def _factory() -> RunnerFactory:
    """The fixture's factory as the fixture builds it in a plain local test."""
    return RunnerFactory(
        num_processes=2,
        timeout_s=DEFAULT_TIMEOUT_S,
        use_gpu=False,
        local_mode=True,
        session_marker="parity",
        spark=lambda: None,
    )


def _offered(door: str) -> set[str]:
    """The launch options (and door-only parameters) a door offers, under the table's names."""
    if door == "cli":
        offered = set()
        for action in _run_parser()._actions:
            if action.dest in CLI_OWN:
                continue
            offered.add(CLI_HAND_DESTS.get(action.dest, action.dest))
        return offered
    if door == "distributor":
        params = list(inspect.signature(Distributor.__init__).parameters.values())[1:]
    elif door == "decorator":
        params = list(inspect.signature(distributed).parameters.values())
    else:
        params = list(inspect.signature(RunnerFactory.__call__).parameters.values())[1:]
    back = {door_name: name for name, door_name in SPELLINGS.get(door, {}).items()}
    offered = set()
    for param in params:
        if param.kind is param.VAR_KEYWORD:  # the fixture: every other option, by name
            from sparkdist.pytest_plugin import _SPELLED_OTHERWISE

            offered |= set(OPTION_NAMES) - set(_SPELLED_OTHERWISE)
        else:
            offered.add(back.get(param.name, param.name))
    return offered


def _argv(name: str, value: Any) -> list[str]:
    """The CLI arguments that set option ``name`` to ``value``, from the table's spelling."""
    option = next(o for o in OPTIONS if o.name == name)
    if option.cli is None:
        return {("local_mode", False): ["--master", "local[2]"], ("use_gpu", False): ["--cpu"]}[
            (name, value)
        ]
    flag, kind = option.cli.flags[-1], option.cli.kind
    if kind is CliKind.ASSIGNMENTS:
        return [arg for k, v in value.items() for arg in (flag, f"{k}={v}")]
    if kind is CliKind.TEXTS:
        return [arg for item in value for arg in (flag, item)]
    if kind is CliKind.SWITCH:
        return [flag if value else "--no-" + flag[2:]]
    if kind is CliKind.FLAG:
        return [flag]
    return [flag, f"{value:g}" if isinstance(value, float) else str(value)]


def _config_through(door: str, options: dict[str, Any], tmp_path: Path) -> LaunchConfig:
    """The config a door builds from these options (given under the table's names)."""
    if door == "distributor":
        return Distributor(**options).config
    if door == "decorator":
        spelled = {SPELLINGS["decorator"].get(k, k): v for k, v in options.items()}
        spelled.setdefault("gpus", 1)
        if "remote" in spelled:
            spelled["remote"] = not spelled["remote"]
        return distributed(**spelled)(lambda: None).config
    if door == "fixture":
        spelled = {SPELLINGS["fixture"].get(k, k): v for k, v in options.items()}
        return _factory()(**spelled).config
    argv = [arg for name, value in options.items() for arg in _argv(name, value)]
    (tmp_path / "train.py").write_text("")
    return run_request(build_parser().parse_args(["run", *argv, str(tmp_path / "train.py")])).config


# -- the table itself ---------------------------------------------------------------------------


def test_the_table_defines_exactly_the_config_fields_each_with_one_help_line():
    assert list(OPTION_NAMES) == [f.name for f in dataclasses.fields(LaunchConfig)]
    for option in OPTIONS:
        assert option.help and "\n" not in option.help and len(option.help) <= 110, option.name
    assert set(EXAMPLES) == set(OPTION_NAMES), "give every new option an example value here"


def test_every_exception_names_a_known_door_and_option_and_says_why():
    for door, name in {**NOT_OFFERED, **OWN_DEFAULTS}:
        assert door in DOORS and (name in OPTION_NAMES or name in DOOR_ONLY)
    assert all(len(reason) > 20 for reason in [*NOT_OFFERED.values(), *OWN_DEFAULTS.values()])


# -- what each door offers ----------------------------------------------------------------------


@pytest.mark.parametrize("door", DOORS)
def test_every_door_offers_every_option_and_nothing_unknown(door):
    wanted = set(OPTION_NAMES) | set(DOOR_ONLY)
    missing = wanted - _offered(door) - {name for d, name in NOT_OFFERED if d == door}
    unknown = _offered(door) - wanted
    assert not missing, f"{door} lacks {sorted(missing)}: add them, or explain in NOT_OFFERED"
    assert not unknown, f"{door} offers {sorted(unknown)}, which the table does not define"
    listed = {name for d, name in NOT_OFFERED if d == door}
    assert not listed & _offered(door), f"{door} offers what NOT_OFFERED says it does not"


def test_the_cli_flags_are_the_tables_and_say_its_help_and_default():
    actions = {a.dest: a for a in _run_parser()._actions}
    for option in OPTIONS:
        if option.cli is None:
            assert option.name in HAND_SPELLED or ("cli", option.name) in NOT_OFFERED
            continue
        action = actions[option.name]
        assert tuple(action.option_strings[: len(option.cli.flags)]) == option.cli.flags
        assert action.help == option.help_with_default()
        assert action.default is argparse.SUPPRESS  # absent unless given: the table's default
    for name, flags in HAND_SPELLED.items():
        assert {CLI_HAND_DESTS[f.lstrip("-")] for f in flags} == {name}


# -- defaults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("door", ["distributor", "decorator"])
def test_signature_defaults_are_the_tables(door):
    function = Distributor.__init__ if door == "distributor" else distributed
    back = {door_name: name for name, door_name in SPELLINGS.get(door, {}).items()}
    table = build_config()
    for param in inspect.signature(function).parameters.values():
        name = back.get(param.name, param.name)
        if name not in OPTION_NAMES:
            continue
        if param.default is param.empty:
            assert (door, name) in OWN_DEFAULTS, f"{door}'s {param.name} has no default"
            continue
        value = (not param.default) if param.name == "remote" else param.default
        built = getattr(build_config(**{name: value}), name)
        differs = built != getattr(table, name)
        assert differs == ((door, name) in OWN_DEFAULTS), (door, name, param.default)


@pytest.mark.parametrize("door", ["cli", "fixture"])
def test_a_door_given_nothing_builds_the_tables_defaults_but_for_its_own(door, tmp_path):
    if door == "cli":
        config = _config_through("cli", {}, tmp_path)
    else:
        config = _factory()().config
    table = build_config()
    differs = {name for name in OPTION_NAMES if getattr(config, name) != getattr(table, name)}
    assert differs == {name for d, name in OWN_DEFAULTS if d == door}


def test_the_fixture_documents_its_own_defaults():
    from sparkdist.pytest_plugin import distributed_fixture

    doc = inspect.getdoc(distributed_fixture) or ""
    for door, name in OWN_DEFAULTS:
        if door == "fixture" and name != "env":
            spelled = SPELLINGS["fixture"].get(name, name)
            assert f"``{spelled}``" in doc, name


# -- documentation ------------------------------------------------------------------------------


@pytest.mark.parametrize("door", ["distributor", "decorator"])
def test_the_docstring_describes_every_option(door):
    doc = inspect.getdoc(Distributor if door == "distributor" else distributed) or ""
    args = doc.split("Args:")[1]
    for name in [*OPTION_NAMES, *DOOR_ONLY]:
        spelled = SPELLINGS.get(door, {}).get(name, name)
        assert f"{spelled}:" in args or f"{spelled}," in args, f"{door}'s docstring: {spelled}"


# -- every option reaches the config ------------------------------------------------------------


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_an_option_given_to_any_door_reaches_its_config_and_nothing_else_changes(name, tmp_path):
    for door in DOORS:
        if (door, name) in NOT_OFFERED:
            continue
        value, companions = EXAMPLES[name]
        if door == "fixture" and name == "use_gpu":
            value = True  # False is the fixture's default
        if door == "cli":
            companions = {k: v for k, v in companions.items() if k != "use_gpu"}  # no --gpu
        baseline = _config_through(door, companions, tmp_path)
        config = _config_through(door, {**companions, name: value}, tmp_path)
        expected = getattr(build_config(**{**companions, name: value}), name)
        if door == "fixture" and name == "env":
            expected = {**expected, SESSION_MARKER_VAR: "parity"}
        assert getattr(config, name) == expected, door
        assert getattr(config, name) != getattr(baseline, name), f"{door}: example is a default"
        changed = {n for n in OPTION_NAMES if getattr(config, n) != getattr(baseline, n)}
        assert changed == {name}, f"{door}: setting {name} also changed {changed - {name}}"


# -- unknown options ----------------------------------------------------------------------------


def test_unknown_options_are_refused_by_every_door(tmp_path):
    with pytest.raises(ConfigTypeError, match="unknown launch option.*nproc.*the options are"):
        build_config(nproc=2)
    with pytest.raises(TypeError, match="nproc"):
        Distributor(nproc=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="nproc"):
        distributed(2, nproc=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigTypeError, match="nproc"):
        _factory()(nproc=2)
    with pytest.raises(ConfigTypeError, match=r"does not take spark=.*spark fixture"):
        _factory()(spark=object())
    with pytest.raises(ConfigTypeError, match=r"does not take num_processes=.*n="):
        _factory()(num_processes=2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--nproc", "2", "train.py"])
    assert issubclass(ConfigTypeError, ConfigError)
