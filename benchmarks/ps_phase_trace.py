"""Where a traced co-located ``ps`` run's step goes, phase by phase, beside the simulator.

    gradsync bench --model resnet50 --compute emulated --np 4 --net 1gbit --dilation 2 \\
        --strategies ps --steps 12 --warmup 3 --rounds 1 --check-steps 0 --trace T.json
    python benchmarks/ps_phase_trace.py T.json --model resnet50 --np 4 --net 1gbit --dilation 2

Each worker of co-located ``ps`` is also the owner of a share of the parameters. In every step
it runs its backward (pushing each group of gradients to its owner as it is ready), waits until
the other workers' pushes of its own share are in, updates that share, posts the receives of its
pulls and answers the other workers' pulls, and the step ends once its own pulls are in. For each
worker's measured step (after ``--warmup``) this prints when, from the step's start, the
backward ended, the pushes of its share were all in (the last receive's end: the owner waits on
them together), it posted its pulls' receives (its answers follow) and the step ended, as medians
over every worker's steps; then, per step, how far apart the workers began the step and began
their answers, and the time from the latest answer to the step's last end. The same cell is
simulated (on the host of the validation matrix's record, where it has one), whose workers are in
lock step. Times are emulated: the trace's wall time over ``--dilation``.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

PHASES = ("backward ends", "pushes of its share in", "answers begin", "step ends")


def measured(path: str, dilation: float, warmup: int) -> tuple[dict, dict]:
    """Per phase, the median time from a worker's step start over every worker's measured steps; and
    per step (every worker traced in it), the spreads named in the module's docstring, each a list."""
    from gradsync.errors import ConfigError
    from gradsync.trace import load_events

    try:
        events = load_events(path)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    steps, backward = defaultdict(dict), defaultdict(list)
    pushes_in, pulls_posted = defaultdict(list), defaultdict(list)
    for e in events:
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
        raise SystemExit(f"{path}: no traced ps steps after {warmup} warm-up steps (a --trace of gradsync bench "
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
        raise SystemExit(f"{path}: its ps steps lack the traced backward, pushes or pulls (co-located ps only)")
    return {phase: statistics.median(v) for phase, v in phases.items()}, dict(spread)


def simulated(model: str, np: int, rate_bps: float, steps: int, warmup: int) -> tuple[dict, str]:
    """The same phases of the simulator's cell, from one measured step of its timeline."""
    from gradsync.simulate import simulate
    from gradsync.simulate.validate import cell_host, cell_network

    host, work, source = cell_host(model, np, rate_bps, "ps")
    record = simulate("ps", work, np, cell_network(model, np, rate_bps, "ps"), host=host, steps=steps, warmup=warmup, trace=True)
    a, b = record["step_ends"][warmup - 1:warmup + 1]
    last = defaultdict(float)
    first_pull = b
    for lane, what, start, stop in record["timeline"]:
        if a <= start < b:
            kind = what.split(" ")[0]
            last[kind] = max(last[kind], stop - a)
            if kind == "pull":
                first_pull = min(first_pull, start)
    times = (last["backward"], last["push"], first_pull - a, b - a)
    return dict(zip(PHASES, times)), source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a gradsync bench --trace file of a co-located ps run")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--np", type=int, required=True, help="the run's workers")
    parser.add_argument("--net", required=True, help="the run's link rate, e.g. 1gbit")
    parser.add_argument("--dilation", type=float, required=True, help="the run's --dilation")
    parser.add_argument("--warmup", type=int, default=3, help="the run's warm-up steps (default 3)")
    args = parser.parse_args()
    if not args.dilation > 0:
        parser.error(f"--dilation must be > 0, got {args.dilation:g}")
    from gradsync.cluster import parse_rate

    phases, spread = measured(args.trace, args.dilation, args.warmup)
    model, source = simulated(args.model, args.np, parse_rate(args.net), 8, args.warmup)
    print(f"{'from a step start (ms, emulated)':34s} {'measured':>9s} {'simulated':>9s}")
    for phase in PHASES:
        print(f"{phase:34s} {phases[phase] * 1e3:9.1f} {model[phase] * 1e3:9.1f}")
    print(f"simulated on {source}; its workers are in lock step")
    for what, values in spread.items():
        print(f"{what:34s} median {statistics.median(values) * 1e3:6.1f} ms, {min(values) * 1e3:.1f}-"
              f"{max(values) * 1e3:.1f} over {len(values)} steps")


if __name__ == "__main__":
    main()
