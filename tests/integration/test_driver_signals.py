"""The driver interrupted (Ctrl-C) or killed outright: no rank, and nothing a rank started,
outlives it.

The driver is a separate Python process whose ranks each start process trees (one in the rank's
group, one in a session of its own, an orphaned daemon: ``test_interrupt.start_trees``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import run_processes
from tests.integration.test_interrupt import (
    LOCAL_BOUND_S,
    PER_RANK,
    alive,
    last_gone_after,
    recorded,
    start_trees,
    wait_for_trees,
)

DRIVER = textwrap.dedent("""
    import sys
    from sparkdist import Distributor
    from driver_helpers import start_trees

    try:
        Distributor(2, use_gpu=False).run(start_trees, sys.argv[1])
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        sys.exit(42)
""")


def _start_driver_and_wait_for_trees(tmp_path):
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "driver_helpers.py").write_text(inspect.getsource(start_trees))
    out = tmp_path / "out"
    out.mkdir()
    driver = subprocess.Popen(
        [sys.executable, "driver.py", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    if not wait_for_trees(out, 2):
        driver.kill()
        pytest.fail(f"the ranks did not start: {driver.communicate(timeout=30)[0]}")
    procs = recorded(out)
    assert len(procs) == 2 * PER_RANK
    return driver, procs


def _wait_until_no_run_processes(timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while run_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    return run_processes()


def test_ctrl_c_stops_every_rank_and_raises_keyboard_interrupt(tmp_path):
    driver, procs = _start_driver_and_wait_for_trees(tmp_path)
    interrupted = time.monotonic()
    driver.send_signal(signal.SIGINT)
    gone_after = last_gone_after(procs, interrupted)
    out, _ = driver.communicate(timeout=30)
    print(f"SIGINT -> last process of the ranks gone {gone_after:.3f} s")
    assert driver.returncode == 42 and "INTERRUPTED" in out
    assert gone_after <= LOCAL_BOUND_S
    assert not run_processes()


def test_killed_driver_takes_its_ranks_down(tmp_path):
    """No agent is left to stop them: each rank ends itself and everything it started
    (the orphaned daemon included) when its command pipe closes."""
    driver, procs = _start_driver_and_wait_for_trees(tmp_path)
    killed = time.monotonic()
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)
    gone_after = last_gone_after(procs, killed)
    print(f"SIGKILL of the driver -> last process of the ranks gone {gone_after:.3f} s")
    assert gone_after <= 5.0
    assert not alive(procs)
    assert not _wait_until_no_run_processes(timeout_s=5.0)


@pytest.fixture(autouse=True)
def _kill_stragglers():
    yield
    for proc in run_processes():
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)
