"""sparkdist's pyspark drop-ins have pyspark's signatures and public attributes.

Every difference must be on ``ALLOWED`` with its reason; anything else fails. pyspark's classes
are introspected, so a new pyspark that changes them shows up here.
"""

from __future__ import annotations

import inspect

import pytest

from tests.compat.side_by_side import pyspark_classes, sparkdist_classes

pytest.importorskip("pyspark")

#: Public names ours have and pyspark's lack, each with why (docs/launching.md lists them).
ALLOWED_EXTRA = {
    "run_all": "sparkdist's: every rank's value and the run's record (RunResult)",
    "run_async": "sparkdist's: start a run and return a handle (sweeps)",
    "config": "sparkdist's: the validated LaunchConfig the instance runs with",
}
#: Public names pyspark's have and ours lack: none.
ALLOWED_MISSING: dict[str, str] = {}
#: Methods whose signatures are compared parameter by parameter (name, kind, default).
METHODS = ("__init__", "run", "_train_on_dataframe")
#: Private class attributes pyspark's code reads on these classes.
CLASS_CONSTANTS = {
    "TorchDistributor": ("_TORCH_SSL_CONF",),
    "DeepspeedTorchDistributor": ("_TORCH_SSL_CONF", "_DEEPSPEED_SSL_CONF"),
}


def shape(function):
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", ["TorchDistributor", "DeepspeedTorchDistributor"])
@pytest.mark.parametrize("method", METHODS)
def test_signatures_match(name, method):
    theirs, ours = pyspark_classes()[name], sparkdist_classes()[name]
    assert shape(getattr(ours, method)) == shape(getattr(theirs, method))


@pytest.mark.parametrize("name", ["TorchDistributor", "DeepspeedTorchDistributor"])
def test_class_level_public_names_match(name):
    theirs, ours = pyspark_classes()[name], sparkdist_classes()[name]
    public = lambda cls: {n for n in dir(cls) if not n.startswith("_")}  # noqa: E731
    # pyspark's instance attributes show on our class too: there they shadow Distributor's
    # read-only properties so that instances hold plain, writable attributes, as pyspark's do.
    allowed = set(ALLOWED_EXTRA) | {"num_processes", "local_mode", "use_gpu"}
    assert public(ours) - public(theirs) <= allowed, public(ours) - public(theirs)
    assert public(theirs) - public(ours) <= set(ALLOWED_MISSING)
    for constant in CLASS_CONSTANTS[name]:
        assert getattr(ours, constant) == getattr(theirs, constant)


def test_the_deepspeed_class_is_a_torch_distributor_in_both():
    theirs, ours = pyspark_classes(), sparkdist_classes()
    assert issubclass(theirs["DeepspeedTorchDistributor"], theirs["TorchDistributor"])
    assert issubclass(ours["DeepspeedTorchDistributor"], ours["TorchDistributor"])


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("TorchDistributor", {"num_processes": 2, "local_mode": True, "use_gpu": False}),
        ("TorchDistributor", {"num_processes": 2, "local_mode": False, "use_gpu": False}),
        (
            "DeepspeedTorchDistributor",
            {
                "numGpus": 2,
                "nnodes": 1,
                "useGpu": False,
                "deepspeedConfig": {"train_batch_size": 2},
            },
        ),
    ],
)
def test_instance_public_attributes_match(spark_local, name, kwargs):
    theirs = pyspark_classes()[name](**kwargs)
    ours = sparkdist_classes()[name](**kwargs)
    public = lambda obj: {n for n in dir(obj) if not n.startswith("_")}  # noqa: E731
    assert public(ours) - public(theirs) <= set(ALLOWED_EXTRA), public(ours) - public(theirs)
    assert public(theirs) - public(ours) <= set(ALLOWED_MISSING), public(theirs) - public(ours)
    # The same values, and the same order in input_params (pyspark builds it from __dict__).
    for attribute in sorted(public(theirs) - {"run", "logger", "spark"}):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    assert list(ours.input_params) == list(theirs.input_params)
    assert ours.spark is theirs.spark
    assert ours.logger is theirs.logger  # the same logging.Logger: named after the class
    # Like pyspark's, the attributes are plain and writable.
    ours.num_processes = 3
    assert ours.num_processes == 3
