"""Checkpoints and the files a run writes, on real files with real torch (no process group: a
world of one, as outside a launcher).

Checkpoints: ``torch.distributed.checkpoint`` directories committed by a marker written last,
retention, asynchronous saves, old single-file checkpoints read, safe loading (weights only
unless asked), fallback past an unreadable newest checkpoint, private modes (0600 files, 0700
directories). Files: atomic writes, and the sweep of directories left by dead processes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from sparkdist import runtime
from sparkdist._checkpoint import api as checkpoints
from sparkdist._core import files
from tests._helpers.files import mode_of

SHARD = "__0_0.distcp"  # a world of one's shards


def step_dir(ckpt_dir, step: int):
    return ckpt_dir / f"step-{step:09d}"


@pytest.fixture
def ckpt_dir(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    monkeypatch.setenv("SPARKDIST_CHECKPOINT_DIR", str(directory))
    return directory


class RunsAShellCommand:
    """Unpickling this runs ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@dataclasses.dataclass
class Point:  # importable (tests.unit.test_checkpoints.Point): allow-listed by one test
    x: int


def write_malicious(path, marker, how: str) -> None:
    payload = {"step": 30, "state": RunsAShellCommand(f"touch {marker}")}
    if how == "torch.save":
        torch.save(payload, path)
    else:  # a bare pickle (protocol 5), as an attacker would write it
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=5)


def trained_model_and_optimizer(steps: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    return model, optimizer


# -- saving ------------------------------------------------------------------------------------


def test_save_then_load_round_trips_and_every_file_is_private(ckpt_dir):
    state = {"w": torch.arange(4.0), "lr": 0.1, "names": ["a", "b"], "nested": {"k": (1, 2)}}
    old_umask = os.umask(0)  # private by creation, whatever the umask
    try:
        before = time.time()
        path = runtime.save_checkpoint(state, 10)
    finally:
        os.umask(old_umask)
    assert path == str(step_dir(ckpt_dir, 10))
    assert sorted(os.listdir(ckpt_dir)) == ["step-000000010"]  # no temporary left
    assert sorted(os.listdir(path)) == [".metadata", "COMMITTED", SHARD]
    assert mode_of(path) == 0o700
    assert {name: mode_of(os.path.join(path, name)) for name in os.listdir(path)} == {
        ".metadata": 0o600,
        "COMMITTED": 0o600,
        SHARD: 0o600,
    }
    marker = json.loads((step_dir(ckpt_dir, 10) / "COMMITTED").read_text())
    assert (marker["format"], marker["step"], marker["world_size"]) == ("dcp", 10, 1)
    assert before - 1 <= marker["saved_at"] <= time.time() + 1
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 10 and latest.path == path
    assert latest.state["w"].equal(torch.arange(4.0)) and latest.state["lr"] == 0.1
    assert latest.state["names"] == ["a", "b"] and latest.state["nested"] == {"k": (1, 2)}
    assert type(latest).__module__ == "sparkdist.runtime" and latest == dataclasses.replace(latest)


def test_the_marker_is_written_last(ckpt_dir):
    path = runtime.save_checkpoint({"w": torch.ones(1000)}, 10)
    marker_written = os.stat(os.path.join(path, "COMMITTED")).st_mtime_ns
    for name in (".metadata", SHARD):
        assert os.stat(os.path.join(path, name)).st_mtime_ns <= marker_written


@pytest.mark.parametrize("steps", [0, 2], ids=["before-the-first-step", "after-two-steps"])
def test_an_optimizer_state_dict_comes_back_as_it_was_saved(ckpt_dir, steps):
    # DCP keys everything by strings and drops empty dicts: the marker's notes undo both.
    model, optimizer = trained_model_and_optimizer(steps)
    runtime.save_checkpoint({"model": model, "optimizer": optimizer.state_dict(), "e": {}}, 3)
    latest = runtime.load_checkpoint()
    assert latest is not None
    saved, loaded = optimizer.state_dict(), latest.state["optimizer"]
    assert list(loaded["state"]) == list(saved["state"])  # int keys, as saved
    for key, value in saved["state"].items():
        assert loaded["state"][key]["momentum_buffer"].equal(value["momentum_buffer"])
    assert loaded["param_groups"] == saved["param_groups"] and latest.state["e"] == {}
    fresh = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.5, momentum=0.9)
    fresh.load_state_dict(loaded)  # what a resuming run does
    assert fresh.state_dict()["param_groups"] == saved["param_groups"]
    assert all(
        fresh.state_dict()["state"][k]["momentum_buffer"].equal(v["momentum_buffer"])
        for k, v in saved["state"].items()
    )
    assert latest.state["model"]["weight"].equal(model.weight.detach())  # saved via state_dict()


