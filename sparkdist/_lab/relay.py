"""Delay without ``netem``: a user-space relay of Ethernet frames between two TAP devices.

The kernels this lab runs on may lack ``sch_netem``; so a host's link can instead go through
two TAP devices in the switch's namespace, one on the host's own bridge and one on the lab's
bridge, and this process carries every frame from one to the other after ``delay_s``. A round
trip between two delayed hosts crosses four relay hops (two per host), so a one-way delay of
RTT/4 per host gives the wanted round-trip time between any two of them.

Frames keep their order (one FIFO per direction, all with the same delay). Non-goals: loss,
jitter, bandwidth limits.
"""

from __future__ import annotations

import collections
import fcntl
import os
import select
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_MAX_FRAME = 65536


def open_tap(name: str) -> int:
    """Attach to the persistent TAP device ``name`` (made by ``ip tuntap add mode tap``)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def relay(left: int, right: int, delay_s: float) -> None:
    queues: dict[int, collections.deque[tuple[float, bytes]]] = {
        left: collections.deque(),
        right: collections.deque(),
    }
    other = {left: right, right: left}
    while True:
        now = time.monotonic()
        due = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(due) - now) if due else None
        readable, _, _ = select.select([left, right], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            try:
                while True:
                    queues[other[fd]].append((now + delay_s, os.read(fd, _MAX_FRAME)))
            except BlockingIOError:
                pass
        for fd, queue in queues.items():
            while queue and queue[0][0] <= now:
                try:
                    os.write(fd, queue.popleft()[1])
                except BlockingIOError:
                    break  # the device's queue is full: the frame is dropped, as a switch would


def main() -> None:
    left, right, delay_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
    relay(open_tap(left), open_tap(right), delay_ms / 1000.0)


if __name__ == "__main__":
    main()
