"""A spark-submit job: DDP training on N ranks, one Spark barrier stage, one rank per GPU.

The master, the GPU conf and the executors all come from spark-submit (or spark-defaults.conf);
nothing here names a cluster, so the same file runs on a laptop and on a GPU cluster:

    PYSPARK_PYTHON=$(which python) spark-submit --master local-cluster[2,1,1024] \\
        examples/submit_job.py --processes 2
    spark-submit --master spark://head:7077 --properties-file conf/spark-defaults.conf \\
        examples/submit_job.py --processes 16

With spark.task.resource.gpu.amount set, each rank gets its own GPU and NCCL; without it, ranks
train on CPU with gloo. The job exits non-zero when a rank fails, so the scheduler sees it.
"""

from __future__ import annotations

import argparse
import os
import time


def train(steps: int, lr: float) -> dict[str, float]:
    """Fit y = 3x + 1 with DDP; every rank trains on its own shard of synthetic data."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    print(
        f"rank {rank}/{world} on {socket.gethostname()}, node {os.environ['NODE_RANK']}, "
        f"local rank {os.environ['LOCAL_RANK']}, device {device}",
        flush=True,
    )

    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(torch.nn.Linear(1, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(rank)  # a different shard per rank
    x = torch.rand(256, 1, generator=generator).to(device)
    y = 3 * x + 1
    first_loss = last_loss = 0.0
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        last_loss = loss.item()
        if step == 0:
            first_loss = last_loss
    weight, bias = model.module.weight.item(), model.module.bias.item()
    dist.destroy_process_group()
    return {
        "first_loss": first_loss,
        "last_loss": last_loss,
        "weight": weight,
        "bias": bias,
        "world_size": world,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="ranks (one per GPU)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    from sparkdist import Distributor

    # spark-submit's --master and --conf (and spark-defaults.conf) configure this session.
    spark = SparkSession.builder.appName("sparkdist-submit-job").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    try:
        started = time.perf_counter()
        result = Distributor(args.processes, local_mode=False, spark=spark).run_all(
            train, args.steps, args.lr
        )
        elapsed = time.perf_counter() - started
        rank0 = result.values[0]
        print(
            f"trained on {result.world_size} rank(s) in {result.num_tasks} barrier task(s) "
            f"({'GPU' if result.use_gpu else 'CPU'}) in {elapsed:.1f} s: loss "
            f"{rank0['first_loss']:.3f} -> {rank0['last_loss']:.5f}, y = {rank0['weight']:.3f} x "
            f"+ {rank0['bias']:.3f} (target y = 3x + 1)"
        )
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
