"""Whether every node reaches the same ``checkpoint_dir``: node 0 leaves a token there before it
says hello, every other node reads it back once the rendezvous comes (every node said hello by
then), before any rank trains.

A ``checkpoint_dir`` that is local to each host (``/tmp/ckpt``, a local disk) gives every
other host an empty directory of the same name: training would run, and a restart on another
host would silently start over from step 0. A node that does not find node 0's token refuses
the run, so the launcher names every such node with the fix before a step is taken.

On an object store the question is another: can this host read and write there at all (its
credentials, the endpoint, the bucket)? So there every node, one node included, also writes a
probe of its own and removes it, and node 0 reads its token back: a store this host cannot use
is named (host, URL, the store's own error) before the first step, not at the first save.

The token is derived from the run's secret (one-way: the secret never reaches the file) and
the attempt, so a stale token of another run or attempt never passes. Node 0 removes it when
its agent ends.

Non-goals: checkpoints themselves (``_checkpoint``); what a refusal does to the run (the
driver's run state).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable

from sparkdist._checkpoint.ranks import describe as describe_store_error
from sparkdist._checkpoint.storage import LocalStorage, Storage, storage_for
from sparkdist._core.env import CHECKPOINT_DIR_VAR, STORAGE_OPTIONS_VAR
from sparkdist._core.files import make_private_dirs, write_private_file
from sparkdist._node.agent.spec import AgentSpec

_PREFIX = ".sparkdist-reach-"


class ReachCheck:
    """One node's part of the check (see the module docstring)."""

    def __init__(self, spec: AgentSpec, directory: str, storage: Storage | None = None) -> None:
        self.spec = spec
        self.directory = directory
        # A client of its own: an agent in the driver's process (local mode) must not pass on
        # a client the driver made earlier with other credentials.
        options = spec.extra_env.get(STORAGE_OPTIONS_VAR)
        self.storage = storage or storage_for(directory, options, fresh=True)
        self._left = False

    @classmethod
    def of(cls, spec: AgentSpec) -> ReachCheck | None:
        """The check for this node, or None where there is nothing to check (no
        ``checkpoint_dir``; one node with a directory)."""
        directory = spec.extra_env.get(CHECKPOINT_DIR_VAR)
        if directory is None:
            return None
        check = cls(spec, directory)
        if spec.num_nodes <= 1 and isinstance(check.storage, LocalStorage):
            return None
        return check

    @property
    def _on_store(self) -> bool:
        return not isinstance(self.storage, LocalStorage)

    def before_hello(self) -> str | None:
        """Node 0 leaves the token; the refusal's reason when it cannot, else None."""
        if self.spec.node_rank != 0:
            return None
        if self._on_store:
            problem = _store_problem(self, "write", lambda: _write_token(self))
        else:
            problem = leave_token(self.directory, self.spec)
        self._left = problem is None
        return problem

    def at_rendezvous(self) -> str | None:
        """Every other node reads it back (on a store every node, and writes a probe of its
        own); the refusal's reason when it does not match, else None."""
        if not self._on_store:
            return None if self.spec.node_rank == 0 else check_token(self.directory, self.spec)
        probe = token_path(self.directory, self.spec, self.storage) + f".node{self.spec.node_rank}"
        problem = _store_problem(self, "write", lambda: self.storage.write_whole(probe, b"probe"))
        if problem is None:
            problem = _store_problem(self, "delete", lambda: self.storage.remove_file(probe))
        if problem is None:
            problem = _store_problem(self, "read", lambda: _read_token(self))
        return problem

    def close(self) -> None:
        if self._left:
            path = token_path(self.directory, self.spec, self.storage)
            if self._on_store:
                with contextlib.suppress(Exception):
                    self.storage.remove_file(path)
            else:
                remove_token(self.directory, self.spec)
            self._left = False


class _TokenMismatch(Exception):
    """What this node read is not this attempt's token (the message says what it saw)."""


def _write_token(check: ReachCheck) -> None:
    path = token_path(check.directory, check.spec, check.storage)
    check.storage.write_whole(path, token_of(check.spec).encode())


def _read_token(check: ReachCheck) -> None:
    path = token_path(check.directory, check.spec, check.storage)
    try:
        found = check.storage.read_bytes(path)[:256].decode(errors="replace")
    except FileNotFoundError:
        raise _TokenMismatch("it does not see what node 0 wrote there") from None
    if found != token_of(check.spec):
        raise _TokenMismatch("it sees another object than node 0 wrote there")


def _store_problem(check: ReachCheck, action: str, attempt: Callable[[], None]) -> str | None:
    """Run ``attempt`` on the store; the refusal's reason (host, URL, the store's own error,
    the fix) when it fails, else None."""
    try:
        attempt()
    except _TokenMismatch as exc:
        return store_refusal(check.spec, check.directory, str(exc))
    except Exception as exc:  # noqa: BLE001 - a backend's errors are its own classes
        problem = f"it cannot {action} there ({describe_store_error(exc)})"
        return store_refusal(check.spec, check.directory, problem)
    return None


def token_path(directory: str, spec: AgentSpec, storage: Storage | None = None) -> str:
    name = f"{_PREFIX}{spec.run_id}-{spec.restart_count}"
    return (storage or LocalStorage()).join(directory, name)


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


def store_refusal(spec: AgentSpec, url: str, problem: str) -> str:
    return (
        f"checkpoint_dir {url} on node {spec.node_rank} (host {spec.host}): {problem}, so no "
        "checkpoint could be saved or loaded there; fix: give this host access to the store "
        "(credentials in its environment, an instance profile or a service account that may "
        "read, write and delete under that prefix), check that the bucket exists, and pass "
        "the store's endpoint or region in storage_options= where it is not the default"
    )
