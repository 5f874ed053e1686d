"""The serverless runtime helpers under plain torchrun and under sparkdist (real gloo, 2 ranks),
and ``Distributor.run_async``: the handle ``distributed_async`` returns, for the other front door.

``runtime_probe.py`` asks every helper inside each rank; both launchers must get the answers
below. Functions launched here import no torch, so each launch costs little more than the
ranks' start-up.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sparkdist import DistributedRun, Distributor, WorkerFailedError, distributed, runtime
from tests.conftest import run_processes

PROBE = Path(__file__).resolve().parent / "runtime_probe.py"
#: Generous for a loaded 2-core machine: two cold interpreters import torch.
TORCHRUN_TIMEOUT_S = 180


def expected_answers(rank: int) -> dict[str, object]:
    """What ``runtime_probe.py`` must write on ``rank`` of a 2-rank CPU world on one node."""
    return {
        "before_init": [rank, 2, rank],  # from the launcher's variables, before any group
        "rank": rank,
        "torch_rank": rank,
        "rank_in_group_of_rank_1": 0 if rank == 1 else -1,  # -1: not a member, as torch says
        "rank_in_world_group": rank,
        "local_rank": rank,
        "world_size": 2,
        "local_world_size": 2,
        "node_rank": 0,
        "main": rank == 0,
        "mode": "ddp",
        "backend": "gloo",
        "device": "cpu",
        "restart_count": 0,
        "checkpoint_dir": None,
        "deepspeed_config": None,
        "replica_rank_without_mesh": rank,  # every rank a whole replica (DDP)
        "rank_with_env_7": 7,  # the launcher's RANK wins over torch.distributed
        "rank_without_env": rank,  # torch.distributed answers when RANK is gone
        "replica_rank_fsdp": 0,  # one replica sharded over both ranks
        "replica_rank_hsdp": rank,  # (2, 1) mesh: each rank its own replica
        "mesh_replicate_coordinate": rank,
        "rank_in_shard_group": 0,
        "replica_rank_after_the_group_ended": rank,  # the mesh went with its group
    }


def probe_answers(out_dir: Path) -> list[dict[str, object]]:
    files = sorted(out_dir.glob("rank-*.json"))
    assert [f.name for f in files] == ["rank-0.json", "rank-1.json"]
    return [json.loads(f.read_text()) for f in files]


def processes_marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``RUNTIME_PROBE_MARK=mark``."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("RUNTIME_PROBE_MARK") == mark:
                found.append(proc.pid)
    return found


def test_every_helper_answers_under_plain_torchrun(tmp_path):
    import psutil

    out = tmp_path / "answers"
    out.mkdir()
    mark = uuid.uuid4().hex
    # Loopback only: the rendezvous store, the agent's address and gloo's sockets.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--rdzv-id",
        mark,
        "--local-addr",
        "127.0.0.1",
        str(PROBE),
        str(out),
    ]
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "TMPDIR": str(tmp_path),
        "RUNTIME_PROBE_MARK": mark,
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    try:
        output, _ = process.communicate(timeout=TORCHRUN_TIMEOUT_S)
    finally:
        if process.poll() is None:  # ran out of time: torchrun's workers first, then torchrun
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(process.pid)
                for proc in [*root.children(recursive=True), root]:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert probe_answers(out) == [expected_answers(0), expected_answers(1)]
    assert not processes_marked(mark), "torchrun left a process behind"


def test_every_helper_answers_the_same_under_sparkdist(tmp_path):
    result = Distributor(2, use_gpu=False).run_all(str(PROBE), str(tmp_path))
    assert probe_answers(tmp_path) == [expected_answers(0), expected_answers(1)]
    assert result.last_metrics == {"loss": 0.5}  # runtime.report() reached the driver


# -- Distributor.run_async -------------------------------------------------------------------


def where_am_i(tag):
    return {"tag": tag, "rank": runtime.get_global_rank(), "replica": runtime.get_replica_rank()}


def test_run_async_result_is_what_run_returns_and_the_handle_is_distributed_asyncs():
    distributor = Distributor(2, use_gpu=False)
    runs = [distributor.run_async(where_am_i, tag) for tag in ("a", "b")]  # a sweep
    decorated = distributed(gpus=2, use_gpu=False)(where_am_i).distributed_async("c")
    assert type(runs[0]) is type(decorated) is DistributedRun
    assert runs[0].run_id != runs[1].run_id

    assert [run.result(timeout=120) for run in runs] == [
        {"tag": "a", "rank": 0, "replica": 0},
        {"tag": "b", "rank": 0, "replica": 0},
    ]
    assert decorated.result(timeout=120) == [  # the decorator's handle: every rank, unchanged
        {"tag": "c", "rank": 0, "replica": 0},
        {"tag": "c", "rank": 1, "replica": 1},
    ]
    everything = runs[1].run_result()
    assert everything.values == [
        {"tag": "b", "rank": 0, "replica": 0},
        {"tag": "b", "rank": 1, "replica": 1},
    ]
    assert everything.run_id == runs[1].run_id
    assert all(run.done() for run in (*runs, decorated))
    assert runs[0].cancel() is False  # already over
    assert runs[0].mlflow_run_id is None  # tracking is off in the test suite
    assert repr(runs[0]) == f"<DistributedRun {runs[0].run_id} done>"


def fail_on_rank_1():
    if runtime.get_global_rank() == 1:
        raise ValueError("rank 1 gives up")
    return "rank 0 is fine"


def test_run_async_result_raises_what_run_raises():
    run = Distributor(2, use_gpu=False).run_async(fail_on_rank_1)
    with pytest.raises(WorkerFailedError) as info:
        run.result(timeout=120)
    assert info.value.root_cause.rank == 1
    assert "ValueError: rank 1 gives up" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)  # chained, as run() chains it
    with pytest.raises(WorkerFailedError):
        run.run_result()
    assert run.done()


def mark_then_sleep(marker_dir):
    Path(marker_dir, str(runtime.get_global_rank())).write_text(os.environ.get("MLFLOW_RUN_ID", ""))
    time.sleep(120)


def wait_for_markers(marker_dir: Path, run: DistributedRun) -> None:
    deadline = time.monotonic() + 60
    while len(os.listdir(marker_dir)) < 2 and time.monotonic() < deadline and not run.done():
        time.sleep(0.05)  # polling the ranks' handshake files, with a deadline
    assert sorted(os.listdir(marker_dir)) == ["0", "1"], "ranks did not start"


def test_run_async_cancel_stops_every_rank_and_leaves_no_process(tmp_path):
    run = Distributor(2, use_gpu=False).run_async(mark_then_sleep, str(tmp_path))
    wait_for_markers(tmp_path, run)
    with pytest.raises(TimeoutError):
        run.result(timeout=0.2)  # the wait timed out; the run goes on
    assert not run.done() and len(run_processes()) == 2

    assert run.cancel() is True
    assert run.done()
    assert not run_processes()
    with pytest.raises(concurrent.futures.CancelledError):
        run.result()
    assert run.cancel() is False


@pytest.mark.mlflow
def test_run_async_names_its_mlflow_run_while_it_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    markers = tmp_path / "markers"
    markers.mkdir()
    run = Distributor(2, use_gpu=False, mlflow=True).run_async(mark_then_sleep, str(markers))
    try:
        wait_for_markers(markers, run)
        seen_by_ranks = {(markers / r).read_text() for r in ("0", "1")}
        assert run.mlflow_run_id is not None
        assert seen_by_ranks == {run.mlflow_run_id}  # the ranks' MLFLOW_RUN_ID, while running
    finally:
        run.cancel()
    from mlflow.tracking import MlflowClient

    assert (
        MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run.mlflow_run_id).info.status
        == "KILLED"
    )
