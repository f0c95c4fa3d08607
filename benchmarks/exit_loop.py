"""Run a finished training script many times and count the runs that did not exit cleanly.

    python benchmarks/exit_loop.py --runs 200 --strategies allreduce,ps,p3,casync-ring

Each run is ``gradsync run -np 2 -- python examples/train.py --strategy S --steps N`` (strategies in
turn) with ``PYTHONFAULTHANDLER=1``, so a rank that aborts (SIGABRT at interpreter exit) prints every
thread's Python stack: the thread that was inside a torch call when the interpreter finalized. The
summary gives the count per exit code and the stack of each failure.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="runs in all (default 200)")
    parser.add_argument("--strategies", default="allreduce,ps,p3,casync-ring",
                        help="comma-separated, used in turn (default allreduce,ps,p3,casync-ring)")
    parser.add_argument("--np", type=int, default=2, help="workers per run (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    parser.add_argument("--model", default="toy", help="model of examples/train.py (default toy)")
    args = parser.parse_args()
    if args.runs < 1 or args.np < 1 or args.steps < 1:
        parser.error("--runs, --np and --steps must be >= 1")
    strategies = [s for s in args.strategies.split(",") if s]
    gradsync = os.path.join(os.path.dirname(sys.executable), "gradsync")
    codes: collections.Counter = collections.Counter()
    failures = []
    start = time.monotonic()
    for k in range(args.runs):
        strategy = strategies[k % len(strategies)]
        cmd = [gradsync, "run", "-np", str(args.np), "--", sys.executable, os.path.join(ROOT, "examples", "train.py"),
               "--strategy", strategy, "--steps", str(args.steps), "--model", args.model]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                             cwd=ROOT, timeout=300)
        codes[(strategy, run.returncode)] += 1
        if run.returncode != 0:
            failures.append((k, strategy, run.returncode, run.stderr[-4000:]))
            print(f"run {k}: {strategy} exited {run.returncode}", flush=True)
    elapsed = time.monotonic() - start
    for k, strategy, code, stderr in failures:
        print(f"--- run {k} ({strategy}, exit {code}) ---\n{stderr}")
    print(f"{args.runs} runs in {elapsed:.0f} s; exit codes per strategy:")
    for (strategy, code), count in sorted(codes.items()):
        print(f"  {strategy:<14} exit {code}: {count}")
    print(f"{len(failures)} of {args.runs} runs failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
