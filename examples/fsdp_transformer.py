"""A decoder-only transformer language model trained with FSDP2, launched by sparkdist.

Every block is sharded with ``fully_shard`` over ``runtime.device_mesh()``, then the root, so
each rank holds 1/world_size of the parameters and gathers a block's weights only while it
computes that block. On GPUs the blocks compute in bf16 (``MixedPrecisionPolicy``) while the
sharded parameters and the gradient reduction stay fp32; on CPU everything is fp32 on gloo.

The tokens are synthetic but learnable: each sequence is a random walk on a fixed graph where
every token has two possible successors (ln 2 nats per step once the graph is learnt), and its
second half repeats its first half (learnable by copying from earlier in the context). The loss
printed on rank 0 falls from ln(vocab) towards the floor shown at the start.

    python examples/fsdp_transformer.py --tiny            # 2 CPU processes, seconds
    python examples/fsdp_transformer.py --processes 8     # ~10M parameters, one GPU per rank
    spark-submit --master <cluster> examples/fsdp_transformer.py --remote --processes 16

Same flags for both sizes: --layers --dim --heads --seq --vocab --steps --batch --lr override
the preset (the default is GPU-sized, --tiny is CPU-sized).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sparkdist import Distributor, runtime


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the model and of one training run."""

    layers: int = 8
    dim: int = 256
    heads: int = 8
    seq: int = 256
    vocab: int = 8192
    steps: int = 200
    batch: int = 16  # sequences per rank per step
    lr: float = 1e-3
    seed: int = 0
    log_every: int = 10


#: The default is about 10.5M parameters (8 blocks of 12*dim^2, plus embeddings and head).
GPU_PRESET = ModelConfig()
#: Small enough that 2 CPU processes sharing 2 cores see the loss fall within seconds.
TINY_PRESET = ModelConfig(
    layers=2, dim=64, heads=4, seq=64, vocab=128, steps=30, batch=8, lr=3e-3, log_every=5
)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be a multiple of heads={heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TransformerLM(nn.Module):
    """Token and learned position embeddings, ``layers`` blocks, a final norm and an LM head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq, config.dim)
        self.blocks = nn.ModuleList(Block(config.dim, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def successor_table(vocab: int, seed: int) -> torch.Tensor:
    """The graph the walks follow: two successors for every token, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (vocab, 2), generator=generator)


def synthetic_batch(
    successors: torch.Tensor, batch: int, seq: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch`` sequences of ``seq + 1`` tokens: a random walk, then the walk again."""
    half = (seq + 2) // 2
    walk = [torch.randint(len(successors), (batch,), generator=generator)]
    for _ in range(half - 1):
        choice = torch.randint(2, (batch,), generator=generator)
        walk.append(successors[walk[-1], choice])
    first = torch.stack(walk, dim=1)
    return torch.cat([first, first], dim=1)[:, : seq + 1]


def loss_floor(seq: int) -> float:
    """The loss of a model that knows the graph and copies perfectly (nats per token)."""
    half = (seq + 2) // 2
    return (half - 1) * math.log(2) / seq


def train(config: ModelConfig) -> dict[str, Any]:
    """Train the model with FSDP2 on every rank; return this rank's summary.

    The returned ``final_loss`` is the mean over ranks of the last step's loss, so every rank
    returns the same value; ``held_params`` is this rank's shard of the parameters.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group(runtime.backend())  # as under torchrun: the script owns the group
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = runtime.device()  # sparkdist already bound this rank to cuda:LOCAL_RANK

    torch.manual_seed(config.seed)  # the same initial weights everywhere, before sharding
    model = TransformerLM(config).to(device)
    total_params = sum(p.numel() for p in model.parameters())

    # bf16 compute only where it pays (GPUs); fp32 reduction keeps gradient sums accurate.
    shard_options: dict[str, Any] = {"mesh": runtime.device_mesh()}
    if device.type == "cuda":
        shard_options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    # Per block first, so each block's weights are gathered just before it runs and freed
    # after; the root then owns what is left (embeddings, final norm, head).
    for block in model.blocks:
        fully_shard(block, **shard_options)
    fully_shard(model, **shard_options)
    # fully_shard turned every parameter into a DTensor; its local part is this rank's shard.
    held_params = sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    successors = successor_table(config.vocab, config.seed)
    generator = torch.Generator().manual_seed(config.seed + 1 + rank)  # each rank its own data
    if rank == 0:
        print(
            f"{total_params:,} parameters, {held_params:,} on each of {world_size} ranks; "
            f"{device.type}, {'bf16' if device.type == 'cuda' else 'fp32'} compute; "
            f"loss starts near {math.log(config.vocab):.2f}, floor ~{loss_floor(config.seq):.2f}"
        )

    losses: list[float] = []
    compute_dtype = torch.float32
    started = time.perf_counter()
    for step in range(config.steps):
        tokens = synthetic_batch(successors, config.batch, config.seq, generator).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        compute_dtype = logits.dtype  # the blocks' output dtype: bf16 under mixed precision
        if rank == 0 and (step % config.log_every == 0 or step == config.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - started

    last = torch.tensor([losses[-1]], device=device)
    dist.all_reduce(last)  # SUM then divide: gloo has no AVG
    dist.destroy_process_group()
    return {
        "rank": rank,
        "world_size": world_size,
        "first_loss": losses[0],
        "final_loss": last.item() / world_size,
        "total_params": total_params,
        "held_params": held_params,
        "tokens_per_s": config.steps * config.batch * config.seq * world_size / seconds,
        "device": str(device),
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
    }


def start_spark(processes: int) -> Any:
    """A SparkSession for ``--remote``: spark-submit's master if any, else local[processes]."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparkdist-fsdp-transformer").config(
        "spark.pyspark.python", sys.executable
    )
    # spark-submit hands its master to this process through the gateway it started; a master
    # set on the builder would override it, so set one only when running alone.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", f"local[{processes}]"))
    spark = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ModelConfig]:
    """The command line, and the model config it selects (preset plus explicit flags)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized preset (seconds)")
    for name in ("layers", "dim", "heads", "seq", "vocab", "steps", "batch", "seed"):
        parser.add_argument(
            f"--{name}",
            type=int,
            help=f"default: {getattr(GPU_PRESET, name)} ({getattr(TINY_PRESET, name)} with --tiny)",
        )
    parser.add_argument("--lr", type=float)
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
    config = ModelConfig(**{**asdict(preset), **overrides})
    if config.steps < 1:
        parser.error("--steps must be at least 1")
    return args, config


def main(argv: list[str] | None = None) -> float:
    """Launch ``train`` with ``Distributor(..., mode="fsdp")``; return the final loss."""
    args, config = parse_args(argv)
    spark = start_spark(args.processes) if args.remote else None
    # use_gpu=None lets sparkdist use GPUs where there are any (nccl) and the CPU otherwise.
    distributor = Distributor(
        args.processes,
        local_mode=not args.remote,
        use_gpu=False if args.cpu else None,
        mode="fsdp",
        spark=spark,
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
            f"rank {value['rank']}: {value['device']} ({value['compute_dtype']}), holds "
            f"{value['held_params']:,} of {value['total_params']:,} parameters, loss "
            f"{value['first_loss']:.4f} -> {value['final_loss']:.4f}"
        )
    summary = result.values[0]
    print(
        f"{result.mode_settings} on {result.world_size} ranks in {elapsed:.1f} s "
        f"({summary['tokens_per_s']:,.0f} tokens/s): final loss {summary['final_loss']:.4f}"
    )
    return float(summary["final_loss"])


if __name__ == "__main__":
    main()
