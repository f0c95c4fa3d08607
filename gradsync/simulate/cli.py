"""gradsync simulate: predict strategies' throughput on a cluster described by its numbers.

Takes gradsync bench's arguments (--model --strategies --np --net --servers --set) and writes its
records, table and charts, from the event simulator (gradsync.simulate) instead of running
anything: 4 to 512 workers in seconds. Compute is the model's compute profile (--compute
PROFILE, as --compute emulated:PROFILE in bench; default: the shipped one).

Example:

    gradsync simulate --model resnet50 --strategies allreduce,ps,p3 --np 4,16,64 --net 1gbit,10gbit
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gradsync.argtypes import output_dir, output_file

DEFAULT_STRATEGIES = ["ddp", "allreduce", "ps", "p3"]


def add_host_arguments(p: argparse.ArgumentParser) -> None:
    """The host's rates (:class:`~gradsync.simulate.Host`) and the network's all-to-all share (``--mesh``), as
    ``simulate`` and ``advise`` take them."""
    p.add_argument("--host-copy-gbps", type=float, default=200.0,
                   help="GB/s of the host work that copies gradients (default 200: an accelerator's)")
    p.add_argument("--host-update-gbps", type=float, default=100.0,
                   help="GB/s of parameters the optimizer updates (default 100: an accelerator's)")
    p.add_argument("--codec-speed", type=float, default=1.0,
                   help="compressors run this many times faster than on this machine's CPU, one thread (default 1)")
    p.add_argument("--message-us", type=float, default=0.0,
                   help="host CPU per end of a point-to-point message sent from Python (p3's and ps-sliced's slices, "
                        "hybrid's row requests and answers, the compressed strategies' headers and bodies), one at a "
                        "time per process (default 0: not counted; 380-630 on a 2-core cloud VM, docs/simulate.md)")
    p.add_argument("--shared-cores", type=int, default=0,
                   help="cores that every rank of the job shares (all on one machine, as an emulated cluster); "
                        "a thread woken while all are busy waits --busy-wake-us, and a message end runs beside "
                        "the other ranks busy at the time (default 0: cores to spare)")
    p.add_argument("--busy-wake-us", type=float, default=0.0,
                   help="a blocked thread's wait for a core when every shared core is busy (default 0: not "
                        "counted; about 3400 on a 2-core cloud VM, docs/simulate.md)")
    p.add_argument("--host-jitter", type=float, default=0.0,
                   help="coefficient of variation of host work from step to step: a step that waits for N hosts' "
                        "same work (hybrid's row servers, the compressed strategies' messages and all-gathers) waits for "
                        "the slowest (default 0; 0.15 with 2 ranks and 0.36 with 4 on a 2-core cloud VM)")
    p.add_argument("--net-cpu-ns", type=float, default=0.0,
                   help="host CPU per byte a host sends or receives, where the ranks share --shared-cores: a load "
                        "that message ends share the cores with (default 0: not counted; 1.2-2 on a 2-core VM's "
                        "emulated cluster, benchmarks/regenerate/mesh_exchange.py)")
    p.add_argument("--mesh", type=float, default=1.0,
                   help="share of a link's rate an all-to-all among 3 or more hosts moves (co-located ps, p3, "
                        "ps-sliced, casync-ps, hybrid's rows), relative to one flow (default 1: fair shares; 0.91-0.98 "
                        "among 4 emulated hosts, benchmarks/regenerate/mesh_exchange.py)")


def add_hosts_arguments(p: argparse.ArgumentParser) -> None:
    """Hosts of several ranks (:attr:`~gradsync.simulate.Network.ranks_per_host`), as ``simulate`` and ``advise`` take them."""
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="workers (ranks) on each host, sharing its NIC (default 1); the topology-aware strategies "
                        "run their two-level schedules, docs/simulate.md")
    p.add_argument("--gpus-per-host", type=int, default=1, help="the older name of --ranks-per-host")
    p.add_argument("--intra-gbps", type=float, default=12.0,
                   help="GB/s between the ranks of one host, shared by them (default 12: PCIe 3 x16)")
    p.add_argument("--flat", action="store_true",
                   help="every rank its own peer, as a strategy that does not know hosts (for comparison)")


def ranks_per_host(args, error) -> int:
    """The ranks per host of ``--ranks-per-host`` or its older name ``--gpus-per-host``."""
    at_least(args, error, ranks_per_host=1, gpus_per_host=1)
    if args.ranks_per_host > 1 and args.gpus_per_host > 1 and args.ranks_per_host != args.gpus_per_host:
        error(f"--ranks-per-host {args.ranks_per_host} and --gpus-per-host {args.gpus_per_host} disagree: give one")
    return max(args.ranks_per_host, args.gpus_per_host)


def at_least(args, error, **lowest) -> None:
    """Refuse the first of ``args``' numbers below its lowest value, naming its flag and value."""
    for name, low in lowest.items():
        value = getattr(args, name)
        if value < low:
            error(f"--{name.replace('_', '-')} must be >= {low}, got {value:g}")


