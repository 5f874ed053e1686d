"""``_node.host.reaper``: ending a rank's whole process tree, on real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sparkdist._node.host.reaper import KILL_CONFIRM_S, end_processes, process_table, start_time

# A "rank": a child in its group, a child in a session of its own that ignores SIGTERM (only
# SIGKILL ends it), and a daemon whose parent exits at once (found by its tag only); it writes
# every pid, then sleeps.
ROOT = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    out = sys.argv[1]
    same_group = subprocess.Popen(["sleep", "300"])
    stubborn = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(300)"],
        start_new_session=True, stdout=subprocess.PIPE, text=True,
    )
    assert stubborn.stdout.readline().strip() == "ready"  # its SIGTERM handler is set
    subprocess.Popen(
        ["sh", "-c", f"setsid sh -c 'echo $$ > {out}.daemon; exec sleep 300' &"]
    ).wait()
    while not os.path.exists(out + ".daemon") or not open(out + ".daemon").read().strip():
        time.sleep(0.01)
    daemon = int(open(out + ".daemon").read())
    with open(out + ".tmp", "w") as f:
        json.dump([os.getpid(), same_group.pid, stubborn.pid, daemon], f)
    os.replace(out + ".tmp", out)
    time.sleep(300)
""")


def _alive(pids: list[int]) -> list[int]:
    living = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.append(pid)
    return living


@pytest.fixture
def killed_at_end() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in _alive(pids):
        os.kill(pid, signal.SIGKILL)


def _start_root(tmp_path: Path, tag: dict[str, str], killed_at_end: list[int]) -> list[int]:
    out = tmp_path / "pids.json"
    root = subprocess.Popen(
        [sys.executable, "-c", ROOT, str(out)],
        env={**os.environ, **tag},
        start_new_session=True,  # a rank leads its own group
    )
    killed_at_end.append(root.pid)
    deadline = time.monotonic() + 60
    while not out.exists():
        assert root.poll() is None and time.monotonic() < deadline, "the root did not start"
        time.sleep(0.01)
    pids = json.loads(out.read_text())
    killed_at_end.extend(pids)
    return pids


def test_ends_the_group_the_setsid_children_and_tagged_orphans_but_nothing_else(
    tmp_path, killed_at_end
):
    tag = {"REAPER_TEST_TAG": uuid.uuid4().hex}
    bystander = subprocess.Popen(["sleep", "300"])  # ours, but not the root's
    killed_at_end.append(bystander.pid)
    pids = _start_root(tmp_path, tag, killed_at_end)
    root = pids[0]
    started = time.monotonic()
    survivors = end_processes({root: start_time(root)}, tag=tag, grace_s=0.3)
    took = time.monotonic() - started
    assert survivors == []
    assert not _alive(pids)
    # The stubborn child ignored SIGTERM: SIGKILL followed the grace, promptly.
    assert 0.3 <= took <= 0.3 + KILL_CONFIRM_S
    assert bystander.poll() is None


def test_a_pid_now_naming_another_process_is_left_alone(killed_at_end):
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    killed_at_end.append(other.pid)
    real_start = start_time(other.pid)
    assert real_start is not None
    # What the agent recorded for an earlier process that had this pid.
    assert end_processes({other.pid: real_start - 1}) == []
    assert other.poll() is None
    assert end_processes({other.pid: real_start}) == []
    assert other.wait(timeout=5) == -signal.SIGTERM


def test_a_command_name_with_parentheses_and_spaces_is_read(tmp_path, killed_at_end):
    odd = tmp_path / "a) b (c"
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "300"])
    killed_at_end.append(proc.pid)
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).name() != odd.name and time.monotonic() < deadline:
        time.sleep(0.01)  # until the exec happened
    entry = process_table()[proc.pid]
    assert entry.ppid == os.getpid() and entry.pgid == os.getpgrp() and not entry.zombie


def test_a_tagged_process_older_than_every_root_is_not_theirs(killed_at_end):
    # Whatever a root started is younger than the root; environments of older processes are
    # not even read (most of a scan's cost), so an older process with the tag is spared.
    tag = {"REAPER_TEST_TAG": uuid.uuid4().hex}
    env = {**os.environ, **tag}
    older = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    killed_at_end.append(older.pid)
    older_start = start_time(older.pid)
    assert older_start is not None
    deadline = time.monotonic() + 10
    while True:  # start times count clock ticks: the root must start on a later one
        root = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
        killed_at_end.append(root.pid)
        root_start = start_time(root.pid)
        assert root_start is not None
        if root_start > older_start:
            break
        root.kill()
        root.wait()
        assert time.monotonic() < deadline
    assert end_processes({root.pid: root_start}, tag=tag, grace_s=0.3) == []
    assert root.wait(timeout=5) == -signal.SIGTERM
    assert older.poll() is None
