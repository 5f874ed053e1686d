"""Run documentation blocks, one after another, in this one process.

Usage: ``python _run_blocks.py BLOCKS_JSON REPORT_JSONL [--spark]``. A script block is written
to ``<cwd>/<stem>.py`` and run like ``python <stem>.py`` would run it (``__name__ ==
"__main__"``, its own fresh globals, its directory first on ``sys.path``); a pytest block is
written to ``<cwd>/<stem>/test_<stem>.py`` and run with ``pytest.main`` (the sparkdist plugin
provides its fixtures). One process for many blocks keeps the docs tests fast: interpreter
start-up, imports, the JVM and sparkdist's warm worker pool are paid once. With ``--spark`` a
local[2] SparkSession is started first and stays active, so a block's
``SparkSession.builder.getOrCreate()``, and the pytest plugin's ``spark`` fixture, reuse it.

Each block's outcome is appended to the report as one JSON line as soon as it ends, so when the
whole process is killed for taking too long, the blocks without a line are the ones to blame.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path


def start_spark() -> object:
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("sparkdist-docs")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        # A short-lived JVM on 2 cores: the C1 compiler alone and the serial collector halve
        # its CPU time (measured: 21 -> 12 s to start and run one small barrier stage).
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_block(path: Path) -> None:
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        sys.path.remove(str(path.parent))


def run_pytest_block(directory: Path, stem: str, source: str) -> None:
    import pytest

    directory.mkdir()
    test_file = directory / f"test_{stem}.py"
    test_file.write_text(source, encoding="utf-8")
    code = pytest.main(
        ["-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(directory), str(test_file)]
    )
    if code != 0:
        raise AssertionError(
            f"pytest exited with {int(code)} for {test_file.name} (its output is above)"
        )


def main() -> int:
    blocks = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    report = Path(sys.argv[2])
    spark = start_spark() if "--spark" in sys.argv[3:] else None
    failed = 0
    for block in blocks:
        print(f"=== docs block {block['id']}", flush=True)
        started = time.monotonic()
        error = None
        try:
            if block["how"] == "pytest":
                run_pytest_block(Path.cwd() / block["stem"], block["stem"], block["source"])
            else:
                path = Path.cwd() / f"{block['stem']}.py"
                path.write_text(block["source"], encoding="utf-8")
                run_block(path)
        except BaseException as exc:  # noqa: BLE001 - every failure is the block's outcome
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = "".join(traceback.format_exception(exc))
            failed += 1
        outcome = {
            "id": block["id"],
            "seconds": round(time.monotonic() - started, 2),
            "error": error,
        }
        with report.open("a", encoding="utf-8") as f:
            f.write(json.dumps(outcome) + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
    if spark is not None:
        spark.stop()  # type: ignore[attr-defined]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    sys.exit(main())
