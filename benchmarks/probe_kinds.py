"""Which kinds of host work slow down when every core does them at once.

    python benchmarks/probe_kinds.py [--rounds 5]

The simulator's validation runs an emulated group's host work (copies, the optimizer's updates and
the compressors' passes) at a lone process's rate times the fraction that copies keep with every
core copying at once (``simulator_matrix.measure_concurrency``). This checks that assumption per
kind of work: for each round, one process alone, then one process per core started together, each
doing for a second apiece a 128 MB copy, a 128 x 128 matmul (in cache: compute only) and onebit's
encode of 12.5 MB (one thread each). Printed per round: what each process kept of the lone
process's rate, per kind.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

KINDS = ("copy 128 MB", "matmul in cache", "onebit encode 12.5 MB")
WORK = r'''
import json, sys, time
import torch
from gradsync.compress import build
torch.set_num_threads(1)
src = torch.randn(32 << 20); dst = torch.empty_like(src)
m = torch.randn(128, 128)
grad = torch.randn(int(12.5 * 2**18)); codec = build("onebit")
work = [lambda: dst.copy_(src), lambda: m @ m, lambda: codec.compress(grad)]
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.001)
rates = []
for fn in work:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        fn(); n += 1
    rates.append(n / (time.perf_counter() - t0))
print(json.dumps(rates))
'''


def together(count: int) -> list[list[float]]:
    """Each of ``count`` processes' rates (calls per second) per kind, all started at one moment."""
    start = time.time() + 3.0  # after torch's import
    runs = [subprocess.Popen([sys.executable, "-c", WORK, str(start)], stdout=subprocess.PIPE, text=True)
            for _ in range(count)]
    outs = [run.communicate()[0] for run in runs]
    if any(run.returncode for run in runs):
        raise RuntimeError("a probe process failed")
    return [json.loads(out) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    for _ in range(args.rounds):
        alone = together(1)[0]
        both = together(cores)
        kept = [sum(run[k] for run in both) / len(both) / alone[k] for k in range(len(KINDS))]
        print(f"{cores} at once kept: " + ", ".join(f"{name} {x:.2f}x" for name, x in zip(KINDS, kept)), flush=True)


if __name__ == "__main__":
    main()
