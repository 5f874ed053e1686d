"""The cluster network check of ``sparkdist doctor --master``: what each barrier task saw, as
rows, verdicts and fixes (pure).

The probe (``network_probe``) runs one barrier task per executor slot; each reports a
``NodeObservation``: its address (the host part of its ``getTaskInfos()`` address), the
interface holding it, what its own host name resolves to, and whether it reached the driver's
listener and task 0's test port. Here tasks at one address become one node, each node gets a
status (the worst of its findings) and one line per finding with its fix, and the whole check
one row of the doctor's table with the node table below it.

What counts: a node that cannot reach task 0's host is a PROBLEM (gloo and NCCL connect every
pair of nodes on OS-chosen ports, so the run fails); one that cannot reach the driver is a NOTE
(the ranks rendezvous through Spark's ``allGather`` instead, their output comes at the end); a
host name that resolves to loopback, or none, is a NOTE (sparkdist tells nodes addresses and
sets ``GLOO_SOCKET_IFNAME``; other tools read the name).

Non-goals: probing (``network_probe``), printing (the CLI prints ``Check.table``).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sparkdist._core.addresses import ip_literal, is_loopback
from sparkdist._core.supported import describe, outside_range
from sparkdist._doctor.table import Check, Status
from sparkdist._wire.channel.client import CONNECT_TIMEOUT_S as CHANNEL_CONNECT_TIMEOUT_S

CHECK_NAME = "cluster network"
_ORDER = {Status.OK: 0, Status.NOTE: 1, Status.PROBLEM: 2}
_PEER_FIX = (
    "a firewall between executors: NCCL/gloo need every port between nodes (they listen on "
    "OS-chosen ports); allow all TCP ports between the executor hosts"
)


@dataclass(frozen=True)
class Reach:
    """One connection attempt with the probe's token.

    Attributes:
        target: ``host:port`` tried ("" when there was nothing to try).
        ok: the listener answered with the token.
        error: why not ("connection refused", "no answer within 5 s", ...).
        seconds: how long the attempt took.
    """

    target: str
    ok: bool
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class NodeObservation:
    """What one barrier task saw.

    Attributes:
        task: its partition id.
        address: the host part of its ``getTaskInfos()`` address.
        interface: the interface here holding that address ("" when none does).
        host_name: ``socket.gethostname()``.
        name_addresses: what ``host_name`` resolves to.
        name_error: why it does not resolve ("" when it does).
        driver: its attempt at the driver's listener.
        task0: its attempt at task 0's test port.
        error: the probe itself failed in this task ("" when it did not).
        versions: the executor's pyspark, torch, MLflow and DeepSpeed (None: not installed).
    """

    task: int
    address: str
    interface: str = ""
    host_name: str = ""
    name_addresses: tuple[str, ...] = ()
    name_error: str = ""
    driver: Reach = field(default_factory=lambda: Reach("", False, "not tried"))
    task0: Reach = field(default_factory=lambda: Reach("", False, "not tried"))
    error: str = ""
    versions: Mapping[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkReport:
    """The probe's outcome.

    Attributes:
        master: the Spark master probed.
        driver: the driver's listener, ``host:port`` ("" when it could not listen).
        tasks: how many barrier tasks ran (one per executor slot).
        nodes: every task's observation, by task.
        seconds: how long the barrier job took.
        error: why the probe did not run to the end ("" when it did).
        fix: what to do about ``error``.
    """

    master: str
    driver: str = ""
    tasks: int = 0
    nodes: tuple[NodeObservation, ...] = ()
    seconds: float = 0.0
    error: str = ""
    fix: str = ""


@dataclass(frozen=True)
class Finding:
    """One thing a node's observation says, with its fix ("" when there is nothing to do)."""

    status: Status
    what: str
    fix: str = ""


@dataclass(frozen=True)
class NodeRow:
    """One node (the tasks at one address) with its findings."""

    node: int
    address: str
    tasks: tuple[int, ...]
    interface: str
    own_name: str
    driver: str
    task0: str
    findings: tuple[Finding, ...]

    @property
    def status(self) -> Status:
        return max((f.status for f in self.findings), key=_ORDER.__getitem__, default=Status.OK)


