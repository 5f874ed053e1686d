"""A lab host's first process: it makes the host's namespaces what a host is, then holds them.

Run by the holder as ``unshare --net --mount --uts python -m sparkdist._lab.host_init SPEC``:
- the host name (UTS namespace);
- a private ``/tmp`` (a tmpfs no other host sees), with the few paths under the caller's
  ``/tmp`` that every host must see bound back in at the same path (the interpreter, the code,
  the shared directory);
- its own ``/etc/hosts`` (a bind mount), so a test decides what the host's name resolves to;
- loopback up. The holder then moves the host's links into its network namespace.

It prints ``ready`` and waits for its stdin to close; the host lives as long as any process in
its namespaces does.

Non-goals: addresses and links (the holder's job, from the switch's side).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    socket.sethostname(spec["hostname"])
    _run("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp")
    for path in spec["keep_under_tmp"]:
        # Bound back from the holder's view of the caller's /tmp, at the same path.
        os.makedirs(path, exist_ok=True)
        _run(
            "mount", "--bind", os.path.join(spec["outer_tmp"], os.path.relpath(path, "/tmp")), path
        )
    os.makedirs("/tmp/.lab", mode=0o700)
    with open("/tmp/.lab/hosts", "w") as hosts:
        hosts.write(spec["hosts_file"])
    _run("mount", "--bind", "/tmp/.lab/hosts", "/etc/hosts")
    os.makedirs("/tmp/home", mode=0o700)
    _run("ip", "link", "set", "lo", "up")
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1])
