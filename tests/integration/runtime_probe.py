"""Asks every ``sparkdist.runtime`` helper inside a rank and writes the answers to
``<out_dir>/rank-<RANK>.json``: ``test_runtime_helpers`` runs it under plain torchrun and under
sparkdist, and both must answer the same.

Usage: ``python -m torch.distributed.run --nproc-per-node 2 runtime_probe.py OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from sparkdist import runtime


def probe(out_dir: str) -> None:
    answers = {
        "before_init": [
            runtime.get_global_rank(),
            runtime.get_world_size(),
            runtime.get_replica_rank(),
        ],
    }
    dist.init_process_group(runtime.backend())
    rank_1_only = dist.new_group([1])  # every rank creates it; only rank 1 is a member
    answers.update(
        rank=runtime.get_global_rank(),
        torch_rank=dist.get_rank(),
        rank_in_group_of_rank_1=runtime.get_global_rank(rank_1_only),
        rank_in_world_group=runtime.get_global_rank(dist.group.WORLD),
        local_rank=runtime.get_local_rank(),
        world_size=runtime.get_world_size(),
        local_world_size=runtime.get_local_world_size(),
        node_rank=runtime.get_node_rank(),
        main=runtime.is_main_process(),
        mode=runtime.mode(),
        backend=runtime.backend(),
        device=str(runtime.device()),
        restart_count=runtime.restart_count(),
        checkpoint_dir=runtime.checkpoint_dir(),
        deepspeed_config=runtime.deepspeed_config(),
        replica_rank_without_mesh=runtime.get_replica_rank(),
    )
    # The launcher's variable wins over torch.distributed; without it, torch.distributed answers.
    launcher_rank = os.environ["RANK"]
    os.environ["RANK"] = "7"
    answers["rank_with_env_7"] = runtime.get_global_rank()
    del os.environ["RANK"]
    answers["rank_without_env"] = runtime.get_global_rank()
    os.environ["RANK"] = launcher_rank

    runtime.device_mesh()  # ("shard",): one replica over every rank
    answers["replica_rank_fsdp"] = runtime.get_replica_rank()
    mesh = runtime.device_mesh(replicas=2)  # ("replicate", "shard") of shape (2, 1)
    answers["replica_rank_hsdp"] = runtime.get_replica_rank()
    answers["mesh_replicate_coordinate"] = mesh.get_local_rank("replicate")
    answers["rank_in_shard_group"] = runtime.get_global_rank(mesh.get_group("shard"))

    runtime.report(step=1, total=1, loss=0.5)  # to the driver under sparkdist; a no-op otherwise
    runtime.heartbeat()
    dist.barrier()
    dist.destroy_process_group()
    answers["replica_rank_after_the_group_ended"] = runtime.get_replica_rank()
    with open(os.path.join(out_dir, f"rank-{answers['rank']}.json"), "w") as f:
        json.dump(answers, f)


if __name__ == "__main__":
    probe(sys.argv[1])
