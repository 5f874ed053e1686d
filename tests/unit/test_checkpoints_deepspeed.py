"""The pure and file-level parts of DeepSpeed's checkpoints, on real files (the engines
themselves, with real ranks, are in tests/integration/test_checkpoints_deepspeed.py): how a
checkpoint loads at a world size (``plan``), the marker's record of it, the strict check of the
pickles DeepSpeed unpickles in full, the weights-only reads of its checkpoint engine, the
universal conversion kept per source marker, DeepSpeed's files in the layout (cleared, sealed,
retained with their conversion), and the format each loader refuses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch

from sparkdist import runtime
from sparkdist._checkpoint import layout as checkpoint_layout
from sparkdist._checkpoint import universal as checkpoint_universal
from sparkdist._checkpoint.deepspeed_engine import Found, _converted, load, save
from sparkdist._checkpoint.layout import Candidate, Unreadable
from sparkdist._checkpoint.pickles import Refused, WeightsOnlyReads, check_file, check_tree
from sparkdist._checkpoint.universal import Refusal, Topology, plan
from tests._helpers.files import mode_of

PATH = "/ckpt/step-000000005"


def needs_deepspeed(test):
    """For a test that imports DeepSpeed (its classes, its converter: seconds, once)."""
    test = pytest.mark.deepspeed(test)
    missing = importlib.util.find_spec("deepspeed") is None
    return pytest.mark.skipif(missing, reason="DeepSpeed is not installed")(test)


def topology(world: int, stage: int = 2, mp: int = 1) -> Topology:
    return Topology(world_size=world * mp, dp_world_size=world, mp_world_size=mp, zero_stage=stage)


class RunsAShellCommand:
    """Unpickling this runs ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.fixture
