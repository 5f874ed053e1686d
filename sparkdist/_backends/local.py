"""Local mode: one agent on a thread of the driver, its ranks processes of this machine.

The ranks run this interpreter, so versions are checked here (only pins can differ), GPUs are
the driver's, and the ranks import from the driver's own directories.

Non-goals: anything Spark (a session is only read, for the driver's GPU conf, if one exists).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

from sparkdist._backends import spark_driver
from sparkdist._backends.base import RunningAgents
from sparkdist._core.errors import ClusterError, ConfigError
from sparkdist._core.launch.config import LaunchConfig, Mode
from sparkdist._core.launch.placement import Placement, place_local
from sparkdist._core.launch.plan import BackendKind
from sparkdist._core.versions import Requirement, check_local
from sparkdist._node.agent.agent import Agent
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._node.host.gpus import gpu_type_mismatch, gpus_at, visible_gpus
from sparkdist._shipping.origin import is_installed_path

LOOPBACK = "127.0.0.1"


class LocalBackend:
    """Ranks as processes of this machine, watched by an agent on a driver thread."""

    kind = BackendKind.LOCAL
    driver_host = LOOPBACK
    ships_large_jobs = False
    detached = False

    def __init__(self, session: Any | None = None) -> None:
        self.session = session if session is not None else spark_driver.active_session()
        self._python_path = local_python_path()  # read once per launch: it walks sys.path

    def place(self, config: LaunchConfig) -> Placement:
        if config.mode is Mode.DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                "mode='deepspeed' needs the deepspeed package, which this Python does not "
                "have; pip install deepspeed (or pass mode='ddp')"
            )
        placement = place_local(config, self._driver_gpus(config))
        if config.gpu_type is not None:
            gpus = gpus_at(list(placement.driver_gpus)) if placement.use_gpu else []
            problem = gpu_type_mismatch(config.gpu_type, gpus, "the driver")
            if problem is not None:
                raise ClusterError(problem)
        return placement

    def place_again(self, config: LaunchConfig, lost_nodes: Collection[int]) -> Placement:
        """One machine loses no capacity to a failed attempt: the same world again."""
        return self.place(config)

    def _driver_gpus(self, config: LaunchConfig) -> list[str]:
        if config.use_gpu is False:
            return []
        from_spark = spark_driver.driver_gpu_addresses(self.session)
        if from_spark is not None:
            return from_spark
        return [gpu.address for gpu in visible_gpus()]

    def requirements(
        self, config: LaunchConfig, wanted: Sequence[Requirement]
    ) -> tuple[Requirement, ...]:
        check_local(wanted)  # the ranks run this interpreter: only pins can differ
        return ()

    def rank_env(self, config: LaunchConfig) -> dict[str, str]:
        return dict(self._python_path)

    def visible_code_dirs(self) -> Sequence[str]:
        return self._python_path.get("PYTHONPATH", "").split(os.pathsep)

    def start(
        self,
        template: AgentSpec,
        placement: Placement,
        on_done: Callable[[], None],
        on_decommission: Callable[[str], None],
    ) -> RunningAgents:
        """One agent on a driver thread; nothing decommissions the driver's own machine."""
        agent = Agent(template)
        return RunningAgents(
            f"sparkdist-run-{template.run_id}",
            agent.run,
            on_done,
            stop=agent.stop,
            in_process=True,
        )

    def world_that_fits(self, config: LaunchConfig) -> int | None:
        """One machine: its capacity does not come and go."""
        return None

    def give_up_nodes(self, nodes: set[int]) -> None:
        """One machine: there is nowhere else to go."""


def local_python_path() -> dict[str, str]:
    """Let local ranks import what the driver imports (modules next to a notebook, say).

    The driver's empty entry (an interactive session's working directory) becomes that
    directory's absolute path; installed locations are on the ranks' path anyway.
    """
    entries = []
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if os.path.isdir(path) and not is_installed_path(path):
            entries.append(path)
    inherited = os.environ.get("PYTHONPATH")
    if inherited:
        entries.append(inherited)
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(entries))} if entries else {}
