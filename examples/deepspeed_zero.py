"""A small transformer language model trained with DeepSpeed ZeRO, launched by sparkdist's
drop-in for pyspark's ``DeepspeedTorchDistributor``.

The DeepSpeed config is a file under ``conf/deepspeed/``: ``zero2.json`` (optimizer state and
gradients partitioned across ranks), ``zero3.json`` (parameters partitioned too) or
``zero3_offload.json`` (ZeRO-3 with optimizer state and parameters kept in CPU memory).
sparkdist checks the file on the driver, ships it to every rank, and the function reads it with
``runtime.deepspeed_config()``; a script target would get pyspark's
``--deepspeed --deepspeed_config <path>`` arguments instead. Without a GPU, the ranks run on
DeepSpeed's CPU accelerator (sparkdist sets ``DS_ACCELERATOR=cpu``) and gloo.

The data is the synthetic language of ``fsdp_transformer.py`` (a random walk on a two-successor
graph, then the walk repeated), so the loss printed on rank 0 falls from ln(vocab) towards the
floor shown at the start. The model is repeated here rather than imported so this file stands
alone: sparkdist ships a function's own module to the ranks, not its neighbours.

    python examples/deepspeed_zero.py --tiny                                  # ZeRO-2, 2 CPU ranks
    python examples/deepspeed_zero.py --tiny --config conf/deepspeed/zero3.json
    python examples/deepspeed_zero.py --processes 8 --bf16                    # one GPU per rank
    spark-submit --master <cluster> examples/deepspeed_zero.py --remote --processes 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sparkdist import DeepspeedTorchDistributor, runtime

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "conf" / "deepspeed" / "zero2.json"


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the model and of one run; the batch size comes from the DeepSpeed config."""

    layers: int = 4
    dim: int = 256
    heads: int = 8
    seq: int = 128
    vocab: int = 4096
    steps: int = 100
    seed: int = 0
    log_every: int = 10


#: About 5.3M parameters: small enough for any GPU, big enough for ZeRO to matter in memory.
GPU_PRESET = ModelConfig()
#: Two CPU processes on two shared cores see the loss fall within seconds.
TINY_PRESET = ModelConfig(layers=2, dim=64, heads=4, seq=64, vocab=128, steps=30, log_every=5)


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


def held_elements(param: torch.nn.Parameter) -> int:
    """Elements of ``param`` this rank keeps between steps (see ``train``)."""
    if not hasattr(param, "ds_tensor"):  # ZeRO-0/1/2: parameters are replicated
        return param.numel()
    # ZeRO-3: an empty placeholder plus this rank's partition, unless the parameter is small
    # enough to persist (stay whole on every rank and skip the gather before each use).
    if param.ds_persist:  # type: ignore[attr-defined] # DeepSpeed adds ds_* at run time
        return int(param.ds_numel)  # type: ignore[attr-defined]
    return int(param.ds_tensor.numel())


