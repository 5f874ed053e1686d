"""What a failed rendezvous says: the node, the address it could not reach, the setting to change.

A rank's ``init_process_group`` fails in a handful of ways, each with torch's, gloo's or NCCL's
own words: the store client cannot connect to ``MASTER_ADDR:MASTER_PORT`` (``DistNetworkError``:
"... while trying to connect to (A, P)", "... to any network address of (A, P)"), a peer never
wrote its address to the store (``DistStoreError``: "wait timeout after ...ms, keys: ..."),
``GLOO_SOCKET_IFNAME`` names no interface ("Unable to find address for: X"), or the full mesh
cannot be built ("Gloo connectFullMesh failed with ..."; gloo names the peer as ``[A]:P``, NCCL
as ``A<P>``).
``diagnose`` reads that message together with the rank's own environment (its node rank,
its host as the driver knows it, ``MASTER_ADDR``/``MASTER_PORT``, the ``*_SOCKET_IFNAME``
settings) and says which node could not reach what, and the fix.

Pure: a message and a mapping in, text out. The worker calls it when a rank fails and the
failure message prints it (``errors``).

Non-goals: retrying, or deciding that a run failed at its rendezvous (the ranks' own clocks
and exit codes decide what failed first: ``run_state``); probing the network (``sparkdist
doctor --master``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sparkdist._core.addresses import is_loopback
from sparkdist._core.env import GLOO_SOCKET_IFNAME_VAR as GLOO_IFNAME_VAR
from sparkdist._core.env import HOST_VAR
from sparkdist._core.env import NCCL_SOCKET_IFNAME_VAR as NCCL_IFNAME_VAR

#: Says which node reaches which: the fix names it whenever the network is in question.
DOCTOR_HINT = "`sparkdist doctor --master <url>` shows which nodes reach the driver and node 0"
_MAX_QUOTE_CHARS = 160

_STORE_CONNECT = (
    re.compile(
        r"(?:trying to connect to|any network address of) \((?P<addr>[^,()\s]+), (?P<port>\d+)\)"
    ),
    re.compile(r"failed to connect/validate to host (?P<addr>\S+?):(?P<port>\d+)"),
)
_STORE_WAIT = re.compile(
    r"wait timeout after \d+ ?ms|Timed out after \d+ seconds waiting for clients|"
    r"Socket Timeout|timed out waiting for keys",
    re.IGNORECASE,
)
_MISSING_IFNAME = re.compile(r"Unable to find address for: (?P<name>\S+)")
_NCCL_NO_INTERFACE = re.compile(r"no socket interface found", re.IGNORECASE)
_GLOO_MESH = re.compile(r"connectFullMesh failed", re.IGNORECASE)
#: gloo's ``Address::str()``: ``[10.0.0.2]:41234`` (the brackets also around IPv6).
_GLOO_REMOTE = re.compile(r"remote=\[(?P<addr>[0-9A-Fa-f.:]+)\]:(?P<port>\d+)")
_GLOO_ADDRESS = re.compile(r"\[(?P<addr>[0-9A-Fa-f.:]+)\]:(?P<port>\d+)")
#: NCCL's socket addresses: ``10.0.0.2<41234>``.
_NCCL_ADDRESS = re.compile(r"(?P<addr>[0-9A-Fa-f.:]+)<(?P<port>\d+)>")
_NCCL = re.compile(r"\bNCCL\b|ncclSystemError|ncclRemoteError|ncclInternalError")
_NCCL_CONNECT = re.compile(r"connect|socket|Connection|timed out", re.IGNORECASE)
#: The source location gloo's enforce messages begin with.
_GLOO_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|h|cpp):\d+\]\s*")


@dataclass(frozen=True)
class Diagnosis:
    """A failed rendezvous explained: what happened where, and what to change.

    Attributes:
        what: which node (node rank, host) could not reach which address.
        fix: the setting or rule that fixes it.
    """

    what: str
    fix: str

    def text(self) -> str:
        """Two lines: ``rendezvous failed on node N ...`` and ``fix: ...``."""
        return f"{self.what}\nfix: {self.fix}"


def diagnose(exc_type: str, message: str, env: Mapping[str, str]) -> Diagnosis | None:
    """Explain a rank's failure when it is a failed rendezvous; None when it is not one.

    Args:
        exc_type: the exception's qualified type name (``torch.distributed.DistNetworkError``).
        message: the exception's message, as torch, gloo or NCCL wrote it.
        env: the failed rank's environment (``NODE_RANK``, ``SPARKDIST_HOST``,
            ``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).
    """
    where = _where(env)
    host = env.get(HOST_VAR, "")
    quoted = _quote(message)
    missing = _MISSING_IFNAME.search(message)
    if missing is not None:
        name = missing.group("name")
        return Diagnosis(
            f"rendezvous failed on {where}: {GLOO_IFNAME_VAR}={name} names no network "
            "interface of this host",
            f"set {GLOO_IFNAME_VAR} (and {NCCL_IFNAME_VAR} for NCCL) through env= to an "
            "interface every node has (the one holding the address Spark reached the node "
            f"at{_at(host)}), or leave it unset: sparkdist then sets it to that interface",
        )
    if _NCCL.search(message) and _NCCL_NO_INTERFACE.search(message):
        return Diagnosis(
            f"rendezvous failed on {where}: NCCL found no usable network interface"
            + _ifname_note(env, NCCL_IFNAME_VAR),
            f"set {NCCL_IFNAME_VAR} through env= to the interface the nodes share (the one "
            f"holding the address Spark reached the node at{_at(host)})",
        )
    for pattern in _STORE_CONNECT:
        found = pattern.search(message)
        if found is not None:
            return _store_unreachable(where, host, found.group("addr"), found.group("port"))
    if exc_type.endswith("DistNetworkError") and env.get("MASTER_ADDR"):
        return _store_unreachable(where, host, env["MASTER_ADDR"], env.get("MASTER_PORT", "?"))
    if _GLOO_MESH.search(message):
        found = _GLOO_REMOTE.search(message) or _GLOO_ADDRESS.search(message)
        return _peer_unreachable(where, host, "gloo", found, quoted, env, GLOO_IFNAME_VAR)
    if _NCCL.search(message) and _NCCL_CONNECT.search(message):
        found = _NCCL_ADDRESS.search(message)
        return _peer_unreachable(where, host, "NCCL", found, quoted, env, NCCL_IFNAME_VAR)
    if exc_type.endswith("DistStoreError") or (
        exc_type.startswith("torch.distributed") and _STORE_WAIT.search(message)
    ):
        store = _store_address(env)
        return Diagnosis(
            f"rendezvous failed on {where}: it reached the store{store} but not every rank "
            f"joined in time ({quoted})",
            "another rank failed first or could not reach the store: its error names the "
            "address it could not reach; raise init_process_group(timeout=...) only if a rank "
            f"is merely slow to start ({DOCTOR_HINT})",
        )
    return None


def _store_unreachable(where: str, host: str, addr: str, port: str) -> Diagnosis:
    what = (
        f"rendezvous failed on {where}: it could not reach rank 0's store at {addr}:{port} "
        "(MASTER_ADDR:MASTER_PORT)"
    )
    if is_loopback(addr) and host and not is_loopback(host):
        return Diagnosis(
            what,
            f"MASTER_ADDR {addr} is a loopback address, so only node 0's own host can use it: "
            "node 0's executor registered with Spark under a loopback address; give it its "
            "network address (spark.executorEnv.SPARK_LOCAL_IP, or SPARK_LOCAL_IP in the "
            "Worker's spark-env.sh)",
        )
    return Diagnosis(
        what,
        f"let {host or 'this host'} reach {addr} on TCP port {port}: open the port range "
        "between the executors (the store's port is chosen by the OS, and NCCL/gloo connect "
        "on OS-chosen ports too, so allow every port between the nodes); if "
        f"{addr} is not node 0's address on the network the nodes share, set SPARK_LOCAL_IP on "
        f"node 0's executor to that address ({DOCTOR_HINT})",
    )


def _peer_unreachable(
    where: str,
    host: str,
    library: str,
    found: re.Match[str] | None,
    quoted: str,
    env: Mapping[str, str],
    ifname_var: str,
) -> Diagnosis:
    note = _ifname_note(env, ifname_var)
    if found is None:
        return Diagnosis(
            f"rendezvous failed on {where}: {library} could not connect every pair of ranks "
            f"({library} names no address: {quoted}){note}",
            _open_ports_fix(host, "", ifname_var),
        )
    addr, port = found.group("addr"), found.group("port")
    what = (
        f"rendezvous failed on {where}: {library} could not connect to a peer rank at "
        f"{addr}:{port}{note}"
    )
    if is_loopback(addr) and not is_loopback(host or addr):
        told = env.get(ifname_var, "")
        if told:
            # The ranks were told an interface (env= tells every rank the same one), so the
            # peer did not listen on its name's address: that interface holds a loopback one
            # (env={"GLOO_SOCKET_IFNAME": "lo"}). NCCL's value is quoted as given ("=lo",
            # "^eth": exact, exclude). sparkdist sets it too, where a node's interface is
            # found: a peer where none was could still have read its loopback host name.
            return Diagnosis(
                what,
                f"a peer offered the loopback address {addr}: {ifname_var}={told} makes "
                f"{library} listen on a loopback address the other nodes cannot reach; unset "
                "it (sparkdist then picks the interface holding the node's address) or name "
                "the interface the nodes share; if you did not set it, the peer's host name "
                "resolves to loopback: map it to its network address in /etc/hosts",
            )
        return Diagnosis(
            what,
            f"a peer offered the loopback address {addr}: its host name resolves to loopback "
            f"(/etc/hosts), so {library} listened there; set {ifname_var} through env= to "
            "the interface the nodes share, or map each host's name to its network address "
            "in /etc/hosts",
        )
    return Diagnosis(what, _open_ports_fix(host, addr, ifname_var))


def _open_ports_fix(host: str, addr: str, ifname_var: str) -> str:
    target = addr or "the other nodes"
    return (
        f"let {host or 'this host'} reach {target} on every TCP port: a firewall between the "
        "executors must allow all ports between the nodes (NCCL/gloo listen on OS-chosen "
        f"ports); on hosts with several interfaces set {ifname_var} through env= to the one "
        f"the nodes share ({DOCTOR_HINT})"
    )


def _where(env: Mapping[str, str]) -> str:
    """``node 1 (host 10.0.0.3)``: a node's ranks that fail alike read alike (one line)."""
    node = env.get("NODE_RANK", env.get("GROUP_RANK", ""))
    head = f"node {node}" if node else "this node"
    return head + (f" (host {env[HOST_VAR]})" if env.get(HOST_VAR) else "")


def _store_address(env: Mapping[str, str]) -> str:
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    return f" at {addr}:{port}" if addr and port else ""


def _ifname_note(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    return f" ({name}={value})" if value else ""


def _at(host: str) -> str:
    return f", {host}" if host else ""


def _quote(message: str) -> str:
    """The library's message, short: its first line without the source location."""
    lines = message.strip().splitlines()
    first = _GLOO_LOCATION.sub("", lines[0] if lines else "").strip()
    if len(first) > _MAX_QUOTE_CHARS:
        first = first[: _MAX_QUOTE_CHARS - 3] + "..."
    return first or "no message"
