"""Host faults in the lab: a host killed, a host cut off, a short cut that heals, a rank busy in a
long C call, a restart onto the hosts that are left, and a checkpoint directory some node does
not share.

Each run here has 2 ranks on 2 of the lab's 3 hosts (one slot per host for the driver's
application). Every fault test brings the hosts it broke back (``restart_host``), so the next
test finds the same cluster. Times are taken inside the lab's driver (when ``run()`` raised)
and by the test (when it struck), on one machine's clock.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sparkdist._lab.spark import DriverKernel, LabCluster

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(400)]

#: issue 27's bounds: a killed host is named within this long; none of its run's ranks is left
#: anywhere this long after.
KILL_BOUND_S, KILL_LEFTOVER_S = 1.5, 2.0
#: A silent host is named within the silence limit (10 s) plus a beat; its own ranks are gone
#: 5 s after that.
SILENCE_BOUND_S, SILENT_LEFTOVER_S = 15.0, 5.0

#: A run whose ranks meet, say where they are (one file per rank in the shared directory), then
#: wait: the fault strikes while they wait.
WAITING_RUN = """
import threading, time
import sparkdist

def waits(shared, steps, pause):
    import json, os, socket
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.ones(1)
    for step in range(steps):
        dist.all_reduce(total)
        if step == 0:
            with open(os.path.join(shared, f"joined-{{rank}}.tmp"), "w") as f:
                json.dump({{"host": socket.gethostname(), "pid": os.getpid()}}, f)
            os.replace(os.path.join(shared, f"joined-{{rank}}.tmp"),
                       os.path.join(shared, f"joined-{{rank}}"))
        {step_body}
    dist.destroy_process_group()
    return total.item()

handle = sparkdist.Distributor(2, local_mode=False, use_gpu=False, **{options}).run_async(
    waits, {shared!r}, {steps}, {pause})
ended = {{}}

def wait_for_it():
    try:
        ended["values"] = handle.run_result(timeout=600).values
    except BaseException as error:
        ended["error"] = f"{{type(error).__name__}}: {{error}}"
    ended["at"] = time.time()

threading.Thread(target=wait_for_it, daemon=True).start()
"""


def _start(
    driver: DriverKernel,
    shared: Path,
    *,
    steps: int = 1,
    pause: float = 0.0,
    step_body: str = "time.sleep(pause if step else 300)",
    **options: object,
) -> None:
    driver.check(
        WAITING_RUN.format(
            shared=str(shared), steps=steps, pause=pause, step_body=step_body, options=options
        )
    )


def _joined(cluster: LabCluster, shared: Path, timeout_s: float = 120.0) -> dict[int, str]:
    """Each rank's lab host, once both ranks met."""
    deadline = time.monotonic() + timeout_s
    by_name = {h.hostname: h.name for h in cluster.lab.hosts.values()}
    while time.monotonic() < deadline:
        files = {r: shared / f"joined-{r}" for r in (0, 1)}
        if all(f.exists() for f in files.values()):
            hosts = {r: by_name[json.loads(f.read_text())["host"]] for r, f in files.items()}
            assert hosts[0] != hosts[1], f"both ranks on {hosts[0]}: the lab lost its spread"
            return hosts
        time.sleep(0.05)
    raise AssertionError("the ranks never met")


def start_in_background(driver: DriverKernel, run_async: str) -> None:
    """In the lab's driver: ``handle = <run_async>`` (a ``run_async(...)`` call), and a thread
    that puts its end in ``ended`` (values and hosts, or the error; then "at") for ``_ended``."""
    driver.check(
        f"""
import threading, time
handle = {run_async}
ended = {{}}
def wait_for_it():
    try:
        r = handle.run_result(timeout=600)
        ended.update(values=r.values, hosts=r.hosts)
    except BaseException as error:
        ended["error"] = f"{{type(error).__name__}}: {{error}}"
    ended["at"] = time.time()
threading.Thread(target=wait_for_it, daemon=True).start()
"""
    )


