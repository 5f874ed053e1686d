"""DeepSpeed's own checkpoints under sparkdist's layout and commit rule: ``save_checkpoint``
and ``load_checkpoint`` given a ``deepspeed.DeepSpeedEngine`` (alone, or as one value of a dict
whose other entries are DeepSpeed's ``client_state``).

Saving: rank 0 makes room for the step (``checkpoint_layout.prepare``); every rank calls
``engine.save_checkpoint(<checkpoint_dir>, tag="step-<9 digits>")`` (collective; DeepSpeed's
``latest`` file is not written: the marker decides what loads); rank 0 makes the files private
and durable (DeepSpeed writes them with the umask, unsynced) and writes the marker last:
format "deepspeed", the world sizes, the ZeRO stage.

Loading: rank 0 picks the newest committed checkpoint, which must be DeepSpeed's, decides how
it loads (``checkpoint_universal.plan``: at another world size through DeepSpeed's universal
checkpoint) and checks its pickles (``weights_only``: strictly, as DeepSpeed
unpickles in full); every rank then loads through ``engine.load_checkpoint``, its checkpoint
engine's reads weights-only. A refusal comes on every rank alike, before the engine is touched.
DeepSpeed reads a universal checkpoint past its checkpoint engine: there the check before is
the only guard (a file swapped in between it and the read is not caught).

Non-goals: DeepSpeed's decoupled (asynchronous) checkpoint engines; resharding tensor- or
pipeline-parallel checkpoints; NVMe offload's swap files (``offloaded_tensors``) in retention.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any

from sparkdist._checkpoint import dcp as checkpoint_io
from sparkdist._checkpoint import deepspeed_store
from sparkdist._checkpoint import layout as checkpoint_layout
from sparkdist._checkpoint import ranks as checkpoint_ranks
from sparkdist._checkpoint import universal as checkpoint_universal
from sparkdist._checkpoint.layout import Unreadable
from sparkdist._checkpoint.pickles import check_tree
from sparkdist._checkpoint.universal import Refusal, Topology, plan

logger = logging.getLogger("sparkdist")

FORMAT = "deepspeed"
#: Keys of DeepSpeed's own entries in its model-states file (0.19): client state under one of
#: these names would overwrite DeepSpeed's, or be dropped on load.
DEEPSPEED_KEYS = frozenset(
    "module buffer_names optimizer param_shapes frozen_param_shapes shared_params "
    "frozen_param_fragments lr_scheduler data_sampler random_ltd sparse_tensor_module_names "
    "skipped_steps global_steps global_samples dp_world_size mp_world_size ds_config ds_version "
    "checkpoint_parallel_dimensions universal_checkpoint_info ds_autoep_layers autoep_layers "
    "folding num_experts".split()
)
#: DeepSpeed's recovery scripts, which it copies into the checkpoint directory itself.
_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


@dataclass(frozen=True)
class Found:
    """The engine in what was given to ``save_checkpoint``/``load_checkpoint``, and its key in
    the dict around it (None: the engine was given alone)."""

    engine: Any
    key: str | None


def find_engine(state: Any) -> Found | None:
    """The DeepSpeed engine in ``state`` (the engine, or the one engine among a dict's values);
    None when there is none. Imports nothing: without deepspeed loaded there is no engine."""
    module = sys.modules.get("deepspeed.runtime.engine")
    engine_class = getattr(module, "DeepSpeedEngine", None)
    if engine_class is None:
        return None
    if isinstance(state, engine_class):
        return Found(state, None)
    if not isinstance(state, dict):
        return None
    keys = [key for key, value in state.items() if isinstance(value, engine_class)]
    if len(keys) > 1:
        raise TypeError(
            f"the state holds {len(keys)} DeepSpeed engines ({', '.join(map(repr, keys))}): "
            "a checkpoint is one engine's, with its client state beside it"
        )
    if not keys:
        return None
    others = [key for key in state if not isinstance(key, str)]
    if others:
        raise TypeError(f"client state keys must be str; got {others[0]!r}")
    return Found(state[keys[0]], keys[0])


# -- saving ------------------------------------------------------------------------------------


def save(
    found: Found,
    state: Any,
    step: int,
    directory: str,
    *,
    async_: bool,
    keep_last: int | None,
    entries: dict[str, Any] | None = None,
) -> str:
    """``runtime.save_checkpoint`` of a DeepSpeed engine: every rank calls it. ``entries``: what
    else the commit marker holds (``api.add_marker_entry``)."""
    engine = found.engine
    if async_:
        raise ValueError(
            "async_=True saves state dicts through torch.distributed.checkpoint; a DeepSpeed "
            "engine saves through its own engine.save_checkpoint, which writes before it "
            "returns: drop async_=True"
        )
    client_state = {} if found.key is None else {k: v for k, v in state.items() if k != found.key}
    clashes = sorted(set(client_state) & DEEPSPEED_KEYS)
    if clashes:
        raise ValueError(
            f"client state keys {', '.join(map(repr, clashes))} are names DeepSpeed uses for "
            "its own entries in the checkpoint; rename them"
        )
    if engine.checkpoint_engine.is_decoupled():
        raise ValueError(
            "this engine's DeepSpeed checkpoint engine is decoupled (it writes after "
            "save_checkpoint returns), so sparkdist cannot tell when to commit the checkpoint; "
            'remove the decoupled writer from the "checkpoint" section of the DeepSpeed config'
        )
    checkpoint_io.wait_for_pending_saves()
    import deepspeed

    topology = Topology.of(engine)
    target, final = checkpoint_ranks.share_from_rank0(
        lambda: checkpoint_layout.prepare(directory, step)
    )
    on_store = deepspeed_store.is_on_store(directory)
    # On a store DeepSpeed writes into this host's mirror, uploaded below.
    local = deepspeed_store.mirror_of(directory) if on_store else directory
    if on_store:
        deepspeed_store.on_each_host(lambda: deepspeed_store.empty(local))
    tag = os.path.basename(target)
    try:
        engine.save_checkpoint(
            local,
            tag=tag,
            client_state=client_state,
            save_latest=False,  # the marker says what loads, not DeepSpeed's "latest"
        )
        if on_store:
            deepspeed_store.on_each_host(lambda: deepspeed_store.upload(local, tag, target))
    except Exception as exc:
        raise RuntimeError(
            f"checkpoint step {step} could not be written to {target}: "
            f"{checkpoint_ranks.describe(exc)}"
        ) from exc
    marker = {
        "format": FORMAT,
        "step": step,
        **dataclasses.asdict(topology),
        "client_keys": sorted(client_state),
        "deepspeed_version": deepspeed.__version__,
        "saved_at": round(time.time(), 3),
        **(entries or {}),
    }

    def commit() -> None:  # on rank 0, after DeepSpeed's barrier: every rank's files are there
        if not on_store:  # a store's objects have no modes, and were uploaded whole
            checkpoint_layout.seal(target)
            for name in _SCRIPTS:
                script = os.path.join(directory, name)
                if os.path.isfile(script) and not os.path.islink(script):
                    os.chmod(script, 0o700)
        checkpoint_layout.commit(directory, target, final, marker)
        if keep_last is not None:
            checkpoint_layout.retain(directory, keep_last, step)

    checkpoint_ranks.share_from_rank0(commit)
    return final


# -- loading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Chosen:
    """What global rank 0 chose for every rank to load."""

    step: int
    path: str
    tag: str  # the directory in ``checkpoint_dir`` that DeepSpeed reads
    universal: bool


def load(
    found: Found, into: Any, directory: str, *, map_location: Any, weights_only: bool
) -> tuple[int, str] | None:
    """``runtime.load_checkpoint`` into a DeepSpeed engine: (step, path) of the checkpoint loaded
    into it (and the client state into ``into``'s other entries), or None when there is none.
    Every rank calls it."""
    if not (isinstance(map_location, str) and map_location == "cpu"):
        raise TypeError(
            f"map_location={map_location!r}: a DeepSpeed engine puts its state where it keeps "
            "it; leave map_location out when loading into an engine"
        )
    engine = found.engine
    wanted = () if found.key is None else tuple(k for k in into if k != found.key)
    checkpoint_io.wait_for_pending_saves()
    current = Topology.of(engine)
    config = getattr(engine, "_config", None)
    setting = checkpoint_universal.SETTING
    settings = (bool(getattr(config, setting, False)), hasattr(config, setting))
    on_store = deepspeed_store.is_on_store(directory)
    # On a store DeepSpeed reads this host's mirror, filled below (rank 0's while it chooses).
    local = deepspeed_store.mirror_of(directory) if on_store else directory
    if on_store:
        deepspeed_store.on_each_host(lambda: deepspeed_store.empty(local))
    kind, value = checkpoint_ranks.share_from_rank0(
        lambda: _decided(directory, local, current, wanted, weights_only, settings)
    )
    if kind == "unpickling":
        raise pickle.UnpicklingError(value)
    if kind == "refused":
        raise RuntimeError(value)
    if value is None:
        return None
    chosen: _Chosen = value
    if on_store:
        remote, mirrored = f"{directory}/{chosen.tag}", os.path.join(local, chosen.tag)
        deepspeed_store.on_each_host(lambda: deepspeed_store.download_tree(remote, mirrored))
    with checkpoint_universal.loading(
        engine, universal=chosen.universal, weights_only=weights_only
    ):
        try:
            loaded, client_state = engine.load_checkpoint(local, tag=chosen.tag)
        except pickle.UnpicklingError:
            raise
        except Exception as exc:
            raise RuntimeError(
                f"DeepSpeed could not load checkpoint {chosen.path}: "
                f"{checkpoint_ranks.describe(exc)}"
            ) from exc
    if loaded is None:
        raise RuntimeError(f"DeepSpeed found no model states in {chosen.path}")
    if on_store:
        deepspeed_store.on_each_host(lambda: deepspeed_store.remove(local))
    for key in wanted:
        into[key] = client_state[key]
    return chosen.step, chosen.path


def _decided(*args: Any) -> tuple[str, Any]:
    """On global rank 0: ("ok", ``_choose``'s checkpoint or None), or the refusal every rank
    raises alike: ("refused", message) or ("unpickling", message)."""
    try:
        return "ok", _choose(*args)
    except Refusal as exc:
        return "refused", str(exc)
    except pickle.UnpicklingError as exc:
        return "unpickling", str(exc)


def _choose(
    directory: str,
    local: str,
    current: Topology,
    wanted: tuple[str, ...],
    weights_only: bool,
    settings: tuple[bool, bool],
) -> _Chosen | None:
    """The newest committed checkpoint, made ready to load from ``local`` (``directory``
    itself, or this host's mirror of a store). ``settings``: whether the config asks for
    universal checkpoints, and whether sparkdist finds where to ask for them."""
    universal_asked, switchable = settings
    unreadable: list[str] = []
    for candidate in checkpoint_layout.candidates(directory):
        if candidate.legacy:
            raise Refusal(wrong_format(candidate.path, "dcp"))
        try:
            marker = checkpoint_layout.read_marker(candidate)
            saved = Topology.saved(marker) if marker["format"] == FORMAT else None
        except FileNotFoundError:
            continue  # removed since it was listed
        except (Unreadable, OSError) as exc:
            logger.warning(
                "sparkdist: checkpoint %s cannot be read (%s); trying the checkpoint before it",
                candidate.path,
                exc,
            )
            unreadable.append(f"{candidate.path}: {exc}")
            continue
        if saved is None:
            raise Refusal(wrong_format(candidate.path, marker["format"]))
        missing = sorted(set(wanted) - set(marker.get("client_keys") or ()))
        if missing:
            held = ", ".join(map(repr, marker.get("client_keys") or ())) or "none"
            raise Refusal(
                f"checkpoint {candidate.path} holds no client state "
                f"{', '.join(map(repr, missing))} (it holds {held}): load into a dict of the "
                "engine and the keys it was saved with"
            )
        tag = checkpoint_layout.step_name(candidate.step)
        source = candidate
        if local != directory:  # on a store: the checks and DeepSpeed read this host's copy
            source = dataclasses.replace(candidate, path=os.path.join(local, tag))
            deepspeed_store.download_tree(candidate.path, source.path)
        partitioned = any(n.endswith("_optim_states.pt") for n in os.listdir(source.path))
        universal = plan(
            saved, current, candidate.path, universal_asked=universal_asked, partitioned=partitioned
        )
        if universal:
            if not switchable:
                raise Refusal(
                    f"checkpoint {candidate.path} was saved by {saved.world_size} ranks and this "
                    f"run has {current.world_size}: it loads only as DeepSpeed's universal "
                    "checkpoint, and this DeepSpeed version keeps its load_universal setting "
                    f"where sparkdist does not find it; run at {saved.world_size} ranks"
                )
            if weights_only:
                check_tree(source.path)  # DeepSpeed's conversion reads them in full
            tag = _converted(directory, local, source, marker, saved, current)
        if weights_only:
            check_tree(os.path.join(local, tag))
        return _Chosen(candidate.step, candidate.path, tag, universal)
    if unreadable:
        raise Refusal(
            f"no checkpoint in {directory} can be read: " + "; ".join(unreadable) + ". Move "
            "these files away to start from scratch, or restore them from a copy"
        )
    return None


def _converted(
    directory: str,
    local: str,
    candidate: checkpoint_layout.Candidate,
    marker: dict[str, Any],
    saved: Topology,
    current: Topology,
) -> str:
    """The tag of the candidate's universal conversion (made now if need be), or ``Refusal``.
    On a store (``local`` its mirror) a conversion kept there is taken, a new one kept there."""
    name = checkpoint_layout.universal_name(candidate.step)
    try:
        kept = True
        if local != directory:
            deepspeed_store.download_tree(f"{directory}/{name}", os.path.join(local, name))
            kept = checkpoint_universal.is_converted(os.path.join(local, name), marker)
        tag = checkpoint_universal.convert(local, candidate, marker, current.world_size)
        if not kept:  # made now, from the store's checkpoint: kept on the store beside it
            deepspeed_store.upload_tree(os.path.join(local, tag), f"{directory}/{tag}")
        return tag
    except Exception as exc:
        raise Refusal(
            f"checkpoint {candidate.path} was saved by {saved.world_size} ranks and this run "
            f"has {current.world_size}: converting it to DeepSpeed's universal checkpoint, to "
            f"load it resharded, failed ({checkpoint_ranks.describe(exc)}); run at "
            f"{saved.world_size} ranks to load it as it is, or convert it yourself with python "
            f"-m deepspeed.checkpoint.ds_to_universal --input_folder {candidate.path} "
            "--output_folder <a new directory> --inject_missing_state and load that with "
            "DeepSpeed's engine.load_checkpoint"
        ) from exc


def wrong_format(path: str, saved_format: str) -> str:
    """The refusal of a checkpoint of one format given to the loader of the other."""
    if saved_format == FORMAT:
        return (
            f"checkpoint {path} is DeepSpeed's (saved with save_checkpoint(engine, ...)): load "
            "it into the engine with load_checkpoint(engine), or move it away to load an "
            "older one"
        )
    return (
        f"checkpoint {path} holds state dicts (saved with save_checkpoint(state_dict, ...)), "
        "which a DeepSpeed engine does not load: load it with load_checkpoint(state_dict), or "
        "move it away to start the engine from an older checkpoint or from scratch"
    )
