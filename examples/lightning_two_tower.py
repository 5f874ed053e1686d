"""A two-tower recommender trained with PyTorch Lightning's DDP strategy, launched by sparkdist.

A user tower and an item tower (an embedding, then a small MLP, then L2 normalisation) score a
pair by the dot product of their outputs; training uses in-batch negatives (every other item of
the batch is a negative for a user, accidental hits masked out) and a softmax over the batch.
The held-out set is one interaction per user, scored against every item: recall@10 is the
fraction of held-out items that land in the user's top 10.

Lightning is left to do its own distributed set-up: sparkdist gives every rank torchrun's
environment (``TORCHELASTIC_RUN_ID`` among it), so Lightning picks its
``TorchElasticEnvironment``, whose processes are "created externally", and starts no process
of its own; its automatic ``DistributedSampler`` gives each rank its own shard. Each rank
returns what Lightning saw from inside the ``LightningModule`` (world size, cluster
environment, the processes in the world) next to its losses and recall, so the run proves it.

The interactions are synthetic but learnable: users and items belong to clusters, and a user
mostly picks items of its own cluster, popular ones more often (random would give recall@10 =
10 / items).

    python examples/lightning_two_tower.py --tiny             # 2 CPU processes, seconds
    python examples/lightning_two_tower.py --processes 8      # 100k users, one GPU per rank
    spark-submit --master <cluster> examples/lightning_two_tower.py --remote --processes 16

The flags --users --items --clusters --interactions --dim --hidden --batch --epochs --seed
--lr override the preset (the default is GPU-sized, --tiny is CPU-sized); --bf16 trains in
bf16 mixed precision on GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, cast

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparkdist import Distributor, runtime

TOP_K = 10


@dataclass(frozen=True)
class TwoTowerConfig:
    """Sizes of the data, the model and one run; ``batch`` is per rank."""

    users: int = 100_000
    items: int = 20_000
    clusters: int = 200
    interactions: int = 20  # training interactions per user (one more is held out)
    dim: int = 64  # embedding width, and the width of each tower's output
    hidden: int = 256
    batch: int = 4096
    epochs: int = 5
    lr: float = 3e-3
    temperature: float = 0.1
    in_cluster: float = 0.9  # probability that an interaction stays in the user's cluster
    seed: int = 0
    bf16: bool = False


#: A few minutes on 8 GPUs: 2M training interactions, 20k items to rank per user.
GPU_PRESET = TwoTowerConfig()
#: Two CPU processes on two shared cores: a few seconds of training.
TINY_PRESET = TwoTowerConfig(
    users=256,
    items=128,
    clusters=16,
    interactions=8,
    dim=16,
    hidden=32,
    batch=64,
    epochs=4,
    lr=1e-2,
)


def synthetic_interactions(config: TwoTowerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(users, items) of the training interactions and of the held-out ones (one per user).

    Deterministic in ``config.seed``, so every rank builds the same data without any transfer;
    the sampler then decides which part each rank trains on.
    """
    generator = torch.Generator().manual_seed(config.seed)
    per_cluster = config.items // config.clusters
    user_cluster = torch.randint(config.clusters, (config.users,), generator=generator)
    # Item i belongs to cluster i % clusters; within a cluster, popularity falls like 1/rank.
    popularity = 1.0 / torch.arange(1, per_cluster + 1, dtype=torch.float)
    picks = config.interactions + 1
    within = torch.multinomial(
        popularity, config.users * picks, replacement=True, generator=generator
    ).view(config.users, picks)
    in_cluster_items = user_cluster[:, None] + within * config.clusters
    random_items = torch.randint(config.items, (config.users, picks), generator=generator)
    stay = torch.rand(config.users, picks, generator=generator) < config.in_cluster
    items = torch.where(stay, in_cluster_items, random_items)
    users = torch.arange(config.users)[:, None].expand(-1, picks)
    train = (users[:, :-1].reshape(-1), items[:, :-1].reshape(-1))
    held_out = (users[:, -1], items[:, -1])
    return torch.stack(train, dim=1), torch.stack(held_out, dim=1)