def _ended(driver: DriverKernel, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ended = driver.check("result = ended if 'at' in ended else None")
        if ended:
            return ended  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"run() had not returned {timeout_s} s after the fault")


def test_a_killed_host_is_named_at_once_and_no_rank_is_left(
    lab_cluster: LabCluster, lab_driver: DriverKernel, shared: Path
) -> None:
    lab = lab_cluster.lab
    _start(lab_driver, shared)
    hosts = _joined(lab_cluster, shared)
    victim = hosts[1]
    try:
        struck = time.time()
        lab.kill_host(victim)
        ended = _ended(lab_driver, 60)
        raised_after = ended["at"] - struck
        error = ended.get("error", "")
        assert error.startswith("WorkerFailedError: rank 1 failed: lost with its node 1 ("), error
        assert f"host {lab.hosts[victim].address}, rank(s) 1-1" in error, error
        assert "control channel closed without a goodbye" in error, error
        assert raised_after <= KILL_BOUND_S, f"raised {raised_after:.2f} s after the kill"
        assert lab.wait_until_no_ranks(KILL_LEFTOVER_S) == []
    finally:
        lab_cluster.restart_host(victim)


def test_a_cut_off_host_is_named_within_the_bound_and_its_ranks_end(
    lab_cluster: LabCluster, lab_driver: DriverKernel, shared: Path
) -> None:
    lab = lab_cluster.lab
    _start(lab_driver, shared)
    hosts = _joined(lab_cluster, shared)
    victim, healthy = hosts[1], hosts[0]
    try:
        struck = time.time()
        lab.cut(victim)  # its switch port down: packets silently dropped, nothing closes
        ended = _ended(lab_driver, 120)
        raised_after = ended["at"] - struck
        error = ended.get("error", "")
        # The root cause is the host that went silent, never the healthy one then stopped.
        assert error.startswith("WorkerFailedError: rank 1 failed: lost with its node 1 ("), error
        assert f"host {lab.hosts[victim].address}, rank(s) 1-1" in error, error
        assert "sent nothing, not even a beat" in error, error
        assert f"rank 0 on {lab.hosts[healthy].address}" not in error.splitlines()[0], error
        # (CI saw 35.8 s once, in ~40 runs: the error, with its timings, says which wait it was.)
        assert raised_after <= SILENCE_BOUND_S, f"raised {raised_after:.1f} s after: {error}"
        # The cut-off host's own ranks end themselves: its agent heard the driver go silent.
        left = lab.wait_until_no_ranks(
            max(0.0, struck + SILENCE_BOUND_S + SILENT_LEFTOVER_S - time.time()), [victim]
        )
        assert left == [], f"still running on the cut-off host: {left}"
    finally:
        lab_cluster.heal_host(victim)  # its Worker and executor lived on behind the cut


def test_a_cut_of_three_seconds_that_heals_does_not_fail_the_run(
    lab_cluster: LabCluster, lab_driver: DriverKernel, shared: Path
) -> None:
    lab = lab_cluster.lab
    # 40 steps of 0.25 s: the cut comes and goes in the middle.
    _start(lab_driver, shared, steps=40, pause=0.25, step_body="time.sleep(pause)")
    hosts = _joined(lab_cluster, shared)
    lab.cut(hosts[1])
    time.sleep(3.0)
    lab.heal(hosts[1])
    ended = _ended(lab_driver, 120)
    assert ended.get("values") == [2.0**40, 2.0**40], ended


def test_a_rank_in_a_long_c_call_holding_the_gil_is_not_a_silent_host(
    lab_driver: DriverKernel, lab_cluster: LabCluster, shared: Path
) -> None:
    # 12 s inside one C call that keeps the GIL (PyDLL does not release it): longer than the
    # silence limit. The node's agent, another process, keeps beating.
    body = "import ctypes; ctypes.PyDLL(None).sleep(12) if rank == 1 and step == 0 else None"
    _start(lab_driver, shared, steps=2, step_body=body)
    _joined(lab_cluster, shared)
    ended = _ended(lab_driver, 120)
    assert ended.get("values") == [4.0, 4.0], ended


