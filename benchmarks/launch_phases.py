"""Where the milliseconds of one warm launch go: a phase-by-phase timeline.

``launch.py`` gives the totals against pyspark and torchrun; this script takes one warm launch
apart. It wraps functions on the launch path with timestamping shims (this process only, set up
by the script: sparkdist itself carries no tracing) and has the ranks stamp their own side, so
one table shows, for the median warm run, when each step started and how long it took:

- driver: ``prepare`` (select the backend, pickle the job, pack local code, place, plan), the
  tracker, the control channel's start, the backend's start;
- the agent (local mode: a thread of this process): its set-up, the rank forks (a request to
  the warm pool's zygote each), connecting to the channel, its threads, waiting, outcomes,
  goodbye and clean-up;
- the messages (first seen at the agent and at the driver): hello, rank 0's store, the
  rendezvous the driver sends, every rank's ready, byes;
- in the ranks (their own clocks, ``time.time()``, same host): the user function's entry,
  ``init_process_group``, the ``all_reduce``, the return; and the agent seeing each rank exit;
- the driver's end: supervise returning, results unpickled, tracking closed, channel closed.

The job is ``_jobs.all_reduce_rank``'s body (gloo group, one ``all_reduce``) with stamps.
Spark mode (``--master local[2]``) shows only the driver's side; the agents then run in
Spark's Python workers.

Usage (see benchmarks/README.md)::

    python benchmarks/launch_phases.py                  # local, 2 ranks, 15 warm runs
    python benchmarks/launch_phases.py --ranks 8 --runs 10
    python benchmarks/launch_phases.py --master "local[2]"

Non-goals: comparisons with other launchers (``launch.py``), cold start (``scaling.py``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import select
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from _harness import set_loopback_env
from _report import format_table

DEFAULT_RUNS = 15


def stamped_all_reduce() -> dict[str, float]:
    """``_jobs.all_reduce_rank`` with the rank's own timestamps (``time.time()``)."""
    entered = time.time()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    joined = time.time()
    dist.all_reduce(torch.ones(1))
    reduced = time.time()
    dist.destroy_process_group()
    return {
        "fn entered": entered,
        "group joined": joined,
        "all_reduce done": reduced,
        "fn returns": time.time(),
    }


class Recorder:
    """Spans and events of the current run, as ``time.time()`` stamps."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.events: dict[str, float] = {}
        self.missing: list[str] = []

    def reset(self) -> None:
        with self.lock:
            self.spans.clear()
            self.events.clear()

    def event(self, name: str, at: float | None = None) -> None:
        with self.lock:
            self.events.setdefault(name, time.time() if at is None else at)

    def span(self, name: str, start: float, end: float) -> None:
        with self.lock:
            self.spans[name].append((start, end))

    def wrap(self, module_name: str, attribute: str, label: str) -> None:
        """Time every call of ``module.attribute`` (``Class.method`` allowed) as ``label``."""
        try:
            owner: Any = importlib.import_module(module_name)
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = getattr(owner, name)
        except (ImportError, AttributeError):
            self.missing.append(f"{module_name}.{attribute}")
            return

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return original(*args, **kwargs)
            finally:
                self.span(label, start, time.time())

        setattr(owner, name, timed)


def instrument(rec: Recorder) -> None:
    """Wrap the launch path's steps (driver, local agent) and its messages."""
    steps = [
        ("sparkdist._engine.launch", "prepare", "prepare (total)"),
        ("sparkdist._engine.launch", "select_backend", "prepare: select backend"),
        ("sparkdist._engine.launch", "dumps_job", "prepare: pickle job"),
        ("sparkdist._engine.launch", "check_job_size", "prepare: job size check"),
        ("sparkdist._engine.launch", "expected_requirements", "prepare: requirements"),
        ("sparkdist._engine.launch", "pack_local_code", "prepare: pack local code"),
        ("sparkdist._backends.local", "LocalBackend.place", "prepare: place"),
        ("sparkdist._backends.spark", "SparkBackend.place", "prepare: place"),
        ("sparkdist._engine.launch", "make_plan", "prepare: plan"),
        ("sparkdist._tracking.tracker", "RunTracker.__init__", "tracker start"),
        ("sparkdist._wire.channel.server", "ChannelServer.__init__", "channel start"),
        ("sparkdist._backends.local", "LocalBackend.start", "backend start"),
        ("sparkdist._backends.spark", "SparkBackend.start", "backend start"),
        ("sparkdist._node.agent.agent", "Agent.run", "agent run (total)"),
        ("sparkdist._node.agent.agent", "sweep_dead_owners", "agent: sweep dead owners"),
        ("sparkdist._node.agent.agent", "refusal_of", "agent: preflight"),
        ("sparkdist._node.agent.agent", "write_private_file", "agent: write job file"),
        ("sparkdist._node.agent.agent", "Agent._spawn_all", "agent: spawn ranks (all)"),
        ("sparkdist._node.agent.agent", "spawn_rank", "agent: spawn one rank"),
        ("sparkdist._node.agent.ranks", "start_rank", "agent: zygote fork request"),
        ("sparkdist._node.agent.ranks", "start_time", "agent: rank start time (/proc)"),
        ("sparkdist._node.agent.ranks", "worker_env", "agent: rank env"),
        ("sparkdist._node.agent.agent", "DriverLink.connect", "agent: connect channel"),
        (
            "sparkdist._node.agent.agent",
            "DriverLink.open_outbox",
            "agent: open outbox + hello",
        ),
        ("sparkdist._node.agent.agent", "Agent._start_threads", "agent: start pump threads"),
        ("sparkdist._node.agent.agent", "Agent._watch", "agent: watch ranks"),
        ("sparkdist._node.agent.agent", "outcome_of", "agent: outcome of a rank"),
        ("sparkdist._node.agent.agent", "DriverLink.say_bye", "agent: bye (flush)"),
        ("sparkdist._node.agent.agent", "end_ranks", "agent: end ranks (reaper)"),
        ("sparkdist._node.agent.agent", "DriverLink.close", "agent: close link"),
        ("sparkdist._node.agent.ranks", "end_processes", "rank exit: reap strays"),
        ("sparkdist._engine.launch", "supervise", "driver: supervise"),
        ("sparkdist._engine.launch", "result_of", "driver: results (unpickle)"),
        ("sparkdist._tracking.tracker", "RunTracker.close", "driver: tracker close"),
        ("sparkdist._wire.channel.server", "ChannelServer.close", "driver: channel close"),
    ]
    for module_name, attribute, label in steps:
        rec.wrap(module_name, attribute, label)
    _watch_messages(rec)


