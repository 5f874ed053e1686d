"""Which SIGHUP is a preemption: the agent's reading of its executor JVM's state in ``/proc``.

PySpark's daemon sends its workers SIGHUP both when the JVM shuts them down (a preemption: the
JVM still runs its shutdown hooks) and when the JVM died under it. A killed JVM's sockets close
while the kernel still tears it down, before it turns zombie: read then, the JVM must count as
gone, or a killed executor becomes a "preemption" and a restart instead of a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from sparkdist._node.agent.node_drain import PF_EXITING, _process_stat, still_running

STARTED = "4242"


def _fields(state: str = "S", flags: int = 0x400100, started: str = STARTED) -> list[str]:
    """Stat fields after the command name: state, ppid, pgrp, session, tty, tpgid, flags, ..."""
    fields = [state, "1", "1", "1", "0", "-1", str(flags)] + ["0"] * 12 + [started, "0"]
    assert fields[19] == started
    return fields


def test_a_running_process_started_then_is_running():
    assert still_running(_fields(), STARTED)


def test_a_process_that_began_to_exit_is_not_running():
    assert not still_running(_fields(state="R", flags=0x400100 | PF_EXITING), STARTED)
    assert not still_running(_fields(state="D", flags=PF_EXITING), STARTED)


def test_a_zombie_a_dead_task_a_reused_pid_and_no_process_are_not_running():
    assert not still_running(_fields(state="Z"), STARTED)
    assert not still_running(_fields(state="X"), STARTED)
    assert not still_running(_fields(started="99"), STARTED)
    assert not still_running(None, STARTED)
    assert not still_running(["S", "1"], STARTED)


def test_real_processes_read_through_proc():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stat = _process_stat(child.pid)
        assert stat is not None
        assert still_running(stat, stat[19])
        child.kill()
        deadline = time.monotonic() + 10
        while still_running(_process_stat(child.pid), stat[19]):  # a zombie until reaped
            assert time.monotonic() < deadline, "a killed child still reads as running"
            time.sleep(0.01)
        assert os.path.exists(f"/proc/{child.pid}")  # not reaped yet: a zombie, not gone
    finally:
        child.kill()
        child.wait()
