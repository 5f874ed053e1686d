"""Supervised fine-tuning of a small causal language model with TRL's ``SFTTrainer``, under DDP
or DeepSpeed ZeRO, launched by sparkdist.

Nothing is downloaded: the model is a ``LlamaForCausalLM`` built from a ``LlamaConfig`` (random
weights), the tokenizer a character-level ``PreTrainedTokenizerFast`` built here from the
``tokenizers`` library, and the instruction data synthetic: prompt/completion pairs such as
``reverse: spark ->`` / `` kraps`` (reverse, sort, uppercase, add), on which SFTTrainer computes
the loss on the completion only.

The Trainer does its own distributed set-up, as under torchrun: sparkdist gives every rank
torchrun's environment, Accelerate reads it, and ``trainer.args.world_size`` is the number of
sparkdist ranks (each rank returns it, with the pids of the processes in the world, to prove
that no process was started twice). With ``--deepspeed`` the ranks are launched in mode
"deepspeed" with ``conf/deepspeed/zero2.json`` (or ``--deepspeed-config``); sparkdist ships the
file to every rank and the Trainer gets it as ``deepspeed=``. Hugging Face refuses a DeepSpeed
config whose concrete values contradict the trainer's, so the micro-batch size, gradient
accumulation, clipping and AdamW settings are taken from the file where it sets them (the
``--batch``/``--lr`` flags then apply only where the file says "auto"). Without a GPU, the ranks
train on CPU with gloo (DeepSpeed on its CPU accelerator, which sparkdist selects).

    python examples/hf_trainer_sft.py --tiny                     # DDP, 2 CPU processes
    python examples/hf_trainer_sft.py --tiny --deepspeed         # ZeRO-2, 2 CPU processes
    python examples/hf_trainer_sft.py --processes 8 --bf16       # ~76M parameters, DDP on GPUs
    python examples/hf_trainer_sft.py --processes 8 --deepspeed \\
        --deepspeed-config conf/deepspeed/zero3.json
    spark-submit --master <cluster> examples/hf_trainer_sft.py --remote --processes 16

The flags --layers --hidden --heads --kv-heads --intermediate --samples --max-length --steps
--batch --seed --lr override the preset (the default is GPU-sized, --tiny is CPU-sized).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sparkdist import Distributor, runtime

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DEEPSPEED_CONFIG = REPO / "conf" / "deepspeed" / "zero2.json"

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
#: Every character the synthetic tasks use: one token each.
CHARACTERS = string.ascii_lowercase + string.ascii_uppercase + string.digits + " :->+"


@dataclass(frozen=True)
class SFTRunConfig:
    """Sizes of the model and of one run; ``batch`` is per rank."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    samples: int = 50_000
    max_length: int = 64
    steps: int = 500
    batch: int = 32
    lr: float = 3e-4
    seed: int = 0
    log_every: int = 10
    bf16: bool = False


#: About 76M parameters (Llama architecture, 12 layers of width 768).
GPU_PRESET = SFTRunConfig()
#: Two CPU processes on two shared cores see the loss fall within seconds.
TINY_PRESET = SFTRunConfig(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    intermediate=128,
    samples=256,
    max_length=48,
    steps=20,
    batch=4,
    lr=1e-3,
    log_every=4,
)


def build_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast``, built without any download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([PAD, UNK, BOS, EOS, *CHARACTERS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own "word" (spaces included), and decoding glues them back.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        model_max_length=1024,
    )


def build_model(config: SFTRunConfig, tokenizer: Any) -> Any:
    """A Llama-architecture causal LM of the configured size, with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden,
        intermediate_size=config.intermediate,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=max(128, config.max_length),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    return LlamaForCausalLM(model_config)


def synthetic_instructions(samples: int, seed: int) -> list[dict[str, str]]:
    """Prompt/completion pairs of four string tasks, deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(samples):
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8)))
        task = rng.choice(("reverse", "sort", "upper", "add"))
        if task == "reverse":
            answer = word[::-1]
        elif task == "sort":
            answer = "".join(sorted(word))
        elif task == "upper":
            answer = word.upper()
        else:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            word, answer = f"{a}+{b}", str(a + b)
        rows.append({"prompt": f"{task}: {word} ->", "completion": f" {answer}"})
    return rows


