"""``gradsync demo``: why the strategies differ, in about a minute.

On one machine's loopback every strategy moves its bytes at memory speed, so strategies measure
within noise of each other there. What separates them is a link slower than the compute, which is
what a cluster has. The demo shows that twice:

1. **Emulated** (root, with iproute2): ResNet-50 on two emulated hosts whose GPUs follow a measured
   V100 profile, joined by 1 Gbit/s links, under ``ddp`` (PyTorch's DDP), ``allreduce`` and
   ``casync-ring`` (HiPress's compressed ring, onebit): a real ``gradsync bench`` run, with each
   strategy's physical bound (compute time against the fewest bytes its algorithm must move).
2. **Simulated** (``gradsync simulate``, anywhere): the same model on 8 hosts at 1 and 10 Gbit/s
   under six strategies, from the same profile and each strategy's own schedule.

Without root the emulated part is skipped, and the demo says so. Exactness against a
single-process reference is what ``make test`` checks; ``gradsync bench`` checks it too.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from gradsync.errors import ConfigError

EMULATED = ["bench", "--model", "resnet50", "--compute", "emulated", "--np", "2", "--net", "1gbit",
            "--strategies", "ddp,allreduce,casync-ring", "--steps", "8", "--warmup", "2", "--rounds", "1",
            "--check-steps", "0"]
SIMULATED = ["simulate", "--model", "resnet50", "--np", "8", "--net", "1gbit,10gbit",
             "--strategies", "ddp,allreduce,ps,p3,allreduce-priority,casync-ring"]
WHY = """\
Why they differ: at 1 Gbit/s a ResNet-50 step moves ~100 MB per worker, so the link, not the GPU,
sets the pace, and a strategy can at best reach its bound (compute against its fewest bytes).
casync-ring sends 1/32 of the bytes (onebit), which raises its bound several-fold, at the cost of
a lossy gradient. Where communication is shorter than compute (10 Gbit/s), overlap decides: p3
and allreduce-priority send the layers the next forward pass needs first and start it early.
Pick with `gradsync advise --model MODEL --np N --net RATE`; measure on your cluster with
`gradsync bench --machine NAME`."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="why the strategies differ: an emulated and a simulated comparison",
                              description=__doc__)
    p.add_argument("--out", default="bench-out", help="folder for the emulated run's table, chart and JSON")
    p.add_argument("--simulated-only", action="store_true", help="skip the emulated cluster even where it runs")
    p.set_defaults(handler=main)


def emulation_available() -> str | None:
    """None where this process can emulate a cluster; else why not."""
    from gradsync.cluster import netns

    try:
        netns.require_privileges()
    except ConfigError as exc:
        return str(exc)
    return None


def _gradsync(argv: list[str]) -> int:
    return subprocess.call([sys.executable, "-m", "gradsync.cli", *argv])


def main(args) -> int:
    started = time.monotonic()
    why_not = "--simulated-only" if args.simulated_only else emulation_available()
    if why_not is None:
        print("== Emulated: ResNet-50, 2 hosts (V100 profile), 1 Gbit/s links, a real gradsync bench run ==",
              flush=True)
        os.makedirs(args.out, exist_ok=True)
        code = _gradsync([*EMULATED, "--out", args.out, "--json", os.path.join(args.out, "bench.json")])
        if code != 0:
            return code
    else:
        print(f"== No emulated cluster here ({why_not}): the comparison below is simulated only ==", flush=True)
    print("\n== Simulated (gradsync simulate): ResNet-50 on 8 hosts at 1 and 10 Gbit/s ==", flush=True)
    code = _gradsync(SIMULATED)
    print(f"\n{WHY}\n(demo took {time.monotonic() - started:.0f} s)")
    return code
