"""The control channel at scale: N simulated agents against one real ``ChannelServer``.

Issue 18. Every simulated agent is a real ``ChannelClient`` (the real handshake with the
run's secret, tagged frames, bounded queues), hosted ``--agent-procs`` to a process on
127.0.0.1; the driver is a process of its own running the real server, whose handler does
what the supervisor's cheapest path does (count, no printing). For each N (``--nodes``):

- ``connect_s``: from the start of the agent processes' connecting to the last handshake done
  (``--connect-threads`` handshakes at a time per process);
- ``rendezvous_s``: every agent sends its hello (all connected first); the driver broadcasts
  the rendezvous once it has all N; the figure runs from the moment the agents were told to
  say hello to the moment the last agent received the rendezvous (one host, one clock);
- ``lines_per_s``: every agent logs flat out for ``--log-s`` seconds (one thread per agent
  process posting ~100-byte lines to its agents in turn, as an agent's output forwarders
  would); lines the driver's handler received, over the time from the first to the last;
- ``p50_ms`` / ``p99_ms`` / ``max_ms``: a line's latency, from the ``time.time()`` written in
  it when posted to the handler's clock when it arrived; ``dropped`` counts lines the agents'
  full queues dropped (flat out, the producers outrun any driver);
- ``driver_rss_mb`` / ``driver_peak_mb``: the driver's RSS at the end and its peak
  (``VmHWM``); ``driver_threads``: its threads, most seen (sampled every 0.1 s).

Usage::

    python benchmarks/channel_scale.py --quick              # N = 64, 1 s of logging
    python benchmarks/channel_scale.py                      # N = 64, 256, 1024
    python benchmarks/channel_scale.py --rate 20000         # paced: 20k lines/s in all
    python benchmarks/channel_scale.py --nodes 64 --log-s 2
    python benchmarks/channel_scale.py --json out.json

The soft RLIMIT_NOFILE of every process is raised to its hard limit (each agent holds three
descriptors: its socket and its wake-up pair). Everything ends by ``--timeout-s`` per N.

Non-goals: the rest of a run (ranks, Spark): ``launch.py`` measures that.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from _channel_scale_jobs import raise_fd_limit, run_agents, run_driver, run_mux_agents  # noqa: E402
from _report import markdown_table  # noqa: E402

# -- the parent ------------------------------------------------------------------------------------


class Child:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"no answer from {self.proc.args} in {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args} exited ({self.proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def tell(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        try:
            self.tell("quit")
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def measure(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    timeout = args.timeout_s
    driver = Child(["--driver", str(nodes)])
    agents: list[Child] = []
    try:
        hello = driver.read(timeout)
        per_proc = -(-nodes // args.agent_procs)
        for first in range(0, nodes, per_proc):
            count = min(per_proc, nodes - first)
            agents.append(
                Child(
                    [
                        "--agents",
                        str(hello["port"]),
                        hello["secret"],
                        str(first),
                        str(count),
                        str(args.connect_threads),
                        "clients" if args.real_clients else "mux",
                    ]
                )
            )
        connected = [agent.read(timeout) for agent in agents]
        connect_s = max(c["connected_at"] for c in connected) - min(
            c["started_at"] for c in connected
        )
        told = time.time()
        for agent in agents:
            agent.tell("hello")
        last = [agent.read(timeout)["rendezvous_last_at"] for agent in agents]
        rendezvous_s = None if None in last else max(last) - told
        driver.tell("mark")
        rate = args.rate / len(agents) if args.rate else 0
        for agent in agents:
            agent.tell(f"log {args.log_s} {rate}")
        logged = [agent.read(timeout + args.log_s) for agent in agents]
        posted = sum(item["posted"] for item in logged)
        # Lines handed to the network may still be on their way: wait for them (or a stall).
        progress_at, seen = time.monotonic(), -1
        while True:
            driver.tell("report")
            report = driver.read(timeout)
            if report["lines"] >= posted or time.monotonic() - progress_at > 5.0:
                break
            if report["lines"] > seen:
                progress_at, seen = time.monotonic(), report["lines"]
            time.sleep(0.2)
    finally:
        for child in (*agents, driver):
            child.end()
    return {
        "nodes": nodes,
        "connect_s": round(connect_s, 3),
        "rendezvous_s": None if rendezvous_s is None else round(rendezvous_s, 3),
        "lines": report["lines"],
        "lines_per_s": round(report["lines"] / report["span_s"]) if report["span_s"] else None,
        "p50_ms": report["p50_ms"],
        "p99_ms": report["p99_ms"],
        "max_ms": report["max_ms"],
        "posted": posted,
        "dropped": sum(item["dropped"] for item in logged),
        "driver_rss_mb": round(report["rss_mb"], 1),
        "driver_peak_mb": round(report["peak_mb"], 1),
        "driver_threads": report["threads"],
        "driver_cpu_us_per_line": round(1e6 * report["cpu_s"] / report["lines"], 2)
        if report["lines"]
        else None,
        "server_stats": report["stats"],
    }


COLUMNS = (
    "nodes",
    "connect_s",
    "rendezvous_s",
    "lines_per_s",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "dropped",
    "driver_rss_mb",
    "driver_peak_mb",
    "driver_threads",
    "driver_cpu_us_per_line",
)


def main() -> None:
    if sys.argv[1:2] == ["--driver"]:
        run_driver(int(sys.argv[2]))
        return
    if sys.argv[1:2] == ["--agents"]:
        port, secret, first, count, threads, kind = sys.argv[2:8]
        run = run_agents if kind == "clients" else run_mux_agents
        run(int(port), secret, int(first), int(count), int(threads))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--agent-procs", type=int, default=2)
    parser.add_argument("--connect-threads", type=int, default=32)
    parser.add_argument("--log-s", type=float, default=5.0)
    parser.add_argument(
        "--rate", type=float, default=0.0, help="lines per second in all (default: flat out)"
    )
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--real-clients",
        action="store_true",
        help="one ChannelClient (and its I/O thread) per agent, instead of one thread per "
        "agent process multiplexing them",
    )
    parser.add_argument("--json", help="write the records here too")
    parser.add_argument("--quick", action="store_true", help="64 nodes, 1 s of logging")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.log_s = [64], 1.0
    hard = raise_fd_limit()
    print(f"RLIMIT_NOFILE {hard}; load before: {os.getloadavg()}", file=sys.stderr)
    records = []
    for nodes in args.nodes:
        record = measure(nodes, args)
        records.append(record)
        print(json.dumps(record), file=sys.stderr)
    print(markdown_table(COLUMNS, [[record[c] for c in COLUMNS] for record in records]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    main()
