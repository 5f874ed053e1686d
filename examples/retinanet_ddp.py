"""torchvision's RetinaNet detector trained with DDP on synthetic images, launched by sparkdist.

The model is ``torchvision.models.detection.RetinaNet`` with random weights (no download) over
a ResNet-18 + FPN backbone built here (GroupNorm instead of BatchNorm, so the tiny per-rank
batches of detection need no batch statistics), or a smaller conv backbone for CPUs; anchor
sizes follow the image size. The data is synthetic: each image is noise with a few filled
rectangles, and a rectangle's colour is its class, so the focal (classification) and
box-regression losses both have something to learn. A ``DistributedSampler`` gives each rank
its own shard of the images and DDP averages the gradients; the losses printed on rank 0 are
averaged over ranks.

torchvision must match the installed torch build: PyPI's torchvision wheels are built for CUDA
and do not import beside a CPU-only torch, so on a CPU-only machine install both from the same
index (or run this on a GPU image that ships them).

    python examples/retinanet_ddp.py --tiny                # 2 CPU processes, 64x64 images
    python examples/retinanet_ddp.py --processes 8         # 512x512 images, one GPU per rank
    spark-submit --master <cluster> examples/retinanet_ddp.py --remote --processes 16

The flags --images --image-size --objects --num-classes --backbone --width --fpn-channels
--batch --steps --workers --seed --lr override the preset (the default is GPU-sized with
ResNet-18, --tiny is CPU-sized with a small four-stage conv backbone).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from sparkdist import Distributor, runtime


@dataclass(frozen=True)
class DetectionConfig:
    """Sizes of the images, the model and one run; ``batch`` is images per rank per step."""

    images: int = 20_000  # the data set, split across ranks
    image_size: int = 512
    objects: int = 4  # rectangles per image
    num_classes: int = 5  # object classes (RetinaNet's num_classes counts them, no background)
    backbone: str = "resnet18"  # or "small": four strided conv stages, `width` wide at first
    width: int = 16
    fpn_channels: int = 256
    batch: int = 8
    steps: int = 200
    lr: float = 1e-4
    workers: int = 4  # DataLoader processes per rank drawing the images
    seed: int = 0
    log_every: int = 10


#: A few minutes on 8 GPUs.
GPU_PRESET = DetectionConfig()
#: Two CPU processes on two shared cores: tens of seconds.
TINY_PRESET = DetectionConfig(
    images=16,
    image_size=64,
    objects=2,
    num_classes=3,
    backbone="small",
    width=16,
    fpn_channels=32,
    batch=2,
    steps=32,
    lr=1e-3,
    workers=0,
    log_every=8,
)

#: One colour per class (RGB in [0, 1]); classes beyond the list reuse colours shifted a bit.
PALETTE = (
    (1.0, 0.1, 0.1),
    (0.1, 1.0, 0.1),
    (0.1, 0.1, 1.0),
    (1.0, 1.0, 0.1),
    (1.0, 0.1, 1.0),
    (0.1, 1.0, 1.0),
)


class SyntheticDetection(Dataset[tuple[torch.Tensor, dict[str, torch.Tensor]]]):
    """``config.images`` noisy images with filled rectangles, and their boxes and labels.

    Image ``i`` is drawn from a generator seeded by ``i``: the same on every rank and in every
    epoch, without storing the data set anywhere.
    """

    def __init__(self, config: DetectionConfig) -> None:
        self.config = config

    def __len__(self) -> int:
        return self.config.images

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config, size = self.config, self.config.image_size
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
        image = 0.2 * torch.rand(3, size, size, generator=generator)
        boxes, labels = [], []
        for _ in range(config.objects):
            width, height = torch.randint(size // 8, size // 2, (2,), generator=generator).tolist()
            x0 = int(torch.randint(0, size - width, (1,), generator=generator))
            y0 = int(torch.randint(0, size - height, (1,), generator=generator))
            label = int(torch.randint(config.num_classes, (1,), generator=generator))
            colour = torch.tensor(PALETTE[label % len(PALETTE)]) * (1 - 0.1 * (label // 6))
            image[:, y0 : y0 + height, x0 : x0 + width] = colour[:, None, None]
            boxes.append([x0, y0, x0 + width, y0 + height])
            labels.append(label)
        return image, {
            "boxes": torch.tensor(boxes, dtype=torch.float),
            "labels": torch.tensor(labels, dtype=torch.int64),
        }


def collate(batch: list[Any]) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Detection batches are lists (images may differ in size), not stacked tensors."""
    images, targets = zip(*batch, strict=True)
    return list(images), list(targets)


def small_body(width: int) -> nn.Module:
    """Five stride-2 conv stages (stem, layer1..layer4), named like a ResNet's so that
    ``BackboneWithFPN`` takes layer2..layer4 (strides 8, 16, 32) from it as from ResNet-18."""

    def stage(in_channels: int, out_channels: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False),
            nn.GroupNorm(8, out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.GroupNorm(8, out_channels),
            nn.ReLU(inplace=True),
        )

    widths = [width, width, width * 2, width * 4, width * 8]
    names = ["stem", "layer1", "layer2", "layer3", "layer4"]
    return nn.Sequential(
        OrderedDict(
            (name, stage(3 if i == 0 else widths[i - 1], widths[i])) for i, name in enumerate(names)
        )
    )


