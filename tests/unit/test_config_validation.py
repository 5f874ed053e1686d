"""Bad launch options are refused before any process starts, naming the parameter (issue 19).

Each case is the options, the error type (``ConfigTypeError`` is also a ``TypeError``; every
refusal is a ``ConfigError``, so a ``ValueError``), and what the message must name. Every case
goes through ``build_config`` and through ``Distributor`` and ``@distributed``; one run per
kind of refusal proves no child process was started.
"""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path

import psutil
import pytest

from sparkdist import ConfigError, Distributor, distributed
from sparkdist._core.env import (
    CTRL_IN_VAR,
    CTRL_OUT_VAR,
    JOB_FILE_VAR,
    LAUNCHER_VARS,
    RESULT_DIR_VAR,
    START_TIMEOUT_VAR,
    RankSeat,
    check_user_env,
    launcher_owns,
    worker_env,
)
from sparkdist._core.errors import ConfigTypeError
from sparkdist._core.launch.checks import CPU_OVERSUBSCRIBE_FACTOR, check_launchable
from sparkdist._core.launch.config import build_config
from sparkdist.cli import main

TOO_MANY = CPU_OVERSUBSCRIBE_FACTOR * (os.cpu_count() or 1) + 1

CASES = [
    # min_processes: elastic runs shrink to it, never below 1 nor above the world
    (
        {"num_processes": 2, "min_processes": 3},
        ConfigError,
        ["min_processes=3 is more than num_processes=2", "between 1 and 2"],
    ),
    ({"min_processes": 0}, ConfigError, ["min_processes must be a positive integer", "0"]),
    ({"min_processes": 1.5}, ConfigTypeError, ["min_processes must be a positive integer"]),
    # grow_after_s: growing back drains to a checkpoint, so it needs checkpoint_dir
    (
        {"num_processes": 3, "min_processes": 2},
        ConfigError,
        ["min_processes=2 with grow_after_s=60", "needs checkpoint_dir", "grow_after_s=None"],
    ),
    ({"grow_after_s": 0}, ConfigError, ["grow_after_s must be a positive number"]),
    ({"env": {"SPARKDIST_REQUESTED_WORLD_SIZE": "8"}}, ConfigError, ["env sets SPARKDIST_REQ"]),
    # env: a mapping of POSIX names to strings, none of the launcher's own
    ({"env": "X=1"}, ConfigTypeError, ["env must be a mapping", "'X=1'", "env={'X': '1'}"]),
    ({"env": ["A=1"]}, ConfigTypeError, ["env must be a mapping", "['A=1']"]),
    ({"env": {"A": 1}}, ConfigTypeError, ["env['A'] must be a string", "int 1"]),
    ({"env": {"A": None}}, ConfigTypeError, ["env['A'] must be a string"]),
    ({"env": {1: "a"}}, ConfigTypeError, ["env names must be strings", "int 1"]),
    ({"env": {"1X": "a"}}, ConfigError, ["env name '1X'", "[A-Za-z_][A-Za-z0-9_]*"]),
    ({"env": {"A-B": "a"}}, ConfigError, ["env name 'A-B'"]),
    ({"env": {"": "a"}}, ConfigError, ["env name ''"]),
    ({"env": {"RANK": "3"}}, ConfigError, ["env sets RANK", "drop RANK from env"]),
    ({"env": {"LOCAL_RANK": "0"}}, ConfigError, ["env sets LOCAL_RANK"]),
    ({"env": {"WORLD_SIZE": "8"}}, ConfigError, ["env sets WORLD_SIZE", "num_processes"]),
    ({"env": {"LOCAL_WORLD_SIZE": "8"}}, ConfigError, ["env sets LOCAL_WORLD_SIZE"]),
    ({"env": {"MASTER_ADDR": "10.0.0.1"}}, ConfigError, ["env sets MASTER_ADDR"]),
    ({"env": {"MASTER_PORT": "29500"}}, ConfigError, ["env sets MASTER_PORT", "OS picks"]),
    ({"env": {"GROUP_RANK": "0"}}, ConfigError, ["env sets GROUP_RANK"]),
    ({"env": {"NODE_RANK": "0"}}, ConfigError, ["env sets NODE_RANK"]),
    ({"env": {"TORCHELASTIC_RUN_ID": "x"}}, ConfigError, ["env sets TORCHELASTIC_RUN_ID"]),
    ({"env": {"TORCHELASTIC_ERROR_FILE": "/x"}}, ConfigError, ["TORCHELASTIC_ERROR_FILE"]),
    ({"env": {"SPARKDIST_RUN_ID": "x"}}, ConfigError, ["env sets SPARKDIST_RUN_ID"]),
    ({"env": {"SPARKDIST_CHECKPOINT_DIR": "/x"}}, ConfigError, ["SPARKDIST_CHECKPOINT_DIR"]),
    ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, ConfigError, ["env sets CUDA_VISIBLE_DEVICES"]),
    # paths: str or os.PathLike
    ({"checkpoint_dir": 123}, ConfigTypeError, ["checkpoint_dir must be a directory path", "123"]),
    ({"checkpoint_dir": b"/tmp/x"}, ConfigTypeError, ["checkpoint_dir", "b'/tmp/x'"]),
    ({"checkpoint_dir": True}, ConfigTypeError, ["checkpoint_dir", "True"]),
    ({"checkpoint_dir": ""}, ConfigTypeError, ["checkpoint_dir must be a non-empty"]),
    # object-store URLs: taken through fsspec where its backend is installed (issue 33)
    (
        {"checkpoint_dir": "gs://b/run"},
        ConfigError,
        ["checkpoint_dir='gs://b/run'", "backend for gs://", "pip install 'sparkdist[gcs]'"],
    ),
    ({"checkpoint_dir": "abfss://c@acct.dfs.core.windows.net/r"}, ConfigError, ["[azure]"]),
    ({"checkpoint_dir": "nosuchstore://b/k"}, ConfigError, ["fsspec knows no storage for"]),
    ({"checkpoint_dir": "memory://b/k"}, ConfigError, ["every rank would see its own"]),
    (
        {"checkpoint_dir": "s3://b/k", "storage_options": {"aws_secret_access_key": "hunter2"}},
        ConfigError,
        ["storage_options['aws_secret_access_key'] looks like a credential", "never travel"],
    ),
    (
        {"checkpoint_dir": "/shared/ckpt", "storage_options": {"endpoint_url": "http://x"}},
        ConfigError,
        ["storage_options (settings endpoint_url)", "is not an object-store URL"],
    ),
    ({"checkpoint_dir": "s3://b/k", "storage_options": "endpoint=x"}, ConfigTypeError, ["mapping"]),
    (
        {"checkpoint_dir": "s3://b/k", "storage_options": {"endpoint_url": object()}},
        ConfigTypeError,
        ["storage_options['endpoint_url'] must be a str, number"],
    ),
    ({"checkpoint_dir": "file://otherhost/x"}, ConfigError, ["names the host 'otherhost'"]),
    (
        {"mode": "deepspeed", "deepspeed_config": 42},
        ConfigTypeError,
        ["deepspeed_config must be a dict or the path of a JSON file", "int 42"],
    ),
    (
        {"deepspeed_config": {"train_batch_size": 8}},
        ConfigError,
        ["deepspeed_config was given with mode='ddp'", "mode='deepspeed'"],
    ),
    # numbers, flags and names
    ({"num_processes": "2"}, ConfigTypeError, ["num_processes must be a positive integer", "'2'"]),
    ({"num_processes": 2.0}, ConfigTypeError, ["num_processes", "float 2.0"]),
    ({"num_processes": 0}, ConfigError, ["num_processes must be a positive integer, got 0"]),
    ({"timeout_s": "10"}, ConfigTypeError, ["timeout_s must be a positive number of seconds"]),
    ({"timeout_s": -1}, ConfigError, ["timeout_s", "-1"]),
    ({"start_timeout_s": None}, ConfigTypeError, ["start_timeout_s", "None"]),
    ({"heartbeat_timeout_s": float("inf")}, ConfigError, ["heartbeat_timeout_s", "inf"]),
    ({"preemption_grace_s": 0}, ConfigError, ["preemption_grace_s", "seconds", "0"]),
    ({"preemption_grace_s": None}, ConfigTypeError, ["preemption_grace_s", "None"]),
    ({"max_restarts": 1.5}, ConfigTypeError, ["max_restarts must be a whole number", "1.5"]),
    ({"max_restarts": -1}, ConfigError, ["max_restarts must be a whole number >= 0, got -1"]),
    ({"local_mode": "yes"}, ConfigTypeError, ["local_mode must be True or False", "'yes'"]),
    ({"use_gpu": 1}, ConfigTypeError, ["use_gpu must be True, False or None", "int 1"]),
    ({"mlflow": "off"}, ConfigTypeError, ["mlflow must be True, False or None", "'off'"]),
    ({"allow_oversubscribe": 1}, ConfigTypeError, ["allow_oversubscribe must be True or False"]),
    ({"mode": 3}, ConfigTypeError, ["mode=3 is not a launch mode", "'ddp'"]),
    ({"mode": "horovod"}, ConfigError, ["mode='horovod' is not a launch mode"]),
    ({"gpu_type": "H1000"}, ConfigError, ["gpu_type='H1000' is not a GPU model"]),
    ({"gpu_type": "H100", "use_gpu": False}, ConfigError, ["gpu_type='H100'", "use_gpu=False"]),
    ({"requirements": "numpy"}, ConfigTypeError, ["requirements must be a list", "['numpy']"]),
    ({"requirements": 3}, ConfigTypeError, ["requirements must be a list", "int 3"]),
    ({"requirements": {"numpy": "1"}}, ConfigTypeError, ["requirements must be a list"]),
    ({"requirements": ["numpy>=1"]}, ConfigError, ["requirements entry 'numpy>=1'"]),
    ({"job_size_warn_mb": "big"}, ConfigTypeError, ["job_size_warn_mb", "'big'"]),
    ({"job_size_limit_mb": 0}, ConfigError, ["job_size_limit_mb must be a positive number"]),
    ({"system_metrics_interval_s": "10"}, ConfigTypeError, ["system_metrics_interval_s", "'10'"]),
    ({"system_metrics_interval_s": -1}, ConfigError, ["system_metrics_interval_s", ">= 0", "-1"]),
    ({"straggler_fraction": True}, ConfigTypeError, ["straggler_fraction must be a number"]),
    ({"straggler_fraction": 1.0}, ConfigError, ["straggler_fraction", "in [0, 1)", "1.0"]),
    ({"straggler_fraction": float("nan")}, ConfigError, ["straggler_fraction", "nan"]),
    ({"straggler_window_s": 0}, ConfigError, ["straggler_window_s must be a positive number"]),
    # local ranks past a sane bound, unless asked for
    (
        {"num_processes": TOO_MANY, "use_gpu": False},
        ConfigError,
        [f"num_processes={TOO_MANY} local CPU ranks", "allow_oversubscribe=True"],
    ),
    (
        {"num_processes": TOO_MANY},
        ConfigError,
        [f"num_processes={TOO_MANY}", "local_mode=False", "--allow-oversubscribe"],
    ),
]


