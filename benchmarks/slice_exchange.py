"""How fast two hosts exchange many slice-sized messages, by how many receives each keeps posted.

    sudo python benchmarks/slice_exchange.py [--net 1gbit] [--messages 256] [--kb 200]

Two emulated hosts (links of ``--net``, full duplex) run one rank each. Each rank sends
``--messages`` messages of ``--kb`` KB to the other through gradsync's transport and a
:class:`~gradsync.strategies.scheduler.PrioritySender`, while a receiving thread keeps a number of
receives posted and posts the next as soon as one completes (as ``p3``'s receiving threads do, but
with nothing to handle). Variants: one way only; both ways with 4 receives posted (``p3.POSTED``),
with every message's receive posted at once, and under a credit of 1 MB (``p3``'s default).
Printed: the median of three of each, and the time the bytes take at the link rate.

It separates the wire from the handling: Gloo moves a message's bytes only once its receive is
posted, and if a few posted receives kept the link from its rate here, no handling would be
needed to explain an idle link in a ``p3`` or ``ps-sliced`` run.
"""
from __future__ import annotations

import argparse
import statistics
import sys

RANK = r"""
import json, sys, threading, time, torch
from collections import deque
import gradsync
from gradsync import runtime
from gradsync.strategies.scheduler import PrioritySender
cfg = json.load(open(sys.argv[1]))
topo = gradsync.init()
t = runtime.current().transport
peer = 1 - topo.rank
count, size = cfg["messages"], cfg["bytes"]
payloads = [torch.ones(size, dtype=torch.uint8) for _ in range(count)]  # touched: no page faults while timed


def receive(posted, tag):
    waiting = deque()
    for _ in range(min(posted, count)):
        buf = torch.empty(size, dtype=torch.uint8)
        waiting.append((buf, t.recv_async(buf, peer, tag, what="slice receive", traced=False)))
    for got in range(1, count + 1):
        buf, handle = waiting.popleft()
        handle.wait(background=True)
        if got + len(waiting) < count:
            waiting.append((buf, t.recv_async(buf, peer, tag, what="slice receive", traced=False)))


def timed(both, posted, credit, tag):
    receiving = both or topo.rank == 1
    thread = threading.Thread(target=receive, args=(posted, tag)) if receiving else None
    if thread is not None:
        thread.start()
    t.barrier(what="exchange start")
    start = time.perf_counter()
    if both or topo.rank == 0:
        sender = PrioritySender(t, credit)
        for buf in payloads:
            sender.put((0, 0.0), buf, peer, tag, what="slice send")
        sender.close()
    if thread is not None:
        thread.join()
    elapsed = time.perf_counter() - start
    t.barrier(what="exchange end")
    return elapsed


out = {}
for repeat in range(cfg["repeats"]):
    for i, (name, both, posted, credit) in enumerate(cfg["variants"]):
        out.setdefault(name, []).append(timed(both, posted, credit, 100 + i))
if topo.rank == 0:
    json.dump(out, open(sys.argv[2], "w"))
gradsync.shutdown()
"""


def main() -> int:
    from _hosts import run_on_hosts
    from gradsync.cluster import format_rate, parse_rate
    from gradsync.errors import ConfigError
    from gradsync.strategies.p3 import POSTED

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", default="1gbit")
    parser.add_argument("--messages", type=int, default=256)
    parser.add_argument("--kb", type=float, default=200.0, help="message size, KB (p3's default slice: 200)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    try:
        rate = parse_rate(args.net)
    except ConfigError as exc:
        parser.error(f"--net: {exc}")
    if args.messages < 1 or args.kb <= 0 or args.repeats < 1:
        parser.error("--messages and --repeats must be >= 1 and --kb > 0")
    size = int(args.kb * 1000)
    variants = [("one way", False, POSTED, None), (f"both ways, {POSTED} posted", True, POSTED, None),
                ("both ways, all posted", True, args.messages, None),
                (f"both ways, {POSTED} posted, 1 MB credit", True, POSTED, 2**20)]
    times = run_on_hosts(RANK, {"messages": args.messages, "bytes": size, "repeats": args.repeats, "variants": variants}, rate, "gradsync-slices-")
    if times is None:
        return 1
    line = args.messages * size * 8 / rate
    print(f"two hosts, links of {format_rate(rate)}; {args.messages} messages of {size / 1e3:g} KB each way; "
          f"median of {args.repeats}; at the link rate: {line:.3f} s")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:40s} {median:7.3f} s  {line / median:5.2f}x the link rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
