"""A replica-group run (torchft): R groups side by side, one Lighthouse, no world restart.

``GroupedLaunch`` starts the run's Lighthouse on the driver, then one ``Launch`` per group: each
its own barrier stage (local mode: its own processes) with its own store, channel, secret and
restarts, its ranks numbered inside the group as torchft expects, and torchft's variables set
(``_core.launch.replica_groups.ReplicaGroup``). A group that loses a host or a rank fails and is
relaunched by its own ``Launch`` (``max_restarts`` per group), on the capacity there is, while
the other groups go on; the relaunched group joins the next quorum and heals from a live peer.
A group whose relaunches were all spent on host faults (ranks that died with no exception of
the user's) is lost for good: the others go on while ``min_replica_groups`` are left, and the
run fails naming the lost groups and their hosts once fewer are (``too_few_groups``). A group
that ends with any other error (an exception of the training code, the same one twice, a start
that cannot work, a timeout) ends the run: every other group is stopped and its error is raised,
naming the group. The run's result is the finished groups', merged (``merged_result``).

MLflow: the whole run has a run of its own (created, or the caller's active one) that ends with
the run's outcome and names the groups lost for good; each group's run is nested under it.

It offers what ``Launch`` offers (``wait``, ``result``, ``done``, ``cancel``...), so every front
door takes either (``_engine.start``).

Non-goals: the rank side of torchft (the user's ``Manager``; ``runtime.torchft_manager_kwargs``),
one group's attempts (``_engine.launch``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import uuid
from signal import SIGTERM
from typing import Any

from sparkdist._backends.choose import select_backend
from sparkdist._core.errors import ConfigError, WorkerFailedError
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import TORCH_IGNORE_SSL_KEY, Placement
from sparkdist._core.launch.replica_groups import (
    ReplicaGroup,
    group_checkpoint_dir,
    lost_for_good,
    merged_result,
    too_few_groups,
)
from sparkdist._core.run.result import RunResult
from sparkdist._engine.ending import Ending, interruption
from sparkdist._engine.launch import Launch
from sparkdist._engine.lighthouse import (
    QUIET_RUST_LOG,
    RUST_LOG_VAR,
    Lighthouse,
    check_torchft,
)
from sparkdist._engine.supervisor import ABORT_GRACE_S
from sparkdist._node.host.signal_notice import notices_during
from sparkdist._tracking.mlflow_run import MlflowRun
from sparkdist._tracking.progress import ProgressDisplay
from sparkdist._tracking.tracker import tracking_wanted
from sparkdist._wire.payload import Job

logger = logging.getLogger("sparkdist")

#: How often the watcher looks at the groups (a group's end is seen within this).
_POLL_S = 0.1
#: Why a group is not relaunched once another has finished: torchft's groups take their last
#: step together, so a relaunch after that would find no peer to heal from and train alone.
_PEERS_FINISHED = "another replica group finished the training: a relaunch would train alone"


def group_config(config: LaunchConfig, index: int) -> LaunchConfig:
    """Group ``index``'s own config: its share of the ranks, its own checkpoint directory, and
    torchft's servers quiet unless the user set ``RUST_LOG``."""
    env = dict(config.env)
    if RUST_LOG_VAR not in env and RUST_LOG_VAR not in os.environ:
        env[RUST_LOG_VAR] = QUIET_RUST_LOG
    return dataclasses.replace(
        config,
        env=env,
        num_processes=config.num_processes // config.replica_groups,
        replica_groups=1,
        min_replica_groups=1,
        checkpoint_dir=(
            group_checkpoint_dir(config.checkpoint_dir, index)
            if config.checkpoint_dir is not None
            else None
        ),
    )


