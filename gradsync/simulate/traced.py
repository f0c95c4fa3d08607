"""A traced emulated run's steps beside the simulator's cell: where the time of a step goes.

Reads a ``gradsync bench --trace`` file and answers one of two questions, each beside the same
cell simulated on the host of the validation matrix's record of it (where it has one):

- ``link``: how busy a ``p3`` or ``ps-sliced`` run kept each worker's downlink through its step.
  Every slice message a worker receives (a push it serves, an answer it trains with) is one span
  of the trace, ending when it was taken; binned by its time from the start of the worker's step,
  the bytes give the rate the downlink carried in each part of the step, pushes and answers apart.
  Below the table: each one's step, the time per step its downlink carried nothing (the step less
  the bytes over the link rate), and how far apart the run's workers began each step's backward.
- ``phases``: when, from a co-located ``ps`` worker's step start, its backward ended, the pushes
  of its share were all in, it posted its pulls' receives (its answers follow) and the step ended,
  as medians over every worker's measured steps; then per step how far apart the workers began
  the step and their answers, and the time from the latest answer to the step's last end.

The simulated workers are in lock step. Times are emulated: the trace's wall time over the run's
``--dilation``. Example (docs/mechanisms.md quotes what these commands give)::

    gradsync bench --model resnet50 --compute emulated --np 4 --net 1gbit --dilation 2 \\
        --strategies p3 --steps 12 --warmup 3 --rounds 1 --check-steps 0 --trace T.json
    python -m gradsync.simulate.traced link T.json --np 4 --net 1gbit --dilation 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict

PHASES = ("backward ends", "pushes of its share in", "answers begin", "step ends")
"""The phases of a co-located ``ps`` worker's step that :func:`ps_phases` times."""


def _events(path: str) -> list[dict]:
    from gradsync.trace import load_events

    return load_events(path)


