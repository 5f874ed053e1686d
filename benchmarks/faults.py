"""Fault to driver error: how fast each kind of rank failure reaches the driver, and how.

Issue 8's fault matrix, timed. Two ranks run ``_fault_jobs.inject(fault, stamp)``: rank 1
writes ``time.time()`` at the moment of the fault, then raises, exits 3, is SIGKILLed,
segfaults, or hangs (stops reporting; ``heartbeat_timeout_s=--heartbeat-timeout-s``), while
rank 0 waits in an ``all_reduce`` only the launcher can end. Per fault and mode:

- ``seconds``: the driver's ``time.time()`` when ``run()`` raised, minus the stamp (one host,
  one clock); for ``hang`` the stamp is rank 1's last report, and ``beyond_timeout_s`` is
  ``seconds`` minus the heartbeat timeout (the watchdog's own latency);
- ``outcomes``: the exception types the driver got (``returned``: no error; ``timeout``: the
  trial was given up after ``--failure-timeout-s``);
- ``root_cause_named``: errors whose ``root_cause.rank`` is rank 1 (for torchrun: its
  "Root Cause" block names rank 1); ``explained``: errors whose text says what happened (the
  exception message, ``exit code: 3``, ``SIGKILL``, ``SIGSEGV``, ``hung``);
- ``survivors``: processes of the run still alive when ``run()`` raised (should be 0).

Modes: ``local`` (``Distributor(2, use_gpu=False)``) for every fault, ``local[2]``
(``local_mode=False``) for ``--spark-faults`` (default: raise). The baseline, in the same
run: ``torchrun --standalone --nproc_per_node=2 _fault_jobs.py FAULT STAMP`` for every fault
but ``hang`` (torchrun has no heartbeat: it would wait for gloo's 30-minute timeout).

Usage (see benchmarks/README.md)::

    python benchmarks/faults.py --quick       # 2 runs per fault
    python benchmarks/faults.py               # 5 runs per fault
    python benchmarks/faults.py --faults raise hang --spark-faults raise sigkill

Non-goals: restarts (the tests), executor loss on local-cluster (the tests), pyspark's
TorchDistributor (``launch.py`` times its failure latency for ``raise``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _fault_jobs
from _harness import Bench, Options, append_records, classic_session
from _jobs import read_stamp
from _measure import call_with_timeout, first_line, run_torchrun
from _report import emit, median, rounded, runs_note, seconds, table

SCRIPT = "faults"
NUM_PROCESSES = 2
DEFAULT_FAILURE_TIMEOUT_S = 120.0
#: What the error text should contain to say what happened, per fault.
EXPLANATIONS = {
    "raise": _fault_jobs.FAILURE_MARKER,
    "exit3": "exit code: 3",
    "sigkill": "SIGKILL",
    "segfault": "SIGSEGV",
    "hang": "hung",
}

OPTIONS = Options(__doc__, quick_help="2 runs per fault")
OPTIONS.add("--runs", type=int, quick=(5, 2), help="trials per fault")
OPTIONS.add(
    "--faults",
    nargs="+",
    choices=_fault_jobs.FAULTS,
    default=list(_fault_jobs.FAULTS),
    help="faults in local mode",
)
OPTIONS.add(
    "--spark-faults",
    nargs="*",
    choices=_fault_jobs.FAULTS,
    default=["raise"],
    help="faults on local[2] (default: raise)",
)
OPTIONS.add(
    "--heartbeat-timeout-s",
    type=float,
    default=2.0,
    help="heartbeat_timeout_s for the hang (default 2)",
)
OPTIONS.add(
    "--failure-timeout-s",
    type=float,
    default=DEFAULT_FAILURE_TIMEOUT_S,
    help="give up on a trial after this long (default 120)",
)
OPTIONS.add(
    "--no-torchrun", dest="torchrun", action="store_false", help="skip the torchrun baseline"
)


def ranks(alive: bool) -> Iterator[Any]:
    """This process's descendants that are ranks of a run (warm-pool spares excluded); with
    ``alive``, zombies left out."""
    import psutil

    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if alive and proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.name().startswith("sparkdist-r") or "sparkdist._node.rank.worker" in " ".join(
                proc.cmdline()
            ):
                yield proc


def survivors() -> int:
    return sum(1 for _ in ranks(alive=True))


def kill_ranks() -> None:
    """After an abandoned trial: kill every rank below this process."""
    import psutil

    for proc in ranks(alive=False):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def sparkdist_trial(
    fault: str, local_mode: bool, args: argparse.Namespace, stamps: str
) -> dict[str, Any]:
    """One failing sparkdist run: latency, error type, root cause, survivors."""
    from sparkdist import Distributor, WorkerFailedError

    stamp = os.path.join(stamps, uuid.uuid4().hex)
    distributor = Distributor(
        NUM_PROCESSES,
        local_mode=local_mode,
        use_gpu=False,
        timeout_s=args.failure_timeout_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s if fault == "hang" else None,
    )
    run: Callable[[], Any] = lambda: distributor.run(_fault_jobs.inject, fault, stamp)
    trial = call_with_timeout(run, args.failure_timeout_s + 30)
    left = survivors()
    if trial.timed_out:
        kill_ranks()
        return {
            "outcome": "timeout",
            "seconds": None,
            "named": False,
            "explained": False,
            "survivors": left,
            "first_error": "",
        }
    error = trial.error
    raised_at = read_stamp(stamp)
    named = isinstance(error, WorkerFailedError) and (
        error.root_cause.rank == _fault_jobs.FAILING_RANK
    )
    return {
        "outcome": "returned" if error is None else type(error).__name__,
        "seconds": None if error is None or raised_at is None else trial.ended_at - raised_at,
        "named": named,
        "explained": error is not None and EXPLANATIONS[fault] in str(error),
        "survivors": left,
        "first_error": first_line(error, 200),
    }


def torchrun_trial(fault: str, args: argparse.Namespace, stamps: str) -> dict[str, Any]:
    """The same fault under torchrun: latency to its exit, and whether it names rank 1."""
    stamp = os.path.join(stamps, uuid.uuid4().hex)
    done = run_torchrun(
        NUM_PROCESSES, _fault_jobs.__file__, fault, stamp, timeout_s=args.failure_timeout_s
    )
    ended_at, raised_at = time.time(), read_stamp(stamp)
    root = done.output[done.output.find("Root Cause") :] if "Root Cause" in done.output else ""
    named = re.search(rf"rank\s*:\s*{_fault_jobs.FAILING_RANK}\b", root) is not None
    exitcode = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    if done.returncode is None:
        outcome = "timeout"
    elif done.returncode == 0:
        outcome = "returned"
    else:
        outcome = f"exit {done.returncode}"
    return {
        "outcome": outcome,
        "seconds": None
        if done.returncode in (None, 0) or raised_at is None
        else ended_at - raised_at,
        "named": named,
        "explained": EXPLANATIONS[fault] in done.output
        or bool(
            exitcode
            and fault in ("exit3", "sigkill", "segfault")
            and exitcode.group(1) == {"exit3": "3", "sigkill": "-9", "segfault": "-11"}[fault]
        ),
        "survivors": 0,
        "first_error": f"root cause exitcode {exitcode.group(1)}" if exitcode else "",
    }


def run_child(args: argparse.Namespace) -> None:
    """``local``: every fault under sparkdist and torchrun in turns; ``local[2]``: the Spark
    faults under sparkdist."""
    from sparkdist import Distributor

    session = None
    if args.child != "local":
        session = classic_session(args.child, "sparkdist-benchmark-faults", Path.cwd())
    local_mode = session is None
    faults = args.faults if local_mode else args.spark_faults
    try:
        Distributor(NUM_PROCESSES, local_mode=local_mode, use_gpu=False).run(
            lambda: None
        )  # warm-up: the pool (and the executors' Python workers) start
        with tempfile.TemporaryDirectory(prefix="bench-fault-stamps-") as stamps:
            for index in range(args.runs):
                for fault in faults:
                    where = {"fault": fault, "round": index}
                    record = sparkdist_trial(fault, local_mode, args, stamps)
                    record = {"mode": args.child, "launcher": "sparkdist", **where, **record}
                    append_records(args.results, [record])
                    if local_mode and fault != "hang" and args.torchrun:
                        record = torchrun_trial(fault, args, stamps)
                        record = {"mode": "local", "launcher": "torchrun", **where, **record}
                        append_records(args.results, [record])
    finally:
        if session is not None:
            session.stop()


def summarize(samples: list[dict[str, Any]], heartbeat_timeout_s: float) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["fault"], s["mode"], s["launcher"]), []).append(s)
    figures = []
    for (fault, mode, launcher), trials in groups.items():
        latencies = [t["seconds"] for t in trials if t["seconds"] is not None]
        outcomes: dict[str, int] = {}
        for t in trials:
            outcomes[t["outcome"]] = outcomes.get(t["outcome"], 0) + 1
        took = median(latencies)
        figures.append(
            {
                "figure": "fault_to_error_s",
                "fault": fault,
                "mode": mode,
                "launcher": launcher,
                "median": rounded(took),
                "beyond_timeout_s": rounded(took - heartbeat_timeout_s)
                if fault == "hang" and took is not None
                else None,
                "runs": [rounded(x) for x in latencies],
                "outcomes": outcomes,
                "root_cause_named": sum(t["named"] for t in trials),
                "explained": sum(t["explained"] for t in trials),
                "trials": len(trials),
                "survivors": sum(t["survivors"] for t in trials),
                "first_error": next((t["first_error"] for t in trials if t["first_error"]), ""),
            }
        )
    order = list(_fault_jobs.FAULTS)
    figures.sort(
        key=lambda f: (f["mode"] != "local", order.index(f["fault"]), f["launcher"] != "sparkdist")
    )
    return figures


def table_of(figures: list[dict[str, Any]]) -> str:
    rows = []
    for f in figures:
        kinds = ", ".join(f"{k} {v}/{f['trials']}" for k, v in sorted(f["outcomes"].items()))
        rows.append(
            {
                "fault": f["fault"],
                "mode": f["mode"],
                "launcher": f["launcher"],
                "fault->error": seconds(f["median"]),
                "beyond timeout": seconds(f["beyond_timeout_s"]),
                "driver got": kinds,
                "rank named": f"{f['root_cause_named']}/{f['trials']}",
                "explained": f"{f['explained']}/{f['trials']}",
                "survivors": str(f["survivors"]),
                "notes": runs_note(f["runs"]),
            }
        )
    return table(rows)


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv)
    if args.child:
        run_child(args)
        return
    per_trial_s = 60 + args.failure_timeout_s
    local_s = 300 + 2 * args.runs * len(args.faults) * per_trial_s
    spark_s = 300 + args.runs * len(args.spark_faults) * per_trial_s
    samples = []
    with Bench(SCRIPT) as bench:
        samples += bench.child("local", OPTIONS.forward(args), budget_s=local_s)
        if args.spark_faults:
            samples += bench.child("local[2]", OPTIONS.forward(args), budget_s=spark_s)
    figures = summarize(samples, args.heartbeat_timeout_s)
    machine = bench.machine(runs=args.runs, heartbeat_timeout_s=args.heartbeat_timeout_s)
    emit([*figures, machine], table_of(figures))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
