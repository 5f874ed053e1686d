"""A failed rendezvous explained: torch's, gloo's and NCCL's own messages and the failed rank's
environment in, the node, the address it could not reach and the setting that fixes it out."""

from __future__ import annotations

import pytest

from sparkdist._core.run.rendezvous import DOCTOR_HINT, Diagnosis, diagnose

NETWORK_ERROR = "torch.distributed.DistNetworkError"
STORE_ERROR = "torch.distributed.DistStoreError"
GLOO_MESH = (
    "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error"
)


def rank_env(**changes: str) -> dict[str, str]:
    """Node 1's environment, its host 10.0.0.3, node 0's store at 10.0.0.2:29500."""
    env = {
        "NODE_RANK": "1",
        "SPARKDIST_HOST": "10.0.0.3",
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "29500",
    }
    env.update(changes)
    return {name: value for name, value in env.items() if value}


def diagnosed(exc_type: str, message: str, env: dict[str, str] | None = None) -> Diagnosis:
    diagnosis = diagnose(exc_type, message, rank_env() if env is None else env)
    assert diagnosis is not None
    return diagnosis


# -- interfaces ---------------------------------------------------------------------------------


def test_an_interface_name_that_is_not_on_the_host_is_named_with_the_variable_to_change():
    diagnosis = diagnosed(
        "RuntimeError",
        "[../third_party/gloo/gloo/transport/tcp/device.cc:84] Unable to find address for: eth9",
        rank_env(GLOO_SOCKET_IFNAME="eth9"),
    )
    assert diagnosis.what.startswith("rendezvous failed on node 1 (host 10.0.0.3): ")
    assert "GLOO_SOCKET_IFNAME=eth9 names no network interface" in diagnosis.what
    assert "GLOO_SOCKET_IFNAME" in diagnosis.fix and "NCCL_SOCKET_IFNAME" in diagnosis.fix
    assert "10.0.0.3" in diagnosis.fix and "leave it unset" in diagnosis.fix


def test_nccl_without_a_usable_interface_names_its_setting_and_the_variable_to_change():
    message = (
        "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, internal "
        "error - please report this issue to the NCCL developers, NCCL version 2.27.5\n"
        "ncclInternalError: Internal check failed.\n"
        "Last error:\nBootstrap : no socket interface found"
    )
    diagnosis = diagnosed(
        "torch.distributed.DistBackendError", message, rank_env(NCCL_SOCKET_IFNAME="=ib0")
    )
    assert "NCCL found no usable network interface (NCCL_SOCKET_IFNAME==ib0)" in diagnosis.what
    assert diagnosis.fix.startswith("set NCCL_SOCKET_IFNAME through env=")
    assert "10.0.0.3" in diagnosis.fix


def test_a_failure_on_a_node_without_a_node_rank_or_host_reads_this_node():
    diagnosis = diagnosed("RuntimeError", "Unable to find address for: eth9", {})
    assert diagnosis.what.startswith("rendezvous failed on this node: ")


def test_the_group_rank_names_the_node_when_there_is_no_node_rank():
    env = rank_env(NODE_RANK="", GROUP_RANK="2")
    diagnosis = diagnosed("RuntimeError", "Unable to find address for: eth9", env)
    assert diagnosis.what.startswith("rendezvous failed on node 2 (host 10.0.0.3): ")


# -- the store ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        "The client socket has timed out after 1800000ms while trying to connect to "
        "(10.0.0.9, 29511).",
        "The client socket has failed to connect to any network address of (10.0.0.9, 29511).",
        "TCP client failed to connect/validate to host 10.0.0.9:29511 - timed out (try=1, "
        "timeout=300000ms): The client socket has failed to connect to 10.0.0.9:29511",
    ],
)
def test_an_unreachable_store_names_the_address_and_port_from_the_message(message):
    # Not a DistNetworkError and no MASTER_ADDR: the message alone names the store.
    diagnosis = diagnosed("RuntimeError", message, rank_env(MASTER_ADDR="", MASTER_PORT=""))
    assert "node 1 (host 10.0.0.3)" in diagnosis.what
    assert "rank 0's store at 10.0.0.9:29511 (MASTER_ADDR:MASTER_PORT)" in diagnosis.what
    assert "let 10.0.0.3 reach 10.0.0.9 on TCP port 29511" in diagnosis.fix
    assert "SPARK_LOCAL_IP" in diagnosis.fix and DOCTOR_HINT in diagnosis.fix


