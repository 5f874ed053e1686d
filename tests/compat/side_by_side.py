"""Running one case against pyspark's distributor and against sparkdist's, and comparing.

An ``Observed`` is everything a user of either class can see: where an exception came from
(making the distributor, or running it) and its type, the value ``run`` returned, the warnings
logged on the class's logger, and the public attributes pyspark's instances carry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests._helpers.spark import pyspark_major

#: The public attributes of pyspark's instances (after construction), compared by value.
TORCH_ATTRIBUTES = (
    "num_processes",
    "local_mode",
    "use_gpu",
    "num_tasks",
    "ssl_conf",
    "input_params",
    "is_remote",
    "is_spark_local_master",
)
DEEPSPEED_ATTRIBUTES = (*TORCH_ATTRIBUTES, "deepspeed_config", "cleanup_deepspeed_conf")


def assert_refused_where_pyspark_3_hangs(theirs: Observed, ours: Observed) -> None:
    """A GPU count that is not a multiple of ``spark.task.resource.gpu.amount``: pyspark 4 and
    sparkdist refuse it when the distributor is made; pyspark 3.5 accepts it and at ``run``
    starts ``ceil(n / amount)`` tasks whose torchrun waits for ``n`` nodes, a rendezvous that
    never completes. The one deliberate difference from pyspark 3.5 (docs/platforms.md)."""
    if pyspark_major() >= 4:
        assert_same(theirs, ours)
        return
    assert (
        theirs.raised_in is None
        and theirs.attributes["num_tasks"] < theirs.attributes["num_processes"]
    ), theirs
    assert ours.raised_in == "init" and isinstance(ours.error, RuntimeError), ours.error
    assert "is not a multiple of spark.task.resource.gpu.amount" in str(ours.error)


def pyspark_classes() -> dict[str, type]:
    from pyspark.ml.deepspeed.deepspeed_distributor import DeepspeedTorchDistributor
    from pyspark.ml.torch.distributor import TorchDistributor

    return {
        "TorchDistributor": TorchDistributor,
        "DeepspeedTorchDistributor": DeepspeedTorchDistributor,
    }


def sparkdist_classes() -> dict[str, type]:
    from sparkdist import DeepspeedTorchDistributor, TorchDistributor

    return {
        "TorchDistributor": TorchDistributor,
        "DeepspeedTorchDistributor": DeepspeedTorchDistributor,
    }


@dataclass
class Observed:
    raised_in: str | None = None  # "init" or "run": where the exception left the user's call
    error: BaseException | None = None
    value: Any = None
    warnings: list[str] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)
    session: Any = None
    logger_name: str | None = None
    seconds: float = 0.0  # the whole case: shown by ``--durations``-style debugging only


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def observe(cls: type, kwargs: dict[str, Any], run: Callable[[Any], Any] | None = None) -> Observed:
    """Make ``cls(**kwargs)``, then (if given) ``run(instance)``; record what a user sees."""
    seen = Observed()
    started = time.monotonic()
    handler = _Collect()
    logger = logging.getLogger(cls.__name__)  # both libraries log on the class's name
    logger.addHandler(handler)
    try:
        try:
            instance = cls(**kwargs)
        except Exception as error:
            seen.raised_in, seen.error = "init", error
            return seen
        names = DEEPSPEED_ATTRIBUTES if "Deepspeed" in cls.__name__ else TORCH_ATTRIBUTES
        seen.attributes = {name: getattr(instance, name) for name in names}
        seen.session = instance.spark
        seen.logger_name = instance.logger.name
        if run is not None:
            try:
                seen.value = run(instance)
            except Exception as error:
                seen.raised_in, seen.error = "run", error
    finally:
        logger.removeHandler(handler)
        seen.warnings = handler.messages
        seen.seconds = time.monotonic() - started
    return seen


def both(
    name: str, kwargs: dict[str, Any], run: Callable[[Any], Any] | None = None
) -> tuple[Observed, Observed]:
    """The case against pyspark's class ``name``, then against sparkdist's."""
    theirs = observe(pyspark_classes()[name], kwargs, run)
    ours = observe(sparkdist_classes()[name], kwargs, run)
    print(f"{name}: pyspark {theirs.seconds:.1f} s, sparkdist {ours.seconds:.1f} s")
    return theirs, ours


def assert_same(theirs: Observed, ours: Observed, *, compare_value: bool = True) -> None:
    """Same moment of failure, an error ``except <pyspark's type>`` catches, same warnings
    count, same attributes and session, same value."""
    assert ours.raised_in == theirs.raised_in, (theirs.error, ours.error)
    if theirs.error is not None:
        assert isinstance(ours.error, type(theirs.error)), (theirs.error, ours.error)
        return
    assert len(ours.warnings) == len(theirs.warnings), (theirs.warnings, ours.warnings)
    assert ours.attributes == theirs.attributes
    assert ours.session is theirs.session
    assert ours.logger_name == theirs.logger_name
    if compare_value:
        assert ours.value == theirs.value
