"""Checkpoints and the files a run writes, on real files with real torch (no process group: a
world of one, as outside a launcher).

Safe loading (weights only unless asked), fallback past an unreadable newest checkpoint,
private modes (0600 files, 0700 directories), atomic writes, and the sweep of directories left
by dead processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

from sparkdist import runtime
from sparkdist._core import files


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


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


# -- saving ------------------------------------------------------------------------------------


def test_save_then_load_round_trips_and_the_file_is_private(ckpt_dir):
    state = {"w": torch.arange(4.0), "lr": 0.1, "names": ["a", "b"], "nested": {"k": (1, 2)}}
    path = runtime.save_checkpoint(state, 10)
    assert path == str(ckpt_dir / "step-000000010.pt")
    assert mode_of(path) == 0o600
    assert sorted(os.listdir(ckpt_dir)) == ["step-000000010.pt"]  # no temporary left
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 10 and latest.path == path
    assert latest.state["w"].equal(torch.arange(4.0))
    assert latest.state["names"] == ["a", "b"] and latest.state["nested"] == {"k": (1, 2)}


def test_earlier_checkpoints_are_kept_and_the_newest_is_loaded(ckpt_dir):
    for step in (10, 20, 30):
        runtime.save_checkpoint({"step_seen": torch.tensor(step)}, step)
    assert sorted(os.listdir(ckpt_dir)) == [f"step-{s:09d}.pt" for s in (10, 20, 30)]
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 30 and int(latest.state["step_seen"]) == 30


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary(ckpt_dir):
    runtime.save_checkpoint({"w": torch.ones(2)}, 10)
    before = (ckpt_dir / "step-000000010.pt").read_bytes()
    with pytest.raises(Exception, match="pickle"):  # a lambda cannot be pickled
        runtime.save_checkpoint({"w": torch.zeros(2), "f": lambda: 0}, 10)
    assert os.listdir(ckpt_dir) == ["step-000000010.pt"]
    assert (ckpt_dir / "step-000000010.pt").read_bytes() == before


def test_a_checkpoint_written_by_earlier_versions_still_loads(ckpt_dir):
    # Before: torch.save straight to a temporary name, renamed; same format and file name.
    torch.save({"step": 7, "state": {"w": torch.ones(3)}}, ckpt_dir / "step-000000007.pt")
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 7 and latest.state["w"].equal(torch.ones(3))


def test_no_checkpoint_yet_gives_none(ckpt_dir):
    (ckpt_dir / "notes.txt").write_text("not a checkpoint")
    assert runtime.load_checkpoint() is None


def test_without_a_checkpoint_dir_both_say_to_pass_one(monkeypatch):
    monkeypatch.delenv("SPARKDIST_CHECKPOINT_DIR", raising=False)
    for call in (lambda: runtime.save_checkpoint({}, 1), runtime.load_checkpoint):
        with pytest.raises(RuntimeError, match="pass checkpoint_dir=... to the launcher"):
            call()


# -- loading safely ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["torch.save", "bare pickle"])
def test_a_malicious_pickle_is_refused_by_default_and_nothing_runs(ckpt_dir, tmp_path, how):
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


def test_the_opt_in_loads_a_full_pickle(ckpt_dir, tmp_path):
    marker = tmp_path / "code-ran"
    write_malicious(ckpt_dir / "step-000000030.pt", marker, "torch.save")
    latest = runtime.load_checkpoint(weights_only=False)
    assert latest is not None and latest.step == 30
    assert latest.state == 0  # os.system's exit status: the pickle ran, as asked
    assert marker.exists()


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


def _zero_middle(data: bytes) -> bytes:
    middle = len(data) // 3
    return data[:middle] + bytes(64) + data[middle + 64 :]


def _not_ours(_: bytes) -> bytes:
    path = os.path.join(os.environ["SPARKDIST_CHECKPOINT_DIR"], "other.pt")
    torch.save(torch.ones(2), path)  # a readable torch file, not {"step", "state"}
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    return data


@pytest.mark.parametrize(
    "damage",
    [_truncate, _zero_middle, lambda _: b"", lambda _: os.urandom(300), _not_ours],
    ids=["truncated", "zeroed-bytes", "empty", "random-bytes", "not-a-checkpoint"],
)
def test_an_unreadable_newest_checkpoint_falls_back_with_a_warning(ckpt_dir, caplog, damage):
    runtime.save_checkpoint({"w": torch.full((64,), 1.0)}, 10)
    runtime.save_checkpoint({"w": torch.full((64,), 2.0)}, 20)
    newest = ckpt_dir / "step-000000020.pt"
    newest.write_bytes(damage(newest.read_bytes()))
    caplog.set_level(logging.WARNING, logger="sparkdist")
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 10
    assert latest.state["w"].equal(torch.full((64,), 1.0))
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(newest) in warning and "trying the checkpoint before it" in warning
    assert newest.exists()  # never deleted: the user may want to look at it


def test_when_no_checkpoint_can_be_read_the_error_lists_them(ckpt_dir, caplog):
    for step in (10, 20):
        (ckpt_dir / f"step-{step:09d}.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(RuntimeError) as info:
        runtime.load_checkpoint()
    message = str(info.value)
    assert str(ckpt_dir / "step-000000010.pt") in message
    assert str(ckpt_dir / "step-000000020.pt") in message
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
