"""DeepSpeed's universal checkpoint, for a DeepSpeed checkpoint loaded at another world size:
when a load needs it (``plan``), converted once from the committed step directory, kept beside
it, and the engine switched to read it while it loads.

DeepSpeed (0.19) loads its ZeRO checkpoints (stages 1 to 3) only at the data-parallel world
size they were saved at; its universal checkpoint, one file per parameter and optimizer state
(``python -m deepspeed.checkpoint.ds_to_universal``), loads at any, with
``"checkpoint": {"load_universal": true}``. Here global rank 0 converts with DeepSpeed's own
converter, in-process and serially (no worker processes), into ``.step-<N>.universal.tmp/``;
the result is made private and durable, stamped with a copy of the step's commit marker, and
renamed to ``step-<N>.universal/``: complete when its name is there, and used only while the
marker it was made from is still the step's (a checkpoint saved again at that step is
converted again). Retention removes it with its step (``checkpoint_layout``).

Non-goals: choosing the checkpoint and refusing it on every rank (``checkpoint_deepspeed``);
tensor- and pipeline-parallel checkpoints, whose conversion needs Megatron's metadata.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sparkdist._checkpoint import layout as checkpoint_layout
from sparkdist._checkpoint import ranks as checkpoint_ranks
from sparkdist._checkpoint.layout import Candidate, Unreadable
from sparkdist._checkpoint.pickles import WeightsOnlyReads, deepspeed_data_classes
from sparkdist._core.files import fsync_directory, make_private_dirs, write_private_file

logger = logging.getLogger("sparkdist")

#: In a conversion: the commit marker of the checkpoint it was made from.
SOURCE = "CONVERTED_FROM"
#: DeepSpeed's config field behind ``"checkpoint": {"load_universal": ...}``.
SETTING = "load_universal_checkpoint"


class Refusal(Exception):
    """A DeepSpeed checkpoint that cannot load into this engine; the message says why and how."""


@dataclass(frozen=True)
class Topology:
    """How an engine's state is laid out across ranks: what decides how a checkpoint loads."""

    world_size: int
    dp_world_size: int  # the ranks ZeRO partitions the state across
    mp_world_size: int  # tensor and pipeline parallel (a user's ``mpu``)
    zero_stage: int

    @classmethod
    def of(cls, engine: Any) -> Topology:
        import torch.distributed as dist

        world_size = dist.get_world_size() if checkpoint_ranks.distributed() else 1
        return cls(
            world_size=world_size,
            dp_world_size=int(getattr(engine, "seq_dp_world_size", world_size)),
            mp_world_size=int(getattr(engine, "mp_world_size", 1)),
            zero_stage=int(engine.zero_optimization_stage()),
        )

    @classmethod
    def saved(cls, marker: dict[str, Any]) -> Topology:
        """The topology a DeepSpeed marker records (``Unreadable`` when it does not)."""
        fields = ("world_size", "dp_world_size", "mp_world_size", "zero_stage")
        values = [marker.get(name) for name in fields]
        if not all(type(value) is int for value in values):
            raise Unreadable(f"its commit marker does not record {', '.join(fields)}")
        return cls(*values)  # type: ignore[arg-type]