def ckpt_dir(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    monkeypatch.setenv("SPARKDIST_CHECKPOINT_DIR", str(directory))
    return directory


# -- plan: as saved, resharded, or refused -------------------------------------------------------


@pytest.mark.parametrize(
    ("saved", "current", "asked", "universal"),
    [
        (topology(2), topology(2), False, False),  # as saved
        (topology(2, stage=3), topology(2, stage=3), False, False),
        (topology(2, stage=0), topology(5, stage=0), False, False),  # replicated: any size
        (topology(2, stage=1), topology(1, stage=1), False, True),  # ZeRO: resharded
        (topology(2, stage=2), topology(3, stage=2), False, True),
        (topology(4, stage=3), topology(2, stage=3), False, True),
        (topology(2), topology(2), True, True),  # the config asks for universal checkpoints
    ],
)
def test_plan_loads_as_saved_or_through_the_universal_checkpoint(saved, current, asked, universal):
    # ZeRO's optimizer state is per rank; without ZeRO (fp32), every rank's is the same.
    partitioned = saved.zero_stage > 0
    assert plan(saved, current, PATH, universal_asked=asked, partitioned=partitioned) is universal


@pytest.mark.parametrize(
    ("saved", "current", "asked", "message"),
    [
        (
            topology(2, stage=2),
            topology(2, stage=3),
            False,
            f"checkpoint {PATH} was saved by 2 ranks with ZeRO stage 2; this run has 2 ranks and "
            "ZeRO stage 3: DeepSpeed loads a checkpoint only into the ZeRO stage it was saved "
            'with; set "zero_optimization": {"stage": 2}',
        ),
        (
            topology(2, mp=2),
            topology(1, mp=2),
            False,
            "saved by 4 ranks with ZeRO stage 2; this run has 2 ranks, with model-parallel size 2 "
            "(this engine: 2): sparkdist reshards only data-parallel (ZeRO) checkpoints; run at "
            "4 ranks",
        ),
        (topology(2, mp=2), topology(4, mp=1), False, "python -m deepspeed.checkpoint"),
        (topology(2, stage=0), topology(2, stage=0), True, '"load_universal": true'),
        (  # DeepSpeed's bf16 optimizer splits the optimizer state even without ZeRO
            topology(2, stage=0),
            topology(1, stage=0),
            False,
            "optimizer state is split across the ranks (DeepSpeed's bf16 optimizer without ZeRO)"
            ", and DeepSpeed reshards only ZeRO checkpoints (stage 1 to 3); run at 2 ranks",
        ),
    ],
)
def test_plan_refuses_what_deepspeed_cannot_load_saying_what_would(saved, current, asked, message):
    with pytest.raises(Refusal) as info:
        plan(saved, current, PATH, universal_asked=asked, partitioned=True)
    assert message in str(info.value)


def test_the_marker_records_the_topology_and_a_marker_without_it_is_unreadable():
    saved = topology(4, stage=3)
    marker = {"format": "deepspeed", "step": 5, **saved.__dict__}
    assert Topology.saved(marker) == saved
    for broken in ({**marker, "zero_stage": "3"}, {"format": "deepspeed", "step": 5}):
        with pytest.raises(Unreadable, match="does not record world_size, dp_world_size"):
            Topology.saved(broken)


def test_misuse_is_refused_before_anything_is_written_or_read(ckpt_dir):
    engine = object()  # never reached: the arguments are refused first
    with pytest.raises(ValueError, match="drop async_=True"):
        save(Found(engine, None), engine, 1, str(ckpt_dir), async_=True, keep_last=None)
    state = {"engine": engine, "global_steps": 3, "epoch": 1}
    with pytest.raises(ValueError, match="'global_steps' are names DeepSpeed uses"):
        save(Found(engine, "engine"), state, 1, str(ckpt_dir), async_=False, keep_last=None)
    with pytest.raises(TypeError, match="leave map_location out"):
        load(Found(engine, None), engine, str(ckpt_dir), map_location="cuda", weights_only=True)
    assert os.listdir(ckpt_dir) == []


def test_plain_state_dicts_never_import_deepspeed(tmp_path):
    code = (
        "import sys, torch\n"
        "from sparkdist import runtime\n"
        "runtime.save_checkpoint({'w': torch.ones(2)}, 1)\n"
        "assert runtime.load_checkpoint().step == 1\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
    )
    env = {**os.environ, "SPARKDIST_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


# -- the formats: each loader refuses the other's checkpoints ---------------------------------


def test_a_state_dict_load_refuses_deepspeeds_checkpoint_naming_what_loads_it(ckpt_dir):
    runtime.save_checkpoint({"w": torch.ones(1)}, 10)
    step = ckpt_dir / "step-000000020"
    step.mkdir()
    (step / "mp_rank_00_model_states.pt").write_bytes(b"")
    (step / "COMMITTED").write_text(json.dumps({"format": "deepspeed", "step": 20}))
    for into in (None, {"w": torch.zeros(1)}):
        with pytest.raises(RuntimeError) as info:
            runtime.load_checkpoint(into)
        assert f"checkpoint {step} is DeepSpeed's" in str(info.value)
        assert "load_checkpoint(engine)" in str(info.value)


# -- pickles: checked strictly before DeepSpeed unpickles them in full -------------------------


@needs_deepspeed
def test_check_file_passes_weights_and_deepspeeds_data_classes(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2), "shape": torch.Size([2]), "names": ["a"]}, plain)
    check_file(str(plain))
    own = tmp_path / "sub" / "optim_states.pt"
    own.parent.mkdir()
    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients}, own)
    with pytest.raises(Refused) as info:
        check_file(str(own))  # not without DeepSpeed's classes allowed
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in info.value.names
    check_tree(str(tmp_path))  # with them


