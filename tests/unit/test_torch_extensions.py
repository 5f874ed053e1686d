"""Stale torch extension build locks and DeepSpeed's CPU comm op: real files in a temp dir."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparkdist._node.rank import torch_extensions as te

OLD = 3600.0  # seconds: a lock this old is past any age limit


def make_lock(root: Path, *parts: str, age_s: float = OLD) -> Path:
    lock = root.joinpath(*parts, te.LOCK_NAME)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    stamp = time.time() - age_s
    os.utime(lock, (stamp, stamp))
    return lock


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TORCH_EXTENSIONS_DIR": "/x/ext", "HOME": "/h"}, "/x/ext"),
        ({"XDG_CACHE_HOME": "/c", "HOME": "/h"}, "/c/torch_extensions"),
        ({"HOME": "/h"}, "/h/.cache/torch_extensions"),
    ],
)
def test_extensions_root_is_where_torch_builds(env, expected):
    assert te.extensions_root(env) == Path(expected)


def test_build_root_adds_torchs_per_build_folder_only_under_the_default_root():
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    assert te.build_root({"HOME": "/h"}, "cpu") == Path(f"/h/.cache/torch_extensions/{py}_cpu")
    assert te.build_root({"TORCH_EXTENSIONS_DIR": "/x"}, "cu124") == Path("/x")


def test_build_root_matches_torch_itself(tmp_path, monkeypatch):
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    theirs = cpp_extension._get_build_directory("some_op", verbose=False)  # creates the folder
    ours = te.build_root(os.environ, te.torch_build_tag()) / "some_op"
    assert os.path.realpath(ours) == os.path.realpath(theirs)


def test_op_is_built_only_when_its_library_is_there(tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    make_lock(tmp_path, "cpu_adam")
    assert not te.op_is_built(tmp_path, "cpu_adam")
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert te.op_is_built(tmp_path, "cpu_adam")
    assert not te.op_is_built(tmp_path / "nowhere", "cpu_adam")


def test_find_locks_at_both_depths_and_nothing_else(tmp_path):
    flat = make_lock(tmp_path, "fused_adam")
    nested = make_lock(tmp_path, "py311_cpu", "deepspeed_shm_comm")
    (tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "build.ninja").write_text("")
    (tmp_path / "lock").touch()  # not an op's folder
    assert te.find_locks(tmp_path) == sorted([flat, nested])
    assert te.find_locks(tmp_path / "missing") == []


@pytest.mark.parametrize(
    ("age_s", "held_open", "working_inside", "stale"),
    [
        (OLD, False, False, True),  # a killed build's lock
        (1.0, False, False, False),  # too young to judge
        (OLD, True, False, False),  # the building process holds it
        (OLD, False, True, False),  # ninja / the compiler still run in the op's folder
    ],
)
def test_stale_locks(tmp_path, age_s, held_open, working_inside, stale):
    lock = make_lock(tmp_path, "py311_cpu", "fused_adam", age_s=age_s)
    real = os.path.realpath(lock)
    view = te.ProcessView(
        open_files=frozenset({real} if held_open else {"/dev/null"}),
        working_dirs=frozenset(
            {os.path.join(os.path.dirname(real), "sub")} if working_inside else {"/"}
        ),
    )
    assert te.stale_locks([lock], view, time.time(), min_age_s=10) == ([lock] if stale else [])


def test_a_lock_that_vanished_is_not_stale(tmp_path):
    lock = make_lock(tmp_path, "op")
    lock.unlink()
    assert te.stale_locks([lock], te.ProcessView(frozenset(), frozenset()), time.time()) == []


def test_live_processes_sees_this_processs_open_file_and_working_dir(tmp_path):
    path = tmp_path / "held"
    with open(path, "w"):
        view = te.live_processes()
        assert os.path.realpath(path) in view.open_files
    assert os.getcwd() in view.working_dirs


HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from torch.utils.file_baton import FileBaton
    baton = FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_killed_builds_lock_is_removed_and_a_live_one_is_not(tmp_path, caplog):
    pytest.importorskip("torch")
    lock = tmp_path / "py311_cpu" / "fused_adam" / te.LOCK_NAME
    lock.parent.mkdir(parents=True)
    # torch's own lock, taken the way a build takes it, by a process that then "builds".
    builder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert builder.stdout is not None and builder.stdout.readline().strip() == "held"
        stamp = time.time() - OLD
        os.utime(lock, (stamp, stamp))
        assert te.clear_stale_locks(tmp_path) == []  # held open: a build in progress
        assert lock.exists()
    finally:
        builder.kill()  # the build is killed midway: its lock stays behind
        builder.wait(timeout=60)
    assert lock.exists()
    with caplog.at_level(logging.WARNING, logger="sparkdist"):
        assert te.clear_stale_locks(tmp_path) == [lock]
    assert not lock.exists()
    assert str(lock) in caplog.text and "no process holds" in caplog.text


def test_a_young_lock_is_left_alone(tmp_path):
    lock = make_lock(tmp_path, "op", age_s=0.0)
    assert te.clear_stale_locks(tmp_path) == []
    assert lock.exists()


def test_a_stale_lock_that_cannot_be_removed_is_reported_with_the_command(
    tmp_path, monkeypatch, caplog
):
    lock = make_lock(tmp_path, "op")

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)  # root may remove anything: fake the refusal
    with caplog.at_level(logging.WARNING, logger="sparkdist"):
        assert te.clear_stale_locks(tmp_path) == []
    assert f"rm {lock}" in caplog.text and "Permission denied" in caplog.text


@pytest.mark.parametrize(
    ("env", "built"),
    [
        ({}, False),  # no DS_ACCELERATOR: a GPU accelerator, no CPU comm op
        ({"DS_ACCELERATOR": "cuda"}, False),
        ({"DS_ACCELERATOR": "cpu"}, True),  # built: DeepSpeed loads and uses it
    ],
)
def test_the_cpu_comm_op_is_left_to_deepspeed_unless_cpu_and_unbuilt(tmp_path, env, built):
    if built:
        (tmp_path / te.SHM_COMM_OP).mkdir()
        (tmp_path / te.SHM_COMM_OP / f"{te.SHM_COMM_OP}.so").write_bytes(b"")
    assert te.skip_unbuilt_cpu_comm_op({**env, "TORCH_EXTENSIONS_DIR": str(tmp_path)}) is False
