"""LaunchConfig validation and the public constructors' argument checks."""

from __future__ import annotations

import pytest

from sparkdist import ConfigError, Distributor, Mode, TorchDistributor
from sparkdist._core.launch.config import LaunchConfig


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True, None])
def test_num_processes_must_be_a_positive_int(n):
    with pytest.raises(ConfigError, match="num_processes must be a positive integer"):
        LaunchConfig(num_processes=n)
    # pyspark raises ValueError (TypeError for None and "2"); ours is both. 1.5 and True are
    # refused here where pyspark takes them and fails in the run (docs/launching.md).
    with pytest.raises(ValueError):
        TorchDistributor(num_processes=n, use_gpu=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": 0}, "timeout_s must be a positive number"),
        ({"timeout_s": float("nan")}, "timeout_s must be a positive number"),
        ({"start_timeout_s": -1}, "start_timeout_s must be"),
        ({"mode": "horovod"}, "mode='horovod' is not a launch mode; use one of 'ddp'"),
        ({"use_gpu": "yes"}, "use_gpu must be True, False or None"),
        ({"local_mode": 1}, "local_mode must be True or False"),
        ({"env": {"A": 1}}, r"env\['A'\] must be a string"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(num_processes=2, **kwargs)


def test_mode_parses_names_case_insensitively():
    assert LaunchConfig(mode="FSDP").mode is Mode.FSDP
    assert Distributor(1, mode=Mode.DEEPSPEED).config.mode is Mode.DEEPSPEED


def test_torch_distributor_keeps_pysparks_signature_and_defaults():
    import inspect

    defaults = {
        name: p.default for name, p in inspect.signature(TorchDistributor).parameters.items()
    }
    assert defaults == {
        "num_processes": 1,
        "local_mode": True,
        "use_gpu": True,
        "_ssl_conf": "pytorch.spark.distributor.ignoreSsl",
    }
    dist = TorchDistributor(4, True, False)
    assert (dist.num_processes, dist.local_mode, dist.use_gpu) == (4, True, False)
    assert (dist.num_tasks, dist.input_params["num_tasks"]) == (4, 4)


def test_distributor_options_beyond_the_first_are_keyword_only():
    with pytest.raises(TypeError):
        Distributor(2, True)  # type: ignore[misc]
