"""The files an agent and its ranks share in the node's run directory, and the signal that asks
a rank for its stacks: the contract between the two sides, imported by both (as torch elastic's
agent and workers share its error file), so the agent never imports the rank's code.

Non-goals: writing or reading the files (the rank's ``worker`` and ``drain``, the agent's
``outcomes`` and ``ranks``).
"""

from __future__ import annotations

import os
import signal

#: The signal on which a rank dumps every thread's Python stack (the hang watchdog sends it).
STACK_DUMP_SIGNAL = signal.SIGUSR1


def value_path(run_dir: str, rank: int) -> str:
    """Where ``rank`` leaves its pickled return value, atomically, when it succeeds."""
    return os.path.join(run_dir, f"rank-{rank}.value")


def failure_path(run_dir: str, rank: int) -> str:
    """Where ``rank`` leaves its pickled ``RankFailure``, atomically, when it fails."""
    return os.path.join(run_dir, f"rank-{rank}.failure")


def stop_marker_path(run_dir: str, rank: int) -> str:
    """The file whose presence says a SIGTERM to ``rank`` is its agent's stop, not a notice."""
    return os.path.join(run_dir, f"rank-{rank}.stop")
