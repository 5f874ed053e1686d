"""Start a run, whichever kind: the one function every front door calls.

A run of one world is a ``Launch``; a run of torchft replica groups (``replica_groups`` > 1)
is a ``GroupedLaunch`` of one ``Launch`` per group. Both offer the same handle (``wait``,
``result``, ``done``, ``cancel``, ``run_id``, ``mlflow_run_id``, ``placement``...).

Non-goals: what either does (``_engine.launch``, ``_engine.replica_groups``).
"""

from __future__ import annotations

from typing import Any

from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import TORCH_IGNORE_SSL_KEY
from sparkdist._core.run.result import RunResult
from sparkdist._engine.launch import Launch
from sparkdist._engine.replica_groups import GroupedLaunch
from sparkdist._wire.payload import Job

#: A started run of either kind.
StartedRun = Launch | GroupedLaunch


def start(
    config: LaunchConfig,
    job: Job,
    *,
    session: Any | None = None,
    ignore_ssl_key: str = TORCH_IGNORE_SSL_KEY,
    dataframe: Any | None = None,
) -> StartedRun:
    """Start ``job`` as ``config`` says and return its handle at once (everything that can be
    refused is refused first, on this thread)."""
    if config.replica_groups > 1:
        return GroupedLaunch(
            config, job, session=session, ignore_ssl_key=ignore_ssl_key, dataframe=dataframe
        )
    return Launch(config, job, session=session, ignore_ssl_key=ignore_ssl_key, dataframe=dataframe)


def launch(
    config: LaunchConfig,
    job: Job,
    *,
    session: Any | None = None,
    ignore_ssl_key: str = TORCH_IGNORE_SSL_KEY,
    dataframe: Any | None = None,
) -> RunResult:
    """Run ``job`` on ``config.num_processes`` ranks and return every rank's value.

    Raises:
        ConfigError, ClusterError: before anything starts.
        WorkerFailedError: a rank failed (every other rank has been stopped).
        RendezvousError: a rank did not join within ``config.start_timeout_s``.
        RunTimeoutError: the run took longer than ``config.timeout_s``.
        KeyboardInterrupt, or any exception raised into the waiting thread: unchanged, after
            every rank and everything it started was stopped (and the Spark job cancelled).
    """
    run = start(config, job, session=session, ignore_ssl_key=ignore_ssl_key, dataframe=dataframe)
    return run.wait()
