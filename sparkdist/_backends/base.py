"""What every backend does: the one small protocol between the engine and a way of running.

A backend answers, for one launch: where the ranks go (``place``: it reads the cluster and
refuses what cannot run), what the nodes must have and get (``requirements``, ``rank_env``,
``visible_code_dirs``), how the job and the channel reach them (``ships_large_jobs``,
``detached``) and how the agents of one attempt start and stop (``start``, returning the
``RunningAgents``). Events stream back through the control channel, the same for every
backend. The engine never asks which backend it has.

Non-goals: supervising a run (``_engine``), the barrier task itself (``stage``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import Placement
from sparkdist._core.launch.plan import BackendKind
from sparkdist._core.versions import Requirement
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._wire.payload import Outcome

logger = logging.getLogger("sparkdist")


class RunningAgents:
    """The agents of one attempt, running on a thread of the driver until they all ended.

    Args:
        work: runs the agents and returns every rank's Outcome (a local agent, or a Spark
            stage's collect).
        on_done: called (on that thread) once ``work`` returned or raised.
        stop: ends every rank now from the calling thread, returning once they are gone, or
            None where only the control channel's abort (and ``cancel``) can reach them.
        cancel: tears the agents' side down (cancels the Spark stage), or None.
        goodbye_before_cancel: after an abort, wait for the agents' goodbyes before
            ``cancel`` (a Spark task cancelled first may be killed half-way through its
            clean-up).
        in_process: the agent runs on a thread of this process (local mode): when it raised,
            no goodbye is coming, and its failure is no Spark stage's.
    """

    def __init__(
        self,
        name: str,
        work: Callable[[], list[Outcome]],
        on_done: Callable[[], None],
        *,
        stop: Callable[[str], None] | None = None,
        cancel: Callable[[], None] | None = None,
        goodbye_before_cancel: bool = False,
        in_process: bool = False,
    ) -> None:
        self.outcomes: list[Outcome] | None = None
        self.error: BaseException | None = None
        self.done = False
        self.goodbye_before_cancel = goodbye_before_cancel
        self.in_process = in_process
        self._stop = stop
        self._cancel = cancel
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], list[Outcome]]) -> None:
        try:
            self.outcomes = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the supervising thread
            self.error = exc
        finally:
            self.done = True
            self._on_done()

    def stop_now(self, reason: str) -> None:
        """End every rank from this thread where the backend can (local processes)."""
        if self._stop is not None:
            self._stop(reason)

    def cancel(self, reason: str = "the run was cancelled") -> None:
        """End the agents' side: ranks stopped here where possible, the stage cancelled."""
        self.stop_now(reason)
        if self._cancel is not None:
            try:
                self._cancel()
            except Exception:
                logger.debug("sparkdist: cancelling the agents failed", exc_info=True)


class Backend(Protocol):
    """One way of running the agents (local processes, a Spark or Spark Connect stage)."""

    kind: BackendKind
    #: The session the run uses (None: local mode without one).
    session: Any | None
    #: Where the agents reach the driver's control channel.
    driver_host: str
    #: Whether a large job travels as a file (Spark) rather than in each agent's spec.
    ships_large_jobs: bool
    #: Whether the agents run without the control channel (they rendezvous through Spark).
    detached: bool

    def place(self, config: LaunchConfig) -> Placement:
        """Read the cluster and cut the world into nodes; refuse what cannot run."""
        ...

    def place_again(self, config: LaunchConfig, lost_nodes: Collection[int]) -> Placement:
        """The placement of a restart: the whole world again, or, for an elastic run
        (``min_processes``), as many ranks as the capacity left holds, the slots of the
        executors of the nodes the last attempt lost left out; waits for at least
        ``min_processes`` up to ``start_timeout_s``."""
        ...

    def requirements(
        self, config: LaunchConfig, wanted: Sequence[Requirement]
    ) -> tuple[Requirement, ...]:
        """What every node must check before it starts a rank (checked here when the ranks
        run this very interpreter)."""
        ...

    def rank_env(self, config: LaunchConfig) -> dict[str, str]:
        """The environment every rank gets from the backend, the user's ``env`` on top."""
        ...

    def visible_code_dirs(self) -> Sequence[str]:
        """Directories the ranks already import from (their code is not shipped)."""
        ...

    def start(
        self,
        template: AgentSpec,
        placement: Placement,
        on_done: Callable[[], None],
        on_decommission: Callable[[str], None],
    ) -> RunningAgents:
        """Start the agents of one attempt; ``on_decommission(host)`` is called when the
        cluster says it is taking a host back (Spark's decommissioning), where it can say."""
        ...

    def world_that_fits(self, config: LaunchConfig) -> int | None:
        """The world (ranks, up to ``config.num_processes``) the cluster's slots hold now, for
        an elastic run that could grow; None where the backend cannot say (one machine,
        Connect), and 0 where not even ``min_processes`` fits."""
        ...

    def give_up_nodes(self, nodes: set[int]) -> None:
        """Keep the next attempt off the executors that ran ``nodes`` of the attempt that just
        ended (those executors only: a later one on the same host is new capacity). A no-op
        where the backend cannot (one machine, Spark Connect)."""
        ...