def _case_id(case: tuple[dict[str, object], type, list[str]]) -> str:
    return ",".join(f"{k}={v!r}"[:40] for k, v in case[0].items())


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize(("options", "error", "needles"), CASES, ids=map(_case_id, CASES))
def test_a_bad_option_is_refused_naming_it_the_value_and_what_is_accepted(options, error, needles):
    doors = [
        lambda: build_config(**options),
        lambda: Distributor(**options),
        lambda: distributed(
            gpus=options.get("num_processes", 1),
            **{k: v for k, v in options.items() if k != "num_processes"},
        ),
    ]
    n = options.get("num_processes", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or "local_mode" in options:
        doors.pop()  # gpus= and remote= are refused in the decorator's words (test_decorator.py)
    for build in doors:
        with pytest.raises(error) as info:
            build()
        assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
        assert isinstance(info.value, TypeError) == (error is ConfigTypeError)
        for needle in needles:
            assert needle in str(info.value), (needle, str(info.value))


def test_the_sane_bound_is_lifted_only_when_asked_or_where_it_does_not_apply():
    assert build_config(num_processes=TOO_MANY, allow_oversubscribe=True).num_processes == TOO_MANY
    assert build_config(num_processes=TOO_MANY, local_mode=False).num_processes == TOO_MANY
    # GPU ranks are bounded by the driver's GPUs instead, when placed (before any start).
    assert build_config(num_processes=TOO_MANY, use_gpu=True).num_processes == TOO_MANY
    assert build_config(num_processes=TOO_MANY - 1).num_processes == TOO_MANY - 1


def test_file_urls_and_dbfs_become_the_paths_they_name(monkeypatch, tmp_path):
    from sparkdist._core.launch import checks

    assert build_config(checkpoint_dir="file:///shared/ck%20pt").checkpoint_dir == "/shared/ck pt"
    assert build_config(checkpoint_dir="file://localhost/x").checkpoint_dir == "/x"
    assert build_config(checkpoint_dir="C:/not-a-scheme").checkpoint_dir == os.path.abspath(
        "C:/not-a-scheme"
    )
    monkeypatch.setattr(checks, "DBFS_MOUNT", str(tmp_path / "no-dbfs-here"))
    with pytest.raises(ConfigError, match="Databricks DBFS URL.*/Volumes"):
        build_config(checkpoint_dir="dbfs:/ckpt/run1")
    monkeypatch.setattr(checks, "DBFS_MOUNT", str(tmp_path))
    assert build_config(checkpoint_dir="dbfs:/ckpt/run1").checkpoint_dir == str(
        tmp_path / "ckpt" / "run1"
    )


def test_good_values_are_normalised(tmp_path):
    config = build_config(
        env={"NCCL_DEBUG": "INFO", "_X1": ""},
        checkpoint_dir=Path("ckpt"),
        gpu_type="h100",
        mode="FSDP",
        requirements=("numpy",),
    )
    assert config.env == {"NCCL_DEBUG": "INFO", "_X1": ""}
    assert config.checkpoint_dir == os.path.abspath("ckpt")
    assert (config.gpu_type, config.mode.value, config.requirements) == ("H100", "fsdp", ("numpy",))
    assert build_config(env=None, requirements=None) == build_config()


# -- what may not be launched -------------------------------------------------------------------


def _gen():
    yield 1


async def _coro():
    return 1


async def _agen():
    yield 1


class _AsyncCall:
    async def __call__(self):
        return 1


class _GenCall:
    def __call__(self):
        yield 1


class _PlainCall:
    def __call__(self):
        return 1


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (_gen, "_gen is a generator function"),
        (_coro, "_coro is an async def function"),
        (_agen, "_agen is an async def function"),
        (_AsyncCall(), "_AsyncCall is an async def function"),
        (_GenCall(), "_GenCall is a generator function"),
        (functools.partial(_coro), "async def"),
    ],
)
def test_generator_and_async_functions_are_refused_at_run_before_any_process(fn, needle):
    before = _children()
    with pytest.raises(ConfigTypeError, match=needle):
        Distributor(1, use_gpu=False, mlflow=False).run(fn)
    with pytest.raises(ConfigTypeError, match=needle):
        distributed(gpus=1, use_gpu=False)(fn)
    assert _children() == before


