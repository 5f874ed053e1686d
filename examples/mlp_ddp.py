"""One training function, three launchers: sparkdist's Distributor, its @distributed decorator,
and pyspark's own TorchDistributor, timed side by side.

Each launcher runs the function twice and both wall times are printed: the first call pays
one-time start-up in this process (sparkdist: its warm worker pool imports torch once, and the
second sparkdist launcher finds that pool already started; pyspark: its imports and, with
``--remote``, Spark's Python workers), the second call is the warm figure to compare.

The function is the MLP of Databricks' serverless GPU DDP example (input 10, hidden 64,
dropout, output 1) trained with DDP on random data split by a DistributedSampler. It uses NCCL
and one GPU per rank where CUDA is available, gloo on CPU otherwise, and every launcher runs it
unchanged. On a laptop the defaults finish in seconds:

    python examples/mlp_ddp.py                          # 2 CPU processes, local mode
    python examples/mlp_ddp.py --skip-pyspark           # without starting Spark at all

On a GPU node or cluster, size it up (``--remote`` runs the ranks as Spark barrier tasks):

    python examples/mlp_ddp.py --processes 8 --samples 4000000 --batch-size 8192 --epochs 5
    spark-submit --master <cluster> examples/mlp_ddp.py --remote --processes 16 \\
        --samples 4000000 --batch-size 8192 --epochs 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from sparkdist import Distributor, distributed

REPO = Path(__file__).resolve().parent.parent


class Timing(NamedTuple):
    """Wall times of one launcher: its first call in this process, then a warm call."""

    first_s: float
    warm_s: float


class SimpleMLP(nn.Module):
    def __init__(self, input_dim: int = 10, hidden_dim: int = 64, output_dim: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, output_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def train(epochs: int, samples: int, batch_size: int, lr: float, hidden: int) -> dict[str, Any]:
    """Train the MLP with DDP; every rank returns the loss all ranks reached together."""
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    # The same data and initial weights on every rank, under every launcher; the sampler then
    # gives each rank its own part of the data.
    torch.manual_seed(0)
    x = torch.randn(samples, 10)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, pin_memory=use_cuda)
    model = DistributedDataParallel(
        SimpleMLP(hidden_dim=hidden).to(device), device_ids=[local_rank] if use_cuda else None
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.MSELoss()
    torch.manual_seed(1 + rank)  # each rank its own dropout masks, the same in every launcher

    epoch_loss = float("nan")
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        totals = torch.zeros(2, device=device)  # sum of losses, number of samples
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            totals += torch.stack(
                [loss.detach() * len(xb), torch.tensor(float(len(xb)), device=device)]
            )
        dist.all_reduce(totals)
        epoch_loss = (totals[0] / totals[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: loss {epoch_loss:.4f}")
    # DDP before its process group: when the DDP module is the last holder of the gloo group
    # (destroy_process_group() dropped the world's hold), freeing it at the function's return
    # joins gloo's worker threads while holding the GIL, and a worker thread still freeing its
    # last collective's tensors waits for the GIL: a deadlock seen under load (torch 2.13, CPU).
    del model, optimizer
    dist.destroy_process_group()
    return {
        "rank": rank,
        "world_size": world_size,
        "loss": epoch_loss,
        "device": "cuda" if use_cuda else "cpu",
    }


def start_spark(processes: int, use_cuda: bool) -> Any:
    """A SparkSession: spark-submit's master on a cluster, local[processes] alone."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparkdist-mlp-ddp")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit: its master wins
        builder = builder.master(os.environ.get("SPARK_MASTER", f"local[{processes}]"))
    builder = builder.config("spark.pyspark.python", sys.executable).config(
        "spark.ui.showConsoleProgress", "false"
    )
    if use_cuda:
        # pyspark's local mode only uses GPUs the driver declares as a Spark resource.
        builder = builder.config("spark.driver.resource.gpu.amount", str(processes)).config(
            "spark.driver.resource.gpu.discoveryScript", str(REPO / "conf" / "getGpusResources.sh")
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def run_with_pysparks_torch_distributor(
    args: argparse.Namespace, train_args: tuple[Any, ...], spark: Any, use_cuda: bool
) -> dict[str, Any]:
    from pyspark import cloudpickle as pyspark_cloudpickle
    from pyspark.ml.torch.distributor import TorchDistributor

    if args.remote:
        use_gpu = float(spark.conf.get("spark.task.resource.gpu.amount", "0")) > 0
    else:
        use_gpu = use_cuda
    # pyspark pickles functions of an importable module by reference, and its torchrun workers
    # cannot import this file; ship it by value (sparkdist does so on its own).
    module = sys.modules[train.__module__]
    by_value = module.__name__ != "__main__"
    if by_value:
        pyspark_cloudpickle.register_pickle_by_value(module)
    try:
        result: dict[str, Any] = TorchDistributor(
            num_processes=args.processes, local_mode=not args.remote, use_gpu=use_gpu
        ).run(train, *train_args)
        return result
    finally:
        if by_value:
            pyspark_cloudpickle.unregister_pickle_by_value(module)


def main(argv: list[str] | None = None) -> list[tuple[str, dict[str, Any], Timing]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=2, help="ranks (one per GPU)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048, help="rows of random data")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--hidden", type=int, default=64, help="hidden layer width")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--remote",
        action="store_true",
        help="run the ranks as Spark barrier tasks instead of on this machine",
    )
    parser.add_argument(
        "--skip-pyspark",
        action="store_true",
        help="leave pyspark's TorchDistributor out (and Spark, unless --remote)",
    )
    args = parser.parse_args(argv)
    train_args = (args.epochs, args.samples, args.batch_size, args.lr, args.hidden)
    use_cuda = torch.cuda.is_available()

    try:
        import pyspark  # noqa: F401 - only to learn whether it is installed

        has_pyspark = True
    except ImportError:
        has_pyspark = False
    run_pyspark = has_pyspark and not args.skip_pyspark
    if args.remote and not has_pyspark:
        parser.error("--remote needs pyspark: pip install 'sparkdist[spark]'")
    spark = start_spark(args.processes, use_cuda) if (args.remote or run_pyspark) else None

    timings: list[tuple[str, dict[str, Any], Timing]] = []

    def timed(name: str, launch: Any) -> None:
        # Twice: the first call includes the launcher's one-time start-up in this process, the
        # second is warm. Comparing one launcher's first call with another's warm one would
        # measure who ran first, not the launchers.
        seconds = []
        for call in ("first call", "warm call"):
            print(f"--- {name} ({call})")
            started = time.perf_counter()
            result = launch()
            seconds.append(time.perf_counter() - started)
        timings.append((name, result, Timing(*seconds)))

    timed(
        "sparkdist Distributor(...).run",
        lambda: Distributor(args.processes, local_mode=not args.remote, spark=spark).run(
            train, *train_args
        ),
    )
    # What `@distributed(gpus=N, remote=...)` above `def train` does; applied here so that N
    # can come from the command line.
    serverless_style = distributed(gpus=args.processes, remote=args.remote, spark=spark)(train)
    timed(
        "sparkdist @distributed + .distributed",
        lambda: serverless_style.distributed(*train_args)[0],
    )
    if run_pyspark:
        timed(
            "pyspark TorchDistributor(...).run",
            lambda: run_with_pysparks_torch_distributor(args, train_args, spark, use_cuda),
        )

    where = "Spark barrier tasks" if args.remote else "this machine"
    print(f"\n{args.processes} rank(s) on {where}, {'NCCL + GPU' if use_cuda else 'gloo + CPU'}:")
    print(
        f"{'launcher':<40} {'first call':>11} {'warm call':>10} {'final loss':>11} "
        f"{'world size':>11} {'device':>7}"
    )
    for name, result, timing in timings:
        print(
            f"{name:<40} {timing.first_s:>10.2f}s {timing.warm_s:>9.2f}s "
            f"{result['loss']:>11.5f} {result['world_size']:>11} {result['device']:>7}"
        )
    print(
        "first call: includes one-time start-up in this process (sparkdist: its worker\n"
        "  pool, which both sparkdist launchers share; pyspark: its imports and, with\n"
        "  --remote, Spark's Python workers); warm call: the same run again. Compare the\n"
        "  warm calls."
    )
    if spark is not None:
        spark.stop()
    return timings


if __name__ == "__main__":
    main()