@needs_deepspeed
def test_check_file_refuses_code_and_what_it_cannot_check_and_nothing_runs(tmp_path):
    ran = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"x": RunsAShellCommand(f"touch {ran}")}, evil)
    with pytest.raises(Refused) as info:
        check_file(str(evil))
    assert info.value.names == ["posix.system"]
    with pytest.raises(pickle.UnpicklingError) as error:
        check_tree(str(tmp_path))
    assert str(evil) in str(error.value) and "weights_only=False" in str(error.value)

    legacy = tmp_path / "legacy.bin"  # torch's legacy format: pickles one after another
    torch.save({"w": torch.ones(1)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(Refused, match="not torch's zip format"):
        check_file(str(legacy))

    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(1)}, good)
    with zipfile.ZipFile(good) as archive:
        [name] = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        cut = tmp_path / "cut.pt"
        with zipfile.ZipFile(cut, "w") as out:
            out.writestr(name, archive.read(name)[:-3])  # no STOP: does not parse to its end
        computed = tmp_path / "computed.pt"
        with zipfile.ZipFile(computed, "w") as out:
            # "os" "system" pushed, then "builtins" "dict" pushed and popped: a scanner that
            # takes the last strings seen would name builtins.dict; the unpickler calls os.system.
            body = b"\x80\x02X\x02\x00\x00\x00osX\x06\x00\x00\x00systemX\x08\x00\x00\x00builtins"
            body += b"X\x04\x00\x00\x00dict00\x93)R."
            out.writestr(name, body)
    with pytest.raises(Refused, match="does not parse"):
        check_file(str(cut))
    with pytest.raises(Refused, match="STACK_GLOBAL of names computed"):
        check_file(str(computed))
    assert not ran.exists()


def test_the_checkpoint_engines_reads_are_weights_only(tmp_path):
    class Inner:
        name = "TorchCheckpointEngine"

        def load(self, path, map_location=None):  # DeepSpeed's: weights_only=False
            return torch.load(path, map_location=map_location, weights_only=False)

    ran = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"x": RunsAShellCommand(f"touch {ran}")}, evil)
    reads = WeightsOnlyReads(Inner())
    assert reads.name == "TorchCheckpointEngine"  # everything else as it was
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        reads.load(str(evil))
    assert not ran.exists()
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    assert reads.load(str(good))["w"].equal(torch.ones(2))


# -- the universal conversion: once per checkpoint, refused with the fix when it fails -----------


def committed_step(ckpt_dir, step: int, marker: dict) -> Candidate:
    path = ckpt_dir / checkpoint_layout.step_name(step)
    path.mkdir(mode=0o700)
    (path / "COMMITTED").write_text(json.dumps(marker))
    return Candidate(step, str(path), legacy=False)


@needs_deepspeed
def test_a_conversion_of_this_very_checkpoint_is_used_again_and_a_stale_one_is_not(ckpt_dir):
    marker = {"format": "deepspeed", "step": 5, **topology(2).__dict__, "saved_at": 1.0}
    candidate = committed_step(ckpt_dir, 5, marker)
    universal = ckpt_dir / "step-000000005.universal"
    universal.mkdir()
    (universal / checkpoint_universal.SOURCE).write_text(json.dumps(marker, sort_keys=True))
    assert checkpoint_universal.convert(str(ckpt_dir), candidate, marker, 1) == universal.name
    # Saved again at this step: the old conversion goes, and converting this one (no
    # DeepSpeed files here) fails, refused with the world sizes and the fix.
    newer = {**marker, "saved_at": 2.0}
    with pytest.raises(Refusal) as info:
        _converted(str(ckpt_dir), str(ckpt_dir), candidate, newer, topology(2), topology(1))
    message = str(info.value)
    assert f"checkpoint {candidate.path} was saved by 2 ranks and this run has 1" in message
    assert "run at 2 ranks to load it as it is" in message
    assert f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {candidate.path}" in (
        message
    )
    assert sorted(os.listdir(ckpt_dir)) == ["step-000000005"]  # no stale or half conversion


# -- DeepSpeed's files in the layout -------------------------------------------------------------

DEEPSPEED_FILES = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_model_states.pt",
    "expp_rank_0_mp_rank_00_optim_states.pt",
    "layer_0_expert_1_mp_rank_00_model_states.pt",
    "layer_01-model_00-model_states.pt",
]


def test_an_uncommitted_deepspeed_step_is_cleared_and_a_foreign_file_is_not(ckpt_dir):
    step = ckpt_dir / "step-000000004"
    step.mkdir()
    for name in DEEPSPEED_FILES:
        (step / name).write_bytes(b"x")
    target, final = checkpoint_layout.prepare(str(ckpt_dir), 4)
    assert target == final == str(step) and os.listdir(step) == []
    (step / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match=r"holds files sparkdist did not write \(notes.txt\)"):
        checkpoint_layout.prepare(str(ckpt_dir), 4)


