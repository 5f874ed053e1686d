"""Elastic runs in the lab: an FSDP2 run of 3 ranks on 3 hosts loses a host and goes on with
the capacity left, from its last checkpoint resharded to the smaller world; the host comes
back, and once it has been back for ``grow_after_s`` the run drains (no step lost) and grows
back to 3 ranks, its loss curve going on where it stopped through both resizes.

The checkpoints live on a real S3 server (SeaweedFS) on the driver's host, as on a cluster with
no shared filesystem (issue 33): the hosts each have only their private /tmp, and the keys reach
the driver and every executor as each host's own environment (``spark.executorEnv``), never
through the job.

The run has an application of its own, on the core of each host the lab's first application
leaves: when a host dies, the standalone master has no free core elsewhere to replace the lost
executor with (it would, on a cluster with room, and the run would grow onto that at once), so
the capacity comes back only with the host.

The run also reads a sharded DataFrame (``sparkdist.data.sharded``), one row a step per rank,
and notes which rows each step took: over the kill, the shrink and the grow, the steps the run
kept took every row of the epoch once.

The training is world-size free by construction: one fixed global batch per step, split evenly
over the ranks (12 samples: 4, 6 or 12 per rank), and FSDP averages the gradients, so an
uninterrupted run at any world size walks the same curve (up to float summation order). That
is the yardstick the resumed run is held to.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sparkdist._lab.spark import DriverKernel, LabCluster
from tests._helpers.s3_server import LabS3Server

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(400)]

STEPS = 40
#: Rows of the DataFrame the run reads (one a step per rank): more than 40 steps take.
ROWS = 150
#: Seconds a step takes on the full world, and while the run is shrunk (long enough for the
#: lost host to come back and the run to grow before it ends).
PAUSE_S, SHRUNK_PAUSE_S = 0.3, 1.0

TRAIN = """
import json, os, socket, threading, time
import sparkdist
import sparkdist.data