def network_of(args, error, rate: float | None):
    """The :class:`~gradsync.simulate.Network` of the network options at ``rate``, or ``error`` naming a bad one."""
    from gradsync.simulate import Network

    if not 0 < args.mesh <= 1:
        error(f"--mesh must be in (0, 1], got {args.mesh:g}")
    return Network(rate, args.latency_us * 1e-6, ranks_per_host(args, error), args.intra_gbps * 1e9, mesh=args.mesh)


def host_of(args, error):
    """The :class:`~gradsync.simulate.Host` of :func:`add_host_arguments`' options, or ``error`` naming a bad one."""
    from gradsync.simulate import Host

    if min(args.host_copy_gbps, args.host_update_gbps, args.codec_speed) <= 0:
        error("--host-copy-gbps, --host-update-gbps and --codec-speed must be > 0")
    for flag in ("message_us", "shared_cores", "busy_wake_us", "host_jitter", "net_cpu_ns"):
        if getattr(args, flag) < 0:
            error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag):g}")
    return Host(args.host_copy_gbps * 1e9, args.host_update_gbps * 1e9, args.codec_speed, message_s=args.message_us * 1e-6,
                busy_wake_s=args.busy_wake_us * 1e-6 if args.busy_wake_us else None, cores=args.shared_cores,
                jitter=args.host_jitter, net_cpu_s=args.net_cpu_ns * 1e-9)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="predict strategies' throughput at any scale (event simulator)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", help="model NAME[:SIZE] (default resnet50)")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help=f"comma-separated strategies (default {','.join(DEFAULT_STRATEGIES)})")
    p.add_argument("--np", "-np", default="4", help="workers, or a comma-separated list, e.g. 4,16,128 (default 4)")
    p.add_argument("--net", default="10gbit", metavar="RATE[,RATE...]",
                   help="host link rates, e.g. 1gbit,10gbit (default 10gbit); 'unlimited' for no limit")
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="one-way latency of one message, wire and software, in microseconds (default 50)")
    add_hosts_arguments(p)
    p.add_argument("--servers", type=int, default=0, help="dedicated parameter-server hosts (default 0: co-located)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--compute", default="", metavar="PROFILE",
                   help="compute profile: a shipped name or file, or flops:RATE, with or without bench's "
                        "'emulated:' (default: the model's shipped one)")
    p.add_argument("--compression", default="", metavar="SPEC[;SPEC...]",
                   help="compressors: casync-ring, casync-ps and compressed-allgather run once per compressor, "
                        "as STRATEGY+SPEC (as in gradsync bench)")
    p.add_argument("--set", action="append", default=[], metavar="STRATEGY.KEY=VALUE",
                   help="a strategy option, as in gradsync bench (repeatable)")
    p.add_argument("--steps", type=int, default=6, help="simulated steps (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the figures (default 2)")
    add_host_arguments(p)
    p.add_argument("--json", metavar="FILE", type=output_file, help="write the records to FILE")
    p.add_argument("--out", metavar="DIR", type=output_dir, help="write records (simulate.json) and charts to DIR")
    p.add_argument("--validate", nargs="?", const="shipped", metavar="MATRIX",
                   help="replay the recorded emulated runs (the shipped matrix; 'held-out', the cells it was not "
                        "fitted to; or MATRIX.json) and report the error of every cell; exits 1 when the targets "
                        "are missed")
    p.add_argument("--markdown", metavar="FILE", type=output_file,
                   help="with --validate: also write the cells, grouped by cluster shape with the commands that "
                        "recorded them, as a markdown page (docs/simulate-validation.md is the shipped matrix's)")
    p.add_argument("--trace", metavar="FILE", type=output_file,
                   help="write a Chrome trace of the first strategy's last simulated step (ui.perfetto.dev)")
    p.set_defaults(handler=main)


def _ints(text: str, what: str, error) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        error(f"{what} must be integers separated by commas, got {text!r}")
    if any(v < 1 for v in values):
        error(f"{what} must be >= 1, got {text!r}")
    return values


