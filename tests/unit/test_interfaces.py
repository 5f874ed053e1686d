"""Which interface a node's ranks use, and MASTER_ADDR as an address (DESIGN.md rule 11): the
pure rules table-driven, the decision over a table of lookups, the syscalls on this machine's
real loopback. Across real hosts: tests/multihost."""

from __future__ import annotations

import socket

import pytest

from sparkdist._core.addresses import (
    ip_literal,
    is_loopback,
    parse_if_inet6,
    pick_address,
    task_host,
)
from sparkdist._core.env import RankSeat, with_socket_ifname, worker_env
from sparkdist._node.agent.network import decide_node_network
from sparkdist._node.host.interfaces import (
    NodeNetwork,
    SystemLookups,
    interface_of,
    node_network,
)
from tests._helpers.specs import agent_spec

GLOO, NCCL = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"

# -- the variables ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("interface", "master", "user_env", "inherited", "expected"),
    [
        # set, both: gloo takes the name, NCCL the exact-match form
        ("eth0", "10.0.0.2", {}, {}, {GLOO: "eth0", NCCL: "=eth0"}),
        # local mode (and any one-host run): loopback stays loopback, nothing set
        ("eth0", "127.0.0.1", {}, {}, {}),
        ("lo", "127.0.0.1", {}, {}, {}),
        ("eth0", "::1", {}, {}, {}),
        # nothing known: nothing set
        (None, "10.0.0.2", {}, {}, {}),
        # the user's value, in env= or inherited, is theirs: each variable on its own
        ("eth0", "10.0.0.2", {GLOO: "ib0"}, {}, {GLOO: "ib0", NCCL: "=eth0"}),
        ("eth0", "10.0.0.2", {}, {NCCL: "^docker,lo"}, {GLOO: "eth0", NCCL: "^docker,lo"}),
        ("eth0", "10.0.0.2", {GLOO: "eth0,eth1"}, {NCCL: "eth"}, {GLOO: "eth0,eth1", NCCL: "eth"}),
        # empty is a value too: the user hands the choice back to gloo / NCCL
        ("eth0", "10.0.0.2", {GLOO: "", NCCL: ""}, {}, {GLOO: "", NCCL: ""}),
    ],
)
def test_socket_ifname_is_set_unless_the_user_set_it(
    interface, master, user_env, inherited, expected
):
    env = {**inherited, **user_env, "RANK": "0"}
    result = with_socket_ifname(
        env, interface, master_addr=master, user_env=user_env, inherited=inherited
    )
    assert {k: v for k, v in result.items() if k in (GLOO, NCCL)} == expected
    assert result["RANK"] == "0"
    assert GLOO not in env or env[GLOO] == result[GLOO]  # the input is not changed


def test_worker_env_carries_the_interface_and_keeps_the_users():
    seat = RankSeat(1, 0, 1, 2, 1, 2)
    args = dict(
        run_id="r",
        restart_count=0,
        max_restarts=0,
        cuda_visible_devices=None,
        mode="ddp",
        host="h1",
        socket_ifname="eth1",
    )
    env = worker_env({}, seat, master_addr="10.0.0.2", **args)
    assert (env[GLOO], env[NCCL]) == ("eth1", "=eth1")
    env = worker_env({NCCL: "ib"}, seat, master_addr="10.0.0.2", extra={GLOO: "bond0"}, **args)
    assert (env[GLOO], env[NCCL]) == ("bond0", "ib")
    env = worker_env({}, seat, master_addr="127.0.0.1", **args)
    assert GLOO not in env and NCCL not in env


def test_env_may_set_the_interface_variables():
    from sparkdist._core.env import check_user_env, launcher_owns

    assert not launcher_owns(GLOO) and not launcher_owns(NCCL)
    assert check_user_env({GLOO: "eth0", NCCL: "=eth0"}) == {GLOO: "eth0", NCCL: "=eth0"}


# -- addresses as data -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("10.0.0.2:40123", "10.0.0.2"),
        ("node-1.example:7077", "node-1.example"),
        ("[fd00::2]:40123", "fd00::2"),
        ("node-1", "node-1"),
    ],
)
def test_task_host(address, host):
    assert task_host(address) == host