def test_a_loopback_store_address_seen_from_another_host_is_fixed_with_spark_local_ip():
    message = (
        "The client socket has timed out after 300000ms while trying to connect to "
        "(127.0.1.1, 29500)."
    )
    diagnosis = diagnosed(NETWORK_ERROR, message, rank_env(MASTER_ADDR="127.0.1.1"))
    assert "store at 127.0.1.1:29500" in diagnosis.what
    assert "MASTER_ADDR 127.0.1.1 is a loopback address" in diagnosis.fix
    assert "spark.executorEnv.SPARK_LOCAL_IP" in diagnosis.fix


def test_a_loopback_store_address_on_a_loopback_host_is_not_blamed_on_loopback():
    # local-cluster: every node is this host, so loopback is right and the port is the question
    message = (
        "The client socket has failed to connect to any network address of (127.0.0.1, 29500)."
    )
    env = rank_env(SPARKDIST_HOST="127.0.0.1", MASTER_ADDR="127.0.0.1")
    diagnosis = diagnosed(NETWORK_ERROR, message, env)
    assert "let 127.0.0.1 reach 127.0.0.1 on TCP port 29500" in diagnosis.fix
    assert "is a loopback address" not in diagnosis.fix


def test_a_network_error_that_names_no_address_falls_back_to_master_addr():
    message = "Connection reset by peer"
    diagnosis = diagnosed(NETWORK_ERROR, message, rank_env(MASTER_ADDR="10.0.0.2"))
    assert "store at 10.0.0.2:29500" in diagnosis.what
    assert "let 10.0.0.3 reach 10.0.0.2 on TCP port 29500" in diagnosis.fix


def test_a_network_error_without_master_addr_or_an_address_is_not_a_rendezvous_failure():
    env = rank_env(MASTER_ADDR="", MASTER_PORT="")
    assert diagnose(NETWORK_ERROR, "Connection reset by peer", env) is None


def test_a_store_wait_timeout_says_the_store_was_reached_but_a_rank_did_not_join():
    message = "wait timeout after 30000ms, keys: /default_pg/0//cpu//0"
    diagnosis = diagnosed(STORE_ERROR, message)
    assert "node 1 (host 10.0.0.3)" in diagnosis.what
    assert "reached the store at 10.0.0.2:29500 but not every rank joined" in diagnosis.what
    assert "keys: /default_pg/0//cpu//0" in diagnosis.what
    assert "another rank failed first" in diagnosis.fix and "timeout=" in diagnosis.fix


def test_a_store_wait_timeout_in_a_plain_torch_error_is_recognised_by_its_words():
    message = "Timed out after 301 seconds waiting for clients. 1/2 clients joined."
    diagnosis = diagnosed("torch.distributed.DistError", message, rank_env(MASTER_PORT=""))
    assert "it reached the store but not every rank joined in time" in diagnosis.what


# -- the full mesh ------------------------------------------------------------------------------


def test_a_gloo_peer_on_a_loopback_address_is_fixed_through_the_host_names():
    message = f"{GLOO_MESH}, remote=[127.0.1.1]:41234"
    diagnosis = diagnosed("RuntimeError", message)
    assert "node 1 (host 10.0.0.3)" in diagnosis.what
    assert "gloo could not connect to a peer rank at 127.0.1.1:41234" in diagnosis.what
    assert "its host name resolves to loopback" in diagnosis.fix
    assert "/etc/hosts" in diagnosis.fix and "GLOO_SOCKET_IFNAME" in diagnosis.fix


@pytest.mark.parametrize(
    "message",
    [
        f"{GLOO_MESH}, remote=[10.0.0.4]:41234",
        "Gloo connectFullMesh failed with [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:"
        "446] Connect timeout [10.0.0.4]:41234",
    ],
)
def test_a_gloo_peer_on_a_network_address_is_fixed_by_opening_the_ports(message):
    diagnosis = diagnosed("RuntimeError", message, rank_env(GLOO_SOCKET_IFNAME="eth0"))
    assert "gloo could not connect to a peer rank at 10.0.0.4:41234" in diagnosis.what
    assert "(GLOO_SOCKET_IFNAME=eth0)" in diagnosis.what
    assert "let 10.0.0.3 reach 10.0.0.4 on every TCP port" in diagnosis.fix
    assert "GLOO_SOCKET_IFNAME" in diagnosis.fix and DOCTOR_HINT in diagnosis.fix


def test_a_gloo_mesh_failure_without_an_address_quotes_gloo_without_its_source_location():
    diagnosis = diagnosed("RuntimeError", GLOO_MESH + "\nmore detail")
    assert "gloo names no address: Gloo connectFullMesh failed with no error" in diagnosis.what
    assert "pair.cc" not in diagnosis.what
    assert "let 10.0.0.3 reach the other nodes on every TCP port" in diagnosis.fix