def _rates(text: str, error) -> list[float | None]:
    from gradsync.cluster.netns import parse_rate
    from gradsync.errors import ConfigError

    out = []
    for item in text.split(","):
        if item.strip().lower() in ("unlimited", "none", "loopback"):
            out.append(None)
            continue
        if "=" in item:
            error(f"--net {text}: the simulator gives every host the same link ({item.strip()} is gradsync bench's "
                  "emulated slow link; run it there)")
        try:
            out.append(parse_rate(item))
        except ConfigError as exc:
            error(str(exc))
    return out


def bound(strategy: str, options: dict, model_bytes: int, np: int, servers: int, rate: float | None,
          compute_s: float, samples: int, min_bytes: float | None = None, per_host: int = 1,
          hosts: str = "flat") -> float:
    """The physical bound, from the strategy's own ``min_bytes_per_host`` (as gradsync bench), or
    ``min_bytes`` where the simulated model knows it (``hybrid``: it depends on the rows read). On
    hosts of ``per_host`` ranks, the strategy's figure on that layout (hosts filled in rank order,
    the servers on hosts of their own after the workers'), as ``gradsync bench --ranks-per-host``
    takes it, whichever form runs; the model's own figure, a peer's, times the ranks per host
    for a flat schedule (``hosts``)."""
    from types import SimpleNamespace

    from gradsync.strategies import resolve
    from gradsync.topology import Topology

    if min_bytes is None:
        obj = resolve(strategy, **options)
        where = [r // per_host for r in range(np)]
        where += [-(-np // per_host) + j // per_host for j in range(servers)]
        obj.ctx = SimpleNamespace(topology=Topology(world_size=np + servers, rank=0, num_servers=servers,
                                                    host_of=tuple(where) if per_host > 1 else ()))
        if hasattr(obj, "codec_name"):  # a compressed strategy: its wire ratio, as the simulator measured it
            from gradsync.simulate.compressed import codec_cost

            obj.ratio = codec_cost(obj.codec_name, obj.codec_options, 1.0).ratio
        min_bytes = obj.min_bytes_per_host(model_bytes)
    elif hosts == "flat":
        min_bytes *= per_host  # the model's own figure (hybrid's) is a peer's
    comm_s = 0.0 if rate is None else min_bytes * 8 / rate
    return samples / max(compute_s, comm_s)


def main(args) -> int:
    from gradsync.bench.args import _overrides
    from gradsync.errors import GradsyncError
    from gradsync.simulate import SIMULATED, load, simulate

    error = argparse.ArgumentParser(prog="gradsync simulate").error
    if args.markdown and not args.validate:
        error("--markdown needs --validate")
    if args.validate:
        return validate(args.validate, args.json, args.markdown)
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in SIMULATED]
    if unknown:
        error(f"no simulator model for {', '.join(unknown)}; simulated: {', '.join(SIMULATED)}")
    nps = _ints(args.np, "--np", error)
    rates = _rates(args.net, error)
    at_least(args, error, latency_us=0, servers=0, gpus_per_host=1, batch_size=1)
    ranks_per_host(args, error)
    if args.steps <= args.warmup or args.warmup < 0:
        error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) >= 0")
    if args.intra_gbps <= 0:
        error(f"--intra-gbps must be > 0, got {args.intra_gbps:g}")
    host = host_of(args, error)
    overrides = _overrides(args.set, strategies, error)
    try:
        workload = load(args.model, args.batch_size, args.compute or None)
    except GradsyncError as exc:
        error(str(exc))
    print(f"gradsync simulate: {args.model} at batch {args.batch_size}, {workload.nbytes / 2**20:.1f} MB of "
          f"parameters, {workload.compute_s * 1e3:.1f} ms of compute per step ({workload.device})", flush=True)
    from gradsync.simulate.compressed import COMPRESSED

    specs = [c for c in args.compression.split(";") if c]
    runs = [(f"{s}+{spec}", s, {**overrides.get(s, {}), "compression": spec}) if spec else (s, s, overrides.get(s, {}))
            for s in strategies for spec in (specs if s in COMPRESSED and specs else [None])]
    records, started = [], time.perf_counter()
    for rate in rates:
        for np in nps:
            for label, strategy, options in runs:
                net = network_of(args, error, rate)
                try:
                    record = simulate(strategy, workload, np, net, host=host, servers=args.servers,
                                      options=options, steps=args.steps, warmup=args.warmup,
                                      trace=bool(args.trace) and not records, flat=args.flat)
                except GradsyncError as exc:
                    print(f"gradsync simulate: {label} at {np} workers: {exc}", file=sys.stderr)
                    return 1
                record["strategy"] = label
                samples = np * args.batch_size
                record["ideal_samples_per_s"] = samples / workload.compute_s
                record["bound_samples_per_s"] = bound(strategy, options, workload.nbytes, np, args.servers, rate,
                                                      workload.compute_s, samples, record.get("min_bytes_per_host"),
                                                      record.get("ranks_per_host", 1), record.get("hosts", "flat"))
                record["efficiency"] = record["samples_per_s"] / record["bound_samples_per_s"]
                if "timeline" in record:
                    _write_trace(record.pop("timeline"), record["step_s"], args.trace, max(record["step_ends"]))
                records.append(record)
    print(table(records))
    print(f"({len(records)} simulations in {time.perf_counter() - started:.1f} s)")
    from gradsync.bench.report import save_records, sweep_charts

    if args.json:
        save_records(records, args.json)
    if args.out:
        save_records(records, os.path.join(args.out, "simulate.json"))
        for path in sweep_charts(records, args.out, f"{args.model} (simulated)"):
            print(f"chart: {path}")
    return 0


def validate(matrix: str, json_path: str | None, markdown_path: str | None = None) -> int:
    from gradsync.simulate import validate as v
    from gradsync.simulate.validation_page import markdown, targets_met

    path = v.SHIPPED.get(matrix, matrix)
    if not os.path.exists(path):
        print(f"gradsync simulate: no validation matrix at {path}", file=sys.stderr)
        return 2
    result = v.replay(path)
    print(v.report(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if markdown_path:
        shown = f"gradsync/simulate/{os.path.basename(path)}" if matrix in v.SHIPPED else matrix
        command = "gradsync simulate --validate" + ("" if matrix == "shipped" else f" {matrix}") + f" --markdown {markdown_path}"
        os.makedirs(os.path.dirname(os.path.abspath(markdown_path)), exist_ok=True)  # its folder made if missing
        with open(markdown_path, "w") as f:
            f.write(markdown(result, shown, command))
        print(f"markdown: {markdown_path}")
    met = targets_met(result)
    print("targets (median <= 5 %, every cell <= 10 %, ranking >= 90 % of cells, advice >= 90 % of groups): "
          + ("met" if met else "NOT met"))
    return 0 if met else 1


def table(records: list[dict]) -> str:
    w = max([10] + [len(r["strategy"]) for r in records])
    head = (f"{'strategy':<{w}} {'np':>4} {'net':>12} {'samples/s':>10} {'bound':>9} {'eff':>5} {'step ms':>8} "
            f"{'compute':>8} {'comm ovh':>9}")
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(f"{r['strategy']:<{w}} {r['np']:>4} {r['net']:>12} {r['samples_per_s']:>10.1f} "
                     f"{r['bound_samples_per_s']:>9.1f} {r['efficiency']:>5.2f} {r['step_s'] * 1e3:>8.1f} "
                     f"{r['compute_s'] * 1e3:>8.1f} {r['comm_overhead_s'] * 1e3:>9.1f}")
    return "\n".join(lines)


def _write_trace(timeline: list, step_s: float, path: str, end: float) -> None:
    """The last simulated step (the one ending at ``end``) as a Chrome trace, as ``gradsync bench
    --trace`` writes a measured one: a process per simulated rank (``rank R ...`` lanes; the first
    rank's, or the one that stands for all, unprefixed), a track per lane, transfers as async
    events. (Work still under way after the last step, a pull sent for the next one, is left out.)"""
    known = ["accelerator", "network", "host", "collectives"]
    tids: dict[tuple[int, str], int] = {}
    events = []
    for n, (lane, what, start, stop) in enumerate(timeline):
        if stop < end - step_s or start > end:
            continue
        words = lane.split(" ", 2)
        ranked = len(words) == 3 and words[0] == "rank" and words[1].isdigit()
        pid, name = (int(words[1]), words[2]) if ranked else (0, lane)
        if (pid, name) not in tids:
            others = sum(p == pid and track not in known for p, track in tids)
            tids[(pid, name)] = known.index(name) + 1 if name in known else len(known) + 1 + others
        common = {"name": what, "pid": pid, "tid": tids[(pid, name)]}
        if name == "network":  # transfers overlap: async events
            events.append({**common, "ph": "b", "cat": name, "id": n, "ts": start * 1e6})
            events.append({**common, "ph": "e", "cat": name, "id": n, "ts": stop * 1e6})
        else:
            events.append({**common, "ph": "X", "ts": start * 1e6, "dur": (stop - start) * 1e6})
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"simulated worker {pid}"}}
            for pid in sorted({p for p, _ in tids})]
    meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
             for (pid, name), tid in tids.items()]
    events = meta + events
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    print(f"trace of the last simulated step: {path}")
