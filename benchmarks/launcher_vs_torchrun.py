"""Wall time of one training script under ``gradsync run`` and under ``torchrun``, side by side.

    python benchmarks/launcher_vs_torchrun.py --runs 5 -- --strategy allreduce --steps 20

Each run starts the script from scratch (interpreter, imports, rendezvous, training, exit) with
``-np N`` workers under either launcher, alternating the two so drift on a shared machine hits
both alike. Neither run sets ``OMP_NUM_THREADS``: each launcher chooses it (torchrun: 1; gradsync:
cores / local workers). Prints every wall time, the medians and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(cmd: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs per launcher (default 5)")
    parser.add_argument("--np", type=int, default=2, help="workers (default 2)")
    parser.add_argument("--script", default="examples/train.py", help="the script (default examples/train.py)")
    parser.add_argument("args", nargs="*", help="the script's arguments (after --)")
    args = parser.parse_args()
    if args.runs < 1 or args.np < 1:
        parser.error("--runs and --np must be >= 1")
    bin_dir = os.path.dirname(sys.executable)
    script = [sys.executable, args.script, *args.args]
    launchers = {
        "gradsync run": [os.path.join(bin_dir, "gradsync"), "run", "-np", str(args.np), "--", *script],
        "torchrun": [os.path.join(bin_dir, "torchrun"), "--nproc-per-node", str(args.np), args.script, *args.args],
    }
    times: dict[str, list[float]] = {name: [] for name in launchers}
    for k in range(args.runs):
        for name, cmd in launchers.items():
            times[name].append(timed(cmd))
            print(f"run {k + 1}: {name:<13} {times[name][-1]:6.2f} s", flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:<13} median {median:6.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times[name])})")
    print(f"gradsync run / torchrun: {medians['gradsync run'] / medians['torchrun']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
