"""The driver side of one run: validate, place, open the channel, submit, hand back a handle.

``start`` is the single engine behind every front door (``Distributor``, ``TorchDistributor``,
the decorator, the CLI): it does everything that can fail before a process starts, on the
caller's thread, so bad input raises at once and nothing is launched. It then returns a
``Launch`` whose supervisor thread watches the run (``_supervisor``). ``launch`` is the blocking
form (``Launch.wait``): whatever interrupts the waiting thread (Ctrl-C, a test timeout's
exception raised from a signal handler, anything else) first stops every rank and everything
the ranks started, then propagates unchanged.

Local mode runs the agent on a thread of this process; Spark mode submits one barrier stage
whose tasks run the same agent.

Non-goals: argument parsing of the public classes (``distributor``), Spark details (``_spark``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from sparkdist._backends import spark_driver as _spark
from sparkdist._backends.job_file import JobFile, job_file_name
from sparkdist._core.config import LaunchConfig, Mode
from sparkdist._core.env import CHECKPOINT_DIR_VAR
from sparkdist._core.errors import ClusterError, ConfigError, RankFailure, WorkerFailedError
from sparkdist._core.placement import (
    TORCH_IGNORE_SSL_KEY,
    Placement,
    check_cluster_conf,
    place_local,
    place_on_cluster,
)
from sparkdist._core.result import RunResult
from sparkdist._core.versions import check_local, expected_requirements
from sparkdist._engine.supervisor import (
    ABORT_GRACE_S,
    RunMonitor,
    Submission,
    request_cancel,
    result_of,
    supervise,
)
from sparkdist._node.agent import AgentSpec
from sparkdist._node.gpus import gpu_type_mismatch, gpus_at, visible_gpus
from sparkdist._shipping.code import ModuleRecorder, pack_local_code
from sparkdist._tracking.tracker import RunTracker
from sparkdist._wire.captures import check_job_size
from sparkdist._wire.channel import ChannelServer, new_secret
from sparkdist._wire.payload import Job, dumps_job

logger = logging.getLogger("sparkdist")

#: ``off`` makes barrier tasks rendezvous through Spark's allGather instead of this process's
#: control channel (for executors that cannot reach it); output then arrives at the end.
CONTROL_CHANNEL_VAR = "SPARKDIST_CONTROL_CHANNEL"


class Launch:
    """A started run: wait for it, poll it, or cancel it (which stops every rank)."""

    def __init__(
        self,
        config: LaunchConfig,
        job: Job,
        *,
        session: Any | None = None,
        ignore_ssl_key: str = TORCH_IGNORE_SSL_KEY,
        dataframe: Any | None = None,
    ) -> None:
        if dataframe is not None:
            if config.local_mode:
                raise ConfigError(
                    "a Spark DataFrame input is read by the barrier stage on the executors; "
                    "pass local_mode=False (local mode runs no Spark job), or collect small "
                    "data yourself and pass it as an argument"
                )
            session = session if session is not None else dataframe.sparkSession
        self._dataframe = dataframe
        recorder = ModuleRecorder()
        job_bytes = dumps_job(job, on_object=recorder)
        large = check_job_size(
            job,
            len(job_bytes),
            config.job_size_warn_mb,
            config.job_size_limit_mb,
            local_mode=config.local_mode,
        )
        requirements = expected_requirements(
            config.mode.value, config.requirements, pinned_only=config.local_mode
        )
        # Local ranks already import from the driver's own directories (_local_python_path).
        code_zip = pack_local_code(
            recorder.names,
            visible_dirs=(
                _local_python_path().get("PYTHONPATH", "").split(os.pathsep)
                if config.local_mode
                else ()
            ),
        )
        self.run_id = uuid.uuid4().hex[:12]
        self.config = config
        self._job_file: JobFile | None = None
        ship_as_file = large and not config.local_mode
        if config.local_mode:
            session = session if session is not None else _spark.active_session()
            _check_local_packages(config)
            self.placement = place_local(config, _driver_gpus(config, session))
            _check_local_gpu_type(config, self.placement)
            check_local(requirements)  # the ranks run this interpreter: only pins can differ
            requirements = ()
            driver_host = "127.0.0.1"
            extra_env = {**_local_python_path(), **config.env}
        else:
            session = session if session is not None else _spark.get_or_create_session()
            conf = _spark.spark_conf(session)
            for warning in check_cluster_conf(conf, ignore_ssl_key):
                _warn_once(warning)
            self.placement = place_on_cluster(config, conf)
            _spark.wait_for_barrier_slots(session, self.placement.num_tasks, config.start_timeout_s)
            driver_host = _spark.driver_host(session)
            extra_env = dict(config.env)
        placement = self.placement
        settings = ", ".join(f"{k}={v}" for k, v in config.mode_settings().items())
        logger.info(
            "sparkdist: run %s: %s on %d process(es) (%s), %s, %d task(s)",
            self.run_id,
            job.name,
            placement.world_size,
            settings,
            "GPU" if placement.use_gpu else "CPU (gloo)",
            placement.num_tasks,
        )
        if config.checkpoint_dir is not None:
            os.makedirs(config.checkpoint_dir, exist_ok=True)
            extra_env[CHECKPOINT_DIR_VAR] = config.checkpoint_dir
        self._session = session
        self._driver_host = driver_host
        self._template = AgentSpec(
            run_id=self.run_id,
            job_bytes=b"" if ship_as_file else job_bytes,
            node_rank=0,
            num_nodes=placement.num_tasks,
            processes_per_node=placement.processes_per_task,
            master_addr=driver_host,
            host=driver_host,
            channel_address=(driver_host, 0),
            secret="",
            gpu_addresses=",".join(placement.driver_gpus) if placement.use_gpu else None,
            mode=config.mode.value,
            start_timeout_s=config.start_timeout_s,
            extra_env=extra_env,
            max_restarts=config.max_restarts,
            gpu_type=config.gpu_type,
            deepspeed_config_json=(
                json.dumps(dict(config.deepspeed_config))
                if config.deepspeed_config is not None
                else None
            ),
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            requirements=requirements,
            code_zip=code_zip,
            job_file=job_file_name(self.run_id) if ship_as_file else None,
        )
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._cancel_reason: str | None = None
        self._lock = threading.Lock()
        self._attempt: _Attempt | None = None
        supervisor = threading.Thread(
            target=self._supervise, name=f"sparkdist-supervisor-{self.run_id}", daemon=True
        )
        # MLflow set-up starts here, on its own thread, and overlaps the workers' start-up.
        self._tracker = RunTracker(config, placement, self.run_id)
        try:
            if ship_as_file:
                self._job_file = JobFile(session, job_bytes, self.run_id)
            self._start_attempt(0)
            supervisor.start()
        except BaseException as exc:
            if self._attempt is None:  # nothing started
                self._release_job_file()
                self._tracker.close(None, exc)
                raise
            # Interrupted after the agents started: the supervisor stops them and cleans up.
            if supervisor.ident is None:
                supervisor.start()
            self.cancel(_interruption(exc))
            raise

    def _start_attempt(self, restart_count: int) -> None:
        """Open a fresh channel (new secret) and submit the agents for one attempt; it becomes
        ``self._attempt`` as soon as they are submitted (so a cancel can reach them)."""
        placement = self.placement
        monitor = RunMonitor(placement.world_size, placement.num_tasks)
        self._tracker.attach(monitor)  # before any agent can ask for the rendezvous
        secret = new_secret()
        server = ChannelServer(self._driver_host, secret, monitor.on_message, monitor.on_disconnect)
        monitor.server = server
        template = dataclasses.replace(
            self._template,
            channel_address=(self._driver_host, self._channel_port(server)),
            secret=secret,
            restart_count=restart_count,
        )
        try:
            self._attempt = _Attempt(
                monitor,
                server,
                Submission(
                    self._session,
                    template,
                    placement,
                    self.config.local_mode,
                    monitor,
                    self._dataframe,
                ),
            )
        except BaseException:
            server.close()
            raise

    def _channel_port(self, server: ChannelServer) -> int:
        """The channel's port for the agents; 0 tells them to run detached (Spark mode only)
        when ``SPARKDIST_CONTROL_CHANNEL=off`` says executors cannot reach this process."""
        off = os.environ.get(CONTROL_CHANNEL_VAR, "").strip().lower() in ("0", "off", "false")
        return 0 if off and not self.config.local_mode else server.port

    def _supervise(self) -> None:
        earlier: list[RankFailure] = []
        try:
            while True:
                attempt = self._attempt
                assert attempt is not None
                try:
                    outcomes = supervise(self.config, attempt.submission, attempt.monitor)
                    self._result = result_of(
                        outcomes, attempt.monitor, self.run_id, self.config, self.placement
                    )
                    return
                except WorkerFailedError as failed:
                    if len(earlier) >= self.config.max_restarts:
                        if earlier:
                            raise WorkerFailedError(
                                failed.failures, failed.root_cause, tuple(earlier)
                            ) from failed.__cause__
                        raise
                    earlier.append(failed.root_cause)
                finally:
                    attempt.close()
                logger.warning(
                    "sparkdist: run %s attempt %d failed (%s); restarting the whole world "
                    "(restart %d of %d)",
                    self.run_id,
                    len(earlier) - 1,
                    earlier[-1].summary(),
                    len(earlier),
                    self.config.max_restarts,
                )
                with self._lock:
                    if self._cancel_reason is not None:
                        raise concurrent.futures.CancelledError(self._cancel_reason)
                    self._start_attempt(len(earlier))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        finally:
            self._release_job_file()
            self._result = self._tracker.close(self._result, self._error)
            self._done.set()

    def _release_job_file(self) -> None:
        """A large job's file is needed until the last attempt ends (restarts reuse it)."""
        if self._job_file is not None:
            self._job_file.remove()
            self._job_file = None

    def done(self) -> bool:
        """True once the run ended (every rank has exited)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RunResult:
        """Wait for the run and return its RunResult, or raise its error.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the run goes on).
            concurrent.futures.CancelledError: the run was cancelled.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"run {self.run_id} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def wait(self) -> RunResult:
        """Wait for the run and return its RunResult, or raise its error.

        Anything raised into the waiting thread (KeyboardInterrupt, a test timeout's exception
        from a signal handler) first cancels the run, which returns once every rank and every
        process the ranks started is gone, and then propagates unchanged.
        """
        with self.cancel_on_exception():
            self._done.wait()
        return self.result(0)

    @contextlib.contextmanager
    def cancel_on_exception(self) -> Iterator[None]:
        """Cancel the run when the block raises anything, then let the exception go on
        unchanged: for the caller's own code between starting a run and waiting for it."""
        try:
            yield
        except BaseException as exc:
            self.cancel(_interruption(exc))
            raise

    def cancel(self, reason: str = "the run was cancelled") -> bool:
        """Stop every rank and wait until they are gone; False if the run had already ended.

        In local mode the ranks, and everything they started, are ended on this thread, so
        this returns within about two seconds; in Spark mode the agents end them on the
        executors, and this waits for them (``ABORT_GRACE_S`` at most).
        """
        with self._lock:
            if self._done.is_set():
                return False
            self._cancel_reason = reason
            attempt = self._attempt
        if attempt is not None:
            request_cancel(attempt.monitor, reason, attempt.submission)
        # The supervisor closes the attempt (and the MLflow run) once its agents returned.
        self._done.wait(ABORT_GRACE_S)
        return True


