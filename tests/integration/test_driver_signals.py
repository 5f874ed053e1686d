"""The driver interrupted (Ctrl-C) or killed outright: no rank outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import run_processes

DRIVER = textwrap.dedent("""
    import sys
    from sparkdist import Distributor

    def sleepy():
        import time
        print("started", flush=True)
        time.sleep(120)

    try:
        Distributor(2, use_gpu=False).run(sleepy)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        sys.exit(42)
""")


def _start_driver_and_wait_for_ranks(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=tmp_path,
    )
    started = set()
    deadline = time.monotonic() + 60
    assert driver.stdout is not None
    while len(started) < 2 and time.monotonic() < deadline:
        line = driver.stdout.readline()
        if not line:
            break
        if line.strip().endswith("started"):
            started.add(line.split("]")[0])
    assert len(started) == 2, "ranks did not start"
    return driver


def _wait_until_no_run_processes(timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while run_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    return run_processes()


def test_ctrl_c_stops_every_rank_and_raises_keyboard_interrupt(tmp_path):
    driver = _start_driver_and_wait_for_ranks(tmp_path)
    driver.send_signal(signal.SIGINT)
    out, _ = driver.communicate(timeout=30)
    assert driver.returncode == 42 and "INTERRUPTED" in out
    assert not run_processes()


def test_killed_driver_takes_its_ranks_down(tmp_path):
    driver = _start_driver_and_wait_for_ranks(tmp_path)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)
    assert not _wait_until_no_run_processes(timeout_s=5.0)


@pytest.fixture(autouse=True)
def _kill_stragglers():
    yield
    for proc in run_processes():
        proc.kill()