def judge_observation(seen: NodeObservation) -> list[Finding]:
    """The findings of one task's observation, the worst first; [OK] when all is well."""
    if seen.error:
        return [
            Finding(
                Status.PROBLEM,
                f"the probe failed in task {seen.task}: {seen.error}",
                "see that executor's log (stderr of its Python worker)",
            )
        ]
    found: list[Finding] = []
    if not seen.task0.ok:
        if not seen.task0.target:
            found.append(
                Finding(
                    Status.PROBLEM,
                    f"task 0 could not listen on its own address ({seen.task0.error})",
                    "the address Spark reached task 0's executor at is not on that host (NAT, "
                    "a container's mapped address?): start the executors with SPARK_LOCAL_IP "
                    "set to an address they hold and the other hosts reach",
                )
            )
        else:
            found.append(
                Finding(
                    Status.PROBLEM,
                    f"cannot reach task 0's host at {seen.task0.target} ({seen.task0.error})",
                    _PEER_FIX,
                )
            )
    if not seen.driver.ok:
        target = seen.driver.target or "its address"
        found.append(
            Finding(
                Status.NOTE,
                f"cannot reach the driver at {target} ({seen.driver.error}): runs fall back "
                f"to Spark's allGather (each launch first waits {CHANNEL_CONNECT_TIMEOUT_S:g} s "
                "for the driver; rank output comes only at the end)",
                "open the port range from the executors to the driver (its control channel "
                "listens on an OS-chosen port), or set spark.driver.host to an address the "
                "executors reach",
            )
        )
    loopback_node = is_loopback(seen.address)  # every task on one host: loopback is right
    if not seen.interface and not loopback_node:
        found.append(
            Finding(
                Status.NOTE,
                f"no interface of this host holds {seen.address}",
                "sparkdist sets GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to the interface holding "
                "the node's address; here it cannot, so set them through env= to the interface "
                "the other nodes reach this one on",
            )
        )
    name = seen.host_name or "?"
    if seen.name_error:
        found.append(
            Finding(
                Status.NOTE,
                f"own name {name} does not resolve ({seen.name_error})",
                "fine for sparkdist (nodes are told addresses), but add it to /etc/hosts or "
                "DNS for other tools",
            )
        )
    elif not loopback_node and all(is_loopback(a) for a in seen.name_addresses):
        found.append(
            Finding(
                Status.NOTE,
                f"own name {name} resolves to {', '.join(seen.name_addresses) or 'nothing'}",
                "fine for sparkdist (it sets GLOO_SOCKET_IFNAME), but fix /etc/hosts for other "
                f"tools (map {name} to {seen.address})",
            )
        )
    elif (
        not loopback_node
        and ip_literal(seen.address) is not None  # Spark may name a node by name (YARN)
        and seen.address not in seen.name_addresses
    ):
        # Tools that advertise the address of their host name (gloo and NCCL without an
        # interface named, torchrun's c10d) would hand out one the peers may not reach.
        found.append(
            Finding(
                Status.NOTE,
                f"own name {name} resolves to {', '.join(seen.name_addresses)}, not to "
                f"{seen.address} (the address Spark reached it at)",
                "fine for sparkdist (it sets GLOO_SOCKET_IFNAME), but other tools advertise "
                f"that address: map {name} to {seen.address} in /etc/hosts or DNS",
            )
        )
    for entry, version in outside_range(seen.versions):
        found.append(
            Finding(
                Status.NOTE,
                f"its {entry.name} is {describe(entry.name, version)}",
                entry.fix() + " on the executors (their image, cluster libraries or init script)",
            )
        )
    if not found:
        found.append(
            Finding(
                Status.OK,
                "reaches the driver and task 0's host; own name resolves to "
                + ", ".join(seen.name_addresses),
            )
        )
    return sorted(found, key=lambda f: -_ORDER[f.status])


def node_rows(report: NetworkReport) -> list[NodeRow]:
    """One row per address the tasks ran at, in the order of their first task."""
    by_address: dict[str, list[NodeObservation]] = {}
    for seen in sorted(report.nodes, key=lambda n: n.task):
        by_address.setdefault(seen.address, []).append(seen)
    rows = []
    for number, (address, group) in enumerate(by_address.items()):
        findings = list(dict.fromkeys(f for seen in group for f in judge_observation(seen)))
        if any(f.status is not Status.OK for f in findings):
            findings = [f for f in findings if f.status is not Status.OK]
        first = group[0]
        rows.append(
            NodeRow(
                node=number,
                address=address,
                tasks=tuple(seen.task for seen in group),
                interface=next((s.interface for s in group if s.interface), "none"),
                own_name=_own_name(first),
                driver=_reach_cell([seen.driver for seen in group]),
                task0=_reach_cell([seen.task0 for seen in group]),
                findings=tuple(sorted(findings, key=lambda f: -_ORDER[f.status])),
            )
        )
    return rows


