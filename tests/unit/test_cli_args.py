"""The CLI's parsing into a RunRequest, its refusals, and its exit codes (no process started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkdist import (
    ClusterError,
    ConfigError,
    Mode,
    RankFailure,
    RunTimeoutError,
    WorkerFailedError,
)
from sparkdist._core.launch.config import build_config
from sparkdist.cli import (
    RunRequest,
    build_parser,
    exit_code_of,
    main,
    make_distributor,
    run_request,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def parse(*argv: str) -> RunRequest:
    return run_request(build_parser().parse_args(["run", *argv]))


@pytest.mark.parametrize(
    ("argv", "target", "script_args"),
    [
        (["-n", "2", "train.py", "--", "--lr", "1e-3"], "train.py", ("--lr", "1e-3")),
        (["-n", "2", "train.py", "--lr", "1e-3"], "train.py", ("--lr", "1e-3")),
        (["train.py", "--", "--", "x"], "train.py", ("--", "x")),  # only the first -- is ours
        (["train.py", "-n", "3"], "train.py", ("-n", "3")),  # after the script: the script's
        (["train.py"], "train.py", ()),
    ],
)
def test_script_arguments_follow_the_script(in_tmp, argv, target, script_args):
    request = parse(*argv)
    assert (request.target, request.script_args, request.module) == (target, script_args, False)


def test_defaults_are_the_tables(in_tmp):
    assert parse("train.py") == RunRequest(target="train.py", config=build_config())


def test_growing_is_set_in_seconds_or_turned_off_with_never(in_tmp):
    elastic = ("-n", "3", "--min-processes", "2")
    stored = parse(*elastic, "--checkpoint-dir", "/shared/ckpt", "--grow-after", "30", "train.py")
    assert stored.config.grow_after_s == 30.0
    assert parse(*elastic, "--grow-after", "never", "train.py").config.grow_after_s is None


def test_module_master_conf_env_cpu_and_timeouts(in_tmp):
    request = parse(
        "-n",
        "4",
        "--master",
        "spark://h:7077",
        "--conf",
        "spark.task.resource.gpu.amount=1",
        "--env",
        "A=x=y",
        "--cpu",
        "--timeout",
        "60",
        "--start-timeout",
        "30",
        "--mode",
        "fsdp",
        "-m",
        "pkg.train",
        "--",
        "--epochs",
        "2",
    )
    assert request == RunRequest(
        target="pkg.train",
        module=True,
        script_args=("--epochs", "2"),
        master="spark://h:7077",
        spark_conf={"spark.task.resource.gpu.amount": "1"},
        config=build_config(
            num_processes=4,
            local_mode=False,
            mode="fsdp",
            use_gpu=False,
            timeout_s=60.0,
            start_timeout_s=30.0,
            env={"A": "x=y"},
        ),
    )


def test_request_becomes_the_distributors_config(in_tmp):
    config_path = str(REPO / "conf/deepspeed/zero2.json")
    request = parse(
        "-n",
        "3",
        "--cpu",
        "--timeout",
        "9",
        "--start-timeout",
        "8",
        "--env",
        "A=1",
        "--max-restarts",
        "2",
        "--deepspeed-config",
        config_path,
        "--checkpoint-dir",
        "ckpt",
        "--heartbeat-timeout",
        "7",
        "--no-mlflow",
        "--requirement",
        "numpy",
        "--requirement",
        "pandas==2.2.0",
        "train.py",
    )
    distributor = make_distributor(request)
    config = distributor.config
    assert config == request.config
    assert (config.num_processes, config.local_mode, config.use_gpu) == (3, True, False)
    assert (config.timeout_s, config.start_timeout_s, config.max_restarts) == (9.0, 8.0, 2)
    assert config.mode.value == "deepspeed" and config.gpu_type is None
    assert config.deepspeed_config["zero_optimization"]["stage"] == 2
    assert config.env == {"A": "1"} and distributor.spark is None
    assert config.checkpoint_dir == str(in_tmp / "ckpt") and config.heartbeat_timeout_s == 7.0
    assert config.mlflow is False and config.requirements == ("numpy", "pandas==2.2.0")
    assert parse("--mlflow", "train.py").config.mlflow is True
    assert not make_distributor(parse("--master", "yarn", "train.py")).config.local_mode
    assert parse("--gpu-type", "h100", "train.py").config.gpu_type == "H100"


def test_values_the_library_refuses_fail_before_spark_starts(in_tmp):
    with pytest.raises(ConfigError, match="asks for GPUs but use_gpu=False"):
        parse("--cpu", "--gpu-type", "h100", "train.py")
    with pytest.raises(ConfigError, match="--gpu-type: gpu_type='abacus' is not a GPU model"):
        parse("--master", "yarn", "--gpu-type", "abacus", "train.py")
    with pytest.raises(ConfigError, match="--env: env sets RANK, which sparkdist sets"):
        parse("--env", "RANK=3", "train.py")


def test_deepspeed_config_implies_the_mode(in_tmp):
    path = REPO / "conf/deepspeed/zero3.json"
    config = parse("--deepspeed-config", str(path), "train.py").config
    assert (config.mode, config.env) == (Mode.DEEPSPEED, {})
    assert config.deepspeed_config == json.loads(path.read_text())
    assert parse("--mode", "deepspeed", "train.py").config.deepspeed_config is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--conf", "a=b", "train.py"], "add --master URL"),
        (["--master", "local[2]", "--conf", "novalue", "train.py"], "is not KEY=VALUE"),
        (["--env", "=x", "train.py"], "is not KEY=VALUE"),
        (["--mode", "ddp", "--deepspeed-config", "ds.json", "train.py"], "not --mode ddp"),
        (["--deepspeed-config", "missing.json", "train.py"], "--deepspeed-config: cannot read"),
        (["--deepspeed-config", "broken.json", "train.py"], "is not valid JSON"),
        (["--deepspeed-config", "list.json", "train.py"], "must be a JSON object"),
        (["missing.py"], "does not exist"),
    ],
)
def test_contradictions_and_bad_files_are_config_errors(in_tmp, argv, message):
    (in_tmp / "ds.json").write_text("{}")
    (in_tmp / "broken.json").write_text("{nope")
    (in_tmp / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "-n", "0", "train.py"],
        ["run", "-n", "two", "train.py"],
        ["run", "--local", "--master", "yarn", "train.py"],
        ["run", "--timeout", "-1", "train.py"],
        ["run", "--grow-after", "0", "train.py"],
        ["run", "--max-restarts", "-1", "train.py"],
        ["run", "--system-metrics-interval", "-1", "train.py"],
        ["run", "--straggler-fraction", "half", "train.py"],
        ["run", "--mode", "horovod", "train.py"],
        ["run"],
        [],
    ],
)
def test_usage_errors_exit_2_with_argparse_message(in_tmp, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_config_error_is_printed_and_exits_2(in_tmp, capsys):
    assert main(["run", "--conf", "a=b", "train.py"]) == 2
    assert capsys.readouterr().err.startswith("sparkdist: error: --conf sets the Spark conf")


@pytest.mark.parametrize("command", [[], ["run"], ["doctor"]])
def test_every_command_has_help_with_examples(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "examples:" in capsys.readouterr().out


def _failed(exit_code: int | None) -> WorkerFailedError:
    failure = RankFailure(rank=1, host="h", exit_code=exit_code, exc_type="", message="died")
    return WorkerFailedError({1: failure}, failure)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (_failed(3), 3),
        (_failed(1), 1),
        (_failed(-9), 137),
        (_failed(-15), 143),
        (_failed(None), 1),
        (_failed(0), 1),
        (RunTimeoutError("slow"), 124),
        (ConfigError("bad"), 2),
        (ClusterError("small"), 1),
    ],
)
def test_exit_code_of(error, code):
    assert exit_code_of(error) == code


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys, monkeypatch):
    import psutil

    from sparkdist import cli

    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    monkeypatch.setenv("SPARKDIST_MLFLOW", "0")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = cli.main(
        ["run", "-n", "3", "--cpu", "--timeout", "60", "--dry-run", str(script), "--", "--lr", "1"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"plan: {script} on 3 rank(s), mode=ddp" in out
    assert "backend: local; 1 node(s) x 3 rank(s); CPU (gloo)" in out
    assert "timeout_s=60" in out and "rank 2: node 0, local rank 2" in out
    assert "never runs" not in out
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