def _watch_messages(rec: Recorder) -> None:
    """First sight of each message, at the agent (local mode) and at the driver."""
    from sparkdist._engine import supervisor
    from sparkdist._node.agent import agent, driver_link, ranks

    def named(message: Any) -> str:
        rank = getattr(message, "rank", None)
        return type(message).__name__.lower() + ("" if rank is None else f" r{rank}")

    send_control = driver_link.DriverLink.send_control

    def agent_sends(self: Any, message: Any) -> None:
        rec.event(f"agent hears {named(message)}")
        send_control(self, message)

    driver_link.DriverLink.send_control = agent_sends  # type: ignore[method-assign]

    on_message = supervisor.RunMonitor.on_message

    def driver_hears(self: Any, peer: Any, message: Any) -> None:
        rec.event(f"driver hears {named(message)}")
        on_message(self, peer, message)

    supervisor.RunMonitor.on_message = driver_hears  # type: ignore[method-assign]

    broadcast = supervisor.RunMonitor._broadcast

    def driver_sends(self: Any, message: Any) -> None:
        rec.event(f"driver sends {named(message)}")
        broadcast(self, message)

    supervisor.RunMonitor._broadcast = driver_sends  # type: ignore[method-assign]

    deliver = agent.Agent._deliver_rendezvous

    def agent_delivers(self: Any, message: Any) -> None:
        rec.event("agent gets rendezvous")
        deliver(self, message)

    agent.Agent._deliver_rendezvous = agent_delivers  # type: ignore[method-assign]

    wait_for_exit = agent.wait_for_exit

    def waits(rank: Any, spec: Any, on_exit: Callable[[Any, int], None]) -> None:
        def exited(handle: Any, code: int) -> None:
            rec.event(f"agent sees exit r{handle.seat.rank}")
            on_exit(handle, code)

        wait_for_exit(rank, spec, exited)

    agent.wait_for_exit = waits

    spawn_rank = agent.spawn_rank

    def spawns(*args: Any, **kwargs: Any) -> Any:
        handle = spawn_rank(*args, **kwargs)
        threading.Thread(target=_watch_pid, args=(rec, handle), daemon=True).start()
        return handle

    agent.spawn_rank = spawns
    del ranks


def _watch_pid(rec: Recorder, handle: Any) -> None:
    """Stamp the moment the kernel says a rank's process is gone (before anyone reaps it)."""
    try:
        fd = os.pidfd_open(handle.proc.pid)
    except (OSError, AttributeError):
        return
    try:
        select.select([fd], [], [])
        rec.event(f"rank {handle.seat.rank}: process gone")
    finally:
        os.close(fd)


def timeline(rec: Recorder, called: float, returned: float, values: list[Any]) -> dict[str, Any]:
    """One run as {label: (start offset s, duration s)} relative to the call."""
    rows: dict[str, tuple[float, float]] = {}
    for label, spans in rec.spans.items():
        start = min(s for s, _ in spans)
        rows[label] = (start - called, sum(e - s for s, e in spans))
    for label, at in rec.events.items():
        rows[label] = (at - called, 0.0)
    for rank, stamps in enumerate(values):
        if isinstance(stamps, dict):
            for name, at in stamps.items():
                rows[f"rank {rank}: {name}"] = (at - called, 0.0)
    rows["run() returns"] = (returned - called, 0.0)
    return rows


