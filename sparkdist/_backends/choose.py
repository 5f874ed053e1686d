"""Choosing the backend of a launch: the one place that looks at ``local_mode``.

Non-goals: what a backend does (``local``, ``spark``).
"""

from __future__ import annotations

from typing import Any

from sparkdist._backends import spark_driver
from sparkdist._backends.base import Backend
from sparkdist._backends.local import LocalBackend
from sparkdist._backends.session import is_connect
from sparkdist._backends.spark import ConnectBackend, SparkBackend
from sparkdist._core.errors import ConfigError
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import TORCH_IGNORE_SSL_KEY


def select_backend(
    config: LaunchConfig,
    session: Any | None = None,
    *,
    ignore_ssl_key: str = TORCH_IGNORE_SSL_KEY,
    dataframe: Any | None = None,
) -> Backend:
    """The backend for this launch: the one place that looks at ``local_mode``."""
    if config.local_mode:
        if dataframe is not None:
            raise ConfigError(
                "a Spark DataFrame input is read by the barrier stage on the executors; pass "
                "local_mode=False (local mode runs no Spark job), or collect small data "
                "yourself and pass it as an argument"
            )
        return LocalBackend(session)
    if session is None and dataframe is not None:
        session = dataframe.sparkSession
    session = session if session is not None else spark_driver.get_or_create_session()
    kind = ConnectBackend if is_connect(session) else SparkBackend
    return kind(session, ignore_ssl_key=ignore_ssl_key, dataframe=dataframe)
