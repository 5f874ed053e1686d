"""Addresses as data: IP literals, loopback, which resolved address a node is told, and the
kernel's table of IPv6 addresses (``/proc/net/if_inet6``) read as text.

DESIGN.md rule 11: nodes are told addresses, never names, and each node's ranks use the
interface holding the address Spark reached that node at. The node side (``_node.host.interfaces``)
resolves names and asks the kernel; the decisions it takes on what comes back are here, pure.

Non-goals: resolving names, sockets, reading files.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def task_host(address: str) -> str:
    """The host part of a barrier task's ``host:port`` (``[v6]:port`` too), brackets removed."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def ip_literal(host: str) -> IPAddress | None:
    """``host`` as an address when it is one (a zone suffix ``%eth0`` allowed), else None."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ``::1``); a name never is: what a
    name means is only known once resolved."""
    address = ip_literal(host)
    return address is not None and address.is_loopback


def pick_address(addresses: Iterable[str]) -> str | None:
    """The address a node is told for a name that resolved to ``addresses`` (in the resolver's
    order): the first IPv4 address that is not loopback, else the first such IPv6 address;
    None when every one is loopback (or there is none).

    IPv4 first: Spark's own addresses and gloo's host-name lookups prefer it, and a cluster
    that resolves names to both families reaches its hosts over IPv4 in practice.
    """
    found = []
    for text in dict.fromkeys(addresses):
        address = ip_literal(text)
        if address is not None and not address.is_loopback:
            found.append((address.version != 4, text))
    return min(found, key=lambda item: item[0])[1] if found else None


def parse_if_inet6(text: str) -> list[tuple[str, str]]:
    """``(address, interface)`` pairs from the text of ``/proc/net/if_inet6``.

    Each line is the address as 32 hex digits, then the interface's index, the prefix length,
    the scope and flags (all hex), then the interface's name. Lines that do not read so are
    skipped.
    """
    pairs = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 6 or len(fields[0]) != 32:
            continue
        try:
            address = ipaddress.IPv6Address(int(fields[0], 16))
        except ValueError:
            continue
        pairs.append((str(address), fields[5]))
    return pairs
