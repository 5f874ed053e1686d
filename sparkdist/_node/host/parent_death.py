"""Asking the kernel to end this process when its parent goes (Linux ``PR_SET_PDEATHSIG``).

A rank normally ends itself when its control pipe closes (``worker``), but a rank stuck in a C
call that holds the GIL cannot run that check; the kernel's signal needs no Python at all.

Two catches shape how it is used:
- the "parent" is the *thread* that created the process: a rank must be started from a thread
  that lives as long as the rank (the agent's thread does; the zygote is single-threaded);
- the parent may already be gone by the time the child asks: the child compares its parent's
  pid with the one it was started by, and ends at once when they differ.

Non-goals: ending a rank's own children (``reaper``), which the killed rank cannot do.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: ``prctl`` option number of ``PR_SET_PDEATHSIG`` (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent thread ends.

    Args:
        parent_pid: the pid of the process that started this one; if this process's parent is
            no longer that one (it died before the request took effect), ``signum`` is sent to
            this process at once.
        signum: the signal to receive (SIGKILL: nothing in the process can delay it).

    Returns:
        Whether the kernel accepted the request (False off Linux, or where ``prctl`` fails).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        accepted = libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        # The parent went between our start and the request: the kernel will never signal.
        os.kill(os.getpid(), signum)
    return bool(accepted)