@pytest.mark.parametrize(
    ("host", "literal", "loopback"),
    [
        ("10.0.0.2", True, False),
        ("127.0.1.1", True, True),
        ("::1", True, True),
        ("fe80::1%eth0", True, False),
        ("localhost", False, False),
        ("lab-host1", False, False),
    ],
)
def test_literals_and_loopback(host, literal, loopback):
    assert (ip_literal(host) is not None) == literal
    assert is_loopback(host) == loopback


@pytest.mark.parametrize(
    ("resolved", "picked"),
    [
        (["127.0.1.1"], None),  # Debian's /etc/hosts: nothing to tell the peers
        (["127.0.1.1", "10.0.0.2"], "10.0.0.2"),
        (["fd00::2", "10.0.0.2"], "10.0.0.2"),  # IPv4 first
        (["fd00::2", "::1"], "fd00::2"),
        (["10.0.0.3", "10.0.0.2"], "10.0.0.3"),  # else the resolver's order
        ([], None),
    ],
)
def test_pick_address(resolved, picked):
    assert pick_address(resolved) == picked


def test_parse_if_inet6():
    text = (
        "00000000000000000000000000000001 01 80 10 80       lo\n"
        "fd000000000000000000000000000002 02 40 00 80     eth0\n"
        "garbage line\n"
    )
    assert parse_if_inet6(text) == [("::1", "lo"), ("fd00::2", "eth0")]


# -- the decision, over a table of lookups ---------------------------------------------------


class Table(SystemLookups):
    """This node holds ``held`` ({address: interface}); names resolve by ``names``; the route
    toward an address leaves from ``routes`` (default: the first held address)."""

    def __init__(self, held, names=None, routes=None):
        self.held, self.names, self.routes = held, names or {}, routes or {}
        self.resolved: list[str] = []

    def resolve(self, host):
        self.resolved.append(host)
        return [host] if ip_literal(host) else list(self.names.get(host, []))

    def source_address(self, target):
        if is_loopback(target):
            return "127.0.0.1"
        return self.routes.get(target, next(iter(self.held)))

    def interface_of(self, address):
        return self.held.get(address)


PEERS = {"n0": ["10.0.0.2"], "n1": ["10.0.0.3"]}