def test_seal_makes_a_tree_private_and_keeps_the_owners_execute_bit(tmp_path):
    old = os.umask(0o022)
    try:
        tree = tmp_path / "tree"
        (tree / "sub").mkdir(parents=True)
        (tree / "sub" / "a.pt").write_bytes(b"x")
        script = tree / "zero_to_fp32.py"
        script.write_text("")
        script.chmod(0o755)
    finally:
        os.umask(old)
    checkpoint_layout.seal(str(tree))
    assert mode_of(tree) == mode_of(tree / "sub") == 0o700
    assert mode_of(tree / "sub" / "a.pt") == 0o600 and mode_of(script) == 0o700


def test_a_conversion_goes_with_its_step_and_when_its_step_is_saved_again(ckpt_dir):
    directory = str(ckpt_dir)
    for step in (1, 2, 3):
        target, final = checkpoint_layout.prepare(directory, step)
        checkpoint_layout.commit(directory, target, final, {"format": "deepspeed", "step": step})
        (ckpt_dir / checkpoint_layout.universal_name(step) / "zero" / "0.weight").mkdir(
            parents=True
        )
    (ckpt_dir / ".step-000000001.universal.tmp").mkdir()  # a conversion cut short
    checkpoint_layout.retain(directory, 2, 3)
    assert sorted(os.listdir(ckpt_dir)) == [
        "step-000000002",
        "step-000000002.universal",
        "step-000000003",
        "step-000000003.universal",
    ]
    target, final = checkpoint_layout.prepare(directory, 3)  # saved again: replaced
    checkpoint_layout.commit(directory, target, final, {"format": "deepspeed", "step": 3})
    assert "step-000000003.universal" not in os.listdir(ckpt_dir)
    assert "step-000000002.universal" in os.listdir(ckpt_dir)


def test_deepspeeds_file_names_are_its_own_and_others_are_not():
    own = checkpoint_layout._OWN_FILE
    assert all(own.match(name) for name in DEEPSPEED_FILES)
    for name in ("model_states.pt", "zero_to_fp32.py", "latest", "x_mp_rank_00_model_states.pt"):
        assert not own.match(name), name


# -- saving and loading around an engine (a stand-in: real engines are the integration tests') --


class Reader:
    def __init__(self, decoupled: bool = False) -> None:
        self.decoupled = decoupled

    def is_decoupled(self) -> bool:
        return self.decoupled


