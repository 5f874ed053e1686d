"""A rank's process as the agent holds it, whichever way it started, and the cold start.

``RankProcess`` is the interface (pid, output pipes, exit status); ``ColdProcess`` starts the
worker as a fresh interpreter (``python_command``). A warm start is ``zygote_client``'s.

Non-goals: choosing warm or cold (``pool``); what a rank does (``worker``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from typing import IO

from sparkdist._core.env import PARENT_PID_VAR


def python_command(module: str, *args: str) -> list[str]:
    """``python -c`` running ``module.main()``, minus the implicit working-directory entry that
    ``-c`` puts first on ``sys.path``: a ``torch.py`` or ``cloudpickle.py`` lying in the
    directory a rank starts in must not shadow the real package. Ranks import exactly what the
    driver would: its ``sys.path``, passed explicitly in ``PYTHONPATH`` (``_backends.local``).
    """
    code = (
        f"import sys; sys.path[:] = [p for p in sys.path if p]; from {module} import main; main()"
    )
    return [sys.executable, "-c", code, *args]


_WORKER_COMMAND = python_command("sparkdist._node.worker")


class RankProcess:
    """A started rank: its pid (also its process group), output pipes, and exit status."""

    pid: int
    stdout: IO[bytes]
    stderr: IO[bytes]
    returncode: int | None

    def wait(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def poll(self) -> int | None:  # pragma: no cover - interface
        raise NotImplementedError


class ColdProcess(RankProcess):
    """A rank started as a fresh interpreter: about a second of torch import, no zygote."""

    def __init__(self, env: Mapping[str, str], ctrl_fds: tuple[int, int]) -> None:
        env = dict(env)
        # Started from the agent's thread, which outlives the rank: the rank asks the kernel
        # to end it with that thread (``parent_death``), checking it is still our child.
        env[PARENT_PID_VAR] = str(os.getpid())
        self._popen = subprocess.Popen(
            _WORKER_COMMAND,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=ctrl_fds,
            start_new_session=True,  # its own group: Ctrl-C is ours, killpg reaches children
        )
        assert self._popen.stdout is not None and self._popen.stderr is not None
        self.pid = self._popen.pid
        self.stdout, self.stderr = self._popen.stdout, self._popen.stderr
        self.returncode = None

    def wait(self) -> int:
        self.returncode = self._popen.wait()
        return self.returncode

    def poll(self) -> int | None:
        self.returncode = self._popen.poll()
        return self.returncode