TRAIN = """
import sparkdist

def train(steps, pause):
    import os, socket, time
    import torch
    import torch.distributed as dist
    from sparkdist import runtime
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    found = runtime.load_checkpoint()
    if found is not None:
        model.module.load_state_dict(found.state["model"])
        opt.load_state_dict(found.state["opt"])
        start = found.step + 1
    data = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(8, 4, generator=data) for _ in range(steps)]
    for step in range(start, steps):
        x = batches[step]
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        runtime.save_checkpoint({"model": model.module.state_dict(),
                                 "opt": opt.state_dict()}, step)
        time.sleep(pause)
    weights = [p.detach().flatten().tolist() for p in model.module.parameters()]
    del model, opt  # DDP gone before its group: torch's gloo teardown can deadlock otherwise
    dist.destroy_process_group()
    return {"weights": weights, "resumed_at": start, "restarts": runtime.restart_count(),
            "host": socket.gethostname()}
"""


def test_a_restart_goes_on_with_the_hosts_left_from_the_last_checkpoint(
    lab_cluster: LabCluster, lab_driver: DriverKernel, shared: Path
) -> None:
    steps = 30
    lab_driver.check(TRAIN)
    whole = lab_driver.check(
        f"""
result = sparkdist.Distributor(2, local_mode=False, use_gpu=False,
    checkpoint_dir={str(shared / "whole")!r}).run(train, {steps}, 0.0)
"""
    )
    checkpoints = shared / "restarted"
    start_in_background(
        lab_driver,
        f"""sparkdist.Distributor(2, local_mode=False, use_gpu=False, max_restarts=1,
    checkpoint_dir={str(checkpoints)!r}).run_async(train, {steps}, 0.3)""",
    )
    deadline = time.monotonic() + 120
    while not (checkpoints / f"step-{10:09d}" / "COMMITTED").exists():
        assert time.monotonic() < deadline, "no checkpoint of step 10"
        time.sleep(0.05)
    kill_a_busy_host_and_check_the_restart(lab_cluster, lab_driver, whole["weights"])


def kill_a_busy_host_and_check_the_restart(
    cluster: LabCluster, driver: DriverKernel, weights: list
) -> None:
    """Kill a host that runs a rank of the run in flight (``start_in_background``'s, past its
    checkpoint of step 10); the run must restart once on the two hosts left, resume from its
    last checkpoint, and end with ``weights`` (an uninterrupted run's), bit for bit."""
    lab = cluster.lab
    victim = sorted({p["host"] for p in lab.rank_processes()})[-1]
    try:
        lab.kill_host(victim)
        ended = _ended(driver, 240)
        assert "values" in ended, ended
        first = ended["values"][0]
        assert first["restarts"] == 1, first
        assert first["resumed_at"] >= 11, first  # from the last checkpoint, not from step 0
        assert lab.hosts[victim].address not in ended["hosts"], ended["hosts"]
        assert len(set(ended["hosts"])) == 2  # on the two live hosts
        assert first["weights"] == weights  # bit for bit
    finally:
        cluster.restart_host(victim)


def test_a_checkpoint_dir_one_node_does_not_share_is_refused_before_any_step(
    lab_driver: DriverKernel, shared: Path
) -> None:
    # /tmp is private to each host in the lab, as a local disk is on a real cluster.
    message = lab_driver.check(
        f"""
import sparkdist

def touches(marker):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    open(marker, "w").close()

try:
    sparkdist.Distributor(2, local_mode=False, use_gpu=False,
        checkpoint_dir="/tmp/local-checkpoints").run(touches, {str(shared / "trained")!r})
    result = "no error"
except sparkdist.ClusterError as error:
    result = str(error)
"""
    )
    assert "checkpoint_dir /tmp/local-checkpoints on node 1 (host 198.18.0." in message, message
    assert "does not see what node 0 wrote there" in message, message
    assert "storage every node mounts at the same path" in message, message
    assert not (shared / "trained").exists()  # no rank got past the rendezvous
