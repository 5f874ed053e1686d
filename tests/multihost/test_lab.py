"""The lab itself: hosts are what they claim, and nothing of a lab survives it, even when the
process that made it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparkdist._lab.lab import Lab, NameResolution
from sparkdist._lab.spark import LabCluster
from sparkdist._lab.support import probe

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _lab_here() -> None:
    support = probe()
    if not support.ok:
        pytest.skip(support.reason)


def _pid_namespace_members(namespace: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _holder_namespace(holder_pid: int) -> str:
    # The holder (unshare) itself stays in ours; its child is the lab's PID 1.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{holder_pid}/task/{holder_pid}/children").read_text().split()
        if children:
            return os.readlink(f"/proc/{children[0]}/ns/pid")
        time.sleep(0.05)  # unshare forks its child right after it starts
    raise AssertionError("the holder never forked the lab's first process")


def test_hosts_have_their_own_names_tmp_and_addresses(tmp_path: Path) -> None:
    with Lab(tmp_path / "lab", tmp_path / "shared", "t") as lab:
        lab.add_hosts(2, [NameResolution.LOOPBACK, NameResolution.SIDE])
        lab.write_file("host1", "/tmp/only-here", "1")
        (lab.shared / "seen-by-all").write_text("shared")
        seen_by_all = str(lab.shared / "seen-by-all")
        probe_code = textwrap.dedent(
            f"""
            import os, socket
            print(socket.gethostname(), socket.gethostbyname(socket.gethostname()),
                  os.path.exists("/tmp/only-here"), open({seen_by_all!r}).read())
            """
        )
        seen = {h: lab.python(h, probe_code).stdout.split() for h in ("host1", "host2")}
        assert seen["host1"] == ["lab-host1", "127.0.1.1", "True", "shared"]
        assert seen["host2"] == ["lab-host2", "198.19.0.12", "False", "shared"]
        reach = "import socket; socket.create_connection(('198.18.0.12', 9), timeout=3)"
        assert "Connection refused" in lab.python("host1", reach).stderr  # reached, port closed
        lab.cut("host2")
        assert "timed out" in lab.python("host1", reach, timeout_s=20).stderr
        lab.heal("host2")
        assert "Connection refused" in lab.python("host1", reach).stderr
        killed = lab.kill_host("host2")
        assert killed and not lab.processes("host2")


def test_nothing_of_a_lab_survives_its_maker_being_killed(tmp_path: Path) -> None:
    maker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from sparkdist._lab.lab import Lab
            lab = Lab(Path({str(tmp_path / "lab")!r}), Path({str(tmp_path / "shared")!r}), "k")
            lab.add_hosts(1)
            lab.spawn("host1", ["sleep", "600"], Path({str(tmp_path / "sleep.log")!r}))
            print(lab._holder.pid, flush=True)
            time.sleep(600)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert maker.stdout is not None
    holder_pid = int(maker.stdout.readline())
    namespace = _holder_namespace(holder_pid)
    assert len(_pid_namespace_members(namespace)) >= 4  # PID 1, server, host inits, sleep
    maker.send_signal(signal.SIGKILL)
    maker.wait()
    deadline = time.monotonic() + 10
    while _pid_namespace_members(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)  # the kernel ends the namespace's processes; nothing else to wait on
    assert _pid_namespace_members(namespace) == []
    assert not os.path.exists("/mnt/outer-tmp")  # the lab's mounts were its own


def test_the_shared_cluster_started_checked(lab_cluster: LabCluster) -> None:
    # start() already required every Worker registered and every host reaching every other;
    # here: each host runs exactly one Worker, bound to its own address.
    workers = [
        p
        for p in lab_cluster.lab.processes()
        if any("deploy.worker.Worker" in a for a in p["argv"])
    ]
    assert sorted(p["host"] for p in workers if p["name"] == "java") == lab_cluster.workers