def slice_downlink(path: str, strategy: str, dilation: float, warmup: int,
                   bin_s: float) -> tuple[dict, float, float, list[float]]:
    """A traced ``p3`` or ``ps-sliced`` run's received slices: the mean bytes per bin of ``bin_s``
    emulated seconds from a step's start, keyed ``(bin, "push" | "pull")``, over every worker's
    steps after ``warmup``; their median step and bytes received per step; and per step how far
    apart the workers began its ``backward()`` (the latest less the earliest)."""
    from gradsync.errors import ConfigError

    steps, received, backward = defaultdict(list), defaultdict(list), defaultdict(list)
    for e in _events(path):
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
        raise ConfigError(f"{path}: no traced {strategy} steps with received slices (a --trace of gradsync bench "
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


def simulated_slice_downlink(model: str, np: int, rate_bps: float, strategy: str, steps: int, warmup: int,
                             bin_s: float) -> tuple[dict, float, float, str]:
    """The simulator's cell binned as :func:`slice_downlink` bins a run, and the host it ran on, in words."""
    from gradsync.simulate import simulate
    from gradsync.simulate.validate import cell_host, cell_network

    host, work, source = cell_host(model, np, rate_bps, strategy)
    record = simulate(strategy, work, np, cell_network(model, np, rate_bps, strategy), host=host, steps=steps,
                      warmup=warmup, trace=True)
    ends = record["step_ends"]
    spans = [(stop, what) for lane, what, start, stop in record["timeline"] if lane == "network"]
    # every message is the same size (P3's wire: the largest slice's), the share of it this worker's links carry
    nbytes = record["bytes_per_step"] * len(ends) / len(spans)
    received = {0: [(stop, nbytes, "push" if what.startswith("push") else "pull") for stop, what in spans]}
    windows = [(0, a, b) for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    return (*_binned(windows, received, 1.0, bin_s), source)


def ps_phases(path: str, dilation: float, warmup: int) -> tuple[dict, dict]:
    """A traced co-located ``ps`` run: per phase of :data:`PHASES`, the median time from a worker's
    step start over every worker's steps after ``warmup``; and per step (every worker traced in it)
    how far apart the workers began the step and their answers, and the time from the latest answer
    to the step's last end, each a list."""
    from gradsync.errors import ConfigError

    steps, backward = defaultdict(dict), defaultdict(list)
    pushes_in, pulls_posted = defaultdict(list), defaultdict(list)
    for e in _events(path):
        name, ph = e.get("name", ""), e.get("ph")
        if ph == "X" and name.startswith("ps step "):
            steps[int(name.rsplit(" ", 1)[1])][e["pid"]] = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        elif ph == "X" and name == "backward()":
            backward[e["pid"]].append((e["ts"] + e["dur"]) / 1e6)
        elif " from rank " in name and ph == "e" and name.startswith("push "):
            pushes_in[e["pid"]].append(e["ts"] / 1e6)  # a push of this rank's share, received
        elif " from rank " in name and ph == "b" and name.startswith("pull "):
            pulls_posted[e["pid"]].append(e["ts"] / 1e6)  # a receive of one of its pulls, posted
    measured_steps = sorted(steps)[warmup:]
    if not measured_steps:
        raise ConfigError(f"{path}: no traced ps steps after {warmup} warm-up steps (a --trace of gradsync bench "
                          f"--strategies ps)")
    phases, spread = defaultdict(list), defaultdict(list)
    for n in measured_steps:
        at = {}
        for pid, (a, b) in steps[n].items():
            inside = lambda ts: [t for t in ts if a <= t <= b]  # noqa: E731
            times = [max(inside(backward[pid]), default=None), max(inside(pushes_in[pid]), default=None),
                     min(inside(pulls_posted[pid]), default=None), b]
            if None in times:
                continue
            for phase, t in zip(PHASES, times):
                phases[phase].append((t - a) / dilation)
            at[pid] = (a, times[2], b)
        if len(at) == len(steps[n]) > 1:
            starts, answers, ends = zip(*at.values())
            spread["steps begin apart"].append((max(starts) - min(starts)) / dilation)
            spread["answers begin apart"].append((max(answers) - min(answers)) / dilation)
            spread["last answer to the step's last end"].append((max(ends) - max(answers)) / dilation)
    if not phases:
        raise ConfigError(f"{path}: its ps steps lack the traced backward, pushes or pulls (co-located ps only)")
    return {phase: statistics.median(v) for phase, v in phases.items()}, dict(spread)


def simulated_ps_phases(model: str, np: int, rate_bps: float, steps: int, warmup: int) -> tuple[dict, str]:
    """The phases of :data:`PHASES` in one measured step of the simulator's co-located ``ps`` cell,
    and the host it ran on, in words."""
    from gradsync.simulate import simulate
    from gradsync.simulate.validate import cell_host, cell_network

    host, work, source = cell_host(model, np, rate_bps, "ps")
    record = simulate("ps", work, np, cell_network(model, np, rate_bps, "ps"), host=host, steps=steps, warmup=warmup,
                      trace=True)
    a, b = record["step_ends"][warmup - 1:warmup + 1]
    last = defaultdict(float)
    first_pull = b
    for lane, what, start, stop in record["timeline"]:
        if a <= start < b:
            kind = what.split(" ")[0]
            last[kind] = max(last[kind], stop - a)
            if kind == "pull":
                first_pull = min(first_pull, start)
    return dict(zip(PHASES, (last["backward"], last["push"], first_pull - a, b - a))), source


def _print_link(args, rate_bps: float) -> None:
    bin_s = args.bin_ms / 1e3
    *sim, source = simulated_slice_downlink(args.model, args.np, rate_bps, args.strategy, 15, args.warmup, bin_s)
    *run, spread = slice_downlink(args.trace, args.strategy, args.dilation, args.warmup, bin_s)
    runs = [("measured", *run), ("simulated", *sim)]
    width = max(j for _, bins, _, _ in runs for j, _ in bins) + 1
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


def _print_phases(args, rate_bps: float) -> None:
    phases, spread = ps_phases(args.trace, args.dilation, args.warmup)
    model, source = simulated_ps_phases(args.model, args.np, rate_bps, 8, args.warmup)
    print(f"{'from a step start (ms, emulated)':34s} {'measured':>9s} {'simulated':>9s}")
    for phase in PHASES:
        print(f"{phase:34s} {phases[phase] * 1e3:9.1f} {model[phase] * 1e3:9.1f}")
    print(f"simulated on {source}; its workers are in lock step")
    for what, values in spread.items():
        print(f"{what:34s} median {statistics.median(values) * 1e3:6.1f} ms, {min(values) * 1e3:.1f}-"
              f"{max(values) * 1e3:.1f} over {len(values)} steps")


def main(argv: list[str] | None = None) -> int:
    from gradsync.errors import ConfigError

    parser = argparse.ArgumentParser(prog="python -m gradsync.simulate.traced", description=__doc__.split("\n\n")[0])
    questions = parser.add_subparsers(dest="question", required=True)
    link = questions.add_parser("link", help="a p3 or ps-sliced run's downlink through the step, beside the model")
    phases = questions.add_parser("phases", help="a co-located ps run's phases from each step's start, beside the model")
    for p in (link, phases):
        p.add_argument("trace", help="a gradsync bench --trace file")
        p.add_argument("--dilation", type=float, default=1.0, help="the run's --dilation (default 1)")
        p.add_argument("--model", default="resnet50", help="the run's model (default resnet50)")
        p.add_argument("--np", type=int, required=True, help="the run's workers")
        p.add_argument("--net", required=True, help="the run's link rate, e.g. 1gbit")
        p.add_argument("--warmup", type=int, default=3, help="the run's --warmup (default 3)")
    link.add_argument("--strategy", default="p3", choices=["p3", "ps-sliced"])
    link.add_argument("--bin-ms", type=float, default=100.0, help="bin width in emulated ms (default 100)")
    args = parser.parse_args(argv)
    if not args.dilation > 0 or not getattr(args, "bin_ms", 1.0) > 0:
        parser.error("--dilation and --bin-ms must be > 0")
    try:
        from gradsync.cluster import parse_rate

        rate_bps = parse_rate(args.net)
        if args.question == "link":
            _print_link(args, rate_bps)
        else:
            _print_phases(args, rate_bps)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from gradsync.fastexit import exit_now

    exit_now(main())