@pytest.mark.parametrize("fn", [lambda: 1, _PlainCall(), print, dict, functools.partial(max, 1)])
def test_plain_callables_are_launchable(fn):
    check_launchable(fn)


def test_a_bad_env_is_refused_before_any_process_starts(tmp_path, capsys):
    before = _children()
    with pytest.raises(ConfigError, match="env sets MASTER_PORT"):
        Distributor(2, use_gpu=False, env={"MASTER_PORT": "1234"}).run(lambda: 1)
    with pytest.raises(ConfigTypeError, match="env must be a mapping"):
        distributed(gpus=2, use_gpu=False, env="A=1")(lambda: 1).distributed()
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    assert main(["run", "-n", "2", "--env", "RANK=1", str(script)]) == 2
    assert "--env: env sets RANK" in capsys.readouterr().err
    assert main(["run", "-n", str(TOO_MANY), str(script)]) == 2
    assert "--allow-oversubscribe" in capsys.readouterr().err
    assert _children() == before


# -- the launcher's own variables ---------------------------------------------------------------


def test_every_variable_the_launcher_sets_is_one_env_may_not_set():
    seat = RankSeat(
        rank=1, local_rank=1, node_rank=0, world_size=2, local_world_size=2, num_nodes=1
    )
    env = worker_env(
        {},
        seat,
        master_addr="h",
        run_id="r",
        restart_count=0,
        max_restarts=0,
        cuda_visible_devices="0,1",
        mode="deepspeed",
        host="h",
    )
    defaulted = {"OMP_NUM_THREADS"}  # setdefault: the user's value wins
    assert all(launcher_owns(name) for name in set(env) - defaulted), set(env) - defaulted
    assert not any(launcher_owns(name) for name in defaulted | {"DS_ACCELERATOR", "NCCL_DEBUG"})
    # The agent's bootstrap variables and the worker's spellings of them agree.
    from sparkdist._node.rank import worker

    assert (
        worker.JOB_FILE_VAR,
        worker.RESULT_DIR_VAR,
        worker.CTRL_IN_VAR,
        worker.CTRL_OUT_VAR,
        worker.START_TIMEOUT_VAR,
    ) == (JOB_FILE_VAR, RESULT_DIR_VAR, CTRL_IN_VAR, CTRL_OUT_VAR, START_TIMEOUT_VAR)
    assert {JOB_FILE_VAR, RESULT_DIR_VAR, CTRL_IN_VAR, CTRL_OUT_VAR} <= LAUNCHER_VARS


def test_user_env_that_sparkdist_leaves_alone_passes():
    env = {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "SPARKDIST_MLFLOW": "0", "PATH": "/b"}
    assert check_user_env(env) == env
    assert check_user_env(env) is not env  # a copy: later changes to the caller's dict stay out


def test_an_asyncio_entry_point_is_the_fix_the_message_suggests():
    def train():
        return asyncio.run(_coro())

    check_launchable(train)
    assert train() == 1
