"""How busy a traced ``p3`` or ``ps-sliced`` run kept each worker's downlink through its step, beside the simulator.

    gradsync bench --model resnet50 --compute emulated --np 4 --net 1gbit --dilation 2 \\
        --strategies p3 --steps 12 --warmup 3 --rounds 1 --check-steps 0 --trace T.json
    python benchmarks/slice_link_trace.py T.json --model resnet50 --np 4 --net 1gbit --dilation 2

Every slice message a worker receives (a push it serves, an answer it trains with) is one span of
the trace, ending when it was taken. Binned by its time from the start of the worker's step (the
measured steps after ``--warmup``, every worker), the bytes give the rate the downlink carried in
each part of the step, pushes and answers apart. The same cell is then simulated (on the host of
the validation matrix's record of that strategy and shape, where it has one) and binned alike.
Below the table: each one's step, the time per step its downlink carried nothing (the step less
the bytes over the link rate), and how far apart the run's workers began each step's backward
(the simulated workers are in lock step). Times are emulated: the trace's wall time over
``--dilation``.
"""
from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict


def measured(path: str, strategy: str, dilation: float, warmup: int,
             bin_s: float) -> tuple[dict, float, float, list[float]]:
    """Mean bytes per bin (by kind) over every worker's measured steps, their median step and bytes per
    step, and per step how far apart the workers began its ``backward()`` (the latest less the earliest)."""
    from gradsync.errors import ConfigError
    from gradsync.trace import load_events

    try:
        events = load_events(path)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    steps, received, backward = defaultdict(list), defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e["name"].startswith(f"{strategy} step "):
            steps[e["pid"]].append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
        elif e["name"] == "backward()":
            backward[e["pid"]].append(e["ts"] / 1e6)
        elif e["name"].startswith(("push slice ", "pull slice ")) and "bytes" in e.get("args", {}):
            received[e["pid"]].append(((e["ts"] + e["dur"]) / 1e6, e["args"]["bytes"], e["name"][:4]))
    windows = [(pid, a, b) for pid, mine in steps.items() for a, b in sorted(mine)[warmup:]]
    if not windows or not received:
        raise SystemExit(f"{path}: no traced {strategy} steps with received slices (a --trace of gradsync bench "
                         f"--strategies {strategy}, after {warmup} warm-up steps)")
    starts = [[next((t for t in backward[pid] if a <= t < b), None) for a, b in sorted(mine)[warmup:]]
              for pid, mine in steps.items()]
    spread = [(max(s) - min(s)) / dilation for s in zip(*starts) if None not in s]
    return (*_binned(windows, received, dilation, bin_s), spread)


def _binned(windows, received, dilation: float, bin_s: float) -> tuple[dict, float, float]:
    bins, totals = defaultdict(list), []
    for pid, a, b in windows:
        count, total = Counter(), 0.0
        for t, nbytes, kind in received[pid]:
            if a <= t < b:
                count[(int((t - a) / dilation // bin_s), kind)] += nbytes
                total += nbytes
        totals.append(total)
        for j in range(int((b - a) / dilation // bin_s) + 1):
            for kind in ("push", "pull"):
                bins[(j, kind)].append(count[(j, kind)])
    steps = [(b - a) / dilation for _, a, b in windows]
    return {key: statistics.fmean(v) for key, v in bins.items()}, statistics.median(steps), statistics.median(totals)


def simulated(model: str, np: int, rate_bps: float, strategy: str, steps: int, warmup: int, bin_s: float):
    """The simulator's cell, binned as :func:`measured` bins the run (the host of the matrix's record, if any)."""
    from gradsync.simulate import simulate
    from gradsync.simulate.validate import cell_host, cell_network

    host, work, source = cell_host(model, np, rate_bps, strategy)
    record = simulate(strategy, work, np, cell_network(model, np, rate_bps, strategy), host=host, steps=steps, warmup=warmup, trace=True)
    ends = record["step_ends"]
    spans = [(stop, what) for lane, what, start, stop in record["timeline"] if lane == "network"]
    # every message is the same size (P3's wire: the largest slice's), the share of it this worker's links carry
    nbytes = record["bytes_per_step"] * len(ends) / len(spans)
    received = {0: [(stop, nbytes, "push" if what.startswith("push") else "pull") for stop, what in spans]}
    windows = [(0, a, b) for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    return (*_binned(windows, received, 1.0, bin_s), source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a gradsync bench --trace file of a p3 or ps-sliced run")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--np", type=int, required=True, help="the run's workers")
    parser.add_argument("--net", required=True, help="the run's link rate, e.g. 1gbit")
    parser.add_argument("--strategy", default="p3", choices=["p3", "ps-sliced"])
    parser.add_argument("--dilation", type=float, default=1.0, help="the run's --dilation (default 1)")
    parser.add_argument("--warmup", type=int, default=3, help="the run's --warmup (default 3)")
    parser.add_argument("--bin-ms", type=float, default=100.0, help="bin width in emulated ms (default 100)")
    args = parser.parse_args()
    from gradsync.cluster import parse_rate

    if args.dilation <= 0 or args.bin_ms <= 0:
        parser.error("--dilation and --bin-ms must be > 0")
    rate_bps = parse_rate(args.net)
    bin_s = args.bin_ms / 1e3
    *sim, source = simulated(args.model, args.np, rate_bps, args.strategy, 15, args.warmup, bin_s)
    *run, spread = measured(args.trace, args.strategy, args.dilation, args.warmup, bin_s)
    runs = [("measured", *run), ("simulated", *sim)]
    width = max(j for bins, _, _ in [r[1:] for r in runs] for j, _ in bins) + 1
    print(f"{'ms into the step':>17}" + "".join(f"{name + ' push/answers/all Gbit/s':>40}" for name, *_ in runs))
    for j in range(width):
        cells = []
        for _, bins, _, _ in runs:
            push, pull = (bins.get((j, kind), 0.0) * 8 / bin_s / 1e9 for kind in ("push", "pull"))
            cells.append(f"{push:12.2f}{pull:9.2f}{push + pull:9.2f}" if (j, "push") in bins else " " * 30)
        print(f"{j * args.bin_ms:7.0f}-{(j + 1) * args.bin_ms:<7.0f}  " + "".join(f"{c:>40}" for c in cells))
    for name, _, step_s, nbytes in runs:
        idle = step_s - nbytes * 8 / rate_bps
        print(f"{name}: step {step_s * 1e3:.1f} ms, {nbytes / 1e6:.1f} MB received, downlink idle {idle * 1e3:.1f} ms a step")
    print(f"simulated on {source}")
    print("measured: the workers' backward() starts, latest less earliest, per step (ms): "
          + ", ".join(f"{x * 1e3:.1f}" for x in spread) + (f"; mean {statistics.fmean(spread) * 1e3:.1f}" if spread else ""))


if __name__ == "__main__":
    main()
