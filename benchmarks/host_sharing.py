"""How two kinds of host work slow down when other processes share the cores: copies, and a
strategy's Python message handling.

    python benchmarks/host_sharing.py [--spinners 2] [--duty 0.5]

The simulator shares an emulated host's cores among the ranks in two ways (docs/simulate.md):
host work (copies, updates, codecs) runs at ``cores / ranks`` of a core all the time, while a
message end, a short burst of a thread that sleeps between messages, runs beside only the other
ranks busy at the time (``Worker.burst_sharing``). This measures how much each really slows
beside ``--spinners`` processes that keep a core
busy ``--duty`` of the time (spin 20 ms, sleep the rest of a 20 ms / duty period) and beside as
many that spin always, against the same work alone:

- copies: two processes (one per core, as two ranks) copying 128 MB, one thread each, the median
  GB/s of each over 3 s;
- message handling: ``gradsync bench --model resnet50 --compute emulated --np 2 --strategies
  allreduce,ps-sliced --steps 12 --warmup 3 --rounds 1 --check-steps 0`` on loopback, whose
  ``ps-sliced`` step is bound by its Python threads' handling of 512 slice messages a step.

Printed per case: the copy rates and the two step times, and each as a slowdown against alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SPIN = """
import sys, time
busy, period = float(sys.argv[1]), 0.02 / max(float(sys.argv[1]), 1e-3)
while True:
    end = time.perf_counter() + (0.02 if busy < 1 else 1.0)
    while time.perf_counter() < end:
        pass
    if busy < 1:
        time.sleep(period - 0.02)
"""

COPY = """
import statistics, time, torch
torch.set_num_threads(1)
n = 1 << 25
src, dst = torch.randn(n), torch.empty(n)
dst.copy_(src)
times, end = [], time.time() + 3
while time.time() < end:
    start = time.perf_counter(); dst.copy_(src); times.append(time.perf_counter() - start)
print(n * 4 / statistics.median(times))
"""

BENCH = ["--model", "resnet50", "--compute", "emulated", "--np", "2", "--strategies", "allreduce,ps-sliced",
         "--steps", "12", "--warmup", "3", "--rounds", "1", "--check-steps", "0"]


def measure() -> dict:
    copies = [subprocess.Popen([sys.executable, "-c", COPY], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    rates = [float(p.communicate()[0]) for p in copies]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        subprocess.run([sys.executable, "-m", "gradsync.cli", "bench", *BENCH, "--json", out,
                        "--out", os.path.join(tmp, "bench")], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            steps = {r["strategy"]: r["step_s"] for r in json.load(f)}
    return {"copy_GBps": statistics.fmean(rates) / 1e9, **steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spinners", type=int, default=2)
    parser.add_argument("--duty", type=float, default=0.5, help="share of the time a spinner keeps its core busy")
    args = parser.parse_args()
    if not 0 < args.duty < 1:
        parser.error(f"--duty must be between 0 and 1 (exclusive), got {args.duty:g}")
    found = {}
    for case, duty in (("alone", None), (f"beside {args.spinners} at {args.duty:g} duty", args.duty),
                       (f"beside {args.spinners} always spinning", 1.0)):
        spinners = [] if duty is None else [subprocess.Popen([sys.executable, "-c", SPIN, str(duty)])
                                            for _ in range(args.spinners)]
        try:
            found[case] = measure()
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    alone = found["alone"]
    for case, got in found.items():
        print(f"{case}: copies {got['copy_GBps']:.2f} GB/s a process (x{alone['copy_GBps'] / got['copy_GBps']:.2f} "
              f"slower), ps-sliced step {got['ps-sliced'] * 1e3:.1f} ms (x{got['ps-sliced'] / alone['ps-sliced']:.2f}), "
              f"allreduce step {got['allreduce'] * 1e3:.1f} ms (x{got['allreduce'] / alone['allreduce']:.2f})", flush=True)


if __name__ == "__main__":
    main()
