"""A SIGKILLed driver leaves no rank behind, even one stuck in a C call (issue 19).

A rank normally ends itself when its control pipe closes; a rank inside a C call that holds the
GIL cannot run that check, so each rank also asks the kernel to kill it with its parent
(``_node/parent_death``): a cold rank with the agent's thread, a pooled rank with its zygote
(which exits a moment after its owner). Bound: 2 s from the driver's death.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparkdist import Distributor
from sparkdist._node.pool import pool as _pool
from tests.integration.test_reaper import _alive

#: No rank may outlive the driver by more than this.
BOUND_S = 2.0

DRIVER = textwrap.dedent("""
    import sys
    from sparkdist import Distributor

    def stuck(out_dir, how):
        import ctypes, os, time
        open(os.path.join(out_dir, f"rank-{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
        if how == "time.sleep":
            time.sleep(120)
        elif how == "C call, GIL released":
            ctypes.CDLL(None).sleep(120)
        else:  # a C call holding the GIL: no Python thread of the rank runs meanwhile
            ctypes.PyDLL(None).sleep(120)

    if sys.argv[3] == "spark":  # local[2]: the ranks run under Spark's Python workers
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
                 .config("spark.ui.showConsoleProgress", "false").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
    Distributor(2, use_gpu=False, local_mode=sys.argv[3] != "spark").run(
        stuck, sys.argv[1], sys.argv[2])
""")


def _one():
    return 1


def _rank_pids(out_dir, world_size: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = sorted(out_dir.glob("rank-*.pid"))
        if len(files) == world_size and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    pytest.fail(f"the ranks did not start within {timeout_s} s")


@pytest.mark.parametrize(
    ("pool", "how"),
    [
        ("warm pool", "time.sleep"),
        ("warm pool", "C call, GIL released"),
        ("warm pool", "C call, GIL held"),
        # A cold rank's Python never runs in the first two either: the GIL-held case is the one
        # only the kernel's signal can end.
        ("cold", "C call, GIL held"),
    ],
)
def test_a_killed_driver_leaves_no_rank(tmp_path, monkeypatch, pool, how):
    _kill_the_driver_and_check(tmp_path, monkeypatch, pool, how, "local")


@pytest.mark.slow  # a JVM of its own (about 17 s on 2 cores); measured 0.09 s to the last rank
def test_a_killed_spark_driver_leaves_no_rank(tmp_path, monkeypatch):
    """Spark mode (local[2]): the driver's JVM and Spark's Python workers go with the driver;
    the agents and their ranks with them (the bound is the same)."""
    _kill_the_driver_and_check(tmp_path, monkeypatch, "warm pool", "C call, GIL held", "spark")


def _kill_the_driver_and_check(tmp_path, monkeypatch, pool, how, where):
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, **{_pool.POOL_VAR: "1" if pool == "warm pool" else "0"})
    env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    driver = subprocess.Popen(
        [sys.executable, "driver.py", str(out), how, where],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        pids = _rank_pids(out, 2, timeout_s=120)
    finally:
        if driver.poll() is not None:
            print(driver.communicate()[0].decode(errors="replace"))
    killed = time.monotonic()
    driver.kill()
    driver.wait(timeout=30)
    while _alive(pids) and time.monotonic() - killed < BOUND_S + 5:
        time.sleep(0.02)
    gone_after = time.monotonic() - killed
    survivors = _alive(pids)
    for pid in survivors:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    print(f"{where}, {pool}, {how}: last rank gone {gone_after:.3f} s after the driver's SIGKILL")
    assert not survivors, f"ranks {survivors} outlived their driver by {BOUND_S + 5} s"
    assert gone_after <= BOUND_S
    # What the killed driver's agent left in the temp directory goes at the next start.
    monkeypatch.setenv(_pool.POOL_VAR, "0")
    assert Distributor(1, use_gpu=False).run(_one) == 1
