"""``compressed-allgather``'s local work on one bucket, as the strategy does it and as the simulator charges it.

    python benchmarks/allgather_local_work.py [--mb 25] [--workers 4] [--compression onebit]

Runs in a child process under the emulated ranks' allocator settings (``gradsync.bench.cli``: a
decode's fresh output is then reused memory, as in the ranks). The strategy's side is
``CompressedAllGather.exchange`` and the division and check before it, without the wire: divide
the bucket by the workers, check it is finite, encode it, check the other workers' messages, then
decode and add all of them into a zeroed total and copy it back (the other workers' payloads are
this one's). The simulator's side is what ``gradsync.simulate.compressed`` charges the
communication thread for the same bucket: two copies, the encode, and per worker a decode and a
copy, at this machine's copy rate (``validate.calibrate``) and the compressor's measured costs
(``compressed.codec_cost``). Printed: both, in ms (the strategy's the median of 7).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import statistics, sys, time, torch
from gradsync.compress import build, parse_spec
from gradsync.compress.base import all_finite, from_bytes, message_problem, to_bytes
from gradsync.simulate.compressed import codec_cost
from gradsync.simulate.validate import calibrate

torch.set_num_threads(1)
mb, n, spec = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
name, options = parse_spec(spec)
flat = torch.randn(int(mb * 2**20) // 4)
codec = build(name, key="0/all", worker=0, **options)

def exchange():
    flat.div_(n)
    all_finite(flat)
    payload, ctx = codec.compress(flat)
    messages = [to_bytes(payload)] * n
    for w in range(1, n):
        message_problem(messages[w])
    total = torch.zeros_like(flat)
    for w in range(n):
        total += codec.decompress(payload if w == 0 else from_bytes(messages[w], payload), ctx)
    flat.copy_(total)

for _ in range(3):
    exchange()
times = []
for _ in range(7):
    start = time.perf_counter()
    exchange()
    times.append(time.perf_counter() - start)
nbytes = flat.numel() * 4
copy = nbytes / calibrate(handoff_repeats=0)["copy_Bps"]
cost = codec_cost(name, options, 1.0)
model = 2 * copy + cost.encode(nbytes) + n * (cost.decode(nbytes) + copy)
print(f"{spec}, {nbytes / 1e6:.1f} MB bucket, {n} workers: the strategy's local work "
      f"{statistics.median(times) * 1e3:.1f} ms; the simulator charges {model * 1e3:.1f} ms "
      f"(a copy {copy * 1e3:.1f}, encode {cost.encode(nbytes) * 1e3:.1f}, decode {cost.decode(nbytes) * 1e3:.1f})")
"""


def main() -> None:
    from gradsync.bench.cli import emulated_rank_env

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=25.0, help="bucket size in MB (default 25: the strategy's)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--compression", default="onebit")
    args = parser.parse_args()
    env = {**os.environ, **emulated_rank_env()}
    subprocess.run([sys.executable, "-c", CHILD, str(args.mb), str(args.workers), args.compression], env=env, check=True)


if __name__ == "__main__":
    main()
