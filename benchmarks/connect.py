"""Launch time on a Spark Connect session, beside a classic one and pyspark's TorchDistributor.

Issue 11's benchmark. The job is launch.py's trivial 2-rank one (``_jobs.all_reduce_rank``),
run as Spark barrier tasks (``local_mode=False``) on two kinds of session, each in a child
process of its own (a process holds one session kind):

- ``classic``: ``SparkSession.builder.master("local[2]")``;
- ``connect``: ``SparkSession.builder.remote("local[2]")`` (a local Spark Connect server in
  the child's JVM; the child is its client).

Launchers, on each session (the two sparkdist variants in turns, then pyspark in a block of its
own: on Connect, the first sparkdist launch after a TorchDistributor job lands on Python workers
without a warm pool and pays for new zygotes, which interleaving would measure instead):

- ``sparkdist``: ``Distributor(2, local_mode=False, use_gpu=False).run(fn)``;
- ``sparkdist-allgather``: the same with ``SPARKDIST_CONTROL_CHANNEL=off``: the executors do
  not use the driver's control channel and rendezvous through Spark's barrier ``allGather``
  (what a cluster that cannot reach the client process gets; output arrives at the end);
- ``pyspark``: ``pyspark.ml.torch.distributor.TorchDistributor(num_processes=2,
  local_mode=False, use_gpu=False).run(fn)``, with ``_jobs`` registered by value.

Each launcher runs once untimed (the warm-up: executors' Python workers, sparkdist's pools),
then ``--runs`` timed runs; figures are medians. Ratios: connect/classic per launcher,
sparkdist/pyspark per session, and ``allgather_cost_s`` (allGather median minus channel median).

If port 15002 (the local Connect server's default) is taken by someone else's server, the
child sets ``SPARK_TESTING=1`` so pyspark binds an ephemeral port instead (noted in the JSON).

Usage (see benchmarks/README.md)::

    python benchmarks/connect.py --quick       # 2 runs
    python benchmarks/connect.py               # 5 runs
    python benchmarks/connect.py --sessions connect --no-pyspark

Non-goals: DataFrame input over Connect (``dataframe_io.py`` measures the classic path), remote
Connect servers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _jobs
from _harness import Bench, Options, append_records, classic_session
from _measure import pickled_by_value
from _report import emit, median, ratio, rounded, runs_note, seconds, table, times

SCRIPT = "connect"
NUM_PROCESSES = 2
SESSIONS = ("classic", "connect")
LAUNCHERS = ("sparkdist", "sparkdist-allgather", "pyspark")
CONNECT_PORT = 15002
CONTROL_CHANNEL_VAR = "SPARKDIST_CONTROL_CHANNEL"

OPTIONS = Options(__doc__, quick_help="2 runs")
OPTIONS.add("--runs", type=int, quick=(5, 2), help="timed runs per launcher, after one warm-up")
OPTIONS.add("--sessions", nargs="+", choices=SESSIONS, default=list(SESSIONS))
OPTIONS.add(
    "--no-pyspark", dest="pyspark", action="store_false", help="skip pyspark's TorchDistributor"
)


# --- in a child ----------------------------------------------------------------------------


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def connect_session(scratch: Path) -> tuple[Any, str]:
    """A local Spark Connect server (local[2]) in this process's JVM, and its client session."""
    from pyspark.sql import SparkSession

    port = "15002"
    if not port_is_free(CONNECT_PORT):
        os.environ["SPARK_TESTING"] = "1"  # pyspark then binds, and finds, an ephemeral port
        port = "ephemeral (15002 was taken)"
    session = (
        SparkSession.builder.remote("local[2]")
        .appName("sparkdist-benchmark-connect")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "lo")
        .config("spark.local.dir", str(scratch))
        .config("spark.driver.extraJavaOptions", f"-Djava.io.tmpdir={scratch}")
        .getOrCreate()
    )
    return session, port


@contextlib.contextmanager
def control_channel_off(off: bool) -> Iterator[None]:
    previous = os.environ.pop(CONTROL_CHANNEL_VAR, None)
    if off:
        os.environ[CONTROL_CHANNEL_VAR] = "off"
    try:
        yield
    finally:
        os.environ.pop(CONTROL_CHANNEL_VAR, None)
        if previous is not None:
            os.environ[CONTROL_CHANNEL_VAR] = previous


def launchers(session: Any, with_pyspark: bool) -> dict[str, Callable[[], Any]]:
    from sparkdist import Distributor

    distributor = Distributor(NUM_PROCESSES, local_mode=False, use_gpu=False, spark=session)

    def sparkdist(off: bool) -> Callable[[], Any]:
        def call() -> Any:
            with control_channel_off(off):
                return distributor.run(_jobs.all_reduce_rank)

        return call

    calls = {"sparkdist": sparkdist(False), "sparkdist-allgather": sparkdist(True)}
    if with_pyspark:
        from pyspark.ml.torch.distributor import TorchDistributor

        torch_distributor = TorchDistributor(
            num_processes=NUM_PROCESSES, local_mode=False, use_gpu=False
        )

        def pyspark() -> Any:
            with pickled_by_value(_jobs):
                return torch_distributor.run(_jobs.all_reduce_rank)

        calls["pyspark"] = pyspark
    return calls