class Tower(nn.Module):
    """An id embedding, a two-layer MLP, then L2 normalisation (so scores are cosines)."""

    def __init__(self, count: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(count, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.mlp(self.embedding(ids)), dim=-1)


class TwoTowerModule(L.LightningModule):
    """The two towers, in-batch-negative training, recall@10 validation, and the probes that
    record what Lightning saw of the launch."""

    def __init__(self, config: TwoTowerConfig, train_size: int) -> None:
        super().__init__()
        self.config = config
        self.user_tower = Tower(config.users, config.dim, config.hidden)
        self.item_tower = Tower(config.items, config.dim, config.hidden)
        self.train_size = train_size
        self.epoch_losses: list[float] = []
        self.recalls: list[float] = []
        self.launch: dict[str, Any] = {}
        self.shard: dict[str, Any] = {}
        self._loss_sum = torch.zeros(2)  # sum of batch losses, number of batches
        self._hits = torch.zeros(2)  # held-out items in the top k, held-out items scored
        self._seen = torch.zeros(0)
        self._all_items: torch.Tensor | None = None

    def on_fit_start(self) -> None:
        trainer = self.trainer
        environment = getattr(trainer.strategy, "cluster_environment", None)  # DDP has one
        launcher = trainer.strategy.launcher
        # The processes Lightning trains in: if it had started its own, there would be more
        # than world_size pids here, or they would not be sparkdist's ranks.
        pids = cast(torch.Tensor, self.all_gather(torch.tensor(os.getpid(), device=self.device)))
        self.launch = {
            "lightning_world_size": trainer.world_size,
            "lightning_global_rank": trainer.global_rank,
            "process_group_size": dist.get_world_size(),
            "cluster_environment": type(environment).__name__,
            "creates_processes_externally": bool(
                getattr(environment, "creates_processes_externally", False)
            ),
            "strategy": type(trainer.strategy).__name__,
            # Lightning's launcher keeps the processes it spawned in .procs.
            "children_spawned_by_lightning": len(getattr(launcher, "procs", [])),
            "world_pids": sorted(int(p) for p in pids.flatten().tolist()),
        }

    def on_train_epoch_start(self) -> None:
        self._loss_sum = torch.zeros(2, device=self.device)
        if self.current_epoch == 0:
            self._seen = torch.zeros(self.train_size, dtype=torch.int32, device=self.device)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        index, users, items = batch
        user_vectors, item_vectors = self.user_tower(users), self.item_tower(items)
        logits = user_vectors @ item_vectors.T / self.config.temperature
        # The same item twice in a batch is not a negative for either user: mask those hits.
        accidental = (items[:, None] == items[None, :]) & ~torch.eye(
            len(items), dtype=torch.bool, device=self.device
        )
        logits = logits.masked_fill(accidental, torch.finfo(logits.dtype).min)
        loss = F.cross_entropy(logits.float(), torch.arange(len(items), device=self.device))
        self._loss_sum += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        if self.current_epoch == 0:
            self._seen[index] += 1
        return loss

    def on_train_epoch_end(self) -> None:
        totals = self.trainer.strategy.reduce(self._loss_sum, reduce_op="sum")
        self.epoch_losses.append(float(totals[0] / totals[1]))
        if self.current_epoch == 0:
            # Which interactions each rank trained on in the first epoch: a (world, N) count.
            seen = cast(torch.Tensor, self.all_gather(self._seen)).view(-1, self.train_size)
            times_seen = seen.sum(dim=0)
            self.shard = {
                "shard_size": int(self._seen.sum()),
                "interactions_seen_twice": int((times_seen > 1).sum()),
                "interactions_covered": int((times_seen > 0).sum()),
                "train_size": self.train_size,
            }
        if self.trainer.is_global_zero:
            recall = f", recall@{TOP_K} {self.recalls[-1]:.3f}" if self.recalls else ""
            print(f"epoch {self.current_epoch}: loss {self.epoch_losses[-1]:.4f}{recall}")

    def on_validation_epoch_start(self) -> None:
        self._hits = torch.zeros(2, device=self.device)
        self._all_items = None

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        _, users, items = batch
        if self._all_items is None:  # every item's vector, once per validation pass
            self._all_items = self.item_tower(torch.arange(self.config.items, device=self.device))
        scores = self.user_tower(users) @ self._all_items.T
        top = scores.topk(TOP_K, dim=1).indices
        hits = (top == items[:, None]).any(dim=1)
        self._hits += torch.stack(
            [hits.sum().float(), torch.tensor(float(len(items)), device=self.device)]
        )

    def on_validation_epoch_end(self) -> None:
        totals = self.trainer.strategy.reduce(self._hits, reduce_op="sum")
        self.recalls.append(float(totals[0] / totals[1]))
        self._all_items = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.config.lr)


