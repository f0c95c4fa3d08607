"""``gradsync advise``: which strategy and compressor to use for a model on a cluster, before renting it.

Every strategy the simulator models (and each compressed strategy once per compressor) is
simulated on the cluster described (workers, link rate, latency, servers, workers per host), and
ranked by predicted throughput, each with one line saying why: what it moves per step, how much of
that is hidden behind compute, what it costs in memory, and what it gives up (exactness, or a
lossy compressor). The strategies that communicate every ``H`` steps (``local-sgd``, ``diloco``) are
ranked by the same throughput, and their line says what they cost in loss: the gap to synchronous
training at equal tokens measured by the stored run of ``gradsync experiment run diloco-communication``
(yours, else the one gradsync ships), or that none is stored.

    gradsync advise --model vgg19 --np 16 --net 10gbit
    gradsync advise --model resnet50 --np 8 --net 25gbit --compression "onebit;fp16" --servers 2

``gradsync simulate --validate`` checks the advice against the emulated runs it ships: in each
group of the matrix the first pick among the strategies measured is the measured best, or within
5 % of it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from gradsync.experiment.store import SHIPPED, Store, default_path
from gradsync.simulate import SIMULATED
from gradsync.simulate.cli import add_host_arguments
from gradsync.simulate.compressed import COMPRESSED
NEEDS_SERVERS = ("ps-async",)
INEXACT = {"sma": "averages models, not gradients (not exact)",
           # local-sgd and diloco: their line gives the measured loss gap (loss_gap)
           "pair-averaging": "averages with one peer a step (in turn), no barrier (not exact)",
           "ps-async": "asynchronous updates (not exact)"}
DEFAULT_COMPRESSION = "onebit;fp16;topk:ratio=0.01"
RARE = [("local-sgd H=10", "local-sgd", {"H": 10}), ("diloco H=50", "diloco", {"H": 50}),
        ("diloco H=50 streaming int4", "diloco", {"H": 50, "fragments": 4, "delay": 1, "compression": "int4"})]
"""The rare-communication candidates: ``(label, strategy, options)``."""
EXPERIMENT = "diloco-communication"


@dataclass
class Advice:
    label: str  # strategy, or strategy+compressor
    strategy: str
    options: dict
    record: dict
    memory_bytes: float
    reason: str


def buffer_bytes(strategy: str, model_bytes: int, np: int, ratio: float = 1.0) -> float:
    """Memory a strategy adds on a worker beyond the model, its gradients and the optimizer's
    state: its gradient buckets, send and receive buffers, snapshots (from each strategy's
    buffers as its module describes them)."""
    extra = {
        "ddp": 1.0, "allreduce": 1.0, "allreduce-priority": 1.0,  # one bucket per gradient
        "ps": 2.0, "ps-async": 2.0,  # pushes out, pulls in
        "p3": 2.0, "ps-sliced": 2.0,  # slices out, answers in
        "casync-ring": 1.0 + 2 * ratio, "casync-ps": 1.0 + 2 * ratio,
        "compressed-allgather": 1.0 + np * ratio,  # every worker's payload held at once
        "sma": 1.0, "pair-averaging": 2.0,  # the average; the snapshot served and the peer's model
        "hybrid": 1.0,  # buckets of its dense parameters (model_bytes: those); a table's rows are few
        "local-sgd": 2.0, "diloco": 3.0,  # the shared copy and its bucket; diloco's outer momentum too
    }
    return extra.get(strategy, 1.0) * model_bytes


def candidates(servers: int, compression: list[str]) -> list[tuple[str, str, dict]]:
    """``(label, strategy, options)`` for every simulated strategy that can run on this shape."""
    out = []
    for name in SIMULATED:
        if name in NEEDS_SERVERS and not servers:
            continue
        if name in ("local-sgd", "diloco"):
            out += [c for c in RARE if c[1] == name]
        elif name in COMPRESSED:
            for spec in compression:
                if name != "casync-ring" and spec.split(":")[0] == "powersgd":
                    continue  # its factors are all-reduced: casync-ring only
                out.append((f"{name}+{spec}", name, {"compression": spec}))
        else:
            out.append((name, name, {}))
    return out


def rank(workload, np: int, net, host=None, servers: int = 0, compression: list[str] | None = None,
         steps: int = 5, warmup: int = 2, only: list[str] | None = None) -> list[Advice]:
    """Every candidate simulated on one cluster shape, best predicted throughput first."""
    from gradsync.simulate import simulate
    from gradsync.simulate.compressed import codec_cost

    compression = DEFAULT_COMPRESSION.split(";") if compression is None else compression
    out = []
    for label, strategy, options in candidates(servers, compression):
        if only is not None and strategy not in only:
            continue
        rec = simulate(strategy, workload, np, net, host=host, servers=servers, options=options,
                       steps=steps, warmup=warmup)
        ratio = 1.0
        if strategy in COMPRESSED:
            from gradsync.compress import parse_spec

            name, opts = parse_spec(options["compression"])
            ratio = codec_cost(name, opts, 1.0).ratio
        buffered = rec.get("dense_bytes", workload.nbytes)  # hybrid buckets only its dense parameters
        out.append(Advice(label, strategy, options, rec, buffer_bytes(strategy, buffered, np, ratio),
                          _reason(strategy, options, rec, workload, ratio)))
    out.sort(key=lambda a: -a.record["samples_per_s"])
    return out


def _reason(strategy: str, options: dict, rec: dict, workload, ratio: float) -> str:
    moved = rec["bytes_per_step"] / 2**20
    exposed = max(0.0, rec["step_s"] - rec["compute_s"])
    hidden = 1.0 - exposed / rec["step_s"] if rec["step_s"] > 0 else 1.0
    parts = [f"{moved:,.1f} MB out per step and worker", f"{exposed * 1e3:,.1f} ms of the step not hidden "
             f"behind compute ({hidden:.0%} of the step computes)"]
    if strategy in COMPRESSED:
        parts.append(f"{options['compression']} sends {ratio:.1%} of the bytes (lossy: see gradsync codecs --convergence)")
    if strategy in INEXACT:
        parts.append(INEXACT[strategy])
    if strategy in ("local-sgd", "diloco"):
        parts.append(f"synchronizes every {options['H']} steps; not exact: {loss_gap(strategy, options)}")
    if strategy == "hybrid":
        parts.append(f"row servers for {rec['plan']}; needs Gloo (tables on the CPU)" if rec.get("plan")
                     else "no embedding table read sparsely: the same as allreduce")
    return "; ".join(parts)


def experiment_label(strategy: str, options: dict) -> str:
    """How the experiment's cells name a strategy with options: ``NAME[:OPTION=VALUE,...]`` without ``H``."""
    rest = ",".join(f"{k}={v}" for k, v in options.items() if k != "H")
    return f"{strategy}:{rest}" if rest else strategy