def plan(
    saved: Topology, current: Topology, path: str, *, universal_asked: bool, partitioned: bool
) -> bool:
    """Whether the checkpoint at ``path`` loads through DeepSpeed's universal checkpoint (True)
    or as it is (False); raises ``Refusal`` for what DeepSpeed cannot load into this engine.
    ``partitioned``: it holds per-rank optimizer state (ZeRO's, or DeepSpeed's bf16 optimizer's
    without ZeRO)."""
    where = (
        f"checkpoint {path} was saved by {saved.world_size} ranks with ZeRO stage "
        f"{saved.zero_stage}; this run has {current.world_size} ranks"
    )
    if saved.zero_stage != current.zero_stage:
        raise Refusal(
            f"{where} and ZeRO stage {current.zero_stage}: DeepSpeed loads a checkpoint only into "
            f'the ZeRO stage it was saved with; set "zero_optimization": {{"stage": '
            f"{saved.zero_stage}}} in the DeepSpeed config to load it"
        )
    reshard = saved.dp_world_size != current.dp_world_size and partitioned
    if saved.mp_world_size != current.mp_world_size or (
        saved.mp_world_size > 1 and (reshard or universal_asked)
    ):
        raise Refusal(
            f"{where}, with model-parallel size {saved.mp_world_size} (this engine: "
            f"{current.mp_world_size}): sparkdist reshards only data-parallel (ZeRO) checkpoints; "
            f"run at {saved.world_size} ranks with the same model-parallel layout, or convert it "
            "yourself with python -m deepspeed.checkpoint.ds_to_universal and load it with "
            "DeepSpeed's own engine.load_checkpoint"
        )
    if universal_asked and saved.zero_stage == 0:
        raise Refusal(
            f'{where}: the DeepSpeed config asks for universal checkpoints ("checkpoint": '
            '{"load_universal": true}), which DeepSpeed loads only with ZeRO (stage 1 to 3); '
            "remove that setting to load it as it is"
        )
    if reshard and saved.zero_stage == 0:
        raise Refusal(
            f"{where}: its optimizer state is split across the ranks (DeepSpeed's bf16 "
            "optimizer without ZeRO), and DeepSpeed reshards only ZeRO checkpoints (stage 1 to "
            f"3); run at {saved.world_size} ranks to load it"
        )
    return reshard or universal_asked


# -- converting --------------------------------------------------------------------------------


def is_converted(path: str, marker: dict[str, Any]) -> bool:
    """Whether ``path`` holds a finished conversion of the checkpoint ``marker`` commits."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(os.path.join(path, SOURCE), encoding="utf-8") as f:
            return f.read() == json.dumps(marker, sort_keys=True)
    return False


def convert(directory: str, candidate: Candidate, marker: dict[str, Any], world_size: int) -> str:
    """On global rank 0: the tag (directory name in ``directory``) of the candidate's universal
    conversion, made now unless one of this very checkpoint is there. Raises what DeepSpeed's
    converter raises."""
    name = checkpoint_layout.universal_name(candidate.step)
    path = os.path.join(directory, name)
    source = json.dumps(marker, sort_keys=True)
    if is_converted(path, marker):
        return name
    checkpoint_layout.remove_tree(path)  # a conversion of what was saved at this step before
    work = os.path.join(directory, f".{name}.tmp")
    checkpoint_layout.remove_tree(work)
    make_private_dirs(work)
    output = os.path.join(work, "universal")  # DeepSpeed writes "latest_universal" beside it
    logger.warning(
        "sparkdist: checkpoint %s was saved by %s ranks; converting it to DeepSpeed's universal "
        "checkpoint %s to load it on %d (once: the conversion is kept with the checkpoint)",
        candidate.path,
        marker.get("world_size"),
        path,
        world_size,
    )
    from deepspeed.checkpoint import ds_to_universal

    try:
        ds_to_universal.main(
            argparse.Namespace(
                input_folder=candidate.path,
                output_folder=output,
                num_extract_workers=1,  # in this process: no worker processes to outlive it
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,  # models without Megatron's universal metadata
            )
        )
        write_private_file(os.path.join(output, SOURCE), source.encode())
        checkpoint_layout.seal(output)
        os.rename(output, path)
        fsync_directory(directory)
    finally:
        checkpoint_layout.remove_tree(work)
    return name


@contextlib.contextmanager
def loading(engine: Any, *, universal: bool, weights_only: bool) -> Iterator[None]:
    """While ``engine.load_checkpoint`` runs: DeepSpeed's config says whether the checkpoint is
    universal (DeepSpeed reads the setting when it loads, and only then); with
    ``weights_only``, its torch checkpoint engine reads through ``torch.load(weights_only=True)``
    with DeepSpeed's own data classes allowed."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    config = getattr(engine, "_config", None)
    switchable = hasattr(config, SETTING)
    was = getattr(config, SETTING, False)
    reader = engine.checkpoint_engine
    if weights_only and isinstance(reader, TorchCheckpointEngine):
        engine.checkpoint_engine = WeightsOnlyReads(reader)
    if switchable:
        setattr(config, SETTING, universal)
    try:
        with torch.serialization.safe_globals(deepspeed_data_classes()):
            yield
    finally:
        engine.checkpoint_engine = reader
        if switchable:
            setattr(config, SETTING, was)
