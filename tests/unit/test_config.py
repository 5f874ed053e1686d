"""LaunchConfig validation and the public constructors' argument checks."""

from __future__ import annotations

import pytest

from sparkdist import ConfigError, Distributor, Mode, TorchDistributor
from sparkdist._core.config import LaunchConfig


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True, None])
def test_num_processes_must_be_a_positive_int(n):
    with pytest.raises(ConfigError, match="num_processes must be a positive integer"):
        LaunchConfig(num_processes=n)
    with pytest.raises(ValueError):  # pyspark raises ValueError here; so do we
        TorchDistributor(num_processes=n)


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
    dist = TorchDistributor()
    assert (dist.num_processes, dist.local_mode, dist.use_gpu) == (1, True, True)
    dist = TorchDistributor(4, False, False)
    assert (dist.num_processes, dist.local_mode, dist.use_gpu) == (4, False, False)


def test_distributor_options_beyond_the_first_are_keyword_only():
    with pytest.raises(TypeError):
        Distributor(2, True)  # type: ignore[misc]