def train(config: ModelConfig) -> dict[str, Any]:
    """Train the model with the run's DeepSpeed config on every rank; return this rank's summary.

    ``final_loss`` is the mean over ranks of the last step's loss (the same on every rank);
    ``held_params`` counts the parameter elements this rank keeps during training: everything
    under ZeRO-2; under ZeRO-3 a 1/world_size partition of each parameter, except parameters
    smaller than ``stage3_param_persistence_threshold``, which stay whole on every rank.
    """
    import warnings

    import deepspeed

    # DeepSpeed calls collectives that this torch deprecated, and the warning repeats each step.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning
    )
    # As under torchrun, the script sets up communication itself; DeepSpeed's helper wraps
    # init_process_group. backend() is "nccl" on GPUs and "gloo" on the CPU accelerator.
    deepspeed.init_distributed(dist_backend=runtime.backend())
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(config.seed)  # the same initial weights everywhere
    model = TransformerLM(config)
    total_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=runtime.deepspeed_config()
    )
    stage = engine.zero_optimization_stage()
    held_params = sum(held_elements(p) for p in engine.module.parameters())
    batch = engine.train_micro_batch_size_per_gpu()

    successors = torch.randint(
        config.vocab, (config.vocab, 2), generator=torch.Generator().manual_seed(config.seed)
    )
    generator = torch.Generator().manual_seed(config.seed + 1 + rank)  # each rank its own data
    if rank == 0:
        floor = ((config.seq + 2) // 2 - 1) * math.log(2) / config.seq
        persist = ""
        if stage == 3:  # DeepSpeed's default threshold is 1e5 elements
            zero = (runtime.deepspeed_config() or {}).get("zero_optimization", {})
            threshold = int(zero.get("stage3_param_persistence_threshold", 100_000))
            persist = f" (parameters under {threshold:,} elements stay whole)"
        print(
            f"ZeRO stage {stage}: {total_params:,} parameters, {held_params:,} held per rank"
            f"{persist}; "
            f"{engine.device}, micro-batch {batch}; loss starts near "
            f"{math.log(config.vocab):.2f}, floor ~{floor:.2f}"
        )

    losses: list[float] = []
    compute_dtype = torch.float32
    started = time.perf_counter()
    for step in range(config.steps):
        tokens = synthetic_batch(successors, batch, config.seq, generator).to(engine.device)
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        compute_dtype = logits.dtype  # the blocks' output dtype: bf16 under mixed precision
        if rank == 0 and (step % config.log_every == 0 or step == config.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - started

    last = torch.tensor([losses[-1]], device=engine.device)
    dist.all_reduce(last)  # SUM then divide: gloo has no AVG
    return {
        "rank": rank,
        "world_size": world_size,
        "zero_stage": stage,
        "first_loss": losses[0],
        "final_loss": last.item() / world_size,
        "total_params": total_params,
        "held_params": held_params,
        "tokens_per_s": config.steps * batch * config.seq * world_size / seconds,
        "device": str(engine.device),
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
    }


def start_spark(processes: int) -> Any:
    """A SparkSession for ``--remote``: spark-submit's master if any, else local[processes]."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparkdist-deepspeed-zero").config(
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
    parser.add_argument(
        "--config",
        default=str(DEFAULT_CONFIG),
        help="DeepSpeed config JSON (default: conf/deepspeed/zero2.json)",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU-sized preset (seconds)")
    for name in ("layers", "dim", "heads", "seq", "vocab", "steps", "seed"):
        parser.add_argument(
            f"--{name}",
            type=int,
            help=f"default: {getattr(GPU_PRESET, name)} ({getattr(TINY_PRESET, name)} with --tiny)",
        )
    parser.add_argument("--processes", type=int, default=2, help="ranks (one per GPU)")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="add bf16 mixed precision to the config (GPUs with bf16 only)",
    )
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
    """Launch ``train`` with ``DeepspeedTorchDistributor``; return the final loss."""
    args, config = parse_args(argv)
    spark = start_spark(args.processes) if args.remote else None
    if args.cpu:
        use_gpu = False
    elif spark is not None:  # the executors' GPUs count, not the driver's
        use_gpu = float(spark.conf.get("spark.task.resource.gpu.amount", "0") or 0) > 0
    else:
        use_gpu = torch.cuda.is_available()
    # The file as is, like pyspark's DeepspeedTorchDistributor; a dict when a flag changes it.
    deepspeed_config: str | dict[str, Any] = args.config
    if args.bf16:
        with open(args.config, encoding="utf-8") as f:
            deepspeed_config = {**json.load(f), "bf16": {"enabled": True}}
    # pyspark's signature: no session argument; in Spark mode the active session is used.
    distributor = DeepspeedTorchDistributor(
        numGpus=args.processes,
        nnodes=1,
        localMode=not args.remote,
        useGpu=use_gpu,
        deepspeedConfig=deepspeed_config,
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
            f"rank {value['rank']}: {value['device']} ({value['compute_dtype']}), ZeRO stage "
            f"{value['zero_stage']}, holds {value['held_params']:,} of "
            f"{value['total_params']:,} parameters, loss {value['first_loss']:.4f} -> "
            f"{value['final_loss']:.4f}"
        )
    summary = result.values[0]
    print(
        f"{result.mode_settings} on {result.world_size} ranks in {elapsed:.1f} s "
        f"({summary['tokens_per_s']:,.0f} tokens/s): final loss {summary['final_loss']:.4f}"
    )
    return float(summary["final_loss"])


if __name__ == "__main__":
    main()