class _Attempt:
    """One try of the whole world: its channel, its driver-side view, its agents."""

    def __init__(self, monitor: RunMonitor, server: ChannelServer, submission: Submission):
        self.monitor = monitor
        self.server = server
        self.submission = submission

    def close(self) -> None:
        self.server.close()
        if self.monitor.dropped:
            logger.warning(
                "sparkdist: %d output line(s) of the ranks were dropped because the driver "
                "fell behind",
                self.monitor.dropped,
            )


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
    run = Launch(config, job, session=session, ignore_ssl_key=ignore_ssl_key, dataframe=dataframe)
    return run.wait()


def _interruption(exc: BaseException) -> str:
    """Why a run is cancelled when ``exc`` interrupted the thread waiting for it."""
    if isinstance(exc, KeyboardInterrupt):
        return "the driver was interrupted (Ctrl-C)"
    text = str(exc).strip().splitlines()
    detail = f": {text[0][:200]}" if text else ""
    return f"the driver's waiting thread was interrupted by {type(exc).__name__}{detail}"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Cluster-wide concerns are said once per driver process, not on every run."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("sparkdist: %s", message)


def _driver_gpus(config: LaunchConfig, session: Any | None) -> list[str]:
    if config.use_gpu is False:
        return []
    from_spark = _spark.driver_gpu_addresses(session)
    if from_spark is not None:
        return from_spark
    return [gpu.address for gpu in visible_gpus()]


def _check_local_packages(config: LaunchConfig) -> None:
    """Local ranks use the driver's interpreter: refuse a mode whose package is missing."""
    if config.mode is Mode.DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "mode='deepspeed' needs the deepspeed package, which this Python does not have; "
            "pip install deepspeed (or pass mode='ddp')"
        )


def _check_local_gpu_type(config: LaunchConfig, placement: Placement) -> None:
    if config.gpu_type is None:
        return
    gpus = gpus_at(list(placement.driver_gpus)) if placement.use_gpu else []
    problem = gpu_type_mismatch(config.gpu_type, gpus, "the driver")
    if problem is not None:
        raise ClusterError(problem)


def _local_python_path() -> dict[str, str]:
    """Let local ranks import what the driver imports (modules next to a notebook, say)."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    entries = []
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if os.path.isdir(path) and not any(path.startswith(p + os.sep) for p in prefixes):
            entries.append(path)
    inherited = os.environ.get("PYTHONPATH")
    if inherited:
        entries.append(inherited)
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(entries))} if entries else {}