def summarize(runs: list[dict[str, tuple[float, float]]]) -> list[list[str]]:
    labels = {label for run in runs for label in run}
    table = []
    for label in labels:
        starts = [run[label][0] for run in runs if label in run]
        durations = [run[label][1] for run in runs if label in run]
        table.append((statistics.median(starts), label, statistics.median(durations)))
    table.sort()
    return [
        [label, f"{start * 1e3:8.1f}", f"{duration * 1e3:7.2f}" if duration else ""]
        for start, label, duration in table
    ]


def phases(runs: list[dict[str, tuple[float, float]]], ranks: int) -> list[list[str]]:
    """The critical path cut into the phases docs/performance.md names (median ms)."""

    def at(run: dict[str, tuple[float, float]], label: str, end: bool = False) -> float | None:
        if label not in run:
            return None
        start, duration = run[label]
        return start + duration if end else start

    def last(run: dict[str, tuple[float, float]], template: str) -> float | None:
        found = [at(run, template.format(r)) for r in range(ranks)]
        return None if None in found else max(f for f in found if f is not None)

    cuts: list[tuple[str, Callable[[dict[str, tuple[float, float]]], float | None]]] = [
        ("prepare: pickle, place, plan", lambda run: at(run, "prepare (total)", end=True)),
        ("tracker + channel start", lambda run: at(run, "channel start", end=True)),
        ("agent start (thread, set-up)", lambda run: at(run, "agent: spawn ranks (all)")),
        ("rank fork (all ranks)", lambda run: at(run, "agent: spawn ranks (all)", end=True)),
        ("connect + hello + threads", lambda run: at(run, "agent: start pump threads", True)),
        ("rank 0 store up -> driver", lambda run: at(run, "driver hears store")),
        ("rendezvous out -> agent", lambda run: at(run, "agent gets rendezvous")),
        ("ranks ready -> user fn", lambda run: last(run, "rank {}: fn entered")),
        ("user fn: init_process_group", lambda run: last(run, "rank {}: group joined")),
        ("user fn: all_reduce + destroy", lambda run: last(run, "rank {}: fn returns")),
        ("rank exit: value written, process gone", lambda run: last(run, "rank {}: process gone")),
        ("rank exit: zygote -> agent hears it", lambda run: last(run, "agent sees exit r{}")),
        ("outcomes + bye + agent clean-up", lambda run: at(run, "agent run (total)", True)),
        ("driver: results, close, return", lambda run: at(run, "run() returns")),
    ]
    rows = []
    for name, cut in cuts:
        deltas = []
        for run in runs:
            previous = 0.0
            for earlier_name, earlier in cuts:
                if earlier_name == name:
                    break
                value = earlier(run)
                previous = value if value is not None else previous
            end = cut(run)
            if end is not None:
                deltas.append(end - previous)
        rows.append([name, f"{statistics.median(deltas) * 1e3:7.1f}" if deltas else "-"])
    totals = [run["run() returns"][0] for run in runs]
    rows.append(["total (median run)", f"{statistics.median(totals) * 1e3:7.1f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS)
    parser.add_argument("--master", default=None, help='a Spark master, e.g. "local[2]"')
    parser.add_argument("--all-steps", action="store_true", help="print every timed step")
    args = parser.parse_args(argv)
    set_loopback_env()
    session = None
    if args.master is not None:
        from _harness import classic_session

        session = classic_session(args.master, "sparkdist-benchmark-phases")
    from sparkdist import Distributor

    rec = Recorder()
    instrument(rec)
    distributor = Distributor(args.ranks, local_mode=args.master is None, use_gpu=False)
    distributor.run(stamped_all_reduce)  # warm-up: the pool's zygote imports torch
    runs = []
    for _ in range(args.runs):
        rec.reset()
        called = time.time()
        values = distributor.run_all(stamped_all_reduce).values
        returned = time.time()
        runs.append(timeline(rec, called, returned, values))
    load = os.getloadavg()
    mode = args.master or "local"
    print(
        f"\nwarm launch of {args.ranks} ranks, {mode}, median of {args.runs} runs; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; times in ms"
    )
    print(format_table(["phase (critical path)", "ms"], phases(runs, args.ranks)))
    if args.all_steps:
        print(format_table(["step", "starts at", "takes"], summarize(runs)))
    if rec.missing:
        print(f"not found (renamed?): {', '.join(rec.missing)}", file=sys.stderr)
    if session is not None:
        session.stop()


if __name__ == "__main__":
    main()
