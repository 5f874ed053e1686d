"""The driver side of one world (a run, or one replica group of it): validate, place, open
the channel, submit, supervise its attempts, hand back a handle.

``Launch`` does everything that can fail before a process starts on the caller's thread, so
bad input raises at once and nothing is launched; its supervisor thread then watches the run.
``wait`` blocks: whatever interrupts the waiting thread (Ctrl-C, a test timeout's exception
raised from a signal handler) first stops every rank and everything the ranks started, then
propagates unchanged. Local mode runs the agent on a thread of this process; Spark mode
submits one barrier stage whose tasks run the same agent.

Non-goals: choosing the kind of run (``start``), argument parsing (``distributor``), Spark.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from signal import SIGTERM, Signals
from typing import Any

from sparkdist._backends.base import RunningAgents
from sparkdist._backends.job_file import JobFile, sweep_job_leftovers
from sparkdist._checkpoint.layout import newest_step
from sparkdist._core.errors import Attempt, WorkerFailedError
from sparkdist._core.files import make_private_dirs
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import TORCH_IGNORE_SSL_KEY, Placement
from sparkdist._core.launch.replica_groups import ReplicaGroup
from sparkdist._core.object_store import encode_options, scheme_of
from sparkdist._core.run.attempts import (
    attempt_of,
    failed_attempts,
    final_error,
    nodes_to_give_up,
    preemption_error,
)
from sparkdist._core.run.result import RunResult
from sparkdist._core.run.run_state import Deadlines
from sparkdist._engine.ending import Ending, interruption
from sparkdist._engine.growth_watch import start_growth_watch
from sparkdist._engine.prepare import prepare
from sparkdist._engine.rank_lines import warn_lines_dropped
from sparkdist._engine.supervisor import (
    ABORT_GRACE_S,
    RunMonitor,
    request_cancel,
    result_of,
    supervise,
)
from sparkdist._node.host.signal_notice import notices_during
from sparkdist._tracking.mlflow_run import MlflowRun
from sparkdist._tracking.tracker import RunTracker
from sparkdist._wire.channel.server import ChannelServer, new_secret
from sparkdist._wire.payload import Job

logger = logging.getLogger("sparkdist")


class Launch(Ending):
    """A started run: wait for it, poll it, or cancel it (which stops every rank)."""

    def __init__(
        self,
        config: LaunchConfig,
        job: Job,
        *,
        session: Any | None = None,
        ignore_ssl_key: str = TORCH_IGNORE_SSL_KEY,
        dataframe: Any | None = None,
        replica_group: ReplicaGroup | None = None,
        mlflow_parent: MlflowRun | None = None,
    ) -> None:
        """``replica_group``: the group of a replica-group run this launch is (its torchft
        variables go to every rank); ``mlflow_parent``: that run's MLflow run."""
        super().__init__()
        prepared = prepare(
            config,
            job,
            session=session,
            ignore_ssl_key=ignore_ssl_key,
            dataframe=dataframe,
            extra_env=replica_group.env() if replica_group is not None else {},
        )
        self.replica_group = replica_group
        self.run_id = prepared.run_id
        self.config = config
        self.plan = prepared.plan
        self.placement = prepared.plan.placement
        self._backend = prepared.backend
        self._dataframe = dataframe
        self._template = prepared.template
        self._job_file: JobFile | None = None
        placement = self.placement
        settings = ", ".join(f"{k}={v}" for k, v in config.mode_settings().items())
        logger.info(
            "sparkdist: run %s%s: %s on %d process(es) (%s), %s, %d task(s)",
            self.run_id,
            f" ({replica_group.name})" if replica_group is not None else "",
            job.name,
            placement.world_size,
            settings,
            "GPU" if placement.use_gpu else "CPU (gloo)",
            placement.num_tasks,
        )
        if config.checkpoint_dir is not None and scheme_of(config.checkpoint_dir) is None:
            make_private_dirs(config.checkpoint_dir)  # a store's prefix needs no making
        self._cancel_reason: str | None = None
        self._no_restart: str | None = None  # set by stop_restarting
        self._lock = threading.Lock()
        self._attempt: _Attempt | None = None
        supervisor = threading.Thread(
            target=self._supervise, name=f"sparkdist-supervisor-{self.run_id}", daemon=True
        )
        # MLflow set-up starts here, on its own thread, and overlaps the workers' start-up.
        self._tracker = RunTracker(
            config,
            placement,
            self.run_id,
            mlflow_parent=mlflow_parent,
            mlflow_tags=replica_group.mlflow_tags() if replica_group is not None else None,
        )
        sweep_job_leftovers()  # killed drivers' job files go at any start, whatever its mode
        try:
            if prepared.plan.job_as_file:
                self._job_file = JobFile(self._backend.session, prepared.job_bytes, self.run_id)
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
            self.cancel(interruption(exc))
            raise

    def _start_attempt(self, restart_count: int) -> None:
        """Open a fresh channel (new secret) and start the agents for one attempt; it becomes
        ``self._attempt`` as soon as they are started (so a cancel can reach them).

        A restart is placed again: an elastic run (``min_processes``) goes on with the
        capacity the cluster has left, the executors the last attempt lost left out."""
        placement = self.placement
        previous = self._attempt
        if restart_count and previous is not None:
            placement = self._backend.place_again(self.config, previous.lost_nodes())
        deadlines = Deadlines(
            self.config.start_timeout_s,
            self.config.timeout_s,
            preemption_grace_s=self.config.preemption_grace_s,
        )
        host = self._backend.driver_host
        secret = new_secret()
        monitor = RunMonitor(
            placement.world_size,
            placement.num_tasks,
            deadlines,
            detached=self._backend.detached,
            expects_rows=self._dataframe is not None,
        )
        self._tracker.attach(monitor)  # before any agent can ask for the rendezvous
        server = monitor.open_channel(host, secret, self.config.heartbeat_timeout_s)
        template = dataclasses.replace(
            self._template,
            channel_address=(host, 0 if self._backend.detached else server.port),  # 0: no channel
            secret=secret,
            restart_count=restart_count,
            num_nodes=placement.num_tasks,
            processes_per_node=placement.processes_per_task,
        )

        def wake() -> None:
            with monitor.changed:
                monitor.changed.notify_all()

        def decommissioning(host: str) -> None:
            with monitor.changed:  # the nodes' hosts change on the channel's thread
                nodes = sorted(n for n, h in monitor.node_hosts.items() if h == host)
            if nodes:
                monitor.preempt(
                    f"node {nodes[0]} (host {host}): Spark is decommissioning its executor"
                )

        try:
            started_from = self._checkpoint_step()
            agents = self._backend.start(template, placement, wake, decommissioning)
            self._attempt = _Attempt(monitor, server, agents, placement, started_from)
        except BaseException:
            server.close()
            raise
        if self.config.grows and placement.world_size < self.config.num_processes:
            start_growth_watch(self.config, self._backend, self._attempt, self.run_id)

    def _supervise(self) -> None:
        history: list[Attempt] = []
        try:
            while True:
                attempt = self._attempt
                assert attempt is not None
                state = attempt.monitor.state
                try:
                    outcomes = supervise(self.config, attempt.agents, attempt.monitor)
                    done = result_of(  # raises when ranks failed
                        outcomes, attempt.monitor, self.run_id, self.config, attempt.placement
                    )
                    if not state.was_preempted:  # after a drain, what ranks return is no result
                        history.append(self._tagged(attempt_of(state, len(history))))
                        self._result = dataclasses.replace(done, attempts=history)
                        return
                except WorkerFailedError as failed:
                    if not state.was_preempted:
                        attempt_failed = attempt_of(state, len(history), failed.root_cause)
                        history.append(self._tagged(attempt_failed))
                        final = final_error(
                            history,
                            failed,
                            self.config.max_restarts,
                            replica_group=self.replica_group is not None,
                            no_restart=self._no_restart,
                        )
                        if final is not None:
                            raise final from failed.__cause__
                except Exception:
                    if not state.was_preempted:  # else: a stage lost with a preempted executor
                        raise
                finally:
                    attempt.close()
                if (grown := attempt_of(state, len(history), grow=attempt.grow_notice)).grew:
                    history.append(self._tagged(grown))
                    restart = "restarting at the larger world (not counted in max_restarts)"
                elif state.was_preempted:  # restarted without using max_restarts
                    progressed = self._checkpoint_step() not in (None, attempt.started_from)
                    drained = attempt_of(state, len(history))
                    history.append(
                        self._tagged(dataclasses.replace(drained, progressed=progressed))
                    )
                    if (too_many := preemption_error(history)) is not None:
                        raise too_many
                    restart = "restarting from its last checkpoint (not counted in max_restarts)"
                else:
                    used = failed_attempts(history)
                    restart = f"restarting (restart {used} of {self.config.max_restarts})"
                if state.was_preempted and self._cancel_reason is not None:  # driver's SIGTERM
                    raise concurrent.futures.CancelledError(self._cancel_reason)
                logger.warning(
                    "sparkdist: run %s %s; %s", self.run_id, history[-1].summary(), restart
                )  # a replica group's attempt names its group (Attempt.summary)
                if give_up := nodes_to_give_up(history, state.node_hosts, set(state.lost)):
                    self._backend.give_up_nodes(give_up)
                with self._lock:
                    if self._cancel_reason is not None:
                        raise concurrent.futures.CancelledError(self._cancel_reason)
                    self._start_attempt(len(history))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        finally:
            self._release_job_file()
            self._result = self._tracker.close(self._result, self._error)
            self._done.set()

    def stop_restarting(self, reason: str) -> None:
        """From now on a failed attempt ends the run (with ``reason``), whatever the budget:
        a replica group whose peers finished would train alone."""
        self._no_restart = reason

    def _tagged(self, attempt: Attempt) -> Attempt:
        """``attempt``, named by its replica group in a replica-group run."""
        if self.replica_group is None:
            return attempt
        return dataclasses.replace(attempt, replica_group=self.replica_group.index)

    def _checkpoint_step(self) -> int | None:
        """The run's newest committed checkpoint step, where the driver can see it."""
        directory = self.config.checkpoint_dir
        if directory is None:
            return None
        return newest_step(directory, encode_options(self.config.storage_options))

    def _release_job_file(self) -> None:
        """A large job's file is needed until the last attempt ends (restarts reuse it)."""
        if self._job_file is not None:
            self._job_file.remove()
            self._job_file = None

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run, as soon as MLflow made it (None before, and with tracking off)."""
        return self._tracker.mlflow_run_id

    def wait(self) -> RunResult:
        """Wait for the run and return its RunResult, or raise its error.

        Anything raised into the waiting thread (KeyboardInterrupt, a test timeout's exception
        from a signal handler) first cancels the run, which returns once every rank and every
        process the ranks started is gone, and then propagates unchanged.

        On the main thread, SIGTERM meanwhile is a preemption notice for the whole run: every
        rank is told to save and return (``runtime.should_stop()``), those still running after
        ``preemption_grace_s`` are stopped, nothing restarts; then the previous SIGTERM
        disposition is put back and the signal delivered again (the process ends with it, or
        the caller's own handler runs; else this raises ``CancelledError``).
        """
        with (
            self.cancel_on_exception(),
            notices_during((SIGTERM,), self.drain_for_signal, "sparkdist-drain"),
        ):
            self._done.wait()
        return self.result(0)

    def drain_for_signal(self, signum: int) -> None:
        """SIGTERM to the driver while it waits on its main thread (``wait``): drain every
        rank, restart nothing; ``wait`` then delivers the signal again, to end the process as
        its sender meant (or run the handler the caller had)."""
        why = f"the driver got {Signals(signum).name}"
        with self._lock:
            if self._done.is_set() or self._cancel_reason is not None:
                return
            self._cancel_reason = f"{why}: every rank was told to save and return; no restart"
            attempt = self._attempt
        if attempt is not None:
            attempt.monitor.preempt(why)

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
            request_cancel(attempt.monitor, reason, attempt.agents)
        # The supervisor closes the attempt (and the MLflow run) once its agents returned.
        self._done.wait(ABORT_GRACE_S)
        return True


class _Attempt:
    """One try of the whole world: its channel, its driver-side view, its agents."""

    def __init__(
        self,
        monitor: RunMonitor,
        server: ChannelServer,
        agents: RunningAgents,
        placement: Placement,
        started_from: int | None,
    ) -> None:
        self.monitor = monitor
        self.server = server
        self.agents = agents
        self.placement = placement  # a restart of an elastic run may have fewer ranks
        self.started_from = started_from  # the newest checkpoint's step when it started
        self.ended = threading.Event()  # set by close(): the growth watch stops
        self.grow_notice: str | None = None  # the drain's why, when it drained to grow

    def lost_nodes(self) -> set[int]:
        """The nodes this attempt lost contact with (killed or cut off)."""
        return set(self.monitor.state.lost)

    def drain(self, why: str) -> None:  # every rank, as for a preemption notice of ``why``
        self.monitor.preempt(why)

    def close(self) -> None:
        self.ended.set()
        self.server.close()
        if self.monitor.dropped:
            warn_lines_dropped(self.monitor.dropped)
