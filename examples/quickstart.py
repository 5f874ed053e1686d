"""Quickstart: train a small model with DDP on 2 processes launched as Spark barrier tasks.

Runs as is on a laptop (Spark in local mode, CPU, gloo) and unchanged on a GPU cluster
(``spark-submit --master <cluster> examples/quickstart.py``: one rank per GPU, NCCL).

    python examples/quickstart.py [--processes 2] [--steps 50] [--local]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def train(steps: int, lr: float) -> dict[str, float]:
    """Fit y = 3x + 1 with DDP; every rank sees its own shard of synthetic data."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    )

    torch.manual_seed(0)  # same initial weights on every rank
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
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {last_loss:.4f}")
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
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--local", action="store_true", help="run on this machine, no Spark job")
    args = parser.parse_args()

    from sparkdist import Distributor

    spark = None
    if not args.local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.appName("sparkdist-quickstart")
        if "PYSPARK_GATEWAY_PORT" not in os.environ:
            # Run alone (not by spark-submit, whose --master must win): Spark in local mode.
            builder = builder.master(os.environ.get("SPARK_MASTER", f"local[{args.processes}]"))
        spark = (
            builder.config("spark.pyspark.python", sys.executable)
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("WARN")

    started = time.perf_counter()
    result = Distributor(args.processes, local_mode=args.local, spark=spark).run(
        train, args.steps, args.lr
    )
    elapsed = time.perf_counter() - started
    print(
        f"trained on {result['world_size']} processes in {elapsed:.1f} s: "
        f"loss {result['first_loss']:.3f} -> {result['last_loss']:.5f}, "
        f"y = {result['weight']:.3f} x + {result['bias']:.3f} (target y = 3x + 1)"
    )
    if spark is not None:
        spark.stop()


if __name__ == "__main__":
    main()