def test_earlier_checkpoints_are_kept_and_the_newest_is_loaded(ckpt_dir):
    for step in (10, 20, 30):
        runtime.save_checkpoint({"step_seen": torch.tensor(step)}, step)
    assert sorted(os.listdir(ckpt_dir)) == [f"step-{s:09d}" for s in (10, 20, 30)]
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 30 and int(latest.state["step_seen"]) == 30


def test_a_directory_without_its_marker_is_never_loaded(ckpt_dir):
    runtime.save_checkpoint({"w": torch.ones(2)}, 10)
    runtime.save_checkpoint({"w": torch.zeros(2)}, 20)
    (step_dir(ckpt_dir, 20) / "COMMITTED").unlink()  # as a crash before the commit leaves it
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 10 and latest.state["w"].equal(torch.ones(2))


def test_an_uncommitted_step_directory_is_cleared_before_it_is_written_again(ckpt_dir):
    stale = step_dir(ckpt_dir, 20)
    stale.mkdir()
    (stale / SHARD).write_bytes(b"half a shard")
    (stale / "__3_0.distcp").write_bytes(b"a rank that is gone")
    (stale / ".metadata.tmp").write_bytes(b"")
    runtime.save_checkpoint({"w": torch.full((3,), 2.0)}, 20)
    assert sorted(os.listdir(stale)) == [".metadata", "COMMITTED", SHARD]
    latest = runtime.load_checkpoint()
    assert (
        latest is not None and latest.step == 20 and latest.state["w"].equal(torch.full((3,), 2.0))
    )


def test_files_sparkdist_did_not_write_are_never_removed(ckpt_dir):
    stale = step_dir(ckpt_dir, 20)
    stale.mkdir()
    (stale / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match=r"holds files sparkdist did not write \(notes.txt\)"):
        runtime.save_checkpoint({"w": torch.ones(1)}, 20)
    assert (stale / "notes.txt").read_text() == "mine"
    (ckpt_dir / "step-000000030").write_text("a file where the directory would go")
    with pytest.raises(RuntimeError, match="is in the way of checkpoint step 30"):
        runtime.save_checkpoint({"w": torch.ones(1)}, 30)
    assert (ckpt_dir / "step-000000030").read_text() == "a file where the directory would go"


def test_a_failed_save_commits_nothing_and_the_previous_checkpoint_loads(ckpt_dir):
    runtime.save_checkpoint({"w": torch.ones(2)}, 10)
    with pytest.raises(RuntimeError, match="checkpoint step 20 could not be written.*pickle"):
        runtime.save_checkpoint({"w": torch.zeros(2), "f": lambda: 0}, 20)  # a lambda: no pickle
    assert not (step_dir(ckpt_dir, 20) / "COMMITTED").exists()
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 10 and latest.state["w"].equal(torch.ones(2))