def test_a_long_library_message_is_quoted_short():
    diagnosis = diagnosed("RuntimeError", GLOO_MESH + " " + "x" * 500)
    assert "x" * 100 + "...)" in diagnosis.what and "x" * 200 not in diagnosis.what


def test_a_gloo_peer_on_a_loopback_address_on_a_local_cluster_is_a_port_question():
    env = rank_env(SPARKDIST_HOST="127.0.0.1", MASTER_ADDR="127.0.0.1")
    diagnosis = diagnosed("RuntimeError", f"{GLOO_MESH}, remote=[127.0.0.1]:41234", env)
    assert "host name" not in diagnosis.fix
    assert "let 127.0.0.1 reach 127.0.0.1 on every TCP port" in diagnosis.fix


def test_an_nccl_peer_it_could_not_connect_to_is_named_with_its_port():
    message = (
        "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled system "
        "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.5\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
        "device error.\nLast error:\nsocketStartConnect: Connect to 10.0.0.2<41234> failed : "
        "Software caused connection abort"
    )
    diagnosis = diagnosed(
        "torch.distributed.DistBackendError", message, rank_env(NCCL_SOCKET_IFNAME="=eth0")
    )
    assert "NCCL could not connect to a peer rank at 10.0.0.2:41234" in diagnosis.what
    assert "(NCCL_SOCKET_IFNAME==eth0)" in diagnosis.what
    assert "let 10.0.0.3 reach 10.0.0.2 on every TCP port" in diagnosis.fix
    assert "NCCL_SOCKET_IFNAME" in diagnosis.fix and "GLOO_SOCKET_IFNAME" not in diagnosis.fix


# -- a loopback interface named through env= ----------------------------------------------------


def test_a_gloo_peer_on_loopback_with_gloo_told_an_interface_blames_that_setting():
    message = f"{GLOO_MESH}, remote=[127.0.0.1]:41234"
    diagnosis = diagnosed("RuntimeError", message, rank_env(GLOO_SOCKET_IFNAME="lo"))
    assert "peer rank at 127.0.0.1:41234 (GLOO_SOCKET_IFNAME=lo)" in diagnosis.what
    assert "GLOO_SOCKET_IFNAME=lo makes gloo listen on a loopback address" in diagnosis.fix
    assert "unset it" in diagnosis.fix and "the interface the nodes share" in diagnosis.fix
    # The setting first; the host name only as the case where the user did not set it.
    assert diagnosis.fix.index("unset it") < diagnosis.fix.index("if you did not set it")


@pytest.mark.parametrize("value", ["=lo", "^eth,docker", "lo"])
def test_an_nccl_peer_on_loopback_with_nccl_told_an_interface_quotes_it_as_given(value):
    message = (
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed "
        "or device error.\nLast error:\nsocketStartConnect: Connect to 127.0.0.1<41234> failed "
        ": Connection refused"
    )
    env = rank_env(NCCL_SOCKET_IFNAME=value, GLOO_SOCKET_IFNAME="eth0")
    diagnosis = diagnosed("torch.distributed.DistBackendError", message, env)
    assert f"NCCL_SOCKET_IFNAME={value} makes NCCL listen on a loopback address" in diagnosis.fix
    assert "its host name resolves to loopback (/etc/hosts)" not in diagnosis.fix


def test_the_other_librarys_interface_setting_does_not_count():
    # NCCL_SOCKET_IFNAME says nothing about where gloo listened
    message = f"{GLOO_MESH}, remote=[127.0.1.1]:41234"
    diagnosis = diagnosed("RuntimeError", message, rank_env(NCCL_SOCKET_IFNAME="=lo"))
    assert "its host name resolves to loopback" in diagnosis.fix


# -- not a rendezvous ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc_type", "message"),
    [
        ("ValueError", "expected 3 channels, got 4"),
        ("RuntimeError", "CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("TimeoutError", "Socket Timeout"),  # not torch's
        ("SystemExit", "exited with code 1"),
    ],
)
def test_a_failure_that_is_not_a_rendezvous_is_none(exc_type, message):
    assert diagnose(exc_type, message, rank_env()) is None


def test_the_diagnosis_text_is_what_then_the_fix():
    diagnosis = diagnosed("RuntimeError", "Unable to find address for: eth9")
    assert diagnosis.text() == f"{diagnosis.what}\nfix: {diagnosis.fix}"
