"""Whether every node sees the same ``checkpoint_dir``: node 0 leaves a token there before it
says hello, every other node reads it back once the rendezvous comes (every node said hello by
then), before any rank trains.

A ``checkpoint_dir`` that is local to each host (``/tmp/ckpt``, a local disk) gives every
other host an empty directory of the same name: training would run, and a restart on another
host would silently start over from step 0. A node that does not find node 0's token refuses
the run, so the launcher names every such node with the fix before a step is taken.

The token is derived from the run's secret (one-way: the secret never reaches the file) and
the attempt, so a stale token of another run or attempt never passes. Node 0 removes it when
its agent ends.

Non-goals: checkpoints themselves (``checkpoints``); what a refusal does to the run (the
driver's run state).
"""

from __future__ import annotations

import contextlib
import hashlib
import os

from sparkdist._core.env import CHECKPOINT_DIR_VAR
from sparkdist._core.files import make_private_dirs, write_private_file
from sparkdist._node.agent.spec import AgentSpec

_PREFIX = ".sparkdist-reach-"


class ReachCheck:
    """One node's part of the check (see the module docstring)."""

    def __init__(self, spec: AgentSpec, directory: str) -> None:
        self.spec = spec
        self.directory = directory
        self._left = False

    @classmethod
    def of(cls, spec: AgentSpec) -> ReachCheck | None:
        """The check for this node, or None where there is nothing to check (one node, no
        ``checkpoint_dir``)."""
        directory = spec.extra_env.get(CHECKPOINT_DIR_VAR)
        if directory is None or spec.num_nodes <= 1:
            return None
        return cls(spec, directory)

    def before_hello(self) -> str | None:
        """Node 0 leaves the token; the refusal's reason when it cannot, else None."""
        if self.spec.node_rank != 0:
            return None
        problem = leave_token(self.directory, self.spec)
        self._left = problem is None
        return problem

    def at_rendezvous(self) -> str | None:
        """Every other node reads it back; the refusal's reason when it does not match."""
        if self.spec.node_rank == 0:
            return None
        return check_token(self.directory, self.spec)

    def close(self) -> None:
        if self._left:
            remove_token(self.directory, self.spec)
            self._left = False


def token_path(directory: str, spec: AgentSpec) -> str:
    return os.path.join(directory, f"{_PREFIX}{spec.run_id}-{spec.restart_count}")


def token_of(spec: AgentSpec) -> str:
    """This attempt's token: every node of the run computes the same one."""
    seed = f"sparkdist-checkpoint-reach:{spec.run_id}:{spec.restart_count}:{spec.secret}"
    return hashlib.sha256(seed.encode()).hexdigest()


def leave_token(directory: str, spec: AgentSpec) -> str | None:
    """Node 0: write the token (private, atomic); why it could not, or None."""
    try:
        make_private_dirs(directory)
        write_private_file(token_path(directory, spec), token_of(spec).encode())
    except OSError as exc:
        return refusal_reason(spec, directory, f"node 0 cannot write there ({exc})")
    return None


def check_token(directory: str, spec: AgentSpec) -> str | None:
    """Any other node: the refusal's reason when node 0's token is not here, else None."""
    try:
        with open(token_path(directory, spec), "rb") as f:
            found = f.read(256).decode(errors="replace")
    except FileNotFoundError:
        return refusal_reason(spec, directory, "it does not see what node 0 wrote there")
    except OSError as exc:
        return refusal_reason(spec, directory, f"it cannot read it ({exc})")
    if found != token_of(spec):
        return refusal_reason(spec, directory, "it sees another file than node 0 wrote there")
    return None


def remove_token(directory: str, spec: AgentSpec) -> None:
    with contextlib.suppress(OSError):
        os.unlink(token_path(directory, spec))


def refusal_reason(spec: AgentSpec, directory: str, problem: str) -> str:
    return (
        f"checkpoint_dir {directory} on node {spec.node_rank} (host {spec.host}): {problem}, "
        "so a checkpoint written on one host would be missing on the others and a restart "
        "there would start over; fix: put checkpoint_dir on storage every node mounts at the "
        "same path (NFS, a cluster file system, a FUSE mount of object storage)"
    )