def test_a_committed_step_is_replaced_only_once_the_new_one_is_committed(ckpt_dir):
    runtime.save_checkpoint({"w": torch.ones(2)}, 10)
    with pytest.raises(RuntimeError, match="pickle"):
        runtime.save_checkpoint({"w": torch.zeros(2), "f": lambda: 0}, 10)
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.state["w"].equal(torch.ones(2))  # the old one stands
    runtime.save_checkpoint({"w": torch.full((2,), 3.0)}, 10)
    assert sorted(os.listdir(ckpt_dir)) == ["step-000000010"]  # the half-written one cleared
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.state["w"].equal(torch.full((2,), 3.0))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: runtime.save_checkpoint(torch.ones(1), 1), TypeError, "a dict with str keys"),
        (lambda: runtime.save_checkpoint({1: torch.ones(1)}, 1), TypeError, "keys that are not"),
        (lambda: runtime.save_checkpoint({}, 1.5), TypeError, "pass the step as an int"),
        (lambda: runtime.save_checkpoint({}, -1), ValueError, "from 0 to 999999999"),
        (lambda: runtime.save_checkpoint({}, 10**9), ValueError, "from 0 to 999999999"),
        (lambda: runtime.save_checkpoint({}, 1, keep_last=0), ValueError, "1 or more"),
        (lambda: runtime.save_checkpoint({}, 1, keep_last=True), ValueError, "1 or more"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(ckpt_dir, call, error, message):
    with pytest.raises(error, match=message):
        call()
    assert os.listdir(ckpt_dir) == []


def test_without_a_checkpoint_dir_both_say_to_pass_one(monkeypatch):
    monkeypatch.delenv("SPARKDIST_CHECKPOINT_DIR", raising=False)
    for call in (lambda: runtime.save_checkpoint({}, 1), runtime.load_checkpoint):
        with pytest.raises(RuntimeError, match="pass checkpoint_dir=... to the launcher"):
            call()


# -- keep_last ---------------------------------------------------------------------------------


def test_keep_last_removes_older_checkpoints_and_only_its_own(ckpt_dir, caplog):
    uncommitted = step_dir(ckpt_dir, 5)  # a crash's leftover, older than any commit
    uncommitted.mkdir()
    (uncommitted / SHARD).write_bytes(b"half")
    foreign = step_dir(ckpt_dir, 7)  # someone's own files in a directory of our name
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    torch.save({"step": 1, "state": {}}, ckpt_dir / "step-000000001.pt")  # an old single file
    (ckpt_dir / "other").mkdir()
    caplog.set_level(logging.WARNING, logger="sparkdist")
    for step in (10, 20, 30):
        runtime.save_checkpoint({"w": torch.tensor(step)}, step, keep_last=2)
    assert sorted(os.listdir(ckpt_dir)) == [
        "other",
        "step-000000001.pt",
        "step-000000007",
        "step-000000020",
        "step-000000030",
    ]
    assert (foreign / "notes.txt").read_text() == "mine"
    assert any(str(foreign) in r.getMessage() for r in caplog.records)
    runtime.save_checkpoint({"w": torch.tensor(15)}, 15, keep_last=1)  # older than the newest
    assert [n for n in sorted(os.listdir(ckpt_dir)) if n.startswith("step-0000000")] == [
        "step-000000001.pt",
        "step-000000007",
        "step-000000015",  # the one just written stays
        "step-000000030",  # the newest stays
    ]


# -- asynchronous saves (a world of one) -------------------------------------------------------


def test_an_async_save_returns_before_the_write_and_the_next_call_waits_for_it(ckpt_dir):
    state = {"w": torch.ones(2000, 2000)}
    path = runtime.save_checkpoint(state, 10, async_=True)
    state["w"].zero_()  # the training goes on: what was staged is what gets written
    assert path == str(step_dir(ckpt_dir, 10))
    latest = runtime.load_checkpoint()  # waits for the pending save, then sees its marker
    assert latest is not None and latest.step == 10 and bool((latest.state["w"] == 1).all())
    runtime.save_checkpoint({"w": torch.zeros(1)}, 20, async_=True)
    checkpoints.wait_for_pending_saves()  # the end of a rank's function
    assert (step_dir(ckpt_dir, 20) / "COMMITTED").exists()
    checkpoints.wait_for_pending_saves()  # nothing pending: nothing to do


def test_a_failed_async_save_raises_on_the_next_call_naming_its_step(ckpt_dir):
    runtime.save_checkpoint({"w": torch.ones(1), "f": lambda: 0}, 10, async_=True)
    with pytest.raises(RuntimeError, match=r"asynchronous save of checkpoint step 10 .* failed"):
        runtime.save_checkpoint({"w": torch.ones(1)}, 20)  # raises instead of saving
    assert not (step_dir(ckpt_dir, 10) / "COMMITTED").exists()
    assert not step_dir(ckpt_dir, 20).exists()
    runtime.save_checkpoint({"w": torch.ones(1)}, 20)  # raised once: the next call saves
    runtime.save_checkpoint({"w": torch.ones(1), "f": lambda: 0}, 30, async_=True)
    with pytest.raises(RuntimeError, match=r"checkpoint step 30 .*pickle"):
        checkpoints.wait_for_pending_saves()
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 20


# -- loading -----------------------------------------------------------------------------------


def test_loading_into_a_state_dict_fills_it_in_place(ckpt_dir):
    model, optimizer = trained_model_and_optimizer(2)
    runtime.save_checkpoint({"model": model.state_dict(), "lr": 0.5}, 4)
    fresh = torch.nn.Linear(3, 2)
    into = {"model": fresh.state_dict(), "lr": 0.0}
    latest = runtime.load_checkpoint(into)
    assert latest is not None and latest.step == 4 and latest.state is into
    assert fresh.weight.equal(model.weight) and fresh.bias.equal(model.bias)  # in place
    assert into["lr"] == 0.5
    module = torch.nn.Linear(3, 2)
    runtime.load_checkpoint({"model": module})  # objects with load_state_dict load themselves
    assert module.weight.equal(model.weight)


def test_map_location_by_position_as_before(ckpt_dir):
    runtime.save_checkpoint({"w": torch.ones(2)}, 1)
    seen = []

    def location(storage, where):
        seen.append(where)
        return storage

    for first in ("cpu", torch.device("cpu"), location):
        latest = runtime.load_checkpoint(first)
        assert latest is not None and latest.step == 1 and latest.state["w"].equal(torch.ones(2))
    assert seen == ["cpu"]
    latest = runtime.load_checkpoint(map_location={"cpu": "cpu"})
    assert latest is not None and latest.state["w"].equal(torch.ones(2))
    with pytest.raises(TypeError, match="map_location twice"):
        runtime.load_checkpoint("cpu", map_location="meta")
    for wrong in ([1], torch.nn.Linear(1, 1)):
        with pytest.raises(TypeError, match=r"takes the state dict to load into"):
            runtime.load_checkpoint(wrong)


def test_no_checkpoint_yet_gives_none(ckpt_dir, monkeypatch):
    (ckpt_dir / "notes.txt").write_text("not a checkpoint")
    assert runtime.load_checkpoint() is None
    monkeypatch.setenv("SPARKDIST_CHECKPOINT_DIR", str(ckpt_dir / "not-made-yet"))
    assert runtime.load_checkpoint() is None


# -- old single-file checkpoints ---------------------------------------------------------------


def test_a_checkpoint_written_by_earlier_versions_still_loads(ckpt_dir):
    # Before: torch.save of {"step", "state"} to step-<9 digits>.pt, renamed into place.
    torch.save({"step": 7, "state": {"w": torch.ones(3)}}, ckpt_dir / "step-000000007.pt")
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 7 and latest.state["w"].equal(torch.ones(3))
    assert latest.path == str(ckpt_dir / "step-000000007.pt")
    model = torch.nn.Linear(3, 1)
    into = {"w": model.weight.detach().view(3)}
    assert runtime.load_checkpoint(into).state is into and model.weight.equal(torch.ones(1, 3))


def test_the_newest_step_of_either_format_wins(ckpt_dir):
    torch.save({"step": 7, "state": {"kind": "file"}}, ckpt_dir / "step-000000007.pt")
    runtime.save_checkpoint({"kind": "dir"}, 5)
    assert runtime.load_checkpoint().state == {"kind": "file"}
    runtime.save_checkpoint({"kind": "dir"}, 7)  # the same step: the directory
    assert runtime.load_checkpoint().path == str(step_dir(ckpt_dir, 7))
    runtime.save_checkpoint({"kind": "dir"}, 9)
    assert runtime.load_checkpoint().step == 9
    assert (ckpt_dir / "step-000000007.pt").exists()  # read, never written nor removed


# -- loading safely ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["torch.save", "bare pickle"])
def test_a_malicious_old_file_is_refused_by_default_and_nothing_runs(ckpt_dir, tmp_path, how):
    marker = tmp_path / "code-ran"
    runtime.save_checkpoint({"w": torch.ones(1)}, 20)  # an older good one does not hide it
    write_malicious(ckpt_dir / "step-000000030.pt", marker, how)
    with pytest.raises(pickle.UnpicklingError) as info:
        runtime.load_checkpoint()
    message = str(info.value)
    assert str(ckpt_dir / "step-000000030.pt") in message
    assert "posix.system" in message  # what it would have called
    assert "load_checkpoint(weights_only=False)" in message  # the opt-in
    assert "torch.serialization.add_safe_globals" in message  # the narrower fix
    assert not marker.exists()


def test_a_malicious_entry_in_a_checkpoint_directory_is_refused(ckpt_dir, tmp_path):
    marker = tmp_path / "code-ran"
    runtime.save_checkpoint({"w": torch.ones(1), "x": RunsAShellCommand(f"touch {marker}")}, 30)
    assert not marker.exists()
    for into in (None, {"w": torch.zeros(1), "x": None}):
        with pytest.raises(pickle.UnpicklingError) as info:
            runtime.load_checkpoint(into)
        assert str(step_dir(ckpt_dir, 30)) in str(info.value)
        assert "posix.system" in str(info.value)
        assert not marker.exists()
    latest = runtime.load_checkpoint(weights_only=False)  # the opt-in: the pickle runs
    assert latest is not None and latest.state["x"] == 0 and marker.exists()


def test_a_malicious_metadata_file_is_refused_and_nothing_runs(ckpt_dir, tmp_path):
    marker = tmp_path / "code-ran"
    path = runtime.save_checkpoint({"w": torch.ones(1)}, 30)
    with open(os.path.join(path, ".metadata"), "wb") as f:  # DCP would pickle.load it
        pickle.dump(RunsAShellCommand(f"touch {marker}"), f, protocol=5)
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        runtime.load_checkpoint()
    assert not marker.exists()


def test_own_classes_load_once_allow_listed(ckpt_dir):
    runtime.save_checkpoint({"p": Point(3)}, 5)
    with pytest.raises(pickle.UnpicklingError, match="test_checkpoints.Point"):
        runtime.load_checkpoint()
    with torch.serialization.safe_globals([Point]):
        latest = runtime.load_checkpoint()
    assert latest is not None and latest.state == {"p": Point(3)}


# -- an unreadable newest checkpoint -----------------------------------------------------------


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _zero_head(data: bytes) -> bytes:
    # Where the format's structure is: torch.load checks no checksum of tensor bytes (DCP
    # keeps none either), so zeros inside a tensor's data read as zeros, in either format.
    return bytes(64) + data[64:]


def _not_ours(_: bytes) -> bytes:
    path = os.path.join(os.environ["SPARKDIST_CHECKPOINT_DIR"], "other.pt")
    torch.save(torch.ones(2), path)  # a readable torch file, not {"step", "state"}
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    return data


DAMAGES = [_truncate, _zero_head, lambda _: b"", lambda _: os.urandom(300), _not_ours]
DAMAGE_IDS = ["truncated", "zeroed-bytes", "empty", "random-bytes", "not-a-checkpoint"]


def save_two(ckpt_dir, legacy: bool):
    for step, value in ((10, 1.0), (20, 2.0)):
        state = {"w": torch.full((64,), value)}
        if legacy:
            torch.save({"step": step, "state": state}, ckpt_dir / f"step-{step:09d}.pt")
        else:
            runtime.save_checkpoint(state, step)


@pytest.mark.parametrize(
    ("legacy", "damaged"),
    [(True, "step-000000020.pt"), (False, f"step-000000020/{SHARD}")]
    + [(False, "step-000000020/.metadata"), (False, "step-000000020/COMMITTED")],
    ids=["old-file", "shard", "metadata", "marker"],
)
@pytest.mark.parametrize("damage", DAMAGES, ids=DAMAGE_IDS)
def test_an_unreadable_newest_checkpoint_falls_back_with_a_warning(
    ckpt_dir, caplog, legacy, damaged, damage
):
    save_two(ckpt_dir, legacy)
    file = ckpt_dir / damaged
    file.write_bytes(damage(file.read_bytes()))
    caplog.set_level(logging.WARNING, logger="sparkdist")
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 10
    assert latest.state["w"].equal(torch.full((64,), 1.0))
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    newest = ckpt_dir / damaged.split("/")[0]
    assert str(newest) in warning and "trying the checkpoint before it" in warning
    assert file.exists()  # never deleted: the user may want to look at it


@pytest.mark.parametrize(
    ("marker", "reason"),
    [
        ({"format": "zarr", "step": 20}, "names format 'zarr'"),
        ({"format": "dcp", "step": 21}, "does not name step 20"),
    ],
)
def test_a_marker_this_version_cannot_use_falls_back(ckpt_dir, caplog, marker, reason):
    save_two(ckpt_dir, legacy=False)
    (step_dir(ckpt_dir, 20) / "COMMITTED").write_text(json.dumps(marker))
    caplog.set_level(logging.WARNING, logger="sparkdist")
    assert runtime.load_checkpoint().step == 10
    assert any(reason in r.getMessage() for r in caplog.records)


def test_when_no_checkpoint_can_be_read_the_error_lists_them(ckpt_dir, caplog):
    for step in (10, 20):
        (ckpt_dir / f"step-{step:09d}.pt").write_bytes(b"PK\x03\x04 cut short")
    path = runtime.save_checkpoint({"w": torch.ones(1)}, 30)
    (step_dir(ckpt_dir, 30) / SHARD).write_bytes(b"")
    with pytest.raises(RuntimeError) as info:
        runtime.load_checkpoint()
    message = str(info.value)
    assert str(ckpt_dir / "step-000000010.pt") in message
    assert str(ckpt_dir / "step-000000020.pt") in message
    assert path in message
    assert "Move these files away to start from scratch" in message


# -- files: private directories, atomic replacement, sweeping ----------------------------------


def test_make_private_dirs_makes_every_new_directory_0700(tmp_path):
    (tmp_path / "existing").mkdir(mode=0o755)
    os.chmod(tmp_path / "existing", 0o755)
    target = tmp_path / "existing" / "a" / "b"
    old_umask = os.umask(0)  # even with nothing masked
    try:
        files.make_private_dirs(str(target))
        files.make_private_dirs(str(target))  # again: already there, no error
    finally:
        os.umask(old_umask)
    assert mode_of(tmp_path / "existing") == 0o755  # not ours to change
    assert mode_of(tmp_path / "existing" / "a") == 0o700
    assert mode_of(target) == 0o700


def test_make_private_dirs_refuses_a_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(OSError):
        files.make_private_dirs(str(tmp_path / "f" / "sub"))


def test_write_private_file_is_0600_and_never_follows_or_reuses_a_name(tmp_path):
    path = tmp_path / "job.pkl"
    files.write_private_file(str(path), b"data")
    assert path.read_bytes() == b"data" and mode_of(path) == 0o600
    with pytest.raises(FileExistsError):
        files.write_private_file(str(path), b"other")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(FileExistsError):
        files.write_private_file(str(tmp_path / "link"), b"overwrite")
    assert victim.read_text() == "keep"


def test_replace_atomically_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "state"
    files.replace_atomically(str(path), lambda f: f.write(b"v1"))
    assert path.read_bytes() == b"v1" and mode_of(path) == 0o600

    def fails(f):
        f.write(b"half of v2")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.replace_atomically(str(path), fails)
    assert path.read_bytes() == b"v1"
    assert os.listdir(tmp_path) == ["state"]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


def test_sweep_removes_only_our_dead_owners_directories(tmp_path):
    host = files._host_tag()
    dead = dead_pid()
    root = tmp_path

    def leftover(name: str) -> str:
        path = root / name
        path.mkdir(mode=0o700)
        (path / "sparkdist-job-abc.pkl").write_bytes(b"x")
        return str(path)

    removed_ones = [leftover(f"sparkdist_job-{host}-{dead}-abc-r1")]
    kept = [
        leftover(f"sparkdist_job-{host}-{os.getpid()}-abc-r2"),  # owner alive
        leftover(f"sparkdist_job-{'0' * 8 if host != '0' * 8 else '1' * 8}-{dead}-abc-r3"),
        leftover(f"sparkdist_pool-{host}-{dead}-abc-r4"),  # another kind
        leftover(f"sparkdist-abc-0-{host}-{dead}-r5"),  # an agent's run dir: kind "run"
    ]
    (root / f"sparkdist_job-{host}-{dead}-abc-file").write_text("")  # a file, not a dir
    (root / f"sparkdist_job-{host}-{dead}-abc-link").symlink_to(kept[0])
    kept += [str(root / f"sparkdist_job-{host}-{dead}-abc-file")]
    kept += [str(root / f"sparkdist_job-{host}-{dead}-abc-link")]
    if os.getuid() == 0:  # root can give a directory away: someone else's is never touched
        others = leftover(f"sparkdist_job-{host}-{dead}-abc-r6")
        os.chown(others, 65534, 65534)
        kept.append(others)

    assert files.sweep_dead_owners("job", str(root)) == removed_ones
    assert not any(os.path.lexists(p) for p in removed_ones)
    assert all(os.path.lexists(p) for p in kept)


def test_sweep_of_agent_run_directories(tmp_path):
    host, dead = files._host_tag(), dead_pid()
    names = {
        f"sparkdist-0a1b2c3d4e5f-1-{host}-{dead}-x1": False,  # owner gone: removed
        f"sparkdist-0a1b2c3d4e5f-1-{host}-{os.getpid()}-x2": True,  # owner alive
        "sparkdist-0a1b2c3d4e5f-1-abc_x3": True,  # named before owners were recorded
        "sparkdist-tests-abc": True,  # a test session's temp dir, not a run's
        f"sparkdist_job-{host}-{dead}-abc-x4": True,  # another kind
    }
    for name in names:
        (tmp_path / name).mkdir()
    files.sweep_dead_owners(files.AGENT_RUN_KIND, str(tmp_path))
    assert {name: (tmp_path / name).exists() for name in names} == names
    prefix = files.agent_run_dir_prefix("0a1b2c3d4e5f", 1)
    assert prefix == f"sparkdist-0a1b2c3d4e5f-1-{host}-{os.getpid()}-"
    live = tempfile.mkdtemp(prefix=prefix, dir=tmp_path)
    assert files.sweep_dead_owners(files.AGENT_RUN_KIND, str(tmp_path)) == []
    assert os.path.isdir(live)


def test_owned_directories_are_private_and_named_for_the_sweep(tmp_path):
    directory = files.make_owned_dir("job", "abc123", str(tmp_path))
    name = os.path.basename(directory)
    assert name.startswith(f"sparkdist_job-{files._host_tag()}-{os.getpid()}-abc123-")
    assert mode_of(directory) == 0o700
    assert files.sweep_dead_owners("job", str(tmp_path)) == []  # we are alive
    for kind in ("Job-1", "run"):
        with pytest.raises(ValueError, match="lower-case letters"):
            files.make_owned_dir(kind, "abc123", str(tmp_path))


def test_a_socket_past_the_path_limit_is_reached_through_its_directory(tmp_path):
    directory = tmp_path / ("d" * 80) / ("e" * 40)
    directory.mkdir(parents=True, mode=0o700)
    path = str(directory / "zygote.sock")
    assert len(path) > files.MAX_SOCKET_PATH_BYTES
    with socket.socket(socket.AF_UNIX) as direct, pytest.raises(OSError, match="too long"):
        direct.bind(path)  # what the kernel says without the detour
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as client:
        with files.unix_socket_address(path) as address:
            assert len(address) <= files.MAX_SOCKET_PATH_BYTES
            server.bind(address)
        server.listen()
        assert os.path.exists(path)  # the socket is where it was asked, in the private dir
        with files.unix_socket_address(path) as address:
            client.connect(address)
    short = str(tmp_path / "s.sock")
    with files.unix_socket_address(short) as address:
        assert address == short  # a short path is used as it is
