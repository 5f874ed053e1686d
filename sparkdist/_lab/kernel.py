"""A driver program that runs code on request, like a notebook's kernel, on the driver's host.

Started on the lab's driver host with pipes to the holder: each request line is JSON
``{"code": ...}``; the code runs in one namespace kept across requests (so a SparkSession, and
sparkdist's warm pool, outlive one test), and what it assigns to ``result`` (JSON-able) comes
back with its output and, if it raised, the traceback. Output goes to the kernel's log, never
to the reply pipe (fd 1 is pointed at the log first), so rank lines cannot garble a reply.

Non-goals: isolating requests from each other (a test that must start fresh starts its own
process on the host).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import traceback
from typing import Any


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stdout -> the log: only replies travel on the pipe
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    log_path = os.readlink("/proc/self/fd/2")
    namespace: dict[str, Any] = {"__name__": "__lab_driver__"}
    for line in sys.stdin:
        request = json.loads(line)
        start = os.path.getsize(log_path) if os.path.isfile(log_path) else 0
        namespace.pop("result", None)
        began = time.monotonic()
        error = None
        try:
            exec(compile(request["code"], "<lab driver>", "exec"), namespace)
        except BaseException:  # the test wants whatever the code raised, named
            error = traceback.format_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        output = ""
        if os.path.isfile(log_path):
            with open(log_path, errors="replace") as log:
                log.seek(start)
                output = log.read()
        try:
            value = json.dumps(namespace.get("result"))
        except (TypeError, ValueError) as bad:
            value, error = "null", error or f"result is not JSON-able: {bad}"
        replies.write(
            json.dumps(
                {
                    "result": json.loads(value),
                    "error": error,
                    "output": output,
                    "elapsed_s": time.monotonic() - began,
                }
            )
            + "\n"
        )
        replies.flush()


if __name__ == "__main__":
    main()
