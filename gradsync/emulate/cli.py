"""``gradsync profile``: measure (or derive) a compute profile for ``--compute emulated:FILE``.

By default it trains the real model here for a few steps and times each layer's forward and
backward (median over the steps); ``--flops RATE`` derives the times from per-layer FLOPs instead,
and ``--throughput`` scales such a FLOP split to a measured samples/s (how the shipped profiles
were made). The profile goes to ``--out FILE`` (JSON) or stdout; a per-layer summary goes to
stderr. See docs/profiles.md.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys

from gradsync.argtypes import output_file

SUMMARY_ROWS = 20


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure per-layer compute times for emulated workers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model NAME[:SIZE], e.g. resnet50 or bert-base:tiny")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where to measure (default: cuda if available, else cpu)")
    p.add_argument("--steps", type=int, default=10, help="measured steps; each layer keeps its median (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads while measuring (default: torch's)")
    p.add_argument("--load", type=int, default=1, metavar="N",
                   help="measure while N-1 more copies run alongside, as N workers share this machine "
                        "(for a profile that should match an N-worker run here; default 1)")
    p.add_argument("--flops", metavar="RATE", help="derive from FLOPs at RATE instead of measuring, e.g. 15tflops")
    p.add_argument("--throughput", type=float, metavar="SAMPLES_PER_S",
                   help="derive from FLOPs, then scale so that a step takes batch-size/SAMPLES_PER_S seconds")
    p.add_argument("--device-name", help="with --flops/--throughput: what the times stand for (the profile's device)")
    p.add_argument("--note", help="appended to the profile's source (e.g. where a throughput was published)")
    p.add_argument("--out", metavar="FILE", type=output_file, help="write the profile here (default: JSON on stdout)")
    p.set_defaults(handler=main)


def _validate(args, parser_error) -> None:
    from gradsync.emulate.profile import parse_rate
    from gradsync.models import get_model

    for flag, value, low in [("--batch-size", args.batch_size, 1), ("--steps", args.steps, 1), ("--load", args.load, 1),
                             ("--warmup", args.warmup, 0), ("--threads", args.threads, 1)]:
        if value is not None and value < low:
            parser_error(f"{flag} must be >= {low}, got {value}")
    try:
        get_model(args.model)
        if args.flops is not None:
            parse_rate(args.flops)
    except ValueError as exc:  # ConfigError is a ValueError too
        parser_error(str(exc))
    if args.throughput is not None and not args.throughput > 0:
        parser_error(f"--throughput must be positive, got {args.throughput}")
    if args.throughput is not None and args.flops is not None:
        parser_error("--flops and --throughput are alternatives: a FLOP rate, or the throughput it must give")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser_error("--device cuda: no CUDA device is available here")


def _profile(args):
    import torch

    from gradsync.emulate.derive import from_flops, measure
    from gradsync.emulate.profile import parse_rate

    if args.flops is None and args.throughput is None:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        with _background_load(args):
            profile = measure(args.model, args.batch_size, device=device, steps=args.steps,
                              warmup=args.warmup, threads=args.threads)
        if args.load > 1:
            profile.device += f", measured with {args.load - 1} more copies running (--load {args.load})"
    elif args.flops is not None:
        profile = from_flops(args.model, args.batch_size, parse_rate(args.flops), device=args.device_name)
    else:
        # At 1 TFLOPS a step takes (GFLOP per step) ms, so this rate keeps the FLOP split and gives
        # the step time of the measured throughput.
        wanted_ms = 1e3 * args.batch_size / args.throughput
        rate = from_flops(args.model, args.batch_size, 1.0).step_ms / wanted_ms
        profile = from_flops(args.model, args.batch_size, rate, device=args.device_name)
        profile.throughput = args.throughput
        profile.source += (f"; that rate is the one at which a step takes {wanted_ms:.3f} ms, i.e. "
                           f"{args.throughput:g} samples/s (--throughput {args.throughput:g})")
    if args.note:
        profile.source += f"; {args.note}"
    return profile


@contextlib.contextmanager
def _background_load(args):
    """``args.load - 1`` copies of the same measurement, started first and running longer, then stopped."""
    extra = args.load - 1
    command = [sys.executable, "-m", "gradsync.cli", "profile", "--model", args.model, "--batch-size",
               str(args.batch_size), "--steps", str(10 * args.steps + 20), "--warmup", "0", "--out", os.devnull]
    if args.threads:
        command += ["--threads", str(args.threads)]
    copies = [subprocess.Popen(command, stderr=subprocess.DEVNULL) for _ in range(extra)]
    try:
        yield
    finally:
        for copy in copies:
            copy.kill()
            copy.wait()


def summary(profile, rows: int = SUMMARY_ROWS) -> str:
    """The ``rows`` slowest layers (in forward order) and the totals, as a text table."""
    slowest = sorted(profile.layers, key=lambda x: x.forward_ms + x.backward_ms, reverse=True)[:rows]
    keep = {id(x) for x in slowest}
    width = max([len("layer")] + [len(x.name or "(root)") for x in slowest])
    lines = [f"{'layer':<{width}}  {'forward ms':>10}  {'backward ms':>11}"]
    lines += [f"{x.name or '(root)':<{width}}  {x.forward_ms:>10.3f}  {x.backward_ms:>11.3f}"
              for x in profile.layers if id(x) in keep]
    if len(profile.layers) > rows:
        lines.append(f"({len(profile.layers) - rows} faster layers not shown)")
    per_s = 1e3 * profile.batch_size / profile.step_ms if profile.step_ms > 0 else float("inf")
    lines.append(f"{'total':<{width}}  {profile.forward_ms:>10.3f}  {profile.backward_ms:>11.3f}   "
                 f"step {profile.step_ms:.3f} ms = {per_s:.1f} samples/s at batch {profile.batch_size}, "
                 f"{len(profile.layers)} layers; {profile.device}")
    return "\n".join(lines)


def main(args) -> int:
    parser_error = argparse.ArgumentParser(prog="gradsync profile").error
    _validate(args, parser_error)
    profile = _profile(args)
    print(summary(profile), file=sys.stderr)
    if args.out:
        profile.save(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        json.dump(dataclasses.asdict(profile), sys.stdout, indent=1)
        sys.stdout.write("\n")
    return 0