@pytest.mark.parametrize(
    ("case", "kwargs", "table", "expected"),
    [
        (
            "local mode: loopback, nothing looked up",
            dict(host="127.0.0.1", master_host="127.0.0.1", is_master_node=True),
            Table({"10.0.0.2": "eth0"}),
            NodeNetwork("127.0.0.1"),
        ),
        (
            "Spark reached the node at an address it holds",
            dict(host="10.0.0.3", master_host="10.0.0.2", is_master_node=False),
            Table({"10.0.0.3": "eth1", "192.168.1.3": "eth0"}),
            NodeNetwork("10.0.0.2", "10.0.0.3", "eth1"),
        ),
        (
            "task 0 at its own address",
            dict(
                host="10.0.0.2",
                master_host="10.0.0.2",
                is_master_node=True,
                peer_hosts=["10.0.0.3"],
            ),
            Table({"10.0.0.2": "eth0"}),
            NodeNetwork("10.0.0.2", "10.0.0.2", "eth0"),
        ),
        (
            "names: the route toward task 0",
            dict(host="n1", master_host="n0", is_master_node=False, peer_hosts=["n0"]),
            Table({"192.168.1.3": "eth0", "10.0.0.3": "eth1"}, PEERS, {"10.0.0.2": "10.0.0.3"}),
            NodeNetwork("10.0.0.2", "10.0.0.3", "eth1"),
        ),
        (
            "Debian: task 0's own name is 127.0.1.1 there; routes toward task 1; is told itself",
            dict(host="n0", master_host="n0", is_master_node=True, peer_hosts=["n1"]),
            Table({"10.0.0.2": "eth0"}, {"n0": ["127.0.1.1"], "n1": ["10.0.0.3"]}),
            NodeNetwork("10.0.0.2", "10.0.0.2", "eth0"),
        ),
        (
            "task 0's name is a side network's address there: not a route to a peer",
            dict(host="n0", master_host="n0", is_master_node=True, peer_hosts=["n1"]),
            Table(
                {"198.19.0.2": "side0", "10.0.0.2": "eth0"},
                {"n0": ["198.19.0.2"], "n1": ["10.0.0.3"]},
                {"10.0.0.3": "10.0.0.2"},
            ),
            NodeNetwork("10.0.0.2", "10.0.0.2", "eth0"),
        ),
        (
            "a lone task routes toward the driver",
            dict(host="n0", master_host="n0", is_master_node=True, driver_host="10.0.0.10"),
            Table({"10.0.0.2": "eth0"}, {"n0": ["127.0.1.1"]}),
            NodeNetwork("10.0.0.2", "10.0.0.2", "eth0"),
        ),
        (
            "one host under a name that is loopback everywhere: loopback, no interface",
            dict(
                host="n",
                master_host="n",
                is_master_node=False,
                peer_hosts=["n"],
                driver_host="127.0.0.1",
            ),
            Table({"10.0.0.2": "eth0"}, {"n": ["127.0.1.1"]}),
            NodeNetwork("127.0.1.1"),
        ),
        (
            "task 0's name does not resolve here: it stays a name",
            dict(
                host="10.0.0.3", master_host="ghost", is_master_node=False, driver_host="10.0.0.10"
            ),
            Table({"10.0.0.3": "eth0"}),
            NodeNetwork("ghost", "10.0.0.3", "eth0"),
        ),
        (
            "no route to anyone: nothing known",
            dict(host="n1", master_host="ghost", is_master_node=False),
            Table({"10.0.0.3": "eth0"}),
            NodeNetwork("ghost"),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_node_network(case, kwargs, table, expected):
    assert node_network(**kwargs, lookups=table) == expected


def test_local_mode_resolves_nothing():
    table = Table({"10.0.0.2": "eth0"})
    node_network("127.0.0.1", "127.0.0.1", is_master_node=True, lookups=table)
    assert table.resolved == []


def test_describe():
    assert NodeNetwork("10.0.0.2", "10.0.0.3", "eth1").describe() == "10.0.0.3 (eth1)"
    assert NodeNetwork("127.0.0.1").describe() == "loopback"
    assert NodeNetwork("ghost").describe() == "address unknown"


# -- the kernel's answers, on this machine ---------------------------------------------------


def test_loopback_is_held_by_lo():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.254") is None  # TEST-NET-3: documentation only
    assert interface_of("not-an-address") is None


def test_ipv6_loopback_is_held_by_lo_where_the_kernel_has_ipv6():
    try:
        with open("/proc/net/if_inet6") as f:
            has_v6_loopback = ("::1", "lo") in parse_if_inet6(f.read())
    except OSError:
        has_v6_loopback = False
    if not has_v6_loopback:
        pytest.skip("no IPv6 loopback here")
    assert interface_of("::1") == "lo"


def test_real_lookups_on_loopback():
    look = SystemLookups()
    assert look.resolve("127.0.0.1") == ["127.0.0.1"]
    assert look.source_address("127.0.0.1") == "127.0.0.1"  # a UDP connect: no packet sent
    assert look.source_address("a-name") is None
    assert "127.0.0.1" in look.resolve("localhost") or "::1" in look.resolve("localhost")
    assert look.resolve("no-such-host.invalid") == []


def test_this_machines_own_address_finds_its_interface():
    # Whatever this machine's default route leaves from, the interface holding it is found.
    source = SystemLookups().source_address("192.0.2.1")
    if source is None:
        pytest.skip("no IPv4 route here")
    assert interface_of(source) is not None


def _spec(**kw):
    return agent_spec(channel_address=("127.0.0.1", 0), secret="", start_timeout_s=5.0, **kw)


def test_the_agents_decision_in_local_mode_is_loopback():
    assert decide_node_network(_spec()) == NodeNetwork("127.0.0.1")


def test_any_loopback_master_means_one_host():
    spec = _spec(
        node_rank=1,
        num_nodes=2,
        master_addr="127.0.0.2",
        host="127.0.0.1",
        task_hosts=("127.0.0.2", "127.0.0.1"),
    )
    assert decide_node_network(spec) == NodeNetwork("127.0.0.2")


def test_the_agents_decision_never_fails_the_node(monkeypatch, caplog):
    from sparkdist._node.agent import network

    def broken(*a, **k):
        raise RuntimeError("surprise")

    monkeypatch.setattr(network, "node_network", broken)
    spec = _spec(master_addr="10.0.0.2", host="10.0.0.2")
    assert decide_node_network(spec) == NodeNetwork("10.0.0.2")
    assert "surprise" in caplog.text


def test_hostname_resolution_is_not_needed_for_literals(monkeypatch):
    def no_dns(*a, **k):
        raise AssertionError("resolved a literal")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    assert SystemLookups().resolve("10.0.0.2") == ["10.0.0.2"]