def build_model(config: DetectionConfig) -> nn.Module:
    """RetinaNet over a ResNet-18 (or small) + FPN (P3-P7) backbone, random weights, anchors
    sized for ``config.image_size``."""
    from torchvision.models import resnet18
    from torchvision.models.detection import RetinaNet
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    channels = config.fpn_channels
    if config.backbone == "resnet18":
        body = resnet18(weights=None, norm_layer=lambda width: nn.GroupNorm(32, width))
        in_channels = [128, 256, 512]
    else:
        body = small_body(config.width)
        in_channels = [config.width * 2, config.width * 4, config.width * 8]
    backbone = BackboneWithFPN(
        body,
        return_layers={"layer2": "0", "layer3": "1", "layer4": "2"},  # strides 8, 16, 32
        in_channels_list=in_channels,
        out_channels=channels,
        extra_blocks=LastLevelP6P7(channels, channels),  # strides 64, 128
    )
    # RetinaNet's default anchors (32 to 512 pixels) suit 800-pixel images; scale them to
    # ours, keeping its three scales per level and three aspect ratios.
    base = max(4, config.image_size // 16)
    sizes = tuple(
        tuple(int(base * 2**level * 2 ** (k / 3)) for k in range(3)) for level in range(5)
    )
    anchors = AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * len(sizes))
    model: nn.Module = RetinaNet(
        backbone,
        num_classes=config.num_classes,
        min_size=config.image_size,
        max_size=config.image_size,
        anchor_generator=anchors,
    )
    return model


def train(config: DetectionConfig) -> dict[str, Any]:
    """Train RetinaNet with DDP on this rank's synthetic images; return this rank's summary."""
    device = runtime.device()  # sparkdist already bound this rank to cuda:LOCAL_RANK
    dist.init_process_group(runtime.backend())
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(config.seed)  # the same initial weights everywhere
    model = build_model(config).to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=config.lr)
    dataset = SyntheticDetection(config)
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, seed=config.seed
    )
    loader = DataLoader(
        dataset,
        batch_size=config.batch,
        sampler=sampler,
        collate_fn=collate,
        num_workers=config.workers,
        pin_memory=device.type == "cuda",
    )

    losses: list[float] = []
    started = time.perf_counter()
    ddp.train()
    epoch = 0
    while len(losses) < config.steps:
        sampler.set_epoch(epoch)  # a new order each epoch; each rank its own shard
        for images, targets in loader:
            images = [image.to(device, non_blocking=True) for image in images]
            targets = [
                {k: v.to(device, non_blocking=True) for k, v in target.items()}
                for target in targets
            ]
            parts = ddp(images, targets)  # {"classification": focal, "bbox_regression": L1}
            loss = sum(parts.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean = loss.detach().reshape(1)
            dist.all_reduce(mean)  # SUM then divide: gloo has no AVG
            losses.append(mean.item() / world_size)
            step = len(losses) - 1
            if rank == 0 and (step % config.log_every == 0 or step == config.steps - 1):
                detail = ", ".join(f"{k} {v.item():.3f}" for k, v in parts.items())
                print(f"step {step:4d}  loss {losses[-1]:.4f} ({detail})")
            if len(losses) == config.steps:
                break
        epoch += 1
    seconds = time.perf_counter() - started

    # One step's loss depends on its images: compare the first and last quarters of the run.
    quarter = max(1, len(losses) // 4)
    world_pids: list[Any] = [None] * world_size
    dist.all_gather_object(world_pids, os.getpid())
    dist.destroy_process_group()
    return {
        "rank": rank,
        "pid": os.getpid(),
        "world_size": runtime.get_world_size(),
        "process_group_size": world_size,
        "world_pids": sorted(world_pids),
        "wrapped_model": type(ddp).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "losses": losses,
        "first_loss": sum(losses[:quarter]) / quarter,
        "final_loss": sum(losses[-quarter:]) / quarter,
        "images_per_s": config.steps * config.batch * world_size / seconds,
        "device": device.type,
    }


def start_spark(processes: int) -> Any:
    """A SparkSession for ``--remote``: spark-submit's master if any, else local[processes]."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparkdist-retinanet-ddp").config(
        "spark.pyspark.python", sys.executable
    )
    # spark-submit hands its master to this process through the gateway it started; a master
    # set on the builder would override it, so set one only when running alone.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", f"local[{processes}]"))
    spark = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, DetectionConfig]:
    """The command line, and the config it selects (preset plus explicit flags)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized preset (seconds)")
    for name in (
        "images",
        "image_size",
        "objects",
        "num_classes",
        "width",
        "fpn_channels",
        "batch",
        "steps",
        "workers",
        "seed",
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=int,
            help=f"default: {getattr(GPU_PRESET, name)} ({getattr(TINY_PRESET, name)} with --tiny)",
        )
    parser.add_argument(
        "--backbone",
        choices=("resnet18", "small"),
        help=f"default: {GPU_PRESET.backbone} ({TINY_PRESET.backbone} with --tiny)",
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
    config = DetectionConfig(**{**asdict(preset), **overrides})
    if config.backbone == "small" and config.width % 8:
        parser.error("--width must be a multiple of 8 (the small backbone's GroupNorm groups)")
    if config.image_size < 32:
        parser.error("--image-size must be at least 32")
    if min(config.steps, config.batch, config.objects, config.num_classes) < 1:
        parser.error("--steps, --batch, --objects and --num-classes must be at least 1")
    if config.images < args.processes:
        parser.error("--images must be at least --processes (every rank needs a shard)")
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
            f"rank {value['rank']}: {value['device']}, world size "
            f"{value['process_group_size']}, loss {value['first_loss']:.4f} -> "
            f"{value['final_loss']:.4f} (first and last quarter of the steps)"
        )
    summary = result.values[0]
    print(
        f"RetinaNet ({summary['parameters']:,} parameters) on {result.world_size} ranks in "
        f"{elapsed:.1f} s ({summary['images_per_s']:.1f} images/s)"
    )
    return list(result.values)


if __name__ == "__main__":
    main()
