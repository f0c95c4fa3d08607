"""``gradsync netcheck``: create an emulated cluster, run :mod:`gradsync.cluster.netcheck` on every
host under the launcher, and compare what the links deliver with the configured rate."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def add_parser(subparsers) -> None:
    check = subparsers.add_parser(
        "netcheck", help="measure the rate an emulated cluster's links deliver",
        description="Create an emulated cluster, measure per-host one-way and bidirectional rates and "
                    "all-reduce bus bandwidth, and compare them with the configured rate (target: within 10 %).")
    check.add_argument("--hosts", type=int, default=2, help="emulated hosts, one rank each (default 2)")
    check.add_argument("--net", required=True, metavar="RATE", help="link rate, e.g. 100mbit, 1gbit, 5gbit")
    check.add_argument("--delay", type=float, default=0.0, metavar="MS", help="one-way host-to-host delay (default 0)")
    check.add_argument("--loss", type=float, default=0.0, metavar="PCT", help="percent of frames each link drops (default 0)")
    check.add_argument("--seconds", type=float, default=2.0, help="duration of one transfer at the configured rate")
    check.add_argument("--repeats", type=int, default=3, help="transfers per measurement; the median is reported")
    check.set_defaults(handler=netcheck)


def netcheck(args) -> int:
    from gradsync.cluster import format_rate, parse_rate
    from gradsync.launch.emulated import launch_emulated
    from gradsync.launch.processes import exit_status
    from gradsync.cluster.netcheck import TARGET, report
    from gradsync.errors import ConfigError

    parser_error = argparse.ArgumentParser(prog="gradsync netcheck").error
    if args.hosts < 2:
        parser_error(f"--hosts must be >= 2, got {args.hosts}")
    if not 0 <= args.loss < 100:
        parser_error(f"--loss must be in [0, 100) percent, got {args.loss:g}")
    if not 0 <= args.delay < float("inf"):
        parser_error(f"--delay must be >= 0 ms, got {args.delay:g}")
    if not 0 < args.seconds < float("inf"):
        parser_error(f"--seconds must be > 0, got {args.seconds:g}")
    if args.repeats < 1:
        parser_error(f"--repeats must be >= 1, got {args.repeats}")
    try:
        rate = parse_rate(args.net)
    except ConfigError as exc:
        parser_error(str(exc))
    print(f"gradsync netcheck: {args.hosts} hosts, links of {format_rate(rate)}"
          + (f", {args.delay:g} ms one-way delay" if args.delay else "")
          + (f", {args.loss:g} % of frames lost per link" if args.loss else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="gradsync-netcheck-") as run_dir:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump({"rate_bps": rate, "seconds": args.seconds, "repeats": args.repeats}, f)
        status = exit_status("netcheck", lambda: launch_emulated(
            [sys.executable, "-m", "gradsync.cluster.netcheck", run_dir], np=args.hosts, rate_bps=rate,
            delay_ms=args.delay, loss=args.loss / 100, env={"GRADSYNC_TIMEOUT": "300"}))
        if status:
            return status
        with open(os.path.join(run_dir, "results.json")) as f:
            results = json.load(f)
    text, ok = report(results["rows"], rate)
    print("Mbit/s and ratio to the configured rate, per host:")
    print(text)
    print(f"\nround trip of a 4-byte message (median): {results['rtt_ms']:.2f} ms"
          + (f" (configured delay: {2 * args.delay:g} ms there and back)" if args.delay else ""))
    verdict = "within" if ok else "NOT within"
    print(f"\n{verdict} {TARGET:.0%} of {format_rate(rate)} on every host and direction")
    return 0 if ok else 1
