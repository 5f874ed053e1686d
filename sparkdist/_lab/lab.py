"""Hosts of the lab: addresses, names, what a host's name resolves to, and host faults.

Addresses come from 198.18.0.0/15 (RFC 2544's benchmarking block, never routed on the
Internet), and only inside the lab's own network namespaces: the driver's host is 198.18.0.10,
``host1`` .. ``hostN`` are .11 onwards; a host whose name resolves to a network its peers do not
share has a second NIC on 198.19.0.0/24.

Faults, each on one host: ``kill_host`` (every process of it SIGKILLed, as a power loss),
``cut``/``heal`` (its switch port down: packets silently dropped, as a switch or NIC failure),
``signal`` (say SIGTERM to one process: a preemption). ``replace_host`` brings a killed host
back under the same name and address.

Non-goals: Spark (``spark``); what runs on a host (callers pass argv).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from sparkdist._lab.client import HolderClient, LabError
from sparkdist._lab.support import probe

SUBNET_PREFIX = 24
DRIVER_ADDRESS = "198.18.0.10"
_FIRST_HOST = 11
_SIDE_NETWORK = "198.19.0"
#: Set in every process started in a lab (and inherited by what they start).
LAB_MARK_VAR = "SPARKDIST_LAB_MARK"
#: The caller's variables a lab host must not inherit: they describe the caller's machine.
_NOT_INHERITED = (
    "SPARK_LOCAL_IP",
    "SPARK_LOCAL_HOSTNAME",
    "TMPDIR",
    "SPARK_HOME",
    "SPARKDIST_PYTEST_SESSION",
    "SPARKDIST_DRIVER_HOST",
    "PYSPARK_GATEWAY_PORT",
    "PYSPARK_GATEWAY_SECRET",
)


class NameResolution(Enum):
    """What a host's own name resolves to in its ``/etc/hosts``."""

    #: Every host's name to its lab address (a well-run cluster).
    PEERS = "peers"
    #: Its own name to 127.0.1.1 only, as Debian's installer and cloud-init write it.
    LOOPBACK = "loopback"
    #: Its own name to the address of a second NIC on a network no peer shares.
    SIDE = "side"


@dataclass(frozen=True)
class Host:
    """One host of the lab."""

    name: str
    hostname: str
    address: str
    index: int
    resolution: NameResolution

    @property
    def side_address(self) -> str | None:
        return f"{_SIDE_NETWORK}.{self.index}" if self.resolution is NameResolution.SIDE else None


@dataclass(frozen=True)
class Result:
    """A command's end on a lab host (``rc`` is None when it timed out)."""

    rc: int | None
    stdout: str
    stderr: str


def _topmost(paths: list[str]) -> list[str]:
    kept: list[str] = []
    for path in sorted(set(paths)):
        if not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


