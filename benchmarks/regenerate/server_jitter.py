"""How much a ``hybrid`` row server's update varies from step to step, traced in an emulated run.

    sudo python benchmarks/regenerate/server_jitter.py [--np 2] [--steps 20] [--matrix gradsync/simulate/validation.json]

Runs ``gradsync bench`` with ``hybrid`` on ``lstm-lm:cpu`` (the validation's shape; root needed for
the emulated cluster) with ``--trace``, at the dilation the validation matrix records that shape at
(``simulator_matrix.dilation``: two cores' time per rank by default, ``--rank-cores``), and reads
each server's updates off its ``server`` track: per step, the time the server spent updating its
partitions of every table. Printed per server: the mean and the coefficient of variation (standard
deviation over mean) of the measured steps; then the mean over the steps of the slowest server's
update against the mean of all, beside what the simulator's order statistics give for that
coefficient (``Host.jitter``: a pull waits for the slowest of N servers, ``1 + jitter * E[max of N
standard normals]`` times the mean). ``--matrix`` keeps the pooled coefficient (the root mean square
of the servers') with the validation matrix's host rates, as ``jitter`` for that many ranks (the
replay takes a record's from the largest count measured up to its own), with the command and what it
measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def command(np: int, steps: int, trace: str, rank_cores: float = 2.0) -> list[str]:
    from simulator_matrix import dilation  # the matrix's rule, beside this script

    return ["gradsync", "bench", "--model", "lstm-lm:cpu", "--compute", "emulated:flops:11.11tflops", "--np", str(np),
            "--net", "1gbit", "--dilation", dilation(np, "1gbit", 0, rank_cores=rank_cores), "--strategies", "hybrid",
            "--steps", str(steps), "--warmup", "3",
            "--rounds", "1", "--check-steps", "0", "--trace", trace]


def server_steps(events: list[dict], warmup: int) -> dict[int, list[float]]:
    """Each server's update time per step (its ``update of table K`` spans, one run of K = 0, 1, ...
    per step), after the first ``warmup`` steps."""
    per: dict[int, list[float]] = {}
    for pid in sorted({e["pid"] for e in events}):
        spans = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == pid and e.get("tid") == 4
                        and e["name"].startswith("update of table ")), key=lambda e: e["ts"])
        steps: list[float] = []
        for e in spans:
            table = int(e["name"].split()[3])
            if table == 0 or not steps:
                steps.append(0.0)
            steps[-1] += e["dur"] / 1e6
        if steps:
            per[pid] = steps[warmup:]
    return per


def main() -> None:
    from gradsync.simulate.worker import expected_max_normal

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank-cores", type=float, default=2.0,
                        help="cores' time per rank, as simulator_matrix.py's (default 2)")
    parser.add_argument("--matrix", help="keep the pooled coefficient with this validation matrix's host rates")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        argv = command(args.np, args.steps, trace, args.rank_cores)
        subprocess.run([sys.executable, "-m", "gradsync.cli", *argv[1:], "--out", os.path.join(tmp, "out")], check=True,
                       stdout=subprocess.DEVNULL)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    per = server_steps(events, warmup=3)
    cvs = []
    for pid, times in per.items():
        mean = statistics.fmean(times)
        cvs.append(statistics.stdev(times) / mean)
        print(f"server on rank {pid}: {len(times)} steps, mean {mean * 1e3:.1f} ms, coefficient of variation {cvs[-1]:.2f}")
    jitter = (sum(c * c for c in cvs) / len(cvs)) ** 0.5
    steps = min(len(t) for t in per.values())
    slowest = statistics.fmean(max(t[i] for t in per.values()) for i in range(steps))
    mean = statistics.fmean(x for t in per.values() for x in t[:steps])
    predicted = 1 + jitter * expected_max_normal(len(per))
    print(f"pooled coefficient of variation {jitter:.2f}; the slowest server's update per step: {slowest / mean:.3f}x "
          f"the mean (order statistics of {len(per)} normals at that coefficient: {predicted:.3f}x)")
    if args.matrix:
        with open(args.matrix) as f:
            matrix = json.load(f)
        # kept per number of ranks: the more share the two cores, the more an update varies
        matrix["host_rates"].setdefault("jitter", {})[str(args.np)] = jitter
        matrix.setdefault("jitter_runs", {})[str(args.np)] = {
            "command": " ".join(argv[:-2]) + " --trace F", "coefficients": cvs,
            "slowest_over_mean": slowest / mean, "predicted": predicted}
        with open(args.matrix, "w") as f:
            json.dump(matrix, f, indent=1)


if __name__ == "__main__":
    main()
