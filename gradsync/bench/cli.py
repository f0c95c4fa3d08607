"""``gradsync bench``: measure every strategy side by side and check it against a reference.

With no arguments it runs the embedded default (``resnet50:tiny``, 2 workers on loopback, every
strategy that can run without servers, 30 measured steps in 3 interleaved rounds, each after 5
warm-up steps): under a minute on a 2-core machine. The ranks run under the same launcher as
``gradsync run``; afterwards this process trains the single-process reference and compares each
exact strategy's parameters.

An emulated cluster: ``--net 1gbit,10gbit`` puts every rank on its own emulated host with a link of
that rate (one run per rate; ``--ranks-per-host R``: R workers to a host, sharing its link, and
``--server-hosts own|shared``: dedicated servers on hosts of their own or on the workers'); ``--compute emulated`` replaces the model's computation by its
profile (GPU-like layer times); ``--dilation K`` slows emulated compute and links alike by K, and
every figure is reported back in undilated units (``--dilation auto``: per rate, just enough that
no link really runs faster than 1 Gbit/s, which this machine emulates faithfully for 4+ hosts;
``--dilation auto:500mbit`` caps the real rate lower, for strategies whose many messages keep the
host's CPU busy: see the ``cpu`` column). ``--np 2,4`` runs once per worker count.
A straggler: ``--slow 1:2`` makes worker 1's emulated compute take twice as long, and
``--net 1gbit,rank1=250mbit`` gives the host holding rank 1 a 250 Mbit/s link.
Several rates or worker counts also draw throughput against them (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from gradsync.bench.args import _check_options, _config, _overrides, _validate, add_arguments


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="compare strategies: throughput, overhead, bytes, correctness",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(handler=main)


EMULATED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
                      "MALLOC_ARENA_MAX": "1"}
"""The allocator settings of an emulated run's ranks (see below): freed blocks of up to 1 GB kept,
on every thread. (glibc gives other threads arenas of their own, whose heaps hold at most 64 MB:
a larger block there is always fresh pages, whatever the thresholds: a hybrid row server's update
of a 101.6 MB partition, whose optimizer makes a partition-sized temporary every step, takes 1.14-1.19x
as long on a thread of its own arena, docs/mechanisms.md.)"""


def emulated_rank_env() -> dict[str, str]:
    """The environment an emulated run's ranks do their host work under (:data:`EMULATED_ALLOCATOR`,
    tensors of 2 MB and more on transparent huge pages unless ``THP_MEM_ALLOC_ENABLE`` says
    otherwise): a measurement of that work (the simulator's host rates and compressor costs) runs
    under it too."""
    return {"THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1"), **EMULATED_ALLOCATOR}


def _run_ranks(config: dict, run_dir: str) -> int:
    from gradsync.emulate.slow import ENV as SLOW_ENV
    from gradsync.launch import launch_local
    from gradsync.launch.emulated import launch_emulated
    from gradsync.launch.processes import exit_status

    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config, f)
    # A rank waits in a collective while others run a strategy it skips: allow long waits.
    # Emulated compute: freed memory up to 1 GB a block is kept for reuse, as a GPU's caching
    # allocator does; else page faults in every new 100 MB gradient would cost more than the
    # layer's emulated time. VGG-19's 411 MB fc6 included: with blocks of up to 256 MB kept,
    # DDP's step took fresh pages for an fc6-sized buffer every step (1.1-1.3 s a step, 18 % of
    # its throughput on 2 workers at 10 Gbit/s; 2 % behind allreduce with them kept). 4 VGG-19
    # workers then use 14 GB of a 24 GB machine.
    # Tensors of 2 MB and more on transparent huge pages (PyTorch's THP_MEM_ALLOC_ENABLE): a fresh
    # 64 MB buffer then costs 32 page faults instead of 16384 (docs/methods.md).
    # Every strategy runs with it; set THP_MEM_ALLOC_ENABLE=0 to measure without.
    env = {"GRADSYNC_TIMEOUT": "600", "OMP_NUM_THREADS": str(config["threads"]),
           "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1")}
    if config["workload"]["compute"] != "real":
        env.update(emulated_rank_env())
        env[SLOW_ENV] = config.get("slow", "")  # set even when empty: none inherited from this shell
    command = [sys.executable, "-m", "gradsync.bench.worker", run_dir]
    if config.get("machine"):  # the other hosts get config.json over ssh and send their traces back
        from gradsync.launch.remote import PYTHON, launch_hosts

        machine = config["machine"]
        command[0] = PYTHON  # each host's own interpreter
        files = {os.path.join(run_dir, "config.json"): json.dumps(config)}
        return exit_status("bench", lambda: launch_hosts(command, machine=machine, np=config["np"],
                                                         servers=config["servers"], env=env, files=files,
                                                         collect=(run_dir, "trace-*.json")))
    options = {"np": config["np"], "servers": config["servers"], "env": env, "prefix_output": False}
    if config["rate_bps"] is None:
        return exit_status("bench", lambda: launch_local(command, **options))
    k = config["dilation"]
    rank_rates = {int(rank): bps / k for rank, bps in config.get("rank_rates_bps", {}).items()}
    return exit_status("bench", lambda: launch_emulated(command, rate_bps=config["rate_bps"] / k, rank_rates=rank_rates,
                                                        delay_ms=config["delay_ms"] * config["dilation"],
                                                        ranks_per_host=config["ranks_per_host"],
                                                        server_hosts=config["server_hosts"], **options))


def _records(config: dict, run_dir: str) -> list[dict]:
    import torch

    from gradsync.bench.report import summarize
    from gradsync.bench.worker import check_workload
    from gradsync.bench.workload import Workload, compare, eval_loss, reference

    work = Workload(**config["workload"])
    if work.compute != "real":  # the reference needs the values, not the emulated time
        work = Workload(**{**config["workload"], "dilation": 0.0})
    # Same thread count as the workers: CPU kernels then sum in the same order, and the comparison
    # measures synchronization alone (with other counts, chaotic models differ by far more).
    torch.set_num_threads(config["threads"])
    with open(os.path.join(run_dir, "results.json")) as f:
        results = json.load(f)
    steps = config["warmup"] + config["per_round"]
    fp32_ref = reference(work, config["np"], steps)
    ref_loss = eval_loss(work, dict(fp32_ref.named_parameters()))
    check = check_workload(config["workload"])
    check_ref = reference(check, config["np"], config["check_steps"]) if config["check_steps"] else None
    records = []
    for name in config["strategies"]:
        raw = results["records"][name]
        final = torch.load(os.path.join(run_dir, f"{name}.pt"), weights_only=True)
        history = raw.get("share_history")  # a @balance label: the reference splits each batch as it did
        fp32 = compare(final, reference(work, config["np"], steps, shares=history) if history else fp32_ref,
                       work.tolerance)
        result = None
        if check_ref is not None:
            ref = reference(check, config["np"], config["check_steps"], shares=[[0, history[-1][1]]]) \
                if history else check_ref
            result = compare(torch.load(os.path.join(run_dir, f"{name}.check.pt"), weights_only=True), ref, check.tolerance)
        records.append(summarize(raw, results["compute"], config, result, fp32["max_abs_diff"]))
        if not raw["exact"] and work.compute == "real":  # not the reference's model: how good is it?
            # (an emulated model's loss is a stand-in, not a measure of its parameters)
            records[-1].update(eval_loss=eval_loss(work, final), ref_eval_loss=ref_loss)
        tuning = results.get("tuning", {}).get(name)
        if tuning is not None:
            records[-1]["tuning"] = tuning
            _print_tuning(name, tuning, config)
    return records


def _print_tuning(name: str, tuning: dict, config: dict) -> None:
    samples, k = config["np"] * config["workload"]["batch_size"], config["dilation"]
    print(f"  tuning {name} ({len(tuning['probes'])} probes of {config['tune_steps']} steps):", flush=True)
    lines = [", ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in probe["options"].items()) for probe in tuning["probes"]]
    width = max(map(len, lines), default=0)
    for options, probe in zip(lines, tuning["probes"]):
        chosen = " <- chosen" if probe["options"] == tuning["chosen"] else ""
        print(f"    {options:<{width}} {samples * k / probe['step_s']:10.1f} samples/s{chosen}", flush=True)


def main(args) -> int:
    import argparse as _argparse

    parser_error = _argparse.ArgumentParser(prog="gradsync bench").error
    strategies = _validate(args, parser_error)
    from gradsync.bench.worker import strategy_of

    overrides = _overrides(args.set, list(dict.fromkeys(strategy_of(s) for s in strategies)), parser_error)
    records = []
    for np in args.np_list:
        for rate in args.rates:
            config = _config(args, strategies, overrides, np, rate)
            _check_options(config, parser_error)
            code = _one_run(config, args, records)
            if code:
                return code
    return _report(records, args)


def _one_run(config: dict, args, records: list[dict]) -> int:
    from gradsync.cluster import format_rate

    rate, k = config["rate_bps"], config["dilation"]
    net = "loopback" if rate is None else f"{format_rate(rate)} links" + (f" (really {format_rate(rate / k)})" if k != 1 else "")
    for rank, bps in sorted(config.get("rank_rates_bps", {}).items(), key=lambda item: int(item[0])):
        net += f", rank {rank}'s host at {format_rate(bps)}"
    if config.get("machine"):
        machine = config["machine"]
        net = f"machine {machine['name']} ({len(machine['hosts'])} hosts" + ("" if rate is None else f", {net}") + ")"
    if config["delay_ms"]:
        net += f", {config['delay_ms']:g} ms delay"
    if config["ranks_per_host"] > 1:
        net += f", {config['ranks_per_host']} workers per host"
    if config["servers"] and config["rate_bps"] is not None and not config.get("machine"):
        net += ", servers on the workers' hosts" if config["server_hosts"] == "shared" else ", servers on hosts of their own"
    print(f"gradsync bench: {args.model}, {config['np']} workers, {args.servers} servers, batch {args.batch_size}, "
          f"{args.warmup}+{args.steps} steps, {net}, compute {args.compute}"
          + (f", dilation {k:g}" if k != 1 else "") + slow_note(config.get("slow", ""))
          + f", strategies {', '.join(config['strategies'])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-") as run_dir:
        code = _run_ranks(config, run_dir)
        if code:
            return code
        print("  comparing with the single-process reference ...", flush=True)
        records += _records(config, run_dir)
        if args.trace:
            several = len(args.np_list) * len(args.rates) > 1
            _save_trace(run_dir, args.trace, config if several else None)
    return 0


def slow_note(slow: str) -> str:
    """``--slow``'s part of the banner: ``, rank 1 computes 2x as long`` (empty for nobody)."""
    return "".join(f", rank {rank} computes {factor}x as long"
                   for rank, _, factor in (item.partition(":") for item in slow.split(",") if item))


def _save_trace(run_dir: str, path: str, config: dict | None) -> None:
    """Merge the ranks' traces into ``path`` (one file per run when there are several: FILE-np4-1gbit.json)."""
    from gradsync.trace import merge

    if config is not None:
        base, ext = os.path.splitext(path)
        rate = "loopback" if config["rate_bps"] is None else f"{config['rate_bps'] / 1e6:g}mbit"
        path = f"{base}-np{config['np']}-{rate}{ext or '.json'}"
    parts = sorted(f for f in os.listdir(run_dir) if f.startswith("trace-"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    count = merge([os.path.join(run_dir, f) for f in parts], path)
    print(f"  trace: {path} ({count} events; open in https://ui.perfetto.dev or chrome://tracing)", flush=True)


def _report(records: list[dict], args) -> int:
    from gradsync.bench.report import chart, cpu_bound_note, save_records, shared_cores_note, sweep_charts, table

    print()
    print(table(records))
    for r in records:
        if "eval_loss" in r:
            change = f" ({r['eval_loss'] / r['ref_eval_loss'] - 1:+.1%})" if r["ref_eval_loss"] else ""
            print(f"{r['strategy']}: not exact; held-out loss of rank 0's model {r['eval_loss']:.4g} against the "
                  f"reference's {r['ref_eval_loss']:.4g}{change}")
    for r in records:
        if r.get("servers"):
            print(f"{r['strategy']}: peak memory of the busiest dedicated server {r['server_peak_mem_mb']:.1f} MB")
        if r["strategy"].startswith("hybrid"):
            print(f"{r['strategy']} at {r['net']}: {r['describe']}")
            stats = r.get("stats") or {}
            if stats.get("steps"):
                print(f"  rows per step and worker: pushed {stats['pushed_rows'] / stats['steps']:.0f}, "
                      f"pulled from other servers {stats['pulled_rows'] / stats['steps']:.0f}")
    for r in records:
        if r.get("shares"):
            print(f"{r['strategy']}: BalanceBatches' shares of the global batch at the end, by worker: "
                  f"{', '.join(map(str, r['shares']))}")
    for slow in sorted({r["slow"] for r in records if r.get("slow")}):
        print(f"slowed (--slow {slow}): {slow_note(slow).removeprefix(', ')}")
    for note in (cpu_bound_note(records), None if args.machine_hosts else shared_cores_note(records)):
        if note:
            print(note)
    if args.json:
        save_records(records, args.json)
    if args.out:
        save_records(records, os.path.join(args.out, "bench.json"))
        title = f"{args.model}, batch {args.batch_size}, compute {args.compute}"
        if len(args.np_list) * len(args.rates) == 1:
            chart(records, os.path.join(args.out, "bench.png"), f"{title}, {args.np_list[0]} workers")
            print(f"\nchart: {os.path.join(args.out, 'bench.png')}")
        for path in sweep_charts(records, args.out, title):
            print(f"chart: {path}")
    failed = [r["strategy"] for r in records if r["correct"] is False]
    if failed:
        print(f"\nFAILED correctness check: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