class Lab:
    """A running lab; ``close`` ends every process and namespace of it (use ``with``)."""

    def __init__(self, directory: Path, shared: Path, mark: str) -> None:
        self.directory = directory
        #: Every host sees this directory at this same path: shared storage.
        self.shared = shared
        self.mark = mark
        self.hosts: dict[str, Host] = {}
        self._resolution: dict[str, NameResolution] = {}
        support = probe()
        if not support.ok:
            raise LabError(support.reason)
        (directory / "logs").mkdir(parents=True, exist_ok=True)
        shared.mkdir(parents=True, exist_ok=True)
        self._holder = HolderClient(support.rootless, str(directory / "logs" / "holder.log"))
        self._outer_tmp = "/mnt/outer-tmp" if os.path.isdir("/mnt") else None
        if self._outer_tmp is None:
            raise LabError("the lab needs an empty mount point at /mnt (none here)")
        self._holder.call("switch", outer_tmp=self._outer_tmp)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hosts ---------------------------------------------------------------------------------
    def add_host(
        self, name: str, index: int, resolution: NameResolution = NameResolution.PEERS
    ) -> Host:
        """Start one host; its ``/etc/hosts`` names every host planned so far (``plan``)."""
        host = self.plan(name, index, resolution)
        self._holder.call(
            "add_host",
            name=name,
            hostname=host.hostname,
            index=index,
            address=host.address,
            prefix=SUBNET_PREFIX,
            side_address=host.side_address,
            hosts_file=self._hosts_file(host),
            keep_under_tmp=self._keep_under_tmp(),
            outer_tmp=self._outer_tmp,
        )
        return host

    def plan(
        self, name: str, index: int, resolution: NameResolution = NameResolution.PEERS
    ) -> Host:
        """Name a host before it starts, so hosts started earlier can resolve its name."""
        host = Host(name, f"lab-{name}", f"198.18.0.{index}", index, resolution)
        self.hosts[name] = host
        return host

    def add_hosts(
        self, count: int, resolution: NameResolution | list[NameResolution] = NameResolution.PEERS
    ) -> list[Host]:
        """The driver's host (its name well resolved) and ``count`` others, ``host1`` onwards,
        each host's own name resolved as ``resolution`` says (one for all, or one per host)."""
        each = resolution if isinstance(resolution, list) else [resolution] * count
        if len(each) != count:
            raise ValueError(f"resolution names {len(each)} hosts, not {count}")
        planned = [self.plan("driver", 10)] + [
            self.plan(f"host{i}", _FIRST_HOST + i - 1, each[i - 1]) for i in range(1, count + 1)
        ]
        return [self.add_host(h.name, h.index, h.resolution) for h in planned]

    def replace_host(self, name: str) -> Host:
        """Bring back a killed host: same name, address and name resolution, fresh namespaces."""
        old = self.hosts[name]
        return self.add_host(name, old.index, old.resolution)

    def _hosts_file(self, host: Host) -> str:
        # Peers' names resolve to their lab addresses (DNS on a real cluster); a host's own
        # name resolves as its resolution says.
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        own = {
            NameResolution.PEERS: host.address,
            NameResolution.LOOPBACK: "127.0.1.1",
            NameResolution.SIDE: host.side_address,
        }[host.resolution]
        lines.append(f"{own}\t{host.hostname}")
        lines += [f"{h.address}\t{h.hostname}" for h in self.hosts.values() if h.name != host.name]
        return "\n".join(lines) + "\n"

    def _keep_under_tmp(self) -> list[str]:
        import sparkdist

        needed = [
            sys.prefix,
            str(Path(sparkdist.__file__).resolve().parents[1]),
            str(self.shared),
            str(self.directory),
        ]
        return _topmost([p for p in (os.path.realpath(n) for n in needed) if p.startswith("/tmp/")])

    # -- running things ------------------------------------------------------------------------
    def env(self, host: str, **extra: str) -> dict[str, str]:
        """The environment of a process on ``host``: the caller's, less what names the caller's
        machine, with a private home and Spark told the host's address."""
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        env.update(
            HOME="/tmp/home",
            SPARK_LOCAL_IP=self.hosts[host].address,
            PYSPARK_PYTHON=sys.executable,
            PYSPARK_DRIVER_PYTHON=sys.executable,
            PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '/usr/bin:/bin')}",
            **{LAB_MARK_VAR: self.mark},
        )
        env.update(extra)
        return env

    def run(
        self,
        host: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str = "/tmp",
        timeout_s: float = 120.0,
        input: str = "",
    ) -> Result:
        reply = self._holder.call(
            "exec",
            timeout_s=timeout_s + 10,
            host=host,
            argv=argv,
            env=env if env is not None else self.env(host),
            cwd=cwd,
            input=input,
        )
        return Result(reply["rc"], reply["stdout"], reply["stderr"])

    def python(self, host: str, code: str, *, timeout_s: float = 60.0, **env: str) -> Result:
        return self.run(
            host, [sys.executable, "-c", code], env=self.env(host, **env), timeout_s=timeout_s
        )

    def spawn(
        self,
        host: str,
        argv: list[str],
        log: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: str = "/tmp",
        pipes: bool = False,
    ) -> dict[str, Any]:
        return self._holder.call(
            "spawn",
            host=host,
            argv=argv,
            env=env if env is not None else self.env(host),
            cwd=cwd,
            log=str(log),
            pipes=pipes,
        )

    def call(self, op: str, timeout_s: float = 120.0, **fields: Any) -> dict[str, Any]:
        """A raw holder request (``holder._OPS``), for the lab's own helpers."""
        return self._holder.call(op, timeout_s=timeout_s, **fields)

    def write_file(self, host: str, path: str, text: str) -> None:
        """Write a file on a host's private file system (its ``/tmp``, say)."""
        self._holder.call("write_file", host=host, path=path, text=text)

    def read_file(self, host: str, path: str) -> str | None:
        return self._holder.call("read_file", host=host, path=path)["text"]  # type: ignore[no-any-return]

    def list_dir(self, host: str, path: str) -> list[str] | None:
        return self._holder.call("list_dir", host=host, path=path)["names"]  # type: ignore[no-any-return]

    def processes(self, host: str | None = None) -> list[dict[str, Any]]:
        """Live processes of one host (or all): pid, ppid, argv, env_names, host."""
        return self._holder.call("processes", host=host)["processes"]  # type: ignore[no-any-return]

    def rank_processes(self, host: str | None = None) -> list[dict[str, Any]]:
        """Processes of sparkdist runs on a host: ranks (cold ones carry their run's id; one
        forked by a warm pool is named ``sparkdist-r<rank>``) and whatever they started.
        A pool's zygote and its parked spares are the pool's, not a run's."""
        rows = self.processes(host)
        children: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            children.setdefault(row["ppid"], []).append(row)
        found = {
            p["pid"]: p
            for p in rows
            if "SPARKDIST_RUN_ID" in p["env_names"] or p["name"].startswith("sparkdist-r")
        }
        pending = list(found.values())
        while pending:
            for child in children.get(pending.pop()["pid"], []):
                if child["pid"] not in found:
                    found[child["pid"]] = child
                    pending.append(child)
        return list(found.values())

    def wait_until_no_ranks(
        self, timeout_s: float, hosts: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """Wait for every rank of every run to be gone; the survivors, if any, after the wait."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = [p for p in self.rank_processes() if hosts is None or p["host"] in hosts]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)  # polling /proc is the only signal that a process is gone

    # -- faults --------------------------------------------------------------------------------
    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of ``host`` (its namespaces go with them)."""
        return self._holder.call("kill_host", host=host)["killed"]  # type: ignore[no-any-return]

    def cut(self, host: str) -> None:
        """Cut ``host`` off: its switch port goes down and its packets are silently dropped."""
        self._holder.call("link", host=host, up=False)

    def heal(self, host: str) -> None:
        self._holder.call("link", host=host, up=True)

    def delay(self, host: str, one_way_ms: float) -> None:
        """Hold every frame to and from ``host`` for ``one_way_ms`` (a user-space relay: see
        ``relay``). Between two hosts delayed by d each, the round trip grows by 4 d."""
        self._holder.call("delay", host=host, delay_ms=one_way_ms)

    def signal(self, pid: int, signal: int) -> None:
        self._holder.call("signal", pid=pid, signal=signal)

    def close(self) -> None:
        """End the lab: every process of every host, and the namespaces with them."""
        self._holder.close()

    @staticmethod
    def clear(directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)
