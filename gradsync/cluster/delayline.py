"""A user-space delay line: ``python -m gradsync.cluster.delayline DELAY_MS LOSS SWITCH_NS HOST_NS...``.

This kernel has no netem, so an emulated cluster with ``--delay`` or ``--loss`` joins each host to
the switch through this process instead of a veth pair. For host ``i`` it creates two TAP
devices, ``eth0`` inside the host's namespace and ``p<i>`` inside the switch's, and copies every
Ethernet frame between them after holding it for ``DELAY_MS / 2`` (so host to host, through two
links, a frame takes ``DELAY_MS`` one way). Each copy drops the frame with probability ``LOSS``
(0 to 1), so host to host a frame is lost with probability ``1 - (1 - LOSS)**2``; TCP resends
it, as on a lossy cable. Frames keep their order; the line itself has no rate limit: the
``tc tbf`` qdiscs on ``eth0`` and ``p<i>`` shape the link exactly as on veth pairs.

It prints ``ready`` once every device exists, then runs until its standard input closes (its
owner closed the cluster or died); the devices vanish with it.
"""
from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import random
import select
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_CLONE_NEWNET = 0x40000000
_MAX_FRAME = 65536 + 14


def open_tap(name: str, namespace: str) -> int:
    """Create TAP device ``name`` inside ``namespace`` and return its file descriptor."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{namespace}") as ns:
        if libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {namespace}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def run(delay_s: float, peer: dict[int, int], control: int, loss: float = 0.0,
        rng: random.Random | None = None) -> None:
    """Move frames between paired descriptors after ``delay_s``, dropping each with probability
    ``loss``; return when ``control`` hits EOF."""
    rng = rng or random.Random()
    queues = {fd: collections.deque() for fd in peer}  # frames waiting to be written to fd
    poller = select.epoll()
    for fd in peer:
        poller.register(fd, select.EPOLLIN)
    poller.register(control, select.EPOLLIN)
    while True:
        now = time.monotonic()
        due = float("inf")
        for fd, queue in queues.items():
            while queue and queue[0][0] <= now:
                try:
                    os.write(fd, queue.popleft()[1])
                except OSError:
                    pass  # the interface went down: the frame is lost, as on a cable pulled out
            if queue:
                due = min(due, queue[0][0])
        timeout = -1 if due == float("inf") else max(0.0, due - time.monotonic())
        for fd, _ in poller.poll(timeout):
            if fd == control:
                if not os.read(control, 4096):
                    return
                continue
            out = peer[fd]
            while True:
                try:
                    frame = os.read(fd, _MAX_FRAME)
                except (BlockingIOError, OSError):
                    break
                if not frame:
                    break
                if loss and rng.random() < loss:
                    continue  # lost on the way
                queues[out].append((time.monotonic() + delay_s, frame))


def main(argv: list[str]) -> int:
    delay_ms, loss, switch, hosts = float(argv[0]), float(argv[1]), argv[2], argv[3:]
    peer = {}
    for i, host in enumerate(hosts):
        a, b = open_tap("eth0", host), open_tap(f"p{i}", switch)
        peer[a], peer[b] = b, a
    print("ready", flush=True)
    run(delay_ms / 2 / 1e3, peer, sys.stdin.fileno(), loss)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
