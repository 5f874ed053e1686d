"""A rank's two pipes to its agent: notes up (``SPARKDIST_CTRL_OUT``), commands down
(``SPARKDIST_CTRL_IN``), one ``protocol`` message a line (``Route.WORKER``).

The reader thread takes the rendezvous and drain commands; end of file means the agent is gone
(it keeps the pipe open until the rank exits), and the rank then ends itself and everything it
started, so no rank outlives its launcher.

Non-goals: the rank's life (``worker``), what a drain does (``drain``).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from typing import BinaryIO

from sparkdist._core.env import RUN_ID_VAR
from sparkdist._node.rank import drain
from sparkdist._wire import protocol
from sparkdist._wire.protocol import ProtocolError, Route

#: What every process this rank starts inherits: marks strays of this rank and attempt.
_OWN_VARS = (RUN_ID_VAR, "TORCHELASTIC_RESTART_COUNT", "RANK")

#: This process's link to its agent (None outside a sparkdist rank); ``runtime`` uses it.
link: AgentLink | None = None


def connect(ctrl_in: int, ctrl_out: int) -> AgentLink:
    """Open this rank's link on the two pipe descriptors the agent passed; it becomes ``link``."""
    global link
    link = AgentLink(ctrl_in, ctrl_out)
    return link


class AgentLink:
    """The two pipes to the agent."""

    def __init__(self, ctrl_in: int, ctrl_out: int) -> None:
        self._out: BinaryIO = os.fdopen(ctrl_out, "wb", buffering=0)
        self._in: BinaryIO = os.fdopen(ctrl_in, "rb")
        self._lock = threading.Lock()
        self.rank = 0  # this process's global rank, once ``main`` read it
        self.master_port: int | None = None
        self.rendezvous = threading.Event()
        self.rank_env: dict[str, str] = {}
        self.run_dir = ""
        threading.Thread(target=self._read, name="sparkdist-agent-link", daemon=True).start()

    def send(self, message: protocol.Message) -> None:
        """Send a note to the agent.

        Raises:
            ProtocolError: ``message`` is not a note a rank may send (the error says why).
        """
        data = protocol.encode(message, Route.WORKER) + b"\n"
        with self._lock:
            try:
                self._out.write(data)
            except OSError:
                pass  # the agent is gone; the reader thread ends the process

    def _read(self) -> None:
        for line in self._in:
            try:
                message = protocol.decode(line.rstrip(b"\n"), Route.WORKER)
            except ProtocolError:
                continue  # only the agent writes here; nothing else is for us
            if isinstance(message, protocol.Rendezvous):
                self.master_port = message.master_port
                self.rank_env = dict(message.env)
                if message.visible_devices:  # the host's GPUs, in local-rank order
                    self.rank_env["CUDA_VISIBLE_DEVICES"] = message.visible_devices
                self.rendezvous.set()
            elif isinstance(message, protocol.Drain):
                drain.drain_from_agent(message.reason)
        # End of file: the agent died (it keeps the pipe open until we exit), so nobody will
        # clean up after the run: remove its directory and take our whole process group
        # (DataLoader workers included) down with us, and what left it (a child that called
        # setsid, a daemon carrying our environment).
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        from sparkdist._node.host.reaper import end_descendants

        own = {k: os.environ.get(k, "") for k in _OWN_VARS}
        end_descendants(own if all(own.values()) else None)
        os.killpg(os.getpgrp(), signal.SIGKILL)


def send_to_agent(message: protocol.Message) -> bool:
    """Send a note to this rank's agent; False outside a sparkdist rank."""
    if link is None:
        return False
    link.send(message)
    return True


def own_rank() -> int | None:
    """This process's global rank; None outside a sparkdist rank."""
    return None if link is None else link.rank
