"""@distributed without launching anything: arguments, misuse, the wrapper, GPU model names."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest

from sparkdist import ConfigError, GPUType, Mode, distributed
from sparkdist._node.host.gpus import gpu_type_matches
from sparkdist.decorator import DistributedFunction


@distributed(gpus=2, gpu_type="h100", timeout_s=30)
def module_level_train(lr, *, epochs=1):
    """Train for a while."""
    return lr * epochs


# -- GPUType -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("H100", GPUType.H100),
        ("h100", GPUType.H100),
        (" a10 ", GPUType.A10),
        ("A10g", GPUType.A10G),
        ("l40s", GPUType.L40S),
        (GPUType.H200, GPUType.H200),
    ],
)
def test_gpu_type_accepts_member_or_name_in_any_case(given, expected):
    assert GPUType.parse(given) is expected


@pytest.mark.parametrize("given", ["H1000", "", "nvidia", 100, None])
def test_unknown_gpu_type_is_refused_listing_the_choices(given):
    with pytest.raises(ConfigError, match=r"use one of T4, V100, A10, .*H100.*gpu_type=None"):
        GPUType.parse(given)


@pytest.mark.parametrize(
    ("model", "device_name", "matches"),
    [
        (GPUType.H100, "NVIDIA H100 80GB HBM3", True),
        (GPUType.H100, "NVIDIA H100 NVL", True),
        (GPUType.H100, "NVIDIA H200", False),
        (GPUType.H200, "NVIDIA H200", True),
        (GPUType.A100, "NVIDIA A100-SXM4-80GB", True),
        (GPUType.A10, "NVIDIA A10G", True),
        (GPUType.A10, "NVIDIA A10", True),
        (GPUType.A10, "NVIDIA A100-SXM4-40GB", False),
        (GPUType.A10G, "NVIDIA A10", False),
        (GPUType.L4, "NVIDIA L4", True),
        (GPUType.L4, "NVIDIA L40S", False),
        (GPUType.L40S, "NVIDIA L40S", True),
        (GPUType.T4, "Tesla T4", True),
        (GPUType.V100, "Tesla V100-SXM2-16GB", True),
        (GPUType.B200, "NVIDIA B200", True),
        (GPUType.B200, "NVIDIA GB200", False),
        (GPUType.GB200, "NVIDIA GB200", True),
    ],
)
def test_every_gpu_type_is_a_model_token_of_nvidia_smi_names(model, device_name, matches):
    assert gpu_type_matches(model.value, device_name) is matches


# -- arguments and misuse ----------------------------------------------------------------


def test_decorator_arguments_become_the_launch_config():
    assert isinstance(module_level_train, DistributedFunction)
    config = module_level_train.config
    assert (config.num_processes, config.local_mode, config.gpu_type, config.timeout_s) == (
        2,
        True,
        "H100",
        30,
    )
    assert module_level_train.gpus == 2
    assert module_level_train.gpu_type is GPUType.H100
    assert module_level_train.remote is False

    @distributed(4, GPUType.A10, True, mode="FSDP", env={"A": "1"}, use_gpu=True)
    def other():
        pass

    assert (other.gpus, other.gpu_type, other.remote) == (4, GPUType.A10, True)
    assert other.config.mode is Mode.FSDP and other.config.env == {"A": "1"}
    assert other.config.use_gpu is True and other.config.local_mode is False


def test_bare_decorator_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"write @distributed\(gpus=2\) above def train"):

        @distributed
        def train():
            pass


@pytest.mark.parametrize("gpus", [0, -1, 1.5, "2", True, None])
def test_gpus_must_be_a_positive_integer(gpus):
    with pytest.raises(ConfigError, match="gpus must be a positive integer"):
        distributed(gpus=gpus)


def test_decorating_twice_is_refused():
    with pytest.raises(ConfigError, match=r"already decorated with @distributed\(gpus=2\)"):
        distributed(gpus=4)(module_level_train)


def test_non_callable_is_refused():
    with pytest.raises(ConfigError, match="decorates a function, got str"):
        distributed(gpus=2)("train.py")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"remote": "yes"}, "remote must be True"),
        ({"gpu_type": "H1000"}, "not a GPU model"),
        ({"gpu_type": "H100", "use_gpu": False}, "drop one of them"),
        ({"mode": "horovod"}, "not a launch mode"),
        ({"timeout_s": 0}, "timeout_s must be a positive number"),
        ({"env": {"A": 1}}, r"env\['A'\] must be a string"),
    ],
)
def test_bad_launcher_options_fail_when_decorating(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        distributed(2, **kwargs)


# -- the wrapper -------------------------------------------------------------------------


def test_wrapper_keeps_name_docstring_and_module_and_calls_plainly():
    assert module_level_train.__name__ == "module_level_train"
    assert module_level_train.__qualname__ == "module_level_train"
    assert module_level_train.__doc__ == "Train for a while."
    assert module_level_train.__module__ == __name__
    assert module_level_train.__wrapped__(2, epochs=3) == 6
    assert module_level_train(2, epochs=3) == 6  # in this process: no launch
    assert "gpus=2 gpu_type='H100' remote=False" in repr(module_level_train)


def test_module_level_wrapper_pickles_by_name():
    for dumps in (pickle.dumps, cloudpickle.dumps):
        data = dumps(module_level_train)
        assert pickle.loads(data) is module_level_train
        assert b"_rebuild" not in data


def test_local_wrapper_pickles_by_value_without_the_session():
    session = object()  # stands for a SparkSession: a live handle that must stay behind

    @distributed(gpus=3, gpu_type="a100", remote=True, spark=session)
    def local_train(x):
        """Local."""
        return x + 1

    copy = cloudpickle.loads(cloudpickle.dumps(local_train))
    assert copy is not local_train
    assert (copy.gpus, copy.gpu_type, copy.remote, copy.spark) == (3, GPUType.A100, True, None)
    assert copy.config == local_train.config
    assert (copy.__name__, copy.__doc__, copy(1)) == ("local_train", "Local.", 2)


def test_module_registered_by_value_pickles_by_value():
    import sys

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        data = cloudpickle.dumps(module_level_train)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    copy = cloudpickle.loads(data)
    assert copy is not module_level_train and copy(2) == 2 and copy.gpus == 2
