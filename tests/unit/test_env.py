"""The worker environment: torchrun's names, a pure function of the seat."""

from __future__ import annotations

from sparkdist._core.env import RankSeat, worker_env


def _env(**overrides):
    args = dict(
        master_addr="10.0.0.5",
        run_id="abc",
        restart_count=0,
        max_restarts=2,
        cuda_visible_devices="4,5",
        mode="ddp",
        host="h1",
    )
    args.update(overrides)
    seat = RankSeat(
        rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2, num_nodes=2
    )
    return worker_env({"PATH": "/bin", "MASTER_PORT": "1", "OMP_NUM_THREADS": "4"}, seat, **args)


def test_full_torchrun_environment():
    env = _env()
    expected = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.5",
        "TORCHELASTIC_RUN_ID": "abc",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "CUDA_VISIBLE_DEVICES": "4,5",
        "PATH": "/bin",
        "PYTHONUNBUFFERED": "1",
        "GROUP_WORLD_SIZE": "2",
    }
    assert expected.items() <= env.items()
    # The port is bound later by rank 0; a stale inherited one must not leak through.
    assert "MASTER_PORT" not in env


def test_omp_threads_default_to_one_but_a_set_value_wins():
    assert _env()["OMP_NUM_THREADS"] == "4"
    seat = RankSeat(0, 0, 0, 1, 1, 1)
    env = worker_env(
        {},
        seat,
        master_addr="a",
        run_id="r",
        restart_count=0,
        max_restarts=0,
        cuda_visible_devices=None,
        mode="ddp",
        host="h",
    )
    assert env["OMP_NUM_THREADS"] == "1"


def test_cpu_runs_hide_every_gpu():
    env = _env(cuda_visible_devices=None)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["SPARKDIST_USE_GPU"] == "0"


def test_user_env_cannot_override_the_rank():
    env = _env(extra={"RANK": "7", "MY_FLAG": "1"})
    assert env["RANK"] == "3" and env["MY_FLAG"] == "1"