def run_child(args: argparse.Namespace) -> None:
    if args.child == "connect":
        session, port = connect_session(Path.cwd())
    else:
        session, port = classic_session("local[2]", "sparkdist-benchmark-connect", Path.cwd()), "-"
    try:
        calls = launchers(session, args.pyspark)
        # sparkdist's two variants in turns, then pyspark in a block of its own: on Connect,
        # the first sparkdist launch after a TorchDistributor job lands on Python workers that
        # have no warm pool (new zygotes: ~1.8 s instead of ~0.4 s here), so interleaving
        # pyspark would measure that interference rather than either launcher.
        blocks = [
            {k: v for k, v in calls.items() if k != "pyspark"},
            {k: v for k, v in calls.items() if k == "pyspark"},
        ]
        for block, index in ((b, i) for b in blocks for i in range(args.runs + 1)):
            for launcher, call in block.items():  # index 0: the warm-up
                started = time.perf_counter()
                value = call()
                elapsed = time.perf_counter() - started
                if value != 0:
                    raise RuntimeError(f"{launcher} returned {value!r}, expected rank 0's 0")
                append_records(
                    args.results,
                    [
                        {
                            "session": args.child,
                            "launcher": launcher,
                            "round": index,
                            "seconds": elapsed,
                            "connect_port": port,
                        }
                    ],
                )
    finally:
        session.stop()


# --- the parent ----------------------------------------------------------------------------


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    medians: dict[tuple[str, str], float | None] = {}
    for session in SESSIONS:
        for launcher in LAUNCHERS:
            trials = [s for s in samples if s["session"] == session and s["launcher"] == launcher]
            if not trials:
                continue
            kept = [t["seconds"] for t in trials if t["round"] > 0]
            warmup = [t["seconds"] for t in trials if t["round"] == 0]
            medians[(session, launcher)] = median(kept)
            figures.append(
                {
                    "figure": "launch_s",
                    "session": session,
                    "launcher": launcher,
                    "median": rounded(median(kept)),
                    "runs": [rounded(k) for k in kept],
                    "warmup": rounded(warmup[0]) if warmup else None,
                    "connect_port": trials[0]["connect_port"],
                }
            )
    for launcher in LAUNCHERS:
        value = ratio(medians.get(("connect", launcher)), medians.get(("classic", launcher)))
        if value is not None:
            figures.append(
                {
                    "figure": "launch_s_ratio",
                    "launcher": launcher,
                    "what": "connect/classic",
                    "value": rounded(value, 3),
                }
            )
    for session in SESSIONS:
        for launcher in ("sparkdist", "sparkdist-allgather"):
            value = ratio(medians.get((session, launcher)), medians.get((session, "pyspark")))
            if value is not None:
                figures.append(
                    {
                        "figure": "launch_s_ratio",
                        "session": session,
                        "what": f"{launcher}/pyspark",
                        "value": rounded(value, 3),
                    }
                )
        on, off = medians.get((session, "sparkdist")), medians.get((session, "sparkdist-allgather"))
        if on is not None and off is not None:
            figures.append(
                {"figure": "allgather_cost_s", "session": session, "value": rounded(off - on)}
            )
    return figures


def table_of(figures: list[dict[str, Any]]) -> str:
    launch = {(f["session"], f["launcher"]): f for f in figures if f["figure"] == "launch_s"}
    rows = []
    for launcher in LAUNCHERS:
        classic, connect = launch.get(("classic", launcher)), launch.get(("connect", launcher))
        if classic is None and connect is None:
            continue
        c_med = classic["median"] if classic else None
        r_med = connect["median"] if connect else None
        vs_pyspark = ratio(r_med, (launch.get(("connect", "pyspark")) or {}).get("median"))
        notes = [
            f"{name} warm-up {seconds(figure['warmup'], 2)}, " + runs_note(figure["runs"])
            for name, figure in (("classic", classic), ("connect", connect))
            if figure
        ]
        rows.append(
            {
                "launcher": launcher,
                "classic local[2]": seconds(c_med),
                "connect local[2]": seconds(r_med),
                "connect/classic": times(ratio(r_med, c_med)),
                "vs pyspark on connect": times(vs_pyspark) if launcher != "pyspark" else "-",
                "notes": "; ".join(notes),
            }
        )
    return table(rows)


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv)
    if args.child:
        run_child(args)
        return
    samples = []
    with Bench(SCRIPT) as bench:
        for session in args.sessions:
            budget_s = 300 + (args.runs + 1) * 3 * 90
            samples += bench.child(session, OPTIONS.forward(args), budget_s=budget_s)
    figures = summarize(samples)
    emit([*figures, bench.machine(runs=args.runs)], table_of(figures))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
