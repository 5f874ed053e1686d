"""The lab's holder: the first process of the lab's namespaces, serving requests on its pipes.

Started as ``unshare --net --mount --pid --fork --kill-child --mount-proc python -m
sparkdist._lab.holder`` (``support.unshare_prefix``), it is PID 1 of a PID namespace of its own,
in a network namespace that becomes the lab's switch (one bridge) and a mount namespace whose
changes reach no one outside. When it exits, for any reason (its pipe closed because the test
process died, Ctrl-C, a crash), the kernel kills every process of the lab and the namespaces go
with their last process: nothing survives.

PID 1 forks once: the child serves; PID 1 only reaps (orphans of killed hosts are reparented
to it) and exits when the server does. Requests and replies are JSON lines on stdin/stdout
(``protocol`` below); each request runs on a thread of its own, so a long command on one host
never holds up a fault injected on another.

A host is a process (``host_init``) in new network, mount and UTS namespaces; commands run on a
host through ``nsenter`` into that process's namespaces, so every process of a host is found by
its network namespace and a host is killed by killing them all.

Non-goals: any policy (which hosts, which addresses, Spark): the client decides; this process
only carries it out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

#: The lab's switch: every host's link is a port of this bridge.
BRIDGE = "br0"
#: Where a host's name resolves to a network its peers do not share, that NIC's name.
SIDE_NIC = "eth1"


@dataclass
class _Host:
    name: str
    init: subprocess.Popen[bytes]
    netns: str
    switch_port: str
    side_port: str = ""


@dataclass
class _State:
    hosts: dict[str, _Host] = field(default_factory=dict)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    next_proc: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)
    out_lock: threading.Lock = field(default_factory=threading.Lock)


def _sh(*argv: str, netns_pid: int | None = None) -> None:
    command = list(argv)
    if netns_pid is not None:
        command = ["nsenter", f"--target={netns_pid}", "--net", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")


def _netns_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _set_up_switch(request: dict[str, Any]) -> dict[str, Any]:
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "link", "set", BRIDGE, "up")
    # The caller's /tmp, seen from every host at a hidden path, so that a host (whose /tmp is
    # a private tmpfs) can still see what must stay visible under /tmp: the interpreter, the
    # code, the shared directory (see host_init).
    # A tmpfs over its parent first, so the mount point exists in the lab only.
    outer_tmp = request["outer_tmp"]
    _sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", os.path.dirname(outer_tmp))
    os.makedirs(outer_tmp)
    _sh("mount", "--bind", "/tmp", outer_tmp)
    return {"pid": os.getpid()}


def _add_host(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    name = request["name"]
    init = subprocess.Popen(
        [
            "unshare",
            "--net",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            sys.executable,
            "-m",
            "sparkdist._lab.host_init",
            json.dumps(request),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert init.stdout is not None and init.stderr is not None
    ready = init.stdout.readline()
    if ready.strip() != b"ready":
        init.kill()
        raise RuntimeError(f"host {name} did not start: {init.stderr.read().decode()[-2000:]}")
    port = f"v-{request['index']}"
    host = _Host(name, init, _netns_of(init.pid), port)
    for stale in (port, f"x-{request['index']}"):
        # A killed predecessor's ports outlive it while the kernel tears its namespace down
        # (later still with connections it left retransmitting): delete them now.
        subprocess.run(["ip", "link", "del", stale], capture_output=True, timeout=30)
    _sh("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", str(init.pid))
    _sh("ip", "link", "set", port, "master", BRIDGE, "up")
    _sh(
        "ip",
        "addr",
        "add",
        f"{request['address']}/{request['prefix']}",
        "dev",
        "eth0",
        netns_pid=init.pid,
    )
    _sh("ip", "link", "set", "eth0", "up", netns_pid=init.pid)
    side = request.get("side_address")
    if side:
        # A second NIC on a network no peer shares: a veth whose other end sits on no bridge.
        host.side_port = f"x-{request['index']}"
        _sh(
            "ip",
            "link",
            "add",
            host.side_port,
            "type",
            "veth",
            "peer",
            "name",
            SIDE_NIC,
            "netns",
            str(init.pid),
        )
        _sh("ip", "link", "set", host.side_port, "up")
        _sh("ip", "addr", "add", f"{side}/{request['prefix']}", "dev", SIDE_NIC, netns_pid=init.pid)
        _sh("ip", "link", "set", SIDE_NIC, "up", netns_pid=init.pid)
    with state.lock:
        state.hosts[name] = host
    return {"pid": init.pid}


def _host_command(host: _Host, argv: list[str], cwd: str) -> list[str]:
    return [
        "nsenter",
        f"--target={host.init.pid}",
        "--net",
        "--mount",
        "--uts",
        f"--wd={cwd}",
        "--",
        *argv,
    ]


def _exec(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    host = state.hosts[request["host"]]
    try:
        done = subprocess.run(
            _host_command(host, request["argv"], request.get("cwd", "/")),
            input=request.get("input", "").encode(),
            capture_output=True,
            env=request["env"],
            timeout=request.get("timeout_s", 120),
        )
    except subprocess.TimeoutExpired as expired:
        return {"rc": None, "stdout": _text(expired.stdout), "stderr": _text(expired.stderr)}
    return {"rc": done.returncode, "stdout": _text(done.stdout), "stderr": _text(done.stderr)}


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def _spawn(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    host = state.hosts[request["host"]]
    with open(request["log"], "ab") as log:
        proc = subprocess.Popen(
            _host_command(host, request["argv"], request.get("cwd", "/")),
            stdin=subprocess.PIPE if request.get("pipes") else subprocess.DEVNULL,
            stdout=subprocess.PIPE if request.get("pipes") else log,
            stderr=log,
            env=request["env"],
        )
    with state.lock:
        handle = state.next_proc
        state.next_proc += 1
        state.procs[handle] = proc
    return {"proc": handle, "pid": proc.pid}


def _send(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    proc = state.procs[request["proc"]]
    assert proc.stdin is not None
    proc.stdin.write(request["data"].encode())
    proc.stdin.flush()
    return {}


def _read_line(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    # One reader per process at a time (the client's contract): a blocking readline on this
    # request's own thread, so waiting long here holds up nothing else.
    proc = state.procs[request["proc"]]
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return {"line": line.decode(errors="replace"), "rc": proc.poll()}


def _wait(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    proc = state.procs[request["proc"]]
    try:
        return {"rc": proc.wait(request.get("timeout_s", 30))}
    except subprocess.TimeoutExpired:
        return {"rc": None}


def _signal(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    os.kill(request["pid"], request["signal"])
    return {}


def _processes() -> list[dict[str, Any]]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            netns = _netns_of(pid)
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/comm", "rb") as comm:
                name = comm.read().strip().decode(errors="replace")
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as environ:
                env_names = [
                    item.split(b"=", 1)[0].decode() for item in environ.read().split(b"\0")
                ]
        except OSError:
            continue  # gone meanwhile, or a zombie
        if fields[0] == b"Z":
            continue
        found.append(
            {
                "pid": pid,
                "ppid": int(fields[1]),
                "name": name,
                "netns": netns,
                "argv": [a.decode(errors="replace") for a in argv if a],
                "env_names": [n for n in env_names if n],
            }
        )
    return found


def _host_processes(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    by_netns = {host.netns: host.name for host in state.hosts.values()}
    rows = []
    for proc in _processes():
        host = by_netns.get(proc.pop("netns"))
        if host is not None and (request.get("host") in (None, host)):
            rows.append({**proc, "host": host})
    return {"processes": rows}


def _kill_host(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    host = state.hosts[request["host"]]
    killed = []
    # Until nothing is left: a process being forked while we scan is caught the next round.
    for _ in range(50):
        pids = [p["pid"] for p in _processes() if p["netns"] == host.netns]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    host.init.wait(10)
    with state.lock:
        del state.hosts[host.name]
    # The switch's end of the link went with the namespace holding its peer.
    return {"killed": sorted(set(killed))}


def _link(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    host = state.hosts[request["host"]]
    _sh("ip", "link", "set", host.switch_port, "up" if request["up"] else "down")
    return {}


def _delay(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    # The host's switch port moves to a bridge of its own, joined to the lab's bridge through
    # two TAP devices and a relay that holds every frame for delay_ms (no netem needed).
    host = state.hosts[request["host"]]
    index = host.switch_port.removeprefix("v-")
    own, near, far = f"br-{index}", f"ta-{index}", f"tb-{index}"
    _sh("ip", "link", "add", own, "type", "bridge")
    _sh("ip", "link", "set", own, "up")
    for tap, bridge in ((near, own), (far, BRIDGE)):
        _sh("ip", "tuntap", "add", "dev", tap, "mode", "tap")
        _sh("ip", "link", "set", tap, "master", bridge, "up")
    _sh("ip", "link", "set", host.switch_port, "master", own)
    relay = subprocess.Popen(
        [sys.executable, "-m", "sparkdist._lab.relay", near, far, str(request["delay_ms"])],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with state.lock:
        handle = state.next_proc
        state.next_proc += 1
        state.procs[handle] = relay
    return {"proc": handle, "pid": relay.pid}


def _write_file(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    # A host's private files are reached through its init's root: /proc/PID/root resolves the
    # path in that process's mount namespace.
    host = state.hosts[request["host"]]
    path = f"/proc/{host.init.pid}/root{request['path']}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as out:
        out.write(request["text"])
    return {}


def _read_file(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    host = state.hosts[request["host"]]
    path = f"/proc/{host.init.pid}/root{request['path']}"
    try:
        with open(path, errors="replace") as source:
            return {"text": source.read()}
    except FileNotFoundError:
        return {"text": None}


def _list_dir(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    host = state.hosts[request["host"]]
    path = f"/proc/{host.init.pid}/root{request['path']}"
    try:
        return {"names": sorted(os.listdir(path))}
    except FileNotFoundError:
        return {"names": None}


_OPS: dict[str, Callable[[_State, dict[str, Any]], dict[str, Any]]] = {
    "switch": lambda state, request: _set_up_switch(request),
    "add_host": _add_host,
    "exec": _exec,
    "spawn": _spawn,
    "send": _send,
    "read_line": _read_line,
    "wait": _wait,
    "signal": _signal,
    "processes": _host_processes,
    "kill_host": _kill_host,
    "link": _link,
    "delay": _delay,
    "write_file": _write_file,
    "read_file": _read_file,
    "list_dir": _list_dir,
}


def _handle(state: _State, request: dict[str, Any], out: IO[str]) -> None:
    try:
        reply = {"id": request["id"], "ok": True, **_OPS[request["op"]](state, request)}
    except Exception as error:  # every failure goes back to the caller, named
        reply = {"id": request["id"], "ok": False, "error": f"{type(error).__name__}: {error}"}
    with state.out_lock:
        out.write(json.dumps(reply) + "\n")
        out.flush()


def serve(requests: IO[str], out: IO[str]) -> None:
    state = _State()
    for line in requests:
        request = json.loads(line)
        if request["op"] == "shutdown":
            break
        threading.Thread(target=_handle, args=(state, request, out), daemon=True).start()


def main() -> None:
    server = os.fork()
    if server == 0:
        try:
            serve(sys.stdin, sys.stdout)
        finally:
            os._exit(0)
    # PID 1: reap whatever is reparented here until the server is gone; then the kernel ends
    # every process left in the namespace.
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == server:
            break


if __name__ == "__main__":
    main()