def train(config: TwoTowerConfig) -> dict[str, Any]:
    """Fit the two towers with ``Trainer(strategy="ddp")`` on this rank; return what it saw."""
    # Lightning 2.6 calls torch APIs that this torch deprecated; the warnings, repeated by each
    # rank, say nothing about this code.
    warnings.filterwarnings(
        "ignore",
        message=r"(torch\.distributed\.nn\.functional\.all_gather|"
        r"`isinstance\(treespec, LeafSpec\)`) is deprecated",
    )
    use_cuda = runtime.device().type == "cuda"
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    train_pairs, held_out = synthetic_interactions(config)
    train_set = TensorDataset(torch.arange(len(train_pairs)), train_pairs[:, 0], train_pairs[:, 1])
    held_out_set = TensorDataset(torch.arange(len(held_out)), held_out[:, 0], held_out[:, 1])
    # shuffle=True and no sampler: Lightning swaps in a DistributedSampler (one shard per rank).
    train_loader = DataLoader(train_set, batch_size=config.batch, shuffle=True)
    held_out_loader = DataLoader(held_out_set, batch_size=config.batch * 4)
    module = TwoTowerModule(config, train_size=len(train_pairs))

    local_world = runtime.get_local_world_size()
    with tempfile.TemporaryDirectory(prefix="two-tower-") as root:
        trainer = L.Trainer(
            accelerator="gpu" if use_cuda else "cpu",
            # Lightning checks these against the environment's WORLD_SIZE.
            devices=local_world,
            num_nodes=runtime.get_world_size() // local_world,
            strategy="ddp",
            max_epochs=config.epochs,
            precision="bf16-mixed" if config.bf16 and use_cuda else "32-true",
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=runtime.is_main_process(),
            num_sanity_val_steps=0,
        )
        started = time.perf_counter()
        trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=held_out_loader)
        seconds = time.perf_counter() - started
    return {
        "rank": runtime.get_global_rank(),
        "pid": os.getpid(),
        "world_size": runtime.get_world_size(),
        **module.launch,
        **module.shard,
        "epoch_losses": module.epoch_losses,
        f"recall_at_{TOP_K}": module.recalls,
        f"random_recall_at_{TOP_K}": TOP_K / config.items,
        "interactions_per_s": config.epochs * len(train_pairs) / seconds,
        "device": "cuda" if use_cuda else "cpu",
    }


def start_spark(processes: int) -> Any:
    """A SparkSession for ``--remote``: spark-submit's master if any, else local[processes]."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparkdist-lightning-two-tower").config(
        "spark.pyspark.python", sys.executable
    )
    # spark-submit hands its master to this process through the gateway it started; a master
    # set on the builder would override it, so set one only when running alone.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", f"local[{processes}]"))
    spark = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, TwoTowerConfig]:
    """The command line, and the config it selects (preset plus explicit flags)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized preset (seconds)")
    for name in (
        "users",
        "items",
        "clusters",
        "interactions",
        "dim",
        "hidden",
        "batch",
        "epochs",
        "seed",
    ):
        parser.add_argument(
            f"--{name}",
            type=int,
            help=f"default: {getattr(GPU_PRESET, name)} ({getattr(TINY_PRESET, name)} with --tiny)",
        )
    parser.add_argument("--lr", type=float)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs only)")
    parser.add_argument("--processes", type=int, default=2, help="ranks (one per GPU)")
    parser.add_argument("--cpu", action="store_true", help="train on CPU even if there are GPUs")
    parser.add_argument(
        "--remote",
        action="store_true",
        help="run the ranks as Spark barrier tasks instead of on this machine",
    )
    args = parser.parse_args(argv)
    preset = TINY_PRESET if args.tiny else GPU_PRESET
    overrides = {k: v for k, v in vars(args).items() if k in asdict(preset) and v is not None}
    config = TwoTowerConfig(**{**asdict(preset), **overrides, "bf16": args.bf16})
    if config.items < config.clusters or config.items < TOP_K:
        parser.error(f"--items must be at least --clusters and at least {TOP_K}")
    if min(config.epochs, config.interactions, config.batch) < 1:
        parser.error("--epochs, --interactions and --batch must be at least 1")
    return args, config


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Launch ``train`` on every rank with ``Distributor``; return each rank's result."""
    args, config = parse_args(argv)
    spark = start_spark(args.processes) if args.remote else None
    # use_gpu=None lets sparkdist use GPUs where there are any (nccl) and the CPU otherwise.
    distributor = Distributor(
        args.processes, local_mode=not args.remote, use_gpu=False if args.cpu else None, spark=spark
    )
    started = time.perf_counter()
    try:
        result = distributor.run_all(train, config)
    finally:
        if spark is not None:
            spark.stop()
    elapsed = time.perf_counter() - started
    for value in result.values:
        print(
            f"rank {value['rank']}: Lightning saw world size {value['lightning_world_size']} "
            f"({value['cluster_environment']}, {value['children_spawned_by_lightning']} "
            f"processes spawned by Lightning), trained on {value['shard_size']:,} of "
            f"{value['train_size']:,} interactions, loss {value['epoch_losses'][0]:.4f} -> "
            f"{value['epoch_losses'][-1]:.4f}"
        )
    summary = result.values[0]
    print(
        f"{result.world_size} ranks in {elapsed:.1f} s: recall@{TOP_K} "
        f"{summary[f'recall_at_{TOP_K}'][-1]:.3f} (random: "
        f"{summary[f'random_recall_at_{TOP_K}']:.3f})"
    )
    return list(result.values)


if __name__ == "__main__":
    main()
