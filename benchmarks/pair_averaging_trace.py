"""Which of a traced ``pair-averaging`` run's pull requests waited behind a model on their connection.

    gradsync bench --model resnet50 --compute emulated --np 4 --net 1gbit --dilation 2 \\
        --strategies pair-averaging --steps 12 --warmup 3 --rounds 1 --check-steps 0 --trace T.json
    python benchmarks/pair_averaging_trace.py T.json --dilation 2

Gloo sends the messages of one pair of ranks in order, so a worker's pull request to a peer
cannot arrive while its own server thread is still sending that peer a model. For every request
(``pull request to worker P`` on worker R) this prints whether R's server was sending P a model
(``model for worker P``) when the request was posted, and then how long the request waited for that
model to finish; the other requests' times (a peer's server busy with someone else) beside them.
Seconds are emulated: the trace's wall time divided by ``--dilation``.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict


def spans(path: str) -> dict[int, list[tuple[float, float, str]]]:
    """Each worker's communication spans (the trace's async begin/end pairs), in seconds."""
    from gradsync.errors import ConfigError
    from gradsync.trace import load_events

    try:
        events = load_events(path)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    began, out = {}, defaultdict(list)
    for e in events:
        if e.get("ph") == "b":
            began[(e["pid"], e["id"])] = e
        elif e.get("ph") == "e" and (e["pid"], e["id"]) in began:
            b = began.pop((e["pid"], e["id"]))
            out[e["pid"]].append((b["ts"] / 1e6, e["ts"] / 1e6, b["name"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a gradsync bench --trace file of a pair-averaging run")
    parser.add_argument("--dilation", type=float, default=1.0, help="the run's --dilation (default 1)")
    args = parser.parse_args()
    if args.dilation <= 0:
        parser.error(f"--dilation must be > 0, got {args.dilation}")
    behind, others = [], []
    for worker, mine in sorted(spans(args.trace).items()):
        serving = [(a, b, name.rsplit(" ", 1)[1]) for a, b, name in mine if name.startswith("model for worker ")]
        for a, b, name in mine:
            if not name.startswith("pull request to worker "):
                continue
            peer = name.rsplit(" ", 1)[1]
            sending = [end for start, end, to in serving if to == peer and start <= a < end]
            if sending:
                behind.append(((sending[0] - a) / args.dilation, (b - a) / args.dilation, worker, peer))
            else:
                others.append((b - a) / args.dilation)
    if not behind and not others:
        raise SystemExit(f"{args.trace}: no pair-averaging pull requests in this trace")
    print(f"{len(behind) + len(others)} pull requests; {len(behind)} posted while the requester's server "
          "was sending that peer a model:")
    for wait, took, worker, peer in sorted(behind):
        print(f"  worker {worker} -> {peer}: {wait:.3f} s until that model was sent, {took:.3f} s until answered")
    if others:
        print(f"the other {len(others)}: answered after a median {statistics.median(others):.3f} s, "
              f"at most {max(others):.3f} s")


if __name__ == "__main__":
    main()
