"""Replica groups (torchft) across the lab's hosts: a host lost costs its own group a relaunch,
never the other groups a restart.

Three groups of one rank, one per host (two of the hosts' own names resolve to loopback, the
third's to a NIC no peer shares: torchft's default of advertising ``socket.gethostname()`` would
fail there). A host is SIGKILLed mid-run: the two surviving groups go on (same processes, the
next committed step within ``STALL_BOUND_S``), the lost group is relaunched on the capacity
there is (the master starts the lost executor again on a free core of another host: the
spare), joins the quorum and heals from a live peer, and every group ends with the same
weights.
The lab's conftest checks that no process of the run is left on any host.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sparkdist._lab.spark import DriverKernel, LabCluster

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(300)]
pytest.importorskip("torchft")

#: From the kill to the survivors' next committed step: the Lighthouse's join timeout (1 s) plus
#: the failed step's error and the new quorum's set-up, with the loaded box's slack.
STALL_BOUND_S = 10.0

GROUPED_RUN = """
import threading, time
import sparkdist

def train(shared, min_steps, full_steps, max_steps):
    import json, os, socket, time
    import torch
    import torchft
    from sparkdist import runtime

    group = runtime.replica_group()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pg = torchft.ProcessGroupGloo()
    manager = torchft.Manager(
        pg=pg, min_replica_size=1,
        load_state_dict=lambda state: model.load_state_dict(state["model"]),
        state_dict=lambda: {{"model": model.state_dict()}},
        **runtime.torchft_manager_kwargs(pg))
    wrapped = torchft.Optimizer(manager, optimizer)
    commits, first_step = [], None
    name = os.path.join(shared, f"group-{{group}}-{{runtime.restart_count()}}")
    try:
        for _ in range(max_steps):
            step = manager.current_step()
            wrapped.zero_grad()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * step + group))
            torch.nn.functional.mse_loss(model(x), x[:, :2]).backward()
            runtime.average_gradients(manager, model)
            wrapped.step()
            if first_step is None:
                first_step = manager.current_step()
                with open(name + ".tmp", "w") as f:
                    json.dump({{"host": socket.gethostname(), "pid": os.getpid()}}, f)
                os.replace(name + ".tmp", name)
            if manager.current_step() > step:
                commits.append((time.time(), manager.num_participants()))
                full = [n for _, n in commits[-full_steps:]] == [3] * full_steps
                if full and manager.current_step() >= min_steps:
                    break
            time.sleep(0.05)
        return {{"group": group, "restarts": runtime.restart_count(), "pid": os.getpid(),
                 "first_step": first_step, "step": manager.current_step(), "commits": commits,
                 "weights": [p.detach().tolist() for p in model.parameters()]}}
    finally:
        manager.shutdown(wait=False)

handle = sparkdist.Distributor(3, replica_groups=3, local_mode=False, use_gpu=False,
    max_restarts=2, start_timeout_s=120).run_async(train, {shared!r}, 40, 3, 4000)
ended = {{}}
def wait_for_it():
    try:
        r = handle.run_result(timeout=600)
        ended.update(values=r.values, hosts=r.hosts,
                     attempts=[(a.replica_group, a.number, list(a.hosts)) for a in r.attempts])
    except BaseException as error:
        ended["error"] = f"{{type(error).__name__}}: {{error}}"
    ended["at"] = time.time()
threading.Thread(target=wait_for_it, daemon=True).start()
"""


def _group_hosts(
    cluster: LabCluster, shared: Path, restarts: int = 0, groups: tuple[int, ...] = (0, 1, 2)
) -> dict[int, str]:
    """Each group's lab host once each took a step (in attempt ``restarts`` of the group)."""
    by_name = {h.hostname: h.name for h in cluster.lab.hosts.values()}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        files = {g: shared / f"group-{g}-{restarts}" for g in groups}
        if all(f.exists() for f in files.values()):
            return {g: by_name[json.loads(f.read_text())["host"]] for g, f in files.items()}
        time.sleep(0.05)
    raise AssertionError("the three groups never all took a step")


def _launcher_lines(log: Path) -> str:
    """sparkdist's and Spark's errors from the lab driver's log: why a run failed."""
    lines = log.read_text(errors="replace").splitlines()
    wanted = ("sparkdist", "ERROR", "Exception", "barrier")
    return "\n".join(line for line in lines if any(w in line for w in wanted))[-6000:]


def test_a_lost_host_costs_its_group_a_relaunch_and_the_others_nothing(
    lab_cluster: LabCluster, lab_driver: DriverKernel, shared: Path
) -> None:
    lab = lab_cluster.lab
    lab_driver.check(GROUPED_RUN.format(shared=str(shared)))
    hosts = _group_hosts(lab_cluster, shared)
    assert len(set(hosts.values())) == 3, f"the groups share hosts: {hosts}"
    victim = hosts[1]
    try:
        struck = time.time()
        lab.kill_host(victim)
        # The master starts the lost executor again on a free core of another host: the spare
        # capacity the lost group is relaunched on.
        deadline = time.monotonic() + 180
        while not (ended := lab_driver.check("result = ended if 'at' in ended else None")):
            assert time.monotonic() < deadline, "run() had not returned 180 s after the kill"
            time.sleep(0.2)
    finally:
        lab_cluster.restart_host(victim)  # and one executor per host again
    if "values" not in ended:
        print(_launcher_lines(lab_driver.log))  # shown with the failure
    assert "values" in ended, ended
    by_group = {v["group"]: v for v in ended["values"]}
    # The survivors are the processes that started: never restarted.
    assert (by_group[0]["restarts"], by_group[1]["restarts"], by_group[2]["restarts"]) == (0, 1, 0)
    assert [a[:2] for a in ended["attempts"]] == [[0, 0], [1, 0], [1, 1], [2, 0]], ended
    # Their next committed step after the kill came within the bound, with two groups.
    for survivor in (by_group[0], by_group[2]):
        after = [(t, n) for t, n in survivor["commits"] if t > struck]
        assert after, survivor["commits"]
        stall = after[0][0] - struck
        assert stall <= STALL_BOUND_S, f"group {survivor['group']} stalled {stall:.1f} s"
        assert 2 in [n for _, n in after], after
    # The relaunched group healed from a peer (it joined at the survivors' step, not 0) and
    # every group ends on one step with the same weights.
    assert by_group[1]["first_step"] > 1, by_group[1]
    relaunched_on = _group_hosts(lab_cluster, shared, restarts=1, groups=(1,))[1]
    assert relaunched_on != victim, f"group 1 was relaunched on the killed host {victim}"
    assert {v["step"] for v in ended["values"]} == {by_group[0]["step"]}
    assert by_group[0]["weights"] == by_group[1]["weights"] == by_group[2]["weights"]
    print(
        "replica groups across hosts: survivors' next step after the kill",
        [
            round(next(t for t, _ in by_group[g]["commits"] if t > struck) - struck, 2)
            for g in (0, 2)
        ],
        "s; the relaunched group joined at step",
        by_group[1]["first_step"],
    )
