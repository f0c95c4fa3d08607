"""Record the emulated runs that ``gradsync simulate --validate`` replays.

    python benchmarks/simulator_matrix.py --out gradsync/simulate/validation.json

Runs one ``gradsync bench --compute emulated`` per (model, workers, link rate) on the emulated
cluster (root needed), with every simulated strategy side by side, and writes the records, each
group with its exact command, as the validation matrix. ``--groups`` picks a subset by index.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

STRATEGIES = "ddp,allreduce,ps,p3,ps-sliced,allreduce-priority"
GROUPS = [  # (model, workers, rate)
    ("resnet50", 2, "1gbit"), ("resnet50", 4, "1gbit"), ("resnet50", 2, "10gbit"), ("resnet50", 4, "10gbit"),
    ("vgg19", 2, "1gbit"), ("vgg19", 2, "10gbit"),
]


def command(model: str, np: int, rate: str, out: str) -> list[str]:
    return ["gradsync", "bench", "--model", model, "--compute", "emulated", "--np", str(np), "--net", rate,
            "--dilation", "auto", "--strategies", STRATEGIES, "--steps", "12", "--warmup", "3", "--rounds", "1",
            "--check-steps", "0", "--json", out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--groups", default=",".join(str(i) for i in range(len(GROUPS))))
    args = parser.parse_args()
    from gradsync.simulate.validate import calibrate

    groups, host_rates = [], None
    if os.path.exists(args.out):  # keep the groups already recorded
        with open(args.out) as f:
            kept = json.load(f)
        groups, host_rates = kept["groups"], kept.get("host_rates")
    host_rates = host_rates or calibrate()  # this machine's, where the runs' host work ran
    for index in (int(i) for i in args.groups.split(",")):
        model, np, rate = GROUPS[index]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "records.json")
            argv = command(model, np, rate, out)
            started = time.monotonic()
            subprocess.run([sys.executable, "-m", "gradsync.cli", *argv[1:]], check=True)
            with open(out) as f:
                records = json.load(f)
        shown = " ".join(argv[:-2])  # without the temporary --json
        groups = [g for g in groups if g["command"] != shown]
        groups.append({"command": shown, "seconds": round(time.monotonic() - started), "records": records})
        with open(args.out, "w") as f:
            json.dump({"cores": os.cpu_count(), "latency_s": 50e-6, "host_rates": host_rates, "groups": groups},
                      f, indent=1)
        print(f"group {index} ({model}, {np} workers, {rate}) recorded", flush=True)


if __name__ == "__main__":
    main()
