"""One hybrid row server's update of a table, alone and with a second server beside it.

    python benchmarks/server_update.py

What ``hybrid``'s server does once per step and table in an emulated run of ``lstm-lm:cpu`` on two
workers (two partitions of 198,368 x 64 rows each, the rows of one step pushed): a zeroed
gradient with the rows added, divided by the workers (into the buffer kept from the previous
step, as server.py does), then the bench's optimizer (momentum SGD with weight decay). Runs under
the allocator settings of the emulated runs' ranks, on a thread other than the main one (as the
server's thread runs it), in one process and then in two at once, so that what the two cores share
(memory bandwidth or the cores) shows.
"""
from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import threading, time, statistics, torch
from gradsync.bench.workload import OPTIMIZERS
torch.set_num_threads(1)
rows, dim, pushed = 198368, 64, 8700
parts = [torch.nn.Parameter(torch.randn(rows, dim)) for _ in range(2)]
opt = OPTIMIZERS["sgd"][0](parts, 0.01)
ids, values = torch.randint(0, rows, (pushed,)), torch.randn(pushed, dim)
def update():
    for p in parts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.zero_().index_add_(0, ids, values).div_(2)
    opt.step()
def serve():
    for _ in range(3):
        update()
    for _ in range(15):
        start = time.perf_counter(); update(); times.append(time.perf_counter() - start)
times = []
server = threading.Thread(target=serve)
server.start()
server.join()
print(f"{statistics.median(times) * 1e3:.1f}")
"""


def main() -> None:
    from gradsync.bench.cli import EMULATED_ALLOCATOR

    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1", **EMULATED_ALLOCATOR}
    run = lambda: subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    alone = run().communicate()[0].strip()
    pair = [p.communicate()[0].strip() for p in [run(), run()]]
    print(f"update of one table's partitions (2 x 50.8 MB), median of 15: alone {alone} ms; "
          f"two servers at once {pair[0]} and {pair[1]} ms")


if __name__ == "__main__":
    main()
