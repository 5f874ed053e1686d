"""Spark settings as the tests pass them to ``spark-submit`` and ``sparkdist run``."""

from __future__ import annotations

from collections.abc import Mapping

from sparkdist._lab.spark import FAST_JVM_OPTIONS


def conf_args(conf: Mapping[str, str]) -> list[str]:
    """``--conf key=value`` for each setting, in order."""
    return [arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")]


#: A small, quiet, fast-starting application: what every submitted test job sets.
SMALL_APP_CONF = conf_args(
    {
        "spark.executor.memory": "512m",
        "spark.ui.enabled": "false",
        "spark.driver.extraJavaOptions": FAST_JVM_OPTIONS,
        "spark.executor.extraJavaOptions": FAST_JVM_OPTIONS,
    }
)