def network_check(report: NetworkReport) -> Check:
    """The doctor's row for the probe, its node table in ``Check.table``."""
    if report.error and not report.nodes:
        return Check(CHECK_NAME, Status.PROBLEM, f"{report.master}: {report.error}", report.fix)
    rows = node_rows(report)
    counts = {status: sum(row.status is status for row in rows) for status in Status}
    worst = max((row.status for row in rows), key=_ORDER.__getitem__, default=Status.PROBLEM)
    detail = (
        f"{report.master}: {report.tasks} barrier task(s) on {len(rows)} node(s) in "
        f"{report.seconds:.1f} s: {counts[Status.OK]} OK, {counts[Status.NOTE]} note(s), "
        f"{counts[Status.PROBLEM]} problem(s)"
    )
    if report.error:
        detail += f"; {report.error}"
        worst = Status.PROBLEM
    fix = "see the node table below" if worst is not Status.OK else ""
    return Check(CHECK_NAME, worst, detail, fix, table=format_nodes(report, rows))


def format_nodes(
    report: NetworkReport, rows: Sequence[NodeRow] | None = None, width: int = 100
) -> str:
    """The node table, then each node's verdict line and its fixes."""
    rows = node_rows(report) if rows is None else rows
    task0_port = next((n.task0.target for n in report.nodes if n.task0.target), "none")
    lines = [
        f"{CHECK_NAME} on {report.master} (driver listener {report.driver or 'none'}, "
        f"task 0's test port {task0_port}):"
    ]
    header = ("node", "tasks", "address", "interface", "own name", "driver", "task 0", "status")
    cells = [
        (
            str(row.node),
            _task_list(row.tasks),
            row.address,
            row.interface,
            row.own_name,
            row.driver,
            row.task0,
            row.status.value,
        )
        for row in rows
    ]
    widths = [max(len(r[i]) for r in (header, *cells)) for i in range(len(header))]
    for cell_row in (header, tuple("-" * w for w in widths), *cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cell_row, widths, strict=True)).rstrip())
    lines.append("")
    for row in rows:
        what = "; ".join(f.what for f in row.findings)
        head = f"node {row.node} ({row.address}): {row.status.value}: {what}"
        lines.extend(textwrap.wrap(head, width, subsequent_indent="    "))
        for fix in dict.fromkeys(f.fix for f in row.findings if f.fix):
            lines.extend(
                textwrap.wrap(
                    "fix: " + fix, width, initial_indent="  ", subsequent_indent="       "
                )
            )
    return "\n".join(lines)


def report_to_json(report: NetworkReport) -> str:
    """One line of JSON (the probe's child process prints it)."""
    return json.dumps(asdict(report))


def report_from_json(text: str) -> NetworkReport:
    """The report ``report_to_json`` wrote.

    Raises:
        ValueError: ``text`` is not such a report.
    """
    try:
        data = json.loads(text)
        return NetworkReport(
            **{**data, "nodes": tuple(observation_from_dict(n) for n in data["nodes"])}
        )
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"not a network report: {exc}") from exc


def observation_from_dict(data: dict[str, Any]) -> NodeObservation:
    """A task's observation from its JSON object (``dataclasses.asdict`` of one)."""
    return NodeObservation(
        **{
            **data,
            "name_addresses": tuple(data.get("name_addresses", ())),
            "driver": Reach(**data["driver"]),
            "task0": Reach(**data["task0"]),
        }
    )


def _own_name(seen: NodeObservation) -> str:
    if seen.name_error:
        return f"{seen.host_name} -> does not resolve"
    shown = ", ".join(seen.name_addresses) or "nothing"
    loopback = seen.name_addresses and all(is_loopback(a) for a in seen.name_addresses)
    return f"{seen.host_name} -> {shown}" + (" (loopback)" if loopback else "")


def _reach_cell(reaches: Sequence[Reach]) -> str:
    failed = [r for r in reaches if not r.ok]
    if not failed:
        return "ok"
    return "FAILED" if len(failed) == len(reaches) else f"FAILED ({len(failed)}/{len(reaches)})"


def _task_list(tasks: Sequence[int]) -> str:
    """``0``, ``0, 1``, ``0-7``: consecutive runs shortened."""
    if len(tasks) > 2 and list(tasks) == list(range(tasks[0], tasks[0] + len(tasks))):
        return f"{tasks[0]}-{tasks[-1]}"
    return ", ".join(map(str, tasks))
