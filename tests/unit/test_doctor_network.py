"""The cluster network check of ``sparkdist doctor --master``: what the barrier tasks saw in,
node rows, verdicts, fixes and the node table out (pure: no Spark, no sockets)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sparkdist._doctor.network import (
    CHECK_NAME,
    NetworkReport,
    NodeObservation,
    Reach,
    judge_observation,
    network_check,
    node_rows,
    observation_from_dict,
    report_from_json,
    report_to_json,
)
from sparkdist._doctor.network_probe import judge_child
from sparkdist._doctor.table import Status

MASTER = "spark://10.0.0.1:7077"
DRIVER = "10.0.0.1:40001"
TASK0 = "10.0.0.2:40002"


def observed(task: int = 0, address: str = "10.0.0.2", **changes: object) -> NodeObservation:
    """A task that saw nothing wrong, with ``changes``."""
    seen = NodeObservation(
        task=task,
        address=address,
        interface="eth0",
        host_name=f"worker-{address.rsplit('.', 1)[-1]}",
        name_addresses=(address,),
        driver=Reach(DRIVER, True, seconds=0.01),
        task0=Reach(TASK0, True, seconds=0.01),
    )
    return replace(seen, **changes)


def reported(*nodes: NodeObservation, **changes: object) -> NetworkReport:
    report = NetworkReport(MASTER, DRIVER, len(nodes), nodes, seconds=2.34)
    return replace(report, **changes)


def statuses(seen: NodeObservation) -> list[Status]:
    return [finding.status for finding in judge_observation(seen)]


# -- one task's observation ---------------------------------------------------------------------


def test_a_task_that_saw_nothing_wrong_is_one_ok_finding_naming_its_addresses():
    [finding] = judge_observation(observed(name_addresses=("10.0.0.2", "fd00::2")))
    assert finding.status is Status.OK
    assert "10.0.0.2, fd00::2" in finding.what and finding.fix == ""


def test_an_executor_with_a_pyspark_outside_the_tested_range_is_a_note_with_the_fix():
    versions = {"pyspark": "3.4.1", "torch": "2.13.0+cpu", "mlflow": None, "deepspeed": None}
    [finding] = judge_observation(observed(versions=versions))
    assert finding.status is Status.NOTE
    assert "pyspark is 3.4.1 (OUTSIDE the tested range >=3.5,<5)" in finding.what
    assert "pip install 'pyspark>=3.5,<5'" in finding.fix and "executors" in finding.fix
    in_range = {**versions, "pyspark": "3.5.0"}
    assert statuses(observed(versions=in_range)) == [Status.OK]
    # What an executor reports travels as JSON to the driver and back unchanged.
    report = reported(observed(versions=versions))
    assert report_from_json(report_to_json(report)) == report


def test_a_node_that_cannot_reach_task_0_is_a_problem_with_the_open_ports_fix():
    seen = observed(task=1, address="10.0.0.3", task0=Reach(TASK0, False, "connection refused"))
    [finding] = judge_observation(seen)
    assert finding.status is Status.PROBLEM
    assert TASK0 in finding.what and "connection refused" in finding.what
    assert "firewall" in finding.fix and "all TCP ports" in finding.fix


def test_a_node_that_cannot_reach_the_driver_is_only_a_note_about_the_allgather_fallback():
    seen = observed(driver=Reach(DRIVER, False, "no answer within 5 s"))
    [finding] = judge_observation(seen)
    assert finding.status is Status.NOTE
    assert DRIVER in finding.what and "no answer within 5 s" in finding.what
    assert "allGather" in finding.what
    assert "spark.driver.host" in finding.fix


def test_a_driver_without_a_listener_address_is_named_its_address():
    [finding] = judge_observation(observed(driver=Reach("", False, "not tried")))
    assert "cannot reach the driver at its address (not tried)" in finding.what


def test_task_0_that_could_not_listen_is_a_problem_with_no_target_and_the_spark_local_ip_fix():
    seen = observed(task0=Reach("", False, "10.0.0.2: Cannot assign requested address"))
    [finding] = judge_observation(seen)
    assert finding.status is Status.PROBLEM
    assert "task 0 could not listen on its own address" in finding.what
    assert "Cannot assign requested address" in finding.what
    assert "SPARK_LOCAL_IP" in finding.fix


def test_an_address_no_interface_holds_is_a_note_to_name_the_interface_through_env():
    [finding] = judge_observation(observed(address="203.0.113.7", interface=""))
    assert finding.status is Status.NOTE
    assert "no interface of this host holds 203.0.113.7" in finding.what
    assert "GLOO_SOCKET_IFNAME" in finding.fix and "env=" in finding.fix


def test_an_own_name_that_does_not_resolve_is_a_note_to_add_it_to_the_hosts_file():
    seen = observed(host_name="worker-x", name_addresses=(), name_error="Name or service unknown")
    [finding] = judge_observation(seen)
    assert finding.status is Status.NOTE
    assert "worker-x does not resolve (Name or service unknown)" in finding.what
    assert "/etc/hosts" in finding.fix


def test_an_own_name_on_loopback_is_a_note_whose_fix_maps_the_name_to_the_nodes_address():
    seen = observed(address="10.0.0.3", host_name="worker-3", name_addresses=("127.0.1.1",))
    [finding] = judge_observation(seen)
    assert finding.status is Status.NOTE
    assert "worker-3 resolves to 127.0.1.1" in finding.what
    assert "map worker-3 to 10.0.0.3" in finding.fix


def test_an_own_name_that_resolves_to_nothing_reads_nothing():
    [finding] = judge_observation(observed(host_name="worker-3", name_addresses=()))
    assert finding.status is Status.NOTE and "resolves to nothing" in finding.what


def test_an_own_name_on_another_network_address_is_a_note_naming_both_addresses():
    seen = observed(address="10.0.0.3", host_name="worker-3", name_addresses=("192.168.5.3",))
    [finding] = judge_observation(seen)
    assert finding.status is Status.NOTE
    assert "worker-3 resolves to 192.168.5.3, not to 10.0.0.3" in finding.what
    assert "map worker-3 to 10.0.0.3" in finding.fix


def test_an_own_name_that_also_resolves_to_the_nodes_address_is_fine():
    seen = observed(address="10.0.0.3", name_addresses=("127.0.1.1", "10.0.0.3"))
    assert statuses(seen) == [Status.OK]


def test_a_node_spark_named_by_host_name_is_not_told_its_name_resolves_elsewhere():
    # YARN reports executors by host name: the address is a name, not what the name resolves to.
    seen = observed(address="worker-3.example", host_name="worker-3", name_addresses=("10.0.0.3",))
    assert statuses(seen) == [Status.OK]


@pytest.mark.parametrize("name_addresses", [("127.0.0.1",), ("127.0.1.1",), ("::1",)])
def test_a_node_entirely_on_loopback_gets_no_loopback_name_note(name_addresses):
    # local-cluster: every task on this host, loopback is what they reach each other at
    seen = observed(address="127.0.0.1", interface="lo", name_addresses=name_addresses)
    assert statuses(seen) == [Status.OK]


def test_a_node_on_loopback_with_no_interface_holding_it_gets_no_interface_note():
    assert statuses(observed(address="127.0.0.1", interface="")) == [Status.OK]


def test_a_probe_that_failed_in_a_task_is_only_that_error_as_a_problem():
    seen = observed(task=3, error="ConnectionResetError: [Errno 104]", interface="")
    [finding] = judge_observation(seen)
    assert finding.status is Status.PROBLEM
    assert "the probe failed in task 3: ConnectionResetError" in finding.what
    assert "executor's log" in finding.fix


def test_findings_come_worst_first():
    seen = observed(
        driver=Reach(DRIVER, False, "refused"),
        task0=Reach(TASK0, False, "refused"),
        name_addresses=("127.0.1.1",),
    )
    assert statuses(seen) == [Status.PROBLEM, Status.NOTE, Status.NOTE]


# -- node rows ----------------------------------------------------------------------------------


def test_tasks_at_one_address_become_one_node_row_with_their_task_ids_in_order():
    report = reported(
        observed(task=2, address="10.0.0.3"),
        observed(task=0, address="10.0.0.2"),
        observed(task=1, address="10.0.0.2"),
        observed(task=3, address="10.0.0.3"),
    )
    rows = node_rows(report)
    assert [(row.node, row.address, row.tasks) for row in rows] == [
        (0, "10.0.0.2", (0, 1)),
        (1, "10.0.0.3", (2, 3)),
    ]
    assert all(row.status is Status.OK and len(row.findings) == 1 for row in rows)


def test_a_node_rows_findings_are_de_duplicated_and_its_ok_dropped_for_a_worse_one():
    refused = Reach(TASK0, False, "connection refused")
    report = reported(
        observed(task=0, address="10.0.0.3"),
        observed(task=1, address="10.0.0.3", task0=refused),
        observed(task=2, address="10.0.0.3", task0=refused),
    )
    [row] = node_rows(report)
    assert [f.status for f in row.findings] == [Status.PROBLEM]
    assert row.task0 == "FAILED (2/3)" and row.driver == "ok"


def test_a_node_rows_status_is_its_worst_finding():
    report = reported(
        observed(task=0, address="10.0.0.3", name_addresses=("127.0.1.1",)),
        observed(task=1, address="10.0.0.3", task0=Reach(TASK0, False, "timed out")),
    )
    [row] = node_rows(report)
    assert row.status is Status.PROBLEM
    assert [f.status for f in row.findings] == [Status.PROBLEM, Status.NOTE]


def test_a_node_row_shows_an_interface_any_of_its_tasks_found_and_its_own_name():
    report = reported(
        observed(task=0, address="10.0.0.3", interface="", name_addresses=("127.0.1.1",)),
        observed(task=1, address="10.0.0.3", interface="ens5", name_addresses=("127.0.1.1",)),
    )
    [row] = node_rows(report)
    assert row.interface == "ens5"
    assert row.own_name == "worker-3 -> 127.0.1.1 (loopback)"


# -- the check ----------------------------------------------------------------------------------


def test_an_all_ok_report_is_one_ok_row_counting_tasks_and_nodes():
    check = network_check(reported(observed(0, "10.0.0.2"), observed(1, "10.0.0.3")))
    assert check.name == CHECK_NAME and check.status is Status.OK and check.fix == ""
    assert check.detail == (
        f"{MASTER}: 2 barrier task(s) on 2 node(s) in 2.3 s: 2 OK, 0 note(s), 0 problem(s)"
    )


def test_the_check_is_its_worst_node_and_counts_the_nodes_by_status():
    report = reported(
        observed(0, "10.0.0.2"),
        observed(1, "10.0.0.3", driver=Reach(DRIVER, False, "refused")),
        observed(2, "10.0.0.4", name_addresses=("127.0.1.1",)),
    )
    check = network_check(report)
    assert check.status is Status.NOTE
    assert check.detail.endswith("1 OK, 2 note(s), 0 problem(s)")
    assert check.fix == "see the node table below"


def test_one_node_that_cannot_reach_task_0_makes_the_check_a_problem():
    report = reported(
        observed(0, "10.0.0.2"), observed(1, "10.0.0.3", task0=Reach(TASK0, False, "refused"))
    )
    check = network_check(report)
    assert check.status is Status.PROBLEM
    assert check.detail.endswith("1 OK, 0 note(s), 1 problem(s)")


def test_a_report_with_an_error_and_no_nodes_is_a_problem_row_with_the_reports_fix():
    report = NetworkReport(MASTER, error="no executor registered within 30 s", fix="check it")
    check = network_check(report)
    assert check.status is Status.PROBLEM
    assert check.detail == f"{MASTER}: no executor registered within 30 s"
    assert check.fix == "check it" and check.table == ""


def test_an_error_after_some_nodes_reported_still_makes_the_check_a_problem():
    report = reported(observed(0, "10.0.0.2"), error="the barrier job did not finish within 60 s")
    check = network_check(report)
    assert check.status is Status.PROBLEM
    assert check.detail.endswith(
        "1 OK, 0 note(s), 0 problem(s); the barrier job did not finish within 60 s"
    )
    assert "10.0.0.2" in check.table


def test_the_node_table_lists_each_node_with_its_verdict_and_fix():
    report = reported(
        observed(0, "10.0.0.2"),
        observed(1, "10.0.0.2"),
        observed(2, "10.0.0.3", task0=Reach(TASK0, False, "connection refused")),
        observed(3, "10.0.0.4", name_addresses=("127.0.1.1",)),
    )
    table = network_check(report).table
    lines = table.splitlines()
    assert lines[0] == (
        f"{CHECK_NAME} on {MASTER} (driver listener {DRIVER}, task 0's test port {TASK0}):"
    )
    assert lines[1].split() == [
        "node", "tasks", "address", "interface", "own", "name", "driver", "task", "0", "status"
    ]  # fmt: skip
    body = {line.split()[0]: line.split() for line in lines[3:6]}
    assert body["0"][:4] == ["0", "0,", "1", "10.0.0.2"] and body["0"][-1] == "OK"
    assert body["1"][1:3] == ["2", "10.0.0.3"] and body["1"][-3:] == ["ok", "FAILED", "PROBLEM"]
    assert body["2"][-1] == "NOTE" and "(loopback)" in lines[5]
    assert "node 1 (10.0.0.3): PROBLEM: cannot reach task 0's host" in table
    assert "node 2 (10.0.0.4): NOTE: own name worker-4 resolves to 127.0.1.1" in table
    assert "  fix: a firewall between executors" in table
    assert table.count("fix: ") == 2  # the OK node has nothing to do


def test_the_node_table_shortens_a_run_of_task_ids():
    report = reported(*(observed(task, "10.0.0.2") for task in range(8)))
    [row] = network_check(report).table.splitlines()[3:4]
    assert row.split()[:3] == ["0", "0-7", "10.0.0.2"]


# -- JSON ---------------------------------------------------------------------------------------


def test_a_report_survives_its_json_round_trip():
    report = reported(
        observed(0, "10.0.0.2", name_addresses=("10.0.0.2", "fd00::2")),
        observed(1, "10.0.0.3", task0=Reach(TASK0, False, "refused", 5.0), error="boom"),
        error="late",
        fix="wait",
    )
    line = report_to_json(report)
    assert "\n" not in line
    assert report_from_json(line) == report


def test_an_observation_without_name_addresses_reads_as_none():
    data = json.loads(report_to_json(reported(observed())))["nodes"][0]
    del data["name_addresses"]
    assert observation_from_dict(data).name_addresses == ()


@pytest.mark.parametrize(
    "text",
    [
        '{"master": "x"}',  # no nodes
        '{"master": "x", "nodes": [], "colour": "red"}',  # not a field
        '{"master": "x", "nodes": [{"task": 0, "address": "a"}]}',  # a node without its reaches
        '{"master": "x", "nodes": [1]}',  # a node that is not an object
        "[1, 2]",
        "null",
        "not json",
    ],
)
def test_text_that_is_not_a_report_is_a_value_error(text):
    with pytest.raises(ValueError):
        report_from_json(text)


# -- the probe's child --------------------------------------------------------------------------


def test_a_child_that_printed_the_marker_line_gives_its_report():
    report = reported(observed(0, "10.0.0.2"))
    out = f"some chatter\nsparkdist-doctor-network {report_to_json(report)}\n"
    assert judge_child(MASTER, 0, out, "WARN NativeCodeLoader: ...\n") == report


def test_a_child_that_crashed_reports_the_last_error_line_of_its_stderr():
    err = (
        "Traceback (most recent call last):\n"
        '  File "<string>", line 1, in <module>\n'
        "py4j.protocol.Py4JJavaError: An error occurred while calling None.SparkContext.\n"
        ": java.net.UnknownHostException: nohost: Name or service not known\n"
        "\tat java.base/java.net.InetAddress.getAllByName0(InetAddress.java:1300)\n"
    )
    report = judge_child("spark://nohost:7077", 1, "", err)
    assert report.master == "spark://nohost:7077" and report.nodes == ()
    assert report.error.startswith("no session on it ran the probe: ")
    assert "UnknownHostException: nohost" in report.error
    assert "spark-shell --master" in report.fix


def test_a_child_that_printed_nothing_reports_its_exit_code():
    report = judge_child(MASTER, -9, "", "")
    assert report.error == "no session on it ran the probe: exit code -9"


def test_a_child_whose_marker_line_is_garbled_falls_back_to_its_stderr():
    out = 'sparkdist-doctor-network {"master": \n'
    report = judge_child(MASTER, 1, out, "starting\nsession lost\n")
    assert report.error == "no session on it ran the probe: session lost"


def test_a_childs_failure_line_is_cut_to_300_characters():
    report = judge_child(MASTER, 1, "", "RuntimeError: " + "x" * 1000)
    assert len(report.error) == len("no session on it ran the probe: ") + 300