class GroupedLaunch(Ending):
    """A started replica-group run: wait for it, poll it, or cancel it (every group)."""

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
            raise ConfigError(
                f"spark_dataframe with replica_groups={config.replica_groups}: each replica "
                "group trains on its own data, which sparkdist does not split across groups "
                "yet; read the data inside the training function (by runtime's replica group), "
                "or drop replica_groups"
            )
        check_torchft()
        super().__init__()
        self.config = config
        backend = select_backend(config, session, ignore_ssl_key=ignore_ssl_key)
        # The whole run placed once: the cluster must hold every group at once (each group's
        # Launch then places its own share), and the driver's address is known from here on.
        placement = backend.place(config)
        self.run_id = uuid.uuid4().hex[:12]
        self._lighthouse = Lighthouse(backend.driver_host, config.min_replica_groups)
        self._mlflow = (
            MlflowRun(
                config,
                placement,
                self.run_id,
                ProgressDisplay(self.run_id),  # announces where the run is; no bar of its own
                tags={"sparkdist.replica_groups": str(config.replica_groups)},
            )
            if tracking_wanted(config.mlflow)
            else None
        )
        self._groups: list[Launch] = []
        try:
            for index in range(config.replica_groups):
                group = ReplicaGroup(index, config.replica_groups, self._lighthouse.address)
                self._groups.append(
                    Launch(
                        group_config(config, index),
                        job,
                        session=session,
                        ignore_ssl_key=ignore_ssl_key,
                        replica_group=group,
                        mlflow_parent=self._mlflow,
                    )
                )
        except BaseException as exc:
            self._stop_groups(interruption(exc))
            self._lighthouse.close()
            self._close_mlflow(None, exc)
            raise
        first = self._groups[0]
        self.plan = first.plan
        self.placement: Placement = first.placement
        self._cancelled = threading.Event()
        self._cancel_reason = "the run was cancelled"
        threading.Thread(
            target=self._watch, name=f"sparkdist-groups-{self.run_id}", daemon=True
        ).start()

    @property
    def mlflow_run_id(self) -> str | None:
        """The whole run's MLflow run (each group's is nested under it), once it exists."""
        return None if self._mlflow is None else self._mlflow.mlflow_run_id

    def _watch(self) -> None:
        """Wait for every group. A group lost for good to host faults (``lost_for_good``) leaves
        the others going while ``min_replica_groups`` are left; any other error ends the run."""
        lost: dict[int, WorkerFailedError] = {}
        seen: set[int] = set()
        training_done = False
        try:
            while not self._cancelled.is_set():
                for index, group in enumerate(self._groups):
                    if index in seen or not group.done():
                        continue
                    seen.add(index)
                    error = _error_of(group)
                    if error is None:
                        if not training_done:  # a relaunch from now on would train alone
                            training_done = True
                            for other in self._groups:
                                other.stop_restarting(_PEERS_FINISHED)
                        continue
                    if not lost_for_good(error):
                        self._fail(group)
                        return
                    assert isinstance(error, WorkerFailedError)
                    lost[index] = error
                    too_few = too_few_groups(
                        lost, len(self._groups), self.config.min_replica_groups
                    )
                    if too_few is not None and not training_done:
                        self._stop_groups("too few replica groups are left")
                        self._error = too_few
                        return
                    logger.warning(
                        "sparkdist: run %s: replica group %d is lost for good (%s); %s",
                        self.run_id,
                        index,
                        error.root_cause.summary(),
                        _PEERS_FINISHED if training_done else "the other groups go on",
                    )
                if len(seen) == len(self._groups):
                    finished = [g.result(0) for i, g in enumerate(self._groups) if i not in lost]
                    lost_attempts = [a for e in lost.values() for a in e.history]
                    self._result = merged_result(self.run_id, finished, lost_attempts)
                    return
                self._cancelled.wait(_POLL_S)
            self._stop_groups(self._cancel_reason)
            self._error = concurrent.futures.CancelledError(self._cancel_reason)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._stop_groups(interruption(exc))
            self._error = exc
        finally:
            self._lighthouse.close()
            if lost and self._mlflow is not None:
                self._mlflow.set_tags({"sparkdist.lost_replica_groups": ",".join(map(str, lost))})
            self._close_mlflow(self._result, self._error)
            self._done.set()

    def _close_mlflow(self, result: RunResult | None, error: BaseException | None) -> None:
        """End the whole run's MLflow run with the run's outcome (never fails the run)."""
        if self._mlflow is None:
            return
        hosts = result.hosts if result is not None else []
        relaunches = len(result.attempts) - len(self._groups) if result is not None else 0
        try:
            mlflow_run_id = self._mlflow.close(error, hosts, relaunches)
        except Exception:  # tracking never changes a run's outcome
            logger.debug("sparkdist: closing the run's MLflow run failed", exc_info=True)
            return
        if result is not None:
            self._result = dataclasses.replace(result, mlflow_run_id=mlflow_run_id)

    def _fail(self, failed: Launch) -> None:
        group = failed.replica_group
        assert group is not None
        error = _error_of(failed)
        assert error is not None
        logger.error(
            "sparkdist: run %s: %s ended the run; stopping the other groups",
            self.run_id,
            group.name,
        )
        self._stop_groups(f"{group.name} failed")
        if isinstance(error, WorkerFailedError):
            note = f"{group.name} failed, and every other group was stopped"
            error = WorkerFailedError(
                error.failures,
                error.root_cause,
                error.attempts,
                error.history,
                f"{error.note}; {note}" if error.note else note,
            )
        self._error = error

    def _stop_groups(self, reason: str) -> None:
        """Cancel every group still running, side by side (each waits for its own ranks)."""
        stoppers = [
            threading.Thread(target=g.cancel, args=(reason,), daemon=True)
            for g in self._groups
            if not g.done()
        ]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join(ABORT_GRACE_S + _POLL_S)  # each cancel waits for its agents at most that

    def wait(self) -> RunResult:
        """``Launch.wait`` for every group: SIGTERM on the main thread drains every group."""
        with self.cancel_on_exception(), notices_during((SIGTERM,), self._drain, "sparkdist-drain"):
            self._done.wait()
        return self.result(0)

    def _drain(self, signum: int) -> None:
        for group in self._groups:
            group.drain_for_signal(signum)

    def cancel(self, reason: str = "the run was cancelled") -> bool:
        """Stop every rank of every group and wait until they are gone; False if it had
        already ended."""
        if self._done.is_set():
            return False
        self._cancel_reason = reason
        self._cancelled.set()
        self._done.wait(ABORT_GRACE_S + 1.0)  # the groups are cancelled side by side
        return True


def _error_of(group: Launch) -> BaseException | None:
    if not group.done():
        return None
    try:
        group.result(0)
    except BaseException as exc:  # noqa: BLE001 - the group's outcome, looked at
        return exc
    return None
