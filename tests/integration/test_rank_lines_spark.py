"""Spark's console progress bar and the ranks' lines share the driver's terminal: every rank
line must still read as a whole line. A real driver (its own local[2] session, the bar on, as
pyspark's launcher sets it for scripts) writes to a real pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import FAST_JVM_OPTIONS

pytestmark = pytest.mark.spark

STEPS = 10

DRIVER = textwrap.dedent(f"""
    from pyspark.sql import SparkSession

    from sparkdist import Distributor

    spark = (SparkSession.builder.master("local[2]")
             .config("spark.ui.showConsoleProgress", "true")
             .config("spark.driver.extraJavaOptions", "{FAST_JVM_OPTIONS}")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    def train():
        import time
        for step in range({STEPS}):
            print(f"step {{step}}", flush=True)
            time.sleep(0.3)  # keeps the stage up: the bar shows after 0.5 s, redraws on change

    Distributor(2, local_mode=False, use_gpu=False, spark=spark).run(train)
    spark.stop()
""")


def shown(raw: str) -> str:
    """What a terminal shows for one line: "\\r" goes back to column 0, ESC[K erases to the
    end of the line, other characters overwrite."""
    cells: list[str] = []
    column = index = 0
    while index < len(raw):
        if raw.startswith("\x1b[K", index):
            del cells[column:]
            index += 3
            continue
        char = raw[index]
        if char == "\r":
            column = 0
        elif column < len(cells):
            cells[column] = char
            column += 1
        else:
            cells.append(char)
            column += 1
        index += 1
    return "".join(cells)


def test_rank_lines_are_whole_under_sparks_progress_bar(tmp_path):
    controller, follower = pty.openpty()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "COLUMNS": "100"},
    )
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if not ready:
                if driver.poll() is not None:
                    break
                continue
            try:
                data = os.read(controller, 65536)
            except OSError:  # the driver and its JVM closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        os.close(controller)
    output = b"".join(chunks).decode(errors="replace")
    assert driver.returncode == 0, output[-3000:]
    assert "[Stage " in output, "Spark drew no progress bar: this test would prove nothing"
    lines = [shown(line) for line in output.split("\n")]
    rank_lines = [line for line in lines if "[rank " in line]
    assert sorted(rank_lines) == sorted(
        f"[rank {rank}] step {step}" for rank in (0, 1) for step in range(STEPS)
    ), output[-3000:]