def train(steps, pause, curve_dir, shrunk_pause=None, with_rows=False):
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from sparkdist import data, runtime

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    start, resumed_from = 0, None
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    rows = data.loader(["id"], batch_size=1) if with_rows else None  # before the load
    found = runtime.load_checkpoint(into=state)
    if found is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        start, resumed_from = found.step + 1, found.step
    data = torch.Generator().manual_seed(7)
    inputs = torch.randn(steps, 12, 8, generator=data)
    targets = inputs.sin().sum(dim=-1, keepdim=True)
    curve = []
    attempt = runtime.restart_count()
    batches = iter(rows) if rows is not None else None

    def note_rows(step):  # the DataFrame rows this rank takes at this step (not trained on)
        nonlocal batches
        while True:
            try:
                epoch, ids = rows.epoch, next(batches).tolist()
                break
            except StopIteration:
                batches = iter(rows)
        path = os.path.join(curve_dir, f"rows-{attempt}-{step}-{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump([world, epoch, ids], f)
        os.replace(path + ".tmp", path)

    for step in range(start, steps):
        if rows is not None:
            note_rows(step)
        x, y = inputs[step].chunk(world)[rank], targets[step].chunk(world)[rank]
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        curve.append((step, whole.item() / world))
        if curve_dir and rank == 0:
            with open(os.path.join(curve_dir, f"step-{step}.tmp"), "w") as f:
                json.dump([world, whole.item() / world], f)
            os.replace(os.path.join(curve_dir, f"step-{step}.tmp"),
                       os.path.join(curve_dir, f"step-{step}"))
        if curve_dir is not None:  # not the yardstick: its curve is all it is for
            model_state, optimizer_state = get_state_dict(model, optimizer)
            runtime.save_checkpoint({"model": model_state, "optimizer": optimizer_state}, step)
        if runtime.should_stop():  # a drain (to grow): this step is saved, the restart goes on
            break
        small = shrunk_pause is not None and world < runtime.requested_world_size()
        time.sleep(shrunk_pause if small else pause)
    else:  # the run's end: the rest of the epoch's rows, noted without training
        extra = steps
        while rows is not None and rows.epoch == 0:
            note_rows(extra)
            extra += 1
    dist.destroy_process_group()
    return {"world": world, "requested": runtime.requested_world_size(),
            "resumed_from": resumed_from, "curve": curve, "host": socket.gethostname()}
"""


def wait_for_commit(driver: DriverKernel, store: LabS3Server, url: str, timeout_s: float) -> None:
    """Inside the lab (the driver's host): wait until the step ``url``'s marker is on the store."""
    driver.check(
        f"""
import time, s3fs
fs = s3fs.S3FileSystem(endpoint_url={store.endpoint_url!r}, skip_instance_cache=True)
deadline = time.monotonic() + {timeout_s}
while not fs.exists({url + "/COMMITTED"!r}):
    assert time.monotonic() < deadline, "no commit of " + {url!r}
    time.sleep(0.1)
    fs.invalidate_cache()
""",
        timeout_s=timeout_s + 30,
    )


# On the object store only: the suite's time is bounded (25 min on 2 cores), and a shared
# directory's restart across hosts is test_host_faults' (the layout is the same through both).
# A DDP restart from the store, bit for bit, is tests/integration/test_checkpoints_store.py's.
@pytest.mark.parametrize("where", ["object store"])
@pytest.mark.usefixtures("lab_driver")  # the lab's first application: one core of each host
def test_an_fsdp_run_shrinks_when_a_host_is_lost_and_grows_back_when_it_returns(
    lab_cluster: LabCluster,
    lab_store: LabS3Server,
    shared: Path,
    where: str,
) -> None:
    store = lab_store
    keys = {f"spark.executorEnv.{name}": value for name, value in store.env().items()}
    lab_driver = lab_cluster.start_application(
        {"spark.cores.max": "3", **keys}, executors=3, SPARKDIST_MLFLOW="0", **store.env()
    )
    try:
        _shrink_and_grow(lab_cluster, lab_driver, store, shared, where)
    finally:
        lab_cluster.stop_application(lab_driver)


def _shrink_and_grow(
    lab_cluster: LabCluster, lab_driver: DriverKernel, store: LabS3Server, shared: Path, where: str
) -> None:
    lab = lab_cluster.lab
    lab_driver.check(TRAIN)
    if where == "object store":  # no directory every host sees holds the checkpoints
        root, options = (
            f"s3://{store.bucket}/elastic-{time.monotonic_ns()}",
            store.storage_options(),
        )
    else:
        root, options = str(shared), None
    # The yardstick: the same training, uninterrupted, on 2 ranks.
    whole = lab_driver.check(
        f"""
result = sparkdist.Distributor(2, local_mode=False, use_gpu=False, mode="fsdp",
    checkpoint_dir={root + "/whole"!r}, storage_options={options!r}).run(
    train, {STEPS}, 0.0, None)["curve"]
"""
    )
    expected = dict((step, loss) for step, loss in whole)
    checkpoints, curve = root + "/elastic", shared / "curve"  # the curve: the test's own notes
    curve.mkdir()
    lab_driver.check(
        f"""
from pyspark.sql import SparkSession
frame = SparkSession.getActiveSession().range({ROWS})
handle = sparkdist.Distributor(3, min_processes=2, grow_after_s=2, local_mode=False,
    use_gpu=False, mode="fsdp", max_restarts=1, checkpoint_dir={checkpoints!r},
    storage_options={options!r}).run_async(
    train, {STEPS}, {PAUSE_S}, {str(curve)!r}, {SHRUNK_PAUSE_S}, True,
    spark_dataframe=sparkdist.data.sharded(frame, key="id", shards=12, seed=1))
ended = {{}}
def wait_for_it():
    try:
        r = handle.run_result(timeout=600)
        ended.update(values=r.values, hosts=r.hosts,
                     attempts=[(list(a.hosts), a.world_size, a.grew) for a in r.attempts])
    except BaseException as error:
        ended["error"] = f"{{type(error).__name__}}: {{error}}"
    ended["at"] = time.time()
threading.Thread(target=wait_for_it, daemon=True).start()
"""
    )
    if where == "object store":
        wait_for_commit(lab_driver, store, f"{checkpoints}/step-{8:09d}", 120)
    deadline = time.monotonic() + 120
    while where != "object store" and not Path(checkpoints, f"step-{8:09d}", "COMMITTED").exists():
        assert time.monotonic() < deadline, "the 3-rank run never committed step 8"
        time.sleep(0.05)
    busy = {p["host"] for p in lab.rank_processes()}
    assert len(busy) == 3, busy
    victim, back = sorted(busy)[-1], False
    address = lab.hosts[victim].address
    try:
        lab.kill_host(victim)
        deadline = time.monotonic() + 120
        while not any(_read(p)[0] == 2 for p in curve.glob("step-*[0-9]")):
            assert time.monotonic() < deadline, "the run never went on with 2 ranks"
            time.sleep(0.1)
        lab_cluster.restart_host(victim)  # the host comes back; the run grows onto it
        back = True
        deadline = time.monotonic() + 240
        while not (ended := lab_driver.check("result = ended if 'at' in ended else None")):
            assert time.monotonic() < deadline, "run() had not returned 240 s after the kill"
            time.sleep(0.1)
        assert "values" in ended, ended
        (first, _, _), (second, shrunk, grew), (third, grown, _) = ended["attempts"]
        assert len(first) == 3 and address in first, ended["attempts"]
        assert address not in second and shrunk == 2, ended["attempts"]
        assert grew.startswith("the cluster has held 3 of the 3 ranks"), ended["attempts"]
        assert grown == 3 and address in ended["hosts"], ended  # a rank on the returned host
        resumed = ended["values"][0]
        assert resumed["world"] == len(ended["values"]) == 3 and resumed["requested"] == 3
        # The grow lost no step: the drain's checkpoint is of the last step the 2 ranks
        # trained, and the 3 ranks went on from the next one, every step once.
        trained_by_two = [int(p.name[5:]) for p in curve.glob("step-*[0-9]") if _read(p)[0] == 2]
        assert resumed["resumed_from"] == max(trained_by_two), (resumed, trained_by_two)
        assert [step for step, _ in resumed["curve"]] == list(
            range(resumed["resumed_from"] + 1, STEPS)
        )
        # The curve goes on where it stopped through both resizes: every step has the loss an
        # uninterrupted run has there (the checkpoints carried the weights and Adam's moments).
        for path in curve.glob("step-*[0-9]"):
            step, loss = int(path.name[5:]), _read(path)[1]
            assert loss == pytest.approx(expected[step], rel=1e-4, abs=1e-6), (step, loss)
        for step, loss in resumed["curve"]:
            assert loss == pytest.approx(expected[step], rel=1e-4, abs=1e-6), (step, loss)
        # No row lost or taken twice over the kill, the shrink and the grow: the rows each
        # step took, as the last attempt that ran the step took them, are every row once.
        _check_every_row_once(curve)
        if where == "object store":  # the URL never became a local folder on any host
            for host in lab_cluster.workers:
                assert "s3:" not in (lab.list_dir(host, "/tmp") or []), host
    finally:
        if not back:
            lab_cluster.restart_host(victim)


def _read(path: Path) -> list:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _check_every_row_once(curve: Path) -> None:
    latest: dict[int, int] = {}  # step -> the last attempt that ran it
    notes = []
    for path in curve.glob("rows-*[0-9]"):
        attempt, step, rank = (int(part) for part in path.name.split("-")[1:])
        latest[step] = max(latest.get(step, -1), attempt)
        notes.append((attempt, step, rank, _read(path)))
    taken: list[int] = []
    worlds = []
    for attempt, step, _, (world, epoch, ids) in sorted(notes):
        if attempt == latest[step] and epoch == 0:
            taken.extend(ids)
            worlds.append(world)
    assert sorted(taken) == list(range(ROWS)), sorted(taken)
    assert {2, 3} <= set(worlds)  # the epoch was read through the shrink and the grow