def trainer_settings_from(deepspeed_config: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments that agree with the concrete values of a DeepSpeed config.

    Hugging Face fills the config's "auto" values from TrainingArguments and raises on any
    concrete value that differs from them; taking those values from the file keeps the file
    authoritative, as it is for pyspark's DeepspeedTorchDistributor.
    """
    optimizer = deepspeed_config.get("optimizer", {}).get("params", {})
    sources = {
        "per_device_train_batch_size": deepspeed_config.get("train_micro_batch_size_per_gpu"),
        "gradient_accumulation_steps": deepspeed_config.get("gradient_accumulation_steps"),
        "max_grad_norm": deepspeed_config.get("gradient_clipping"),
        "learning_rate": optimizer.get("lr"),
        "adam_epsilon": optimizer.get("eps"),
        "weight_decay": optimizer.get("weight_decay"),
        "bf16": deepspeed_config.get("bf16", {}).get("enabled"),
        "fp16": deepspeed_config.get("fp16", {}).get("enabled"),
    }
    settings = {k: v for k, v in sources.items() if v is not None and v != "auto"}
    betas = optimizer.get("betas")
    if isinstance(betas, list):
        settings["adam_beta1"], settings["adam_beta2"] = betas
    return settings


def train(config: SFTRunConfig) -> dict[str, Any]:
    """Fine-tune with ``SFTTrainer`` on this rank; return what the trainer saw and the losses."""
    import warnings

    import datasets
    from trl import SFTConfig, SFTTrainer

    # DeepSpeed calls collectives that this torch deprecated, and the warning repeats each step.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning
    )
    use_cuda = runtime.device().type == "cuda"
    deepspeed_config = runtime.deepspeed_config()  # None unless launched in mode "deepspeed"
    settings: dict[str, Any] = {
        "per_device_train_batch_size": config.batch,
        "learning_rate": config.lr,
        "bf16": config.bf16 and use_cuda,
    }
    if deepspeed_config is not None:
        settings.update(trainer_settings_from(deepspeed_config))

    tokenizer = build_tokenizer()
    model = build_model(config, tokenizer)
    parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    # Its progress bars would reach the driver as dozens of lines per rank for a few ms of work.
    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_list(synthetic_instructions(config.samples, config.seed))
    with tempfile.TemporaryDirectory(prefix="sft-") as output_dir:
        args = SFTConfig(
            output_dir=output_dir,
            max_steps=config.steps,
            max_length=config.max_length,
            lr_scheduler_type="constant",
            logging_steps=config.log_every,
            logging_first_step=True,  # the loss before any update, to compare the last one with
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,  # \r progress bars become one line each through sparkdist
            activation_checkpointing=False,  # TRL turns it on; this model is too small to need it
            dataloader_num_workers=0,
            ddp_find_unused_parameters=False,  # every parameter gets a gradient every step
            seed=config.seed,
            use_cpu=not use_cuda,
            ddp_backend=runtime.backend(),  # nccl on GPUs, gloo on CPU
            deepspeed=deepspeed_config,
            **settings,
        )
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        started = time.perf_counter()
        metrics = trainer.train().metrics
        seconds = time.perf_counter() - started

    # Every process of the world says who it is: exactly the sparkdist ranks, none of them
    # started a second time.
    world_pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(world_pids, os.getpid())
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    deepspeed_plugin = trainer.accelerator.state.deepspeed_plugin
    return {
        "rank": runtime.get_global_rank(),
        "pid": os.getpid(),
        "world_size": runtime.get_world_size(),
        "trainer": type(trainer).__name__,
        "trainer_world_size": trainer.args.world_size,
        "trainer_process_index": trainer.args.process_index,
        "accelerate_num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type.value),
        "wrapped_model": type(trainer.model_wrapped).__name__,
        "zero_stage": deepspeed_plugin.zero_stage if deepspeed_plugin is not None else None,
        "world_pids": sorted(world_pids),
        "per_device_batch": trainer.args.per_device_train_batch_size,
        "learning_rate": trainer.args.learning_rate,
        "parameters": parameters,
        "losses": losses,
        "steps": trainer.state.global_step,
        "samples_per_s": metrics.get("train_samples_per_second", 0.0),
        "seconds": seconds,
        "device": "cuda" if use_cuda else "cpu",
    }


def start_spark(processes: int) -> Any:
    """A SparkSession for ``--remote``: spark-submit's master if any, else local[processes]."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparkdist-hf-trainer-sft").config(
        "spark.pyspark.python", sys.executable
    )
    # spark-submit hands its master to this process through the gateway it started; a master
    # set on the builder would override it, so set one only when running alone.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", f"local[{processes}]"))
    spark = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, SFTRunConfig]:
    """The command line, and the config it selects (preset plus explicit flags)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized preset (seconds)")
    for name in (
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "intermediate",
        "samples",
        "max_length",
        "steps",
        "batch",
        "seed",
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=int,
            help=f"default: {getattr(GPU_PRESET, name)} ({getattr(TINY_PRESET, name)} with --tiny)",
        )
    parser.add_argument("--lr", type=float)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs only)")
    parser.add_argument(
        "--deepspeed",
        action="store_true",
        help="train with DeepSpeed (mode 'deepspeed') instead of DDP",
    )
    parser.add_argument(
        "--deepspeed-config",
        default=str(DEFAULT_DEEPSPEED_CONFIG),
        help="DeepSpeed config JSON (default: conf/deepspeed/zero2.json)",
    )
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
    config = SFTRunConfig(**{**asdict(preset), **overrides, "bf16": args.bf16})
    if min(config.steps, config.batch, config.samples) < 1:
        parser.error("--steps, --batch and --samples must be at least 1")
    return args, config


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Launch ``train`` on every rank with ``Distributor``; return each rank's result."""
    args, config = parse_args(argv)
    deepspeed_config: str | dict[str, Any] | None = None
    if args.deepspeed:
        deepspeed_config = args.deepspeed_config
        if args.bf16:  # the file as is, unless a flag changes it
            with open(args.deepspeed_config, encoding="utf-8") as f:
                deepspeed_config = {**json.load(f), "bf16": {"enabled": True}}
    spark = start_spark(args.processes) if args.remote else None
    # Nothing here needs the Hugging Face Hub; offline, no rank waits on a network timeout.
    env = {
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    # use_gpu=None lets sparkdist use GPUs where there are any (nccl) and the CPU otherwise.
    distributor = Distributor(
        args.processes,
        local_mode=not args.remote,
        use_gpu=False if args.cpu else None,
        mode="deepspeed" if args.deepspeed else "ddp",
        deepspeed_config=deepspeed_config,
        env=env,
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
        stage = f", ZeRO stage {value['zero_stage']}" if value["zero_stage"] is not None else ""
        print(
            f"rank {value['rank']}: {value['trainer']} saw world size "
            f"{value['trainer_world_size']} ({value['distributed_type']}, "
            f"{value['wrapped_model']}{stage}), loss {value['losses'][0]:.4f} -> "
            f"{value['losses'][-1]:.4f} in {value['steps']} steps"
        )
    summary = result.values[0]
    print(
        f"{result.mode_settings} on {result.world_size} ranks in {elapsed:.1f} s: "
        f"{summary['parameters']:,} parameters, {summary['samples_per_s']:.1f} samples/s"
    )
    return list(result.values)


if __name__ == "__main__":
    main()
