"""``gradsync codecs``: every compressor's encode and decode throughput on this machine, its wire
ratio, round-trip error and the state it keeps, on one gradient-sized tensor.

Throughput is input bytes (float32) per second, the median over ``--repeats`` timed calls after one
untimed call; error is ``||decompress(compress(x)) - x|| / ||x||`` for one call on ``x ~ N(0, 1)``
(error feedback and momentum make later calls different by design). State is the bytes of tensors a
compressor keeps between calls (residuals, momenta, warm starts). These numbers feed the cost model
of compression-aware synchronization (when compression pays on a given link) and docs/bench-codecs.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from gradsync.argtypes import available_bytes, output_file


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("codecs", help="measure compressors' encode/decode speed, ratio and error",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", default="all",
                   help="comma-separated NAME[:KEY=VALUE...] entries, options joined by ';' "
                        "(e.g. topk:ratio=0.01;seed=1); 'all' is every registered compressor with its defaults (the default)")
    p.add_argument("--size", type=float, default=4.0, help="tensor size in millions of float32 elements (default 4)")
    p.add_argument("--shape", default="rows=1024",
                   help="matrix view for PowerSGD: rows=N (default 1024; the tensor is N x size/N)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per compressor (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, like one bench rank)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write one record per compressor to FILE")
    p.add_argument("--convergence", action="store_true",
                   help="instead: train a seeded teacher task with each compressor, with and without error "
                        "feedback, against exact averaging (see gradsync.compress.convergence)")
    p.add_argument("--steps", type=int, default=600, help="--convergence: SGD steps (default 600)")
    p.add_argument("--lr", type=float, default=0.3, help="--convergence: learning rate (default 0.3)")
    p.add_argument("--workers", type=int, default=4, help="--convergence: simulated workers (default 4)")
    p.add_argument("--plot", metavar="FILE", type=output_file, help="--convergence: write the loss curves to FILE (png)")
    p.set_defaults(handler=main)


def _state_bytes(compressor) -> int:
    import torch

    seen = [compressor, getattr(compressor, "inner", None)]
    return sum(v.numel() * v.element_size() for c in seen if c is not None
               for v in vars(c).values() if isinstance(v, torch.Tensor))


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, options: dict, x, repeats: int) -> dict:
    from gradsync.compress import build, wire_bytes

    c = build(name, key="bench", **options)
    payload, ctx = c.compress(x)
    y = c.decompress(payload, ctx)
    error = float((y - x).norm() / x.norm())
    encode = _timed(lambda: c.compress(x), repeats)
    payload, ctx = c.compress(x)
    decode = _timed(lambda: c.decompress(payload, ctx), repeats)
    nbytes = x.numel() * 4
    return {"compressor": name, "describe": c.describe(), "elements": x.numel(),
            "encode_gb_s": nbytes / encode / 1e9, "decode_gb_s": nbytes / decode / 1e9,
            "ratio": nbytes / max(wire_bytes(payload), 1), "rel_error": error, "state_mb": _state_bytes(c) / 2**20}


def _specs(arg: str) -> list[tuple[str, str, dict]]:
    """``(label, name, options)`` per entry; ``;`` separates options inside an entry."""
    from gradsync.compress import COMPRESSORS, compressor_names, parse_spec
    from gradsync.errors import ConfigError

    entries = [e for item in arg.split(",") for e in (compressor_names() if item == "all" else [item])]
    out = []
    for entry in entries:
        name, options = parse_spec(entry.replace(";", ","))
        if name not in COMPRESSORS:
            raise ConfigError(f"unknown compressor {name!r}; valid compressors: {', '.join(compressor_names())}")
        out.append((entry, name, options))
    return out


def convergence(args, specs) -> int:
    from gradsync.compress import convergence as conv

    task = conv.teacher_task()
    common = dict(task=task, steps=args.steps, lr=args.lr, workers=args.workers)
    results = [conv.train(None, **common)]
    for label, name, options in specs:
        if name == "none":
            continue
        for feedback in (False,) if name in conv.OWN_FEEDBACK else (False, True):
            r = conv.train(name, error_feedback=feedback, **common, **options)
            r["compressor"] = label
            results.append(r)
    base = results[0]
    print(f"teacher task, {args.workers} workers x batch 32, SGD lr {args.lr}, {args.steps} steps; held-out 2000")
    print(f"{'compressor':<26} {'EF':<4} {'loss':>7} {'accuracy':>8} {'vs exact':>9}")
    for r in results:
        ef = "own" if r["compressor"].split(":")[0] in conv.OWN_FEEDBACK else ("yes" if r["error_feedback"] else "no")
        print(f"{r['compressor']:<26} {ef:<4} {r['loss']:>7.3f} {r['accuracy']:>8.1%} "
              f"{r['accuracy'] - base['accuracy']:>+9.1%}")
    if args.plot:
        conv.plot(results, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _check_numbers(args) -> str | None:
    """What is wrong with the sizes and counts given, or None."""
    if not 0 < args.size < float("inf"):
        return f"--size must be > 0 (millions of elements), got {args.size:g}"
    available = available_bytes()
    if available is not None and 16e6 * args.size > available:  # the input, its round trip, a compressor's state
        return (f"--size {args.size:g} (million float32 elements) needs about {16e6 * args.size / 2**30:.1f} GB; "
                f"this machine has {available / 2**30:.1f} GB available")
    kind, _, rows = args.shape.partition("=")
    if kind != "rows" or not rows.isdigit() or int(rows) < 1:
        return f"--shape must be rows=N with N >= 1, got {args.shape!r}"
    if int(args.size * 1e6) < int(rows):
        return f"--size {args.size:g} M elements is fewer than one row of {rows} ({args.shape})"
    for name in ("repeats", "threads", "steps", "workers"):
        if getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    if not 0 < args.lr < float("inf"):
        return f"--lr must be > 0, got {args.lr:g}"
    return None


def main(args) -> int:
    import torch

    from gradsync.compress import build
    from gradsync.errors import ConfigError

    problem = _check_numbers(args)
    if problem:
        print(f"gradsync codecs: error: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        specs = _specs(args.compressors)
        for _, name, options in specs:  # bad options fail here, before minutes of measuring
            build(name, **options)
    except ConfigError as exc:
        print(f"gradsync codecs: error: {exc}", file=sys.stderr)
        return 2
    if args.convergence:
        return convergence(args, specs)
    rows = int(args.shape.split("=", 1)[1])
    n = int(args.size * 1e6) // rows * rows
    x = torch.randn(rows, n // rows, generator=torch.Generator().manual_seed(0))
    records = [measure(name, options, x, args.repeats) | {"compressor": label} for label, name, options in specs]
    print(f"{n / 1e6:.1f} M float32 elements ({rows} x {n // rows}), {args.threads} thread(s), "
          f"median of {args.repeats}")
    print(f"{'compressor':<18} {'encode GB/s':>11} {'decode GB/s':>11} {'ratio':>7} {'rel error':>9} "
          f"{'state MB':>8}  options")
    for r in records:
        print(f"{r['compressor']:<18} {r['encode_gb_s']:>11.3f} {r['decode_gb_s']:>11.3f} {r['ratio']:>7.1f} "
              f"{r['rel_error']:>9.3f} {r['state_mb']:>8.1f}  {r['describe']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    sys.stdout.flush()
    return 0
