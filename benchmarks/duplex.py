"""How fast one large message moves between two hosts when another crosses it the other way.

    sudo python benchmarks/duplex.py [--net 1gbit] [--sizes 1,4,12,50,200,400]

Two emulated hosts (links of ``--net``, full duplex) run one rank each. For each size (MB) the
ranks time, through gradsync's transport, one message from rank 0 to rank 1 with the reverse
idle (one-way), then one message each way at once (exchange), the median of three. Printed: the
rate each direction gets in the exchange, as a fraction of the one-way rate. On a full-duplex
link that is 1 in both orders; with the send posted first Gloo gives each direction half. It is
why co-located ``ps`` posts its pulls' receives before its answers, and what the simulator's
``Worker.duplex`` link stands for where two workers still exchange send-first (``pair-averaging``).
"""
from __future__ import annotations

import argparse
import sys

RANK = """
import json, statistics, sys, time, torch
import gradsync
from gradsync import runtime
cfg = json.load(open(sys.argv[1]))
topo = gradsync.init()
t = runtime.current().transport
peer = 1 - topo.rank
out = {}
for mb in cfg["sizes"]:
    n = int(mb * 1e6) // 4
    send, recv = torch.ones(n), torch.ones(n)  # touched: no page faults while timed
    def timed(both, recv_first=False):
        t.barrier(what="duplex start")
        start = time.perf_counter()
        hs = []
        if (both or topo.rank == 1) and recv_first:
            hs.append(t.recv_async(recv, peer, tag=3, what="duplex receive"))
        if both or topo.rank == 0:
            hs.append(t.send_async(send, peer, tag=3, what="duplex send"))
        if (both or topo.rank == 1) and not recv_first:
            hs.append(t.recv_async(recv, peer, tag=3, what="duplex receive"))
        for h in hs:
            h.wait()
        t.barrier(what="duplex end")
        return time.perf_counter() - start
    timed(True)
    one = statistics.median(timed(False) for _ in range(cfg["repeats"]))
    both = statistics.median(timed(True) for _ in range(cfg["repeats"]))
    first = statistics.median(timed(True, True) for _ in range(cfg["repeats"]))
    out[str(mb)] = [one, both, first]
if topo.rank == 0:
    json.dump(out, open(sys.argv[2], "w"))
gradsync.shutdown()
"""


def main() -> int:
    from _hosts import run_on_hosts
    from gradsync.cluster import format_rate, parse_rate
    from gradsync.errors import ConfigError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", default="1gbit")
    parser.add_argument("--sizes", default="1,4,12,50,200,400", help="message sizes, MB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    try:
        rate = parse_rate(args.net)
        sizes = [float(s) for s in args.sizes.split(",")]
    except (ValueError, ConfigError) as exc:
        parser.error(f"--net or --sizes: {exc}")
    if not sizes or min(sizes) <= 0 or args.repeats < 1:
        parser.error("--sizes must be positive MB and --repeats >= 1")
    times = run_on_hosts(RANK, {"sizes": sizes, "repeats": args.repeats}, rate, "gradsync-duplex-")
    if times is None:
        return 1
    print(f"two hosts, links of {format_rate(rate)}; median of {args.repeats}")
    print("exchange: each rank posts its send, then its receive; receive first: the other order")
    print(f"{'MB':>6} {'one-way s':>10} {'Mbit/s':>8} {'exchange s':>11} {'share':>6} {'receive first s':>16} {'share':>6}")
    for mb, (one, both, first) in times.items():
        print(f"{float(mb):>6g} {one:>10.3f} {float(mb) * 8 / one:>8.0f} {both:>11.3f} {one / both:>6.2f} "
              f"{first:>16.3f} {one / first:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
