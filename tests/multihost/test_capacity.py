"""Capacity follows the cluster: an executor given up in one run is given up for that run only.

- A host where two attempts' root causes struck has its executor given up (the next attempt
  does not use it); the application keeps its executor target, so the cluster manager starts a
  new executor there, and the next run places a rank on it. Before, ``SparkContext.killExecutors``
  lowered the target of a standalone application to 0 for good: the host never came back.
- A host the run lost contact with (cut off) has its executor given up before the restart:
  Spark would list it until ``spark.network.timeout`` (120 s) and could place a rank there.

The tests have an application of their own (the cores the lab's first application leaves, one
per host), so the only free core for a new executor is the given-up host's, and a target gone
wrong cannot spill into the other lab tests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkdist._lab.spark import DriverKernel, LabCluster

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(300)]

#: How long the given-up host may take to have an executor of the application again: the
#: master starts one as soon as the old one is gone (a JVM start, a few seconds here).
RETURN_BOUND_S = 30.0

#: A run whose rank on ``victim`` (a lab host name) fails in the first two attempts.
STRIKES = """
import socket
import sparkdist
from sparkdist import runtime

def fails_on(victim):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    if socket.gethostname() == victim and runtime.restart_count() < 2:
        raise RuntimeError(f"struck on {victim}")
    dist.destroy_process_group()
    return socket.gethostname()

def steps_until_cut(shared):
    # Every rank says where it runs, then steps until a restart (after the cut) lets it return.
    import json, os, time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, total = dist.get_rank(), torch.ones(1)
    if runtime.restart_count() == 0:
        with open(os.path.join(shared, f"joined-{rank}"), "w") as f:
            json.dump({"host": socket.gethostname()}, f)
        for _ in range(600):
            dist.all_reduce(total)
            time.sleep(0.1)
    dist.destroy_process_group()
    return socket.gethostname()

def executors():
    # The executors Spark's scheduler offers tasks to: id -> host address.
    jsc = spark.sparkContext._jsc.sc()
    summaries = jsc.statusStore().executorList(True)
    listed = [summaries.apply(i) for i in range(summaries.size())]
    return {str(s.id()): str(s.hostPort()).rsplit(":", 1)[0] for s in listed
            if s.id() != "driver" and jsc.schedulerBackend().isExecutorActive(s.id())}
"""


@pytest.fixture(scope="module")
def own_application(lab_cluster: LabCluster, lab_driver: DriverKernel) -> Iterator[DriverKernel]:
    # lab_driver: the lab's first application holds one core of each host.
    driver = lab_cluster.start_application(
        {"spark.cores.max": "3"}, executors=3, SPARKDIST_MLFLOW="0"
    )
    yield driver
    lab_cluster.stop_application(driver)


def test_a_host_given_up_in_a_run_gets_its_executor_back_and_the_next_run_uses_it(
    lab_cluster: LabCluster, own_application: DriverKernel
) -> None:
    lab, driver = lab_cluster.lab, own_application
    workers = [h for h in sorted(lab.hosts) if h != "driver"]
    victim = lab.hosts[workers[-1]]
    driver.check(STRIKES)
    before = driver.check("result = executors()")
    assert sorted(before.values()) == sorted(lab.hosts[w].address for w in workers), before

    ended = driver.check(
        f"""
r = sparkdist.Distributor(3, local_mode=False, use_gpu=False, max_restarts=2,
    min_processes=2, grow_after_s=None).run_all(fails_on, {victim.hostname!r})
result = {{"values": r.values, "struck": [a.failure.host for a in r.attempts if a.failure]}}
"""
    )
    assert ended["struck"] == [victim.address, victim.address], ended

    # The given-up executor is gone, and a new one runs on that host: three again.
    deadline = time.monotonic() + RETURN_BOUND_S
    while True:
        now = driver.check("result = executors()")
        new_on_victim = [i for i, host in now.items() if host == victim.address and i not in before]
        if len(now) == 3 and new_on_victim:
            break
        assert time.monotonic() < deadline, (
            f"the application's executors are {now} (before the run: {before}) "
            f"{RETURN_BOUND_S} s after the run gave up its executor on {victim.address}: "
            "that host got no executor back"
        )
        time.sleep(0.5)

    # The next run places a rank there (three ranks, one core per host).
    again = driver.check(
        """
r = sparkdist.Distributor(3, local_mode=False, use_gpu=False,
    start_timeout_s=30).run_all(fails_on, "nowhere")
result = {"values": r.values, "hosts": r.hosts}
"""
    )
    assert victim.hostname in again["values"] and victim.address in again["hosts"], again


def test_a_cut_off_hosts_executor_is_given_up_before_the_restart(
    lab_cluster: LabCluster, own_application: DriverKernel, shared: Path
) -> None:
    lab, driver = lab_cluster.lab, own_application
    driver.check(STRIKES)
    before = driver.check("result = executors()")
    assert len(before) == 3, before
    driver.check(
        f"""
import threading
handle = sparkdist.Distributor(3, local_mode=False, use_gpu=False, max_restarts=1,
    min_processes=2, grow_after_s=None, start_timeout_s=30).run_async(
    steps_until_cut, {str(shared)!r})
ended = {{}}
def wait_for_it():
    try:
        r = handle.run_result(timeout=240)
        ended.update(values=r.values, hosts=r.hosts, listed=executors())
    except BaseException as error:
        ended["error"] = f"{{type(error).__name__}}: {{error}}"
    ended["at"] = time.time()
threading.Thread(target=wait_for_it, daemon=True).start()
"""
    )
    deadline = time.monotonic() + 120
    while len(list(shared.glob("joined-*"))) < 3:
        assert time.monotonic() < deadline, "the ranks never met"
        time.sleep(0.05)
    by_name = {h.hostname: h for h in lab.hosts.values()}
    victim = by_name[json.loads((shared / "joined-1").read_text())["host"]]
    (old,) = [i for i, host in before.items() if host == victim.address]
    try:
        lab.cut(victim.name)
        deadline = time.monotonic() + 180
        while not (ended := driver.check("result = ended if 'at' in ended else None")):
            assert time.monotonic() < deadline, "run() had not returned 180 s after the cut"
            time.sleep(0.2)
        assert "values" in ended, ended
        assert victim.address not in ended["hosts"] and len(ended["hosts"]) == 2, ended
        # Spark would offer the silent executor tasks until spark.network.timeout (120 s):
        # sparkdist gave it up before the restart, so no rank could be placed there.
        assert old not in ended["listed"], ended
    finally:
        lab_cluster.heal_host(victim.name)
