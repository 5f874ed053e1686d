"""Spark settings as the tests pass them to ``spark-submit`` and ``sparkdist run``, and which
pyspark the tests run on."""

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


def pyspark_major() -> int:
    """The installed pyspark's major version: 3 in the floor environment (tests/floor/), 4 in
    the main one. Tests that compare with pyspark compare with this one."""
    import pyspark

    from sparkdist._core.versions import release_of

    return release_of(pyspark.__version__)[0]


#: Why Spark Connect is not tested on pyspark 3.5 (docs/platforms.md says so too).
NO_CONNECT_SERVER_ON_3 = (
    "pyspark 3.5's wheel holds no Spark Connect server to start here (its jar comes from "
    "Maven): Spark Connect on 3.5 is untested"
)
