"""One hybrid row server's update of a table, alone and with a second server beside it.

    python benchmarks/server_update.py [--partitions 1] [--rows 396736] [--own-arenas | --glibc-defaults] [--fresh]

What ``hybrid``'s server does once per step and table in an emulated run of ``lstm-lm:cpu`` on two
workers (by default one partition of 396,736 x 64 rows, 101.6 MB, the rows of one step pushed): a
zeroed gradient with the rows added, divided by the workers (into the buffer kept from the previous
step, as server.py does), then the bench's optimizer (momentum SGD with weight decay). Runs under
the allocator settings of the emulated runs' ranks, on a thread other than the main one (as the
server's thread runs it), in one process and then in two at once, so that what the two cores share
(memory bandwidth or the cores) shows. ``--own-arenas`` leaves out the ranks' single malloc arena:
the thread then allocates from an arena of its own, whose blocks over 64 MB are fresh pages;
``--glibc-defaults`` leaves out every allocator setting of the ranks (what a process gets without
them). ``--fresh`` makes a new zeroed gradient each step and drops it after the optimizer, as the
server did before it kept its buffers.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import sys, threading, time, statistics, torch
from gradsync.bench.workload import OPTIMIZERS
torch.set_num_threads(1)
count, rows, dim, pushed, fresh = int(sys.argv[1]), int(sys.argv[2]), 64, 8700, sys.argv[3] == "1"
parts = [torch.nn.Parameter(torch.randn(rows, dim)) for _ in range(count)]
opt = OPTIMIZERS["sgd"][0](parts, 0.01)
ids, values = torch.randint(0, rows, (pushed,)), torch.randn(pushed, dim)
def update():
    for p in parts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.zero_().index_add_(0, ids, values).div_(2)
    opt.step()
    if fresh:
        for p in parts:
            p.grad = None
def serve():
    for _ in range(3):
        update()
    for _ in range(15):
        start = time.perf_counter(); update(); times.append(time.perf_counter() - start)
times = []
server = threading.Thread(target=serve)
server.start()
server.join()
print(f"{statistics.median(times) * 1e3:.1f} {statistics.stdev(times) / statistics.fmean(times):.2f}")
"""


def main() -> None:
    from gradsync.bench.cli import EMULATED_ALLOCATOR

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=1, help="partitions of the table on this server")
    parser.add_argument("--rows", type=int, default=396736, help="rows of 64 floats per partition")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--own-arenas", action="store_true", help="without the ranks' single malloc arena")
    how.add_argument("--glibc-defaults", action="store_true", help="without any of the ranks' allocator settings")
    parser.add_argument("--fresh", action="store_true", help="a new gradient buffer every step")
    args = parser.parse_args()
    allocator = {} if args.glibc_defaults else {
        k: v for k, v in EMULATED_ALLOCATOR.items() if not (args.own_arenas and k == "MALLOC_ARENA_MAX")}
    env = {k: v for k, v in os.environ.items() if k not in EMULATED_ALLOCATOR}
    env.update({"THP_MEM_ALLOC_ENABLE": "1", **allocator})
    child = [sys.executable, "-c", CHILD, str(args.partitions), str(args.rows), "1" if args.fresh else "0"]
    run = lambda: subprocess.Popen(child, env=env, stdout=subprocess.PIPE, text=True)
    alone = run().communicate()[0].split()
    pair = [p.communicate()[0].split() for p in [run(), run()]]
    size = args.partitions * args.rows * 64 * 4 / 1e6
    how = " (an arena of its own)" if args.own_arenas else " (glibc's defaults)" if args.glibc_defaults else ""
    print(f"update of {args.partitions} partition(s), {size:.1f} MB, on a server thread{how}, "
          f"{'a fresh' if args.fresh else 'a kept'} gradient buffer, median of 15 (coefficient of variation): "
          f"alone {alone[0]} ms ({alone[1]}); two servers at once {pair[0][0]} ({pair[0][1]}) and "
          f"{pair[1][0]} ms ({pair[1][1]})")


if __name__ == "__main__":
    main()