def loss_gap(strategy: str, options: dict) -> str:
    """The measured loss of ``strategy`` against synchronous training's at equal tokens, from the
    newest stored run of :data:`EXPERIMENT` (the user's store first, then the shipped runs)."""
    import os

    for path in (default_path(), SHIPPED):
        if not os.path.exists(path):
            continue
        store = Store(path, readonly=True)
        try:
            run = store.latest(EXPERIMENT)
            records = store.records(run["id"]) if run else []
        finally:
            store.close()
        at = [r for r in records if r["cell"].get("net") == "1gbit"]
        sync = [r["loss"] for r in at if r["cell"]["strategy"] == "allreduce"]
        mine = [r["loss"] for r in at if r["cell"]["strategy"] == experiment_label(strategy, options)
                and r["cell"]["H"] == options["H"]]
        if sync and mine:
            return (f"held-out loss {mine[0] / sync[0] - 1:+.1%} against allreduce at equal tokens "
                    f"(gradsync experiment show {EXPERIMENT}: an LSTM language model, 4 workers)")
    return f"its loss against allreduce is not measured here (gradsync experiment run {EXPERIMENT})"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("advise", help="rank strategies and compressors for a model on a cluster (simulated)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model NAME[:SIZE]")
    p.add_argument("--np", "-np", type=int, required=True, help="workers")
    p.add_argument("--net", required=True, metavar="RATE", help="host link rate, e.g. 10gbit; 'unlimited' for none")
    p.add_argument("--latency-us", type=float, default=50.0, help="one-way latency of a message in µs (default 50)")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="workers (ranks) on each host, sharing its NIC (default 1): the strategies' two-level schedules")
    p.add_argument("--gpus-per-host", type=int, default=1, help="the older name of --ranks-per-host")
    p.add_argument("--intra-gbps", type=float, default=12.0, help="GB/s between the ranks of one host (default 12)")
    p.add_argument("--servers", type=int, default=0, help="dedicated parameter-server hosts (default 0)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--compute", default="", metavar="PROFILE", help="compute profile (default: the model's shipped one)")
    p.add_argument("--compression", default=DEFAULT_COMPRESSION, metavar="SPEC[;SPEC...]",
                   help=f"compressors to try with the compressed strategies (default {DEFAULT_COMPRESSION})")
    add_host_arguments(p)
    p.set_defaults(handler=main)


def main(args) -> int:
    from gradsync.errors import GradsyncError
    from gradsync.simulate import load
    from gradsync.simulate.cli import _rates, at_least, host_of, network_of

    error = argparse.ArgumentParser(prog="gradsync advise").error
    at_least(args, error, np=1, batch_size=1, gpus_per_host=1, servers=0, latency_us=0)
    if args.intra_gbps <= 0:
        error(f"--intra-gbps must be > 0, got {args.intra_gbps:g}")
    host = host_of(args, error)
    rates = _rates(args.net, error)
    if len(rates) != 1:
        error(f"--net takes one rate, got {args.net!r}")
    compression = [c for c in args.compression.split(";") if c]
    try:
        from gradsync.compress import build, parse_spec

        for spec in compression:
            name, opts = parse_spec(spec)
            build(name, **opts)
        workload = load(args.model, args.batch_size, args.compute or None)
        net = network_of(args, error, rates[0])
        ranked = rank(workload, args.np, net, host, args.servers, compression)
    except GradsyncError as exc:
        print(f"gradsync advise: {exc}", file=sys.stderr)
        return 2
    net_text = "unlimited links" if rates[0] is None else f"{rates[0] / 1e9:g} Gbit/s links"
    print(f"gradsync advise: {args.model}, {args.np} workers, {net_text}, batch {args.batch_size}, "
          f"{workload.nbytes / 2**20:.1f} MB of parameters, {workload.compute_s * 1e3:.1f} ms of compute per step "
          f"(predicted by the event simulator; docs/simulate.md)\n")
    best = ranked[0].record["samples_per_s"]
    w = max(len(a.label) for a in ranked)
    print(f"{'#':>2} {'strategy':<{w}} {'samples/s':>10} {'vs best':>8} {'+memory MB':>10}  why")
    for i, a in enumerate(ranked, 1):
        print(f"{i:>2} {a.label:<{w}} {a.record['samples_per_s']:>10.1f} {a.record['samples_per_s'] / best:>8.2f} "
              f"{a.memory_bytes / 2**20:>10.0f}  {a.reason}")
    return 0
