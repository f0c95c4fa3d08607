"""``gradsync bench``: measure every strategy side by side and check it against a reference.

With no arguments it runs the embedded default (``resnet50:tiny``, 2 workers on loopback, every
strategy that can run without servers, 30 measured steps in 3 interleaved rounds, each after 5
warm-up steps): under a minute on a 2-core machine. The ranks run under the same launcher as ``gradsync run``; afterwards this
process trains the single-process reference and compares each exact strategy's parameters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

DEFAULT_STRATEGIES = ["ddp", "allreduce", "ps", "ps-async"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="compare strategies: throughput, overhead, bytes, correctness",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50:tiny", help="model NAME[:SIZE] (default resnet50:tiny)")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help="comma-separated strategies (default: all that can run)")
    p.add_argument("--np", type=int, default=2, help="number of workers (default 2)")
    p.add_argument("--servers", type=int, default=0, help="dedicated parameter-server ranks (default 0: co-located)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per strategy, over all rounds (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of every round (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds that interleave the strategies, so drift hits all alike (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9) or adam (default sgd)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="STRATEGY.KEY=VALUE",
                   help="a strategy option, e.g. ps.fuse_kb=0 or allreduce.bucket_mb=4 (repeatable)")
    p.add_argument("--json", metavar="FILE", help="write one record per strategy to FILE")
    p.add_argument("--out", metavar="DIR", help="write the chart (bench.png) and records (bench.json) to DIR")
    p.add_argument("--check-steps", type=int, default=5,
                   help="steps of the float64 correctness replay (default 5; 0 skips the check)")
    p.set_defaults(handler=main)


def _validate(args, parser_error) -> list[str]:
    from gradsync.bench.workload import OPTIMIZERS
    from gradsync.models import get_model
    from gradsync.strategies import STRATEGIES, strategy_names

    for flag, value, low in [("--np", args.np, 1), ("--batch-size", args.batch_size, 1), ("--steps", args.steps, 1),
                             ("--servers", args.servers, 0), ("--warmup", args.warmup, 0), ("--threads", args.threads, 1),
                             ("--check-steps", args.check_steps, 0), ("--rounds", args.rounds, 1)]:
        if value < low:
            parser_error(f"{flag} must be >= {low}, got {value}")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        parser_error(f"unknown strategy {', '.join(unknown) or '(none)'}; valid strategies: {', '.join(strategy_names())}")
    if args.optimizer not in OPTIMIZERS:
        parser_error(f"unknown optimizer {args.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    try:
        get_model(args.model)
    except ValueError as exc:
        parser_error(str(exc))
    if args.servers == 0 and "ps-async" in names:
        names.remove("ps-async")
        print("note: skipping ps-async, which needs dedicated servers (--servers 1 or more)", flush=True)
    return names


def _overrides(items: list[str], strategies: list[str], parser_error) -> dict[str, dict]:
    """``["ps.fuse_kb=0"]`` -> ``{"ps": {"fuse_kb": 0}}``; values are JSON (numbers, true/false) or strings."""
    out: dict[str, dict] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        name, dot, option = key.partition(".")
        if not (eq and dot and option) or name not in strategies:
            parser_error(f"--set {item!r}: expected STRATEGY.KEY=VALUE with STRATEGY one of {', '.join(strategies)}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(name, {})[option] = value
    return out


def _config(args, strategies: list[str], overrides: dict[str, dict]) -> dict:
    from gradsync.models import get_model

    hints = get_model(args.model).options.get("strategy_options", {})
    workload = {"model": args.model, "batch_size": args.batch_size, "optimizer": args.optimizer,
                "lr": args.lr, "seed": args.seed}
    return {"workload": workload, "strategies": strategies, "np": args.np, "servers": args.servers,
            "steps": args.steps, "warmup": args.warmup, "threads": args.threads, "check_steps": args.check_steps,
            "rounds": args.rounds, "per_round": -(-args.steps // args.rounds),
            "options": {s: {**hints.get(s, {}), **overrides.get(s, {})} for s in strategies}}


def _check_options(config: dict, parser_error) -> None:
    """Build each strategy once here, so a bad option is an argument error, not a crash in the ranks."""
    from gradsync.errors import ConfigError
    from gradsync.strategies import resolve

    for name, options in config["options"].items():
        try:
            resolve(name, **options)
        except ConfigError as exc:
            parser_error(str(exc))


def _run_ranks(config: dict, run_dir: str) -> int:
    from gradsync.launch import launch_local

    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config, f)
    # A rank waits in a collective while others run a strategy it skips: allow long waits. Fixed
    # mmap threshold: freed tensors go back to the OS, so per-strategy peak memory is meaningful.
    env = {"GRADSYNC_TIMEOUT": "600", "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(config["threads"])}
    result = launch_local([sys.executable, "-m", "gradsync.bench.worker", run_dir], np=config["np"],
                          servers=config["servers"], env=env, prefix_output=False)
    if result.returncode:
        print(result.message, file=sys.stderr)
    return result.returncode


def _records(config: dict, run_dir: str) -> list[dict]:
    import torch

    from gradsync.bench.report import summarize
    from gradsync.bench.workload import Workload, compare, reference

    work = Workload(**config["workload"])
    # Same thread count as the workers: CPU kernels then sum in the same order, and the comparison
    # measures synchronization alone (with other counts, chaotic models differ by far more).
    torch.set_num_threads(config["threads"])
    with open(os.path.join(run_dir, "results.json")) as f:
        results = json.load(f)
    fp32_ref = reference(work, config["np"], config["warmup"] + config["per_round"])
    check = Workload(**{**config["workload"], "dtype": "float64"})
    check_ref = reference(check, config["np"], config["check_steps"]) if config["check_steps"] else None
    records = []
    for name in config["strategies"]:
        raw = results["records"][name]
        fp32 = compare(torch.load(os.path.join(run_dir, f"{name}.pt")), fp32_ref, work.tolerance)
        result = None
        if check_ref is not None:
            result = compare(torch.load(os.path.join(run_dir, f"{name}.check.pt")), check_ref, check.tolerance)
        records.append(summarize(raw, results["compute"], config, result, fp32["max_abs_diff"]))
    return records


def main(args) -> int:
    import argparse as _argparse

    parser_error = _argparse.ArgumentParser(prog="gradsync bench").error
    strategies = _validate(args, parser_error)
    config = _config(args, strategies, _overrides(args.set, strategies, parser_error))
    _check_options(config, parser_error)
    print(f"gradsync bench: {args.model}, {args.np} workers, {args.servers} servers, batch {args.batch_size}, "
          f"{args.warmup}+{args.steps} steps, strategies {', '.join(strategies)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-") as run_dir:
        code = _run_ranks(config, run_dir)
        if code:
            return code
        print("  comparing with the single-process reference ...", flush=True)
        records = _records(config, run_dir)
    return _report(records, args, config)


def _report(records: list[dict], args, config: dict) -> int:
    from gradsync.bench.report import chart, table

    print()
    print(table(records))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(records, f, indent=1)
        title = f"{args.model}, {args.np} workers, batch {args.batch_size}"
        chart(records, os.path.join(args.out, "bench.png"), title)
        print(f"\nchart: {os.path.join(args.out, 'bench.png')}")
    failed = [r["strategy"] for r in records if r["correct"] is False]
    if failed:
        print(f"\nFAILED correctness check: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
