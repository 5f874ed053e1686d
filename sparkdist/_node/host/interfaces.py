"""This node's place on the network: the address its peers reach it at, the interface holding
that address (its ranks' ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``), and ``MASTER_ADDR``
as an address (DESIGN.md rule 11).

Decided once per node by the agent, in local mode as in Spark mode (rule 7); only what the
placement says differs (local mode: every host is 127.0.0.1, and loopback stays loopback).

- **This node's address**: the task's own host (``getTaskInfos()``) when it is an IP literal
  held by an interface here; otherwise the source address the kernel would use toward the
  first peer that is not this node: task 0's host, then the other tasks' hosts in task order,
  then the driver's (a UDP socket's ``connect`` sends no packet; ``getsockname`` then says).
- **Its interface**: the one holding that address (IPv4: ``SIOCGIFADDR`` over
  ``if_nameindex()``, the primary address of each; IPv6: ``/proc/net/if_inet6``).
- **MASTER_ADDR**: task 0's host when it is an IP literal. A name is resolved here: its first
  non-loopback address (IPv4 first, ``_core.addresses.pick_address``); on task 0's own node,
  where its name may resolve to 127.0.1.1 (Debian) or to a network no peer shares, this node's
  own address instead; a name that resolves only to loopback elsewhere means every task is on
  one host, and that loopback address is used; a name that does not resolve stays a name (the
  ranks' errors then name it).

Stdlib only (psutil is optional). Every lookup that fails counts as "not known": the ranks then
get no interface variables, never a wrong one, and the agent logs why.

Non-goals: setting the variables (``_core.env.with_socket_ifname``), Spark.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from sparkdist._core.addresses import ip_literal, is_loopback, parse_if_inet6, pick_address

logger = logging.getLogger("sparkdist")

#: ``ioctl`` request: an interface's (primary) IPv4 address (linux/sockios.h).
_SIOCGIFADDR = 0x8915
#: Any port will do: a UDP ``connect`` only chooses a route, it sends nothing.
_PROBE_PORT = 9
_IF_INET6 = "/proc/net/if_inet6"


@dataclass(frozen=True)
class NodeNetwork:
    """What a node's ranks are told about the network.

    Attributes:
        master_addr: their ``MASTER_ADDR``.
        address: this node's address as its peers reach it; None when every rank is on this
            host (loopback) or it could not be told.
        interface: the interface holding ``address``; None likewise.
    """

    master_addr: str
    address: str | None = None
    interface: str | None = None

    def describe(self) -> str:
        """``10.0.0.2 (eth0)``, for messages."""
        if self.address is None:
            return "loopback" if is_loopback(self.master_addr) else "address unknown"
        return f"{self.address} ({self.interface or 'interface unknown'})"


class SystemLookups:
    """The lookups ``node_network`` makes, on this host (a test passes a table instead)."""

    def resolve(self, host: str) -> list[str]:
        """``host``'s addresses: itself for a literal, the resolver's for a name ([] if none)."""
        if ip_literal(host) is not None:
            return [host]
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return []
        return list(dict.fromkeys(str(info[4][0]) for info in infos))

    def source_address(self, target: str) -> str | None:
        """The address the kernel would send from toward ``target`` (no packet is sent)."""
        address = ip_literal(target)
        if address is None:
            return None
        family = socket.AF_INET if address.version == 4 else socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((target, _PROBE_PORT))
                return str(probe.getsockname()[0]).split("%", 1)[0]
        except OSError:
            return None

    def interface_of(self, address: str) -> str | None:
        """The interface holding ``address`` here, or None."""
        return interface_of(address)


def interface_of(address: str) -> str | None:
    """The name of the interface of this host that holds ``address``, or None."""
    ip = ip_literal(address)
    if ip is None:
        return None
    if ip.version == 6:
        try:
            with open(_IF_INET6) as f:
                table = parse_if_inet6(f.read())
        except OSError:
            return None
        return next((name for held, name in table if held == str(ip)), None)
    wanted = socket.inet_aton(str(ip))
    try:
        names = [name for _, name in socket.if_nameindex()]
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    with probe:
        for name in names:
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):  # no IPv4 address on it, or it just went away
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
                if reply[20:24] == wanted:  # struct ifreq: name[16], then sockaddr_in
                    return name
    return None


def node_network(
    host: str,
    master_host: str,
    *,
    is_master_node: bool,
    peer_hosts: Sequence[str] = (),
    driver_host: str = "",
    lookups: SystemLookups | None = None,
) -> NodeNetwork:
    """Decide this node's address, its interface and ``MASTER_ADDR`` (see the module docstring).

    Args:
        host: this task's host, as Spark reports it (``getTaskInfos()``; 127.0.0.1 locally).
        master_host: task 0's host, as Spark reports it.
        is_master_node: this node is task 0 (its ranks host the store).
        peer_hosts: the other tasks' hosts, in task order.
        driver_host: the driver's address (its control channel), the last peer to route to.
        lookups: the resolver and the kernel's answers (this host's unless a test passes its own).
    """
    look = lookups or SystemLookups()
    if is_loopback(master_host):
        return NodeNetwork(master_host)  # every rank on this host: loopback stays loopback
    master_addresses = look.resolve(master_host)
    master = pick_address(master_addresses)
    address = _own_address(look, host, [master_host, *peer_hosts, driver_host])
    if master is not None and not (is_master_node and address is not None and _held(look, master)):
        master_addr = master
    elif is_master_node and address is not None:
        # Task 0's name resolves here only to loopback, or to an address of this node that may
        # sit on a network no peer shares: its ranks reach their own store at the address its
        # peers reach this node at.
        master_addr = address
    else:
        master_addr = master_addresses[0] if master_addresses else master_host
    interface = look.interface_of(address) if address is not None else None
    return NodeNetwork(master_addr, address, interface)


def _own_address(look: SystemLookups, host: str, peers: Sequence[str]) -> str | None:
    if ip_literal(host) is not None and look.interface_of(host) is not None:
        return host  # the address Spark reached this node at
    for peer in dict.fromkeys(p for p in peers if p and p != host):
        target = pick_address(look.resolve(peer))
        if target is None or _held(look, target):
            continue  # loopback, unresolvable, or this node itself: no route to a peer there
        source = look.source_address(target)
        if source is not None and not is_loopback(source):
            return source
    return None


def _held(look: SystemLookups, address: str) -> bool:
    return look.interface_of(address) is not None
