"""SparkSessions the command line starts, and the Spark properties files it reads.

The CLI's ``--master`` needs a session with a given master and extra conf, which
``_spark.get_or_create_session`` (active session or builder defaults) does not take; this module
builds one the same way: this interpreter on the executors, no console progress bar, logs at
WARN so rank output stays readable.

Non-goals: the barrier stage and anything run on executors (``_spark``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparkdist._core.errors import ConfigError

#: The log level of sessions sparkdist starts itself.
QUIET_LOG_LEVEL = "WARN"


def create_session(
    master: str | None,
    conf: Mapping[str, str] | None = None,
    *,
    app_name: str = "sparkdist",
    log_level: str = QUIET_LOG_LEVEL,
) -> Any:
    """Start (or get) a SparkSession: the one place sparkdist builds a session.

    ``master`` None leaves the master to spark-submit / spark-defaults.conf. The executors run
    this interpreter (``spark.pyspark.python``, or ``PYSPARK_PYTHON`` when set) and Spark's
    console progress bar is off, so rank output stays readable; ``conf`` wins over both.

    Raises:
        ConfigError: pyspark is not installed.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ConfigError(
            "running on Spark needs pyspark; install it (pip install 'sparkdist[spark]') or "
            "run on this machine (local_mode=True, or the CLI's --local)"
        ) from exc
    # Executors must run the driver's interpreter, or every import of the job fails there.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    settings = {
        "spark.app.name": app_name,
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
        "spark.ui.showConsoleProgress": "false",
        **(conf or {}),
    }
    builder = SparkSession.builder
    if master is not None:
        builder = builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level)
    return session


def active_session() -> Any | None:
    """The active SparkSession (classic or Connect), or None; no pyspark counts as None."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return None
    return SparkSession.getActiveSession()


def is_connect(session: Any) -> bool:
    """Whether ``session`` is a Spark Connect client session."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def get_or_create_session() -> Any:
    """The active session, or a new one (``create_session`` with spark-submit's master)."""
    session = active_session()
    return session if session is not None else create_session(None)


def parse_assignment(text: str, what: str) -> tuple[str, str]:
    """Split ``KEY=VALUE`` (the CLI's ``--conf`` and ``--env``), refusing anything else."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{what} {text!r} is not KEY=VALUE; write e.g. {what} name=value")
    return key, value


def spark_defaults_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """The spark-defaults.conf a new session would read, or None when there is none.

    Spark reads ``$SPARK_CONF_DIR/spark-defaults.conf``, else ``$SPARK_HOME/conf/...``; a pip
    installed pyspark is its own SPARK_HOME.
    """
    env = os.environ if environ is None else environ
    conf_dir = env.get("SPARK_CONF_DIR")
    if not conf_dir:
        home = env.get("SPARK_HOME") or _pyspark_home()
        if home is None:
            return None
        conf_dir = os.path.join(home, "conf")
    path = Path(conf_dir) / "spark-defaults.conf"
    return path if path.is_file() else None


def _pyspark_home() -> str | None:
    try:
        import pyspark
    except ImportError:
        return None
    return os.path.dirname(os.path.abspath(pyspark.__file__))


def read_properties(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a Spark properties file (spark-defaults.conf, ``--properties-file``).

    Spark loads these with ``java.util.Properties``: ``#``/``!`` comments, and a key separated
    from its value by whitespace, ``=`` or ``:``. Line continuations and escapes, which Spark
    confs hardly ever use, are not interpreted.

    Raises:
        ConfigError: the file cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the Spark properties file {str(path)!r}: {exc}") from exc
    properties = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        end = len(line)
        for index, char in enumerate(line):
            if char in " \t=:":
                end = index
                break
        key, rest = line[:end], line[end:].lstrip(" \t")
        if rest[:1] in ("=", ":"):
            rest = rest[1:].lstrip(" \t")
        properties[key] = rest
    return properties