class StandInEngine:
    """What sparkdist asks of a DeepSpeed engine, in a world of one; ``fail`` makes its save or
    load raise, ``loads`` what its load returns."""

    seq_dp_world_size = 1
    mp_world_size = 1

    def __init__(self, *, stage=2, decoupled=False, fail=None, loads=("path", {})) -> None:
        self.stage, self.fail, self.loads = stage, fail, loads
        self.checkpoint_engine = Reader(decoupled)
        self.loaded_tags: list[str] = []

    def zero_optimization_stage(self) -> int:
        return self.stage

    def save_checkpoint(self, directory, tag, client_state, save_latest):
        assert save_latest is False
        if self.fail is not None:
            raise self.fail
        torch.save({"module": {}, **client_state}, os.path.join(directory, tag, MODEL_STATES))
        if self.stage > 0:  # ZeRO's optimizer state, per rank
            torch.save(
                {}, os.path.join(directory, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
            )

    def load_checkpoint(self, directory, tag):
        self.loaded_tags.append(tag)
        if self.fail is not None:
            raise self.fail
        return self.loads


MODEL_STATES = "mp_rank_00_model_states.pt"


@needs_deepspeed
def test_a_failed_deepspeed_save_names_its_step_and_commits_nothing(ckpt_dir):
    engine = StandInEngine(fail=OSError("No space left on device"))
    with pytest.raises(RuntimeError) as info:
        save(Found(engine, None), engine, 3, str(ckpt_dir), async_=False, keep_last=None)
    step = ckpt_dir / "step-000000003"
    assert str(info.value) == (
        f"checkpoint step 3 could not be written to {step}: OSError: No space left on device"
    )
    assert not (step / "COMMITTED").exists()
    decoupled = StandInEngine(decoupled=True)
    with pytest.raises(ValueError, match="checkpoint engine is decoupled"):
        save(Found(decoupled, None), decoupled, 4, str(ckpt_dir), async_=False, keep_last=None)


@needs_deepspeed
def test_a_saved_engine_is_committed_and_loads_into_it_with_its_client_state(ckpt_dir):
    engine = StandInEngine(loads=("path", {"epoch": 7, "ds_config": {}}))
    nothing_yet = load(
        Found(engine, None), engine, str(ckpt_dir), map_location="cpu", weights_only=True
    )
    assert nothing_yet is None and engine.loaded_tags == []
    path = save(
        Found(engine, "e"),
        {"e": engine, "epoch": 7},
        3,
        str(ckpt_dir),
        async_=False,
        keep_last=None,
    )
    marker = json.loads((ckpt_dir / "step-000000003" / "COMMITTED").read_text())
    assert marker["format"] == "deepspeed" and marker["client_keys"] == ["epoch"]
    assert mode_of(os.path.join(path, MODEL_STATES)) == 0o600
    into = {"e": engine, "epoch": -1}
    assert load(Found(engine, "e"), into, str(ckpt_dir), map_location="cpu", weights_only=True) == (
        3,
        path,
    )
    assert into == {"e": engine, "epoch": 7} and engine.loaded_tags == ["step-000000003"]


@needs_deepspeed
@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            StandInEngine(fail=KeyError("module")),
            "DeepSpeed could not load checkpoint {path}: KeyError: 'module'",
        ),
        (StandInEngine(loads=(None, None)), "DeepSpeed found no model states in {path}"),
    ],
)
def test_a_failed_deepspeed_load_names_the_checkpoint(ckpt_dir, engine, message):
    saver = StandInEngine()
    path = save(Found(saver, None), saver, 3, str(ckpt_dir), async_=False, keep_last=None)
    with pytest.raises(RuntimeError) as info:
        load(Found(engine, None), engine, str(ckpt_dir), map_location="cpu", weights_only=True)
    assert message.format(path=path) in str(info.value)


def test_an_engine_refuses_an_old_file_and_says_when_nothing_can_be_read(ckpt_dir, caplog):
    engine = StandInEngine()
    step = ckpt_dir / "step-000000002"
    step.mkdir()
    (step / "COMMITTED").write_text("not json")
    with pytest.raises(RuntimeError) as info:
        load(Found(engine, None), engine, str(ckpt_dir), map_location="cpu", weights_only=True)
    assert f"no checkpoint in {ckpt_dir} can be read: {step}: its commit marker is not JSON" in (
        str(info.value)
    )
    assert any("trying the checkpoint before it" in r.getMessage() for r in caplog.records)
    torch.save({"step": 5, "state": {}}, ckpt_dir / "step-000000005.pt")
    with pytest.raises(RuntimeError, match="step-000000005.pt holds state dicts"):
        load(Found(engine, None), engine, str(ckpt_dir), map_location="cpu", weights_only=True)
    assert engine.loaded_tags == []


@needs_deepspeed
def test_a_reshard_this_deepspeed_cannot_be_switched_to_is_refused(ckpt_dir):
    saver = StandInEngine()
    saver.seq_dp_world_size = 2  # as if saved by 2 ranks
    save(Found(saver, None), saver, 3, str(ckpt_dir), async_=False, keep_last=None)
    engine = StandInEngine()  # no DeepSpeed config where sparkdist sets load_universal
    with pytest.raises(RuntimeError, match="keeps its load_universal setting where sparkdist"):
        load(Found(engine, None), engine, str(ckpt_dir), map_location="cpu", weights_only=True)
    assert engine.loaded_tags == []


@needs_deepspeed
def test_find_engine_wants_one_engine_and_str_keys():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from sparkdist._checkpoint.deepspeed_engine import find_engine

    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)  # an instance for isinstance, no init
    assert find_engine(engine) == Found(engine, None)
    assert find_engine({"e": engine, "epoch": 1}) == Found(engine, "e")
    assert find_engine({"w": torch.ones(1)}) is None
    with pytest.raises(TypeError, match="client state keys must be str; got 1"):
        find_engine({"e": engine, 1: 2})
    with pytest.raises(TypeError, match="holds 2 DeepSpeed engines"):
        find_engine({"a": engine, "b": engine})
