"""``gradsync bench``'s arguments: the options, and turning them into checked run configurations
(strategies with their compressors and monitors, ``--set`` overrides, rates and dilation, worker
counts). :mod:`gradsync.bench.cli` runs what they describe."""
from __future__ import annotations

import argparse
import json
import sys

from gradsync.argtypes import available_bytes, checked, output_dir, output_file
from gradsync.emulate.slow import SlowRanks
from gradsync.launch.emulated import SERVER_HOSTS

DEFAULT_STRATEGIES = ["ddp", "allreduce", "ps", "ps-async"]
AUTO_REAL_RATE = 1e9  # bits/s: the fastest real link rate --dilation auto allows (see docs/emulation.md)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``gradsync bench``'s options on ``p``."""
    p.add_argument("--model", default="resnet50:tiny",
                   help="model NAME[:SIZE] (default resnet50:tiny), or your own package.module:function "
                        "returning (model, make_batch, loss): see gradsync.models.user")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help="comma-separated strategies (default: all that can run); STRATEGY:flat runs a strategy "
                        "without its host-aware form (with --ranks-per-host), beside it")
    p.add_argument("--np", "-np", default="2", help="number of workers, or a comma-separated list (default 2)")
    p.add_argument("--servers", type=int, default=0, help="dedicated parameter-server ranks (default 0: co-located)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per strategy, over all rounds (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of every round (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds that interleave the strategies, so drift hits all alike (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9), adam or adagrad (default sgd)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate of every strategy and the reference (default 0.01)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model's initial parameters and of the batches (default 0)")
    p.add_argument("--compression", metavar="SPEC[;SPEC...]",
                   help="compressors (docs/compression.md), e.g. onebit or 'onebit;topk:ratio=0.01': every "
                        "strategy that takes one runs once per compressor, as STRATEGY+SPEC (casync-ring, casync-ps, "
                        "compressed-allgather; allreduce and ddp where the payloads add up); the others run plain")
    p.add_argument("--monitors", metavar="NAME[,NAME...]",
                   help="also run every strategy with each monitor attached, as STRATEGY@NAME, to measure its cost: "
                        "noise-scale, variance (exact) or variance-sampled (gradsync.adapt)")
    p.add_argument("--balance", action="store_true",
                   help="also run every strategy that averages gradients over workers under BalanceBatches, as "
                        "STRATEGY@balance: each worker's share of the global batch follows its measured speed "
                        "(gradsync.adapt; --strategies allreduce@balance names one directly)")
    p.add_argument("--set", action="append", default=[], metavar="STRATEGY.KEY=VALUE",
                   help="a strategy option, e.g. ps.fuse_kb=0 or allreduce.bucket_mb=4 (repeatable)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write one record per strategy to FILE")
    p.add_argument("--out", metavar="DIR", type=output_dir, help="write the chart (bench.png) and records (bench.json) to DIR")
    p.add_argument("--check-steps", type=int, default=5,
                   help="steps of the float64 correctness replay (default 5; 0 skips the check)")
    p.add_argument("--net", metavar="RATE[,RATE...][,rankN=RATE...]",
                   help="emulate hosts with links of RATE (e.g. 1gbit,10gbit: one run per rate), one rank per host "
                        "unless --ranks-per-host; rankN=RATE gives the host holding rank N a link of its own in every "
                        "run (1gbit,rank1=250mbit: a slow link); needs root")
    p.add_argument("--ranks-per-host", type=int, default=1, metavar="R",
                   help="with --net: R workers per emulated host, sharing its link (default 1); R must divide --np")
    p.add_argument("--server-hosts", choices=SERVER_HOSTS, default=None,
                   help="with --net and --servers: own (default) puts the servers on hosts of their own, "
                        "--ranks-per-host to a host; shared puts them on the workers' hosts, server j on host j mod H")
    p.add_argument("--machine", metavar="NAME",
                   help="run on the hosts of a registered machine (gradsync machine add NAME --hosts FILE), "
                        "started over ssh from its first host, which is this one; its links are real, so no --net")
    p.add_argument("--delay", type=float, default=0.0, metavar="MS",
                   help="with --net: one-way host-to-host delay in ms (undilated; a user-space delay line)")
    p.add_argument("--compute", default="real", metavar="real|emulated[:PROFILE]",
                   help="run the model (real), or emulate an accelerator from a compute profile "
                        "(emulated: the model's shipped profile; emulated:flops:15tflops; emulated:FILE.json)")
    p.add_argument("--slow", action="append", default=[], type=checked(SlowRanks.parse), metavar="RANK:FACTOR",
                   help="emulated compute only: worker RANK's layers take FACTOR (>= 1) times as long, a straggler "
                        "(repeatable, or 3:2,1:1.25)")
    p.add_argument("--dilation", default="1", metavar="K|auto[:RATE]",
                   help="emulated compute only: multiply layer times and divide link rates by K (default 1); "
                        f"auto: per rate, max(1, rate / {AUTO_REAL_RATE / 1e9:g} Gbit/s); auto:RATE: "
                        "max(1, rate / RATE), e.g. auto:500mbit when the cpu column is near 100 %%")
    p.add_argument("--tune", action="store_true",
                   help="before measuring, search each tunable strategy's knobs (p3: slice size and credit; "
                        "allreduce-priority: partition size and credit) on the live cluster, and report every probe")
    p.add_argument("--tune-steps", type=int, default=6, help="measured steps per tuning probe (default 6)")
    p.add_argument("--trace", metavar="FILE", type=output_file, help="write a Chrome trace of the last round (open in ui.perfetto.dev)")


def _rates(args, parser_error) -> list[float | None]:
    """``--net`` as undilated bits/s per run; ``[None]`` (loopback) without it; with ``--machine``
    the machine's own rate (its hosts file's ``net``), not emulated."""
    from gradsync.cluster import parse_rate, require_privileges
    from gradsync.errors import ConfigError

    args.machine = getattr(args, "machine", None)  # a Namespace built without it runs here
    if args.machine:
        from gradsync.launch import machines

        if args.net:
            parser_error(f"--net emulates links on this host; machine {args.machine!r} has real ones: drop --net "
                         "(the hosts file's \"net\" is the rate the efficiency column uses)")
        try:
            args.machine_hosts = {"name": args.machine, **machines.get(args.machine)}
            machines.require_first_host_here(args.machine_hosts)
            machines.master_addr(args.machine_hosts)
        except ConfigError as exc:
            parser_error(str(exc))
        net = args.machine_hosts.get("net")
        return [parse_rate(str(net)) if net else None]
    args.machine_hosts = None
    if not args.net:
        return [None]
    from gradsync.cluster import parse_net

    try:
        runs = parse_net(args.net)
    except ConfigError as exc:
        parser_error(f"--net {args.net}: {exc}")
    try:
        require_privileges()
    except ConfigError as exc:
        parser_error(str(exc))
    args.rank_rates = runs[0].ranks
    return [run.default for run in runs]


def _cluster_args(args, parser_error) -> None:
    """Parse --np lists, --net, --delay and --dilation in place (``args.dilation`` None means auto,
    up to ``args.auto_real_rate`` bits/s really on a link)."""
    try:
        args.np_list = [int(n) for n in str(args.np).split(",")]
    except ValueError:
        parser_error(f"--np must be a number or a comma-separated list of numbers, got {args.np!r}")
    _placement_args(args, parser_error)
    args.rank_rates = {}
    args.rates = _rates(args, parser_error)
    _straggler_args(args, parser_error)
    if args.delay < 0 or (args.delay and not args.net):
        parser_error("--delay needs --net and must be >= 0")
    from gradsync.cluster import parse_rate
    from gradsync.errors import ConfigError

    text = str(args.dilation)
    auto = text == "auto" or text.startswith("auto:")
    args.auto_real_rate = AUTO_REAL_RATE
    try:
        if text.startswith("auto:"):
            args.auto_real_rate = parse_rate(text[len("auto:"):])
        args.dilation = None if auto else float(text)
    except (ValueError, ConfigError) as exc:
        parser_error(f"--dilation must be a number >= 1, auto, or auto:RATE (e.g. auto:500mbit), got {text!r}"
                     + (f" ({exc})" if isinstance(exc, ConfigError) else ""))
    if not auto and args.dilation < 1:
        parser_error(f"--dilation must be >= 1, got {args.dilation}")
    if args.machine_hosts is not None:  # real links: nothing to dilate
        if not auto and args.dilation != 1:
            parser_error(f"--dilation slows emulated links; machine {args.machine!r} has real ones (drop --dilation)")
        args.dilation = 1.0
    if (auto or args.dilation != 1) and not args.compute.startswith("emulated"):
        parser_error("--dilation needs --compute emulated: real computation cannot be slowed down")


def _straggler_args(args, parser_error) -> None:
    """Check ``--slow`` (``args.slow``: merged into one :class:`SlowRanks`) and ``--net``'s rankN=RATE
    (``args.rank_rates``) against every run's ranks and hosts."""
    from gradsync.cluster import LinkRates
    from gradsync.errors import ConfigError
    from gradsync.launch.emulated import placement

    servers = getattr(args, "servers", 0)
    try:
        args.slow = SlowRanks.union(getattr(args, "slow", None) or [])
        args.slow.check(min(args.np_list), servers)  # a worker of the smallest run is one of every run
    except ConfigError as exc:
        parser_error(f"--slow: {exc}" + (f" (with --np {min(args.np_list)})" if len(args.np_list) > 1 else ""))
    if args.slow and not str(getattr(args, "compute", "real")).startswith("emulated"):
        parser_error("--slow needs --compute emulated: real computation cannot be slowed down")
    try:
        for np in args.np_list:
            LinkRates(0.0, args.rank_rates).per_host(placement(np, servers, args.ranks_per_host, args.server_hosts))
    except ConfigError as exc:
        parser_error(f"--net {args.net}: {exc}" + (f" (with --np {np})" if len(args.np_list) > 1 else ""))


def _placement_args(args, parser_error) -> None:
    """Check ``--ranks-per-host`` and ``--server-hosts`` against ``--net``, ``--np`` and ``--servers``
    (``args.np_list`` parsed); ``args.server_hosts`` is set to its default where not given."""
    per_host = getattr(args, "ranks_per_host", 1)  # a Namespace built without them runs here
    where = getattr(args, "server_hosts", None)
    args.ranks_per_host, args.server_hosts = per_host, where or "own"
    if per_host < 1:
        parser_error(f"--ranks-per-host must be >= 1, got {per_host}")
    for flag, given in (("--ranks-per-host", per_host != 1), ("--server-hosts", where is not None)):
        if given and not args.net:
            machine = getattr(args, "machine", None)
            parser_error(f"{flag} places ranks on emulated hosts: it needs --net"
                         + (f" (machine {machine!r} places them on its own hosts)" if machine else ""))
    if where is not None and not args.servers:
        parser_error("--server-hosts places dedicated servers: it needs --servers 1 or more")
    uneven = [n for n in args.np_list if n % per_host]
    if uneven:
        parser_error(f"--ranks-per-host {per_host} must divide --np {uneven[0]}: every host runs {per_host} workers "
                     f"(--np {per_host}, {2 * per_host}, ...)")


def _validate(args, parser_error) -> list[str]:
    from gradsync.bench.workload import OPTIMIZERS, Workload
    from gradsync.errors import ConfigError
    from gradsync.models import get_model
    from gradsync.strategies import STRATEGIES
    from gradsync.strategies import names as strategy_names

    _cluster_args(args, parser_error)
    for flag, value, low in [("--np", min(args.np_list), 1), ("--batch-size", args.batch_size, 1), ("--steps", args.steps, 1),
                             ("--servers", args.servers, 0), ("--warmup", args.warmup, 0), ("--threads", args.threads, 1),
                             ("--check-steps", args.check_steps, 0), ("--rounds", args.rounds, 1),
                             ("--tune-steps", args.tune_steps, 1)]:
        if value < low:
            parser_error(f"{flag} must be >= {low}, got {value}")
    if args.machine_hosts is not None:
        slots = sum(h["slots"] for h in args.machine_hosts["hosts"])
        if max(args.np_list) > slots:
            parser_error(f"--np {max(args.np_list)} exceeds the {slots} slots of machine {args.machine!r}")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s.removesuffix("@balance").removesuffix(":flat") not in STRATEGIES]
    if unknown or not names:
        parser_error(f"unknown strategy {', '.join(unknown) or '(none)'}; valid strategies: {', '.join(strategy_names())}")
    if args.optimizer not in OPTIMIZERS:
        parser_error(f"unknown optimizer {args.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    if not 0 < args.lr < float("inf"):
        parser_error(f"--lr must be > 0, got {args.lr:g}")
    try:
        get_model(args.model)
        Workload(model=args.model, batch_size=args.batch_size, compute=args.compute, dilation=args.dilation or 1.0).spec()
    except (ValueError, ConfigError) as exc:
        parser_error(str(exc))
    if args.machine_hosts is None:
        _check_memory(args, parser_error)
    if args.compression:
        names = _with_compression(names, args.compression, parser_error)
    if args.monitors:
        names = _with_monitors(names, args.monitors, parser_error)
    names = _with_balance(names, args.balance, parser_error)
    flat = [n for n in names if n.endswith(":flat")]
    if flat and getattr(args, "ranks_per_host", 1) == 1:
        print(f"note: {', '.join(flat)} run as their plain forms: with one worker per host every strategy is flat",
              flush=True)
    if args.servers == 0 and "ps-async" in names:
        names.remove("ps-async")
        print("note: skipping ps-async, which needs dedicated servers (--servers 1 or more)", flush=True)
    return names


RANK_BASE_BYTES = 200 * 2**20  # a rank's process with torch and gradsync imported (about 220 MB measured)


def _check_memory(args, parser_error) -> None:
    """Refuse a run on this machine that cannot fit in its memory: every rank holds the model's
    parameters, gradients and optimizer state (at least 3x its parameters; 3-6x measured) beside
    a process's own 200 MB. Larger scales are what ``gradsync simulate`` predicts."""
    from gradsync.models import get_model

    available = available_bytes()
    if available is None:
        return
    try:
        params = sum(p.numel() * p.element_size() for p in get_model(args.model).build_meta().parameters())
    except Exception:  # noqa: BLE001 - a model that cannot be built on the meta device is not checked here
        return
    ranks = max(args.np_list) + args.servers
    need = ranks * (RANK_BASE_BYTES + 3 * params)
    if need > available:
        parser_error(f"--np {max(args.np_list)}" + (f" with --servers {args.servers}" if args.servers else "")
                     + f": {ranks} ranks of {args.model} ({params / 2**20:.0f} MB of parameters) need at least "
                     f"{need / 2**30:.1f} GB on this machine, which has {available / 2**30:.1f} GB available; run "
                     "fewer workers, or predict this scale with gradsync simulate")


def _with_compression(names: list[str], specs: str, parser_error) -> list[str]:
    """Each strategy that takes a compressor once per spec, labelled ``STRATEGY+SPEC``, and plain too
    where compressing is its option rather than its purpose (``compression=None`` by default:
    allreduce, ddp, hybrid, diloco, local-sgd); others as they are."""
    from gradsync.errors import ConfigError, accepted_options
    from gradsync.strategies import STRATEGIES, resolve

    out = []
    for name in names:
        if "@" in name:
            parser_error(f"--compression with {name}: name the strategy alone and add --balance (it runs "
                         "STRATEGY+SPEC@balance)")
        known, rest = accepted_options(STRATEGIES[name.removesuffix(":flat")])
        labels = []
        plain = any(p.name == "compression" and p.default is None for p in known)  # also uncompressed: the baseline
        if rest is None and all(p.name != "compression" for p in known):
            out += [] if name in out else [name]  # the strategy takes no compressor: it runs plain, once
            continue
        for spec in filter(None, (s.strip() for s in specs.split(";"))):
            try:
                resolve(name.removesuffix(":flat"), compression=spec)
            except ConfigError as exc:
                if "cannot" in str(exc) or "does not take" in str(exc):  # a valid spec this strategy refuses
                    what = "runs plain, without" if plain else "skips"
                    print(f"note: {name} {what} {spec}: {exc}", flush=True)
                    continue
                parser_error(f"--compression {spec!r} with {name}: {exc}")
            labels.append(f"{name}+{spec}")
        out += labels + ([name] if plain and name not in out else [])
    if not out:
        parser_error(f"none of --strategies {','.join(names)} takes --compression {specs!r}")
    return out


def _with_monitors(names: list[str], monitors: str, parser_error) -> list[str]:
    """Each label as it is, then once per monitor as ``LABEL@MONITOR`` (strategies that can carry it)."""
    from gradsync.bench.worker import MONITORS, strategy_of
    from gradsync.strategies import STRATEGIES

    wanted = [m.strip() for m in monitors.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in MONITORS]
    if unknown or not wanted:
        parser_error(f"unknown monitor {', '.join(unknown) or '(none)'}; valid: {', '.join(MONITORS)}")
    out = []
    for name in names:
        out.append(name)
        if "@" in name:
            continue  # already a STRATEGY@balance
        if not getattr(STRATEGIES[strategy_of(name)], "mean_grads_at_apply", False):
            print(f"note: {name} runs without monitors: they read synchronized gradients, which it does not produce")
            continue
        out += [f"{name}@{m}" for m in wanted]
    return out


def _with_balance(names: list[str], wanted: bool, parser_error) -> list[str]:
    """``--balance``: each label, then ``LABEL@balance`` for strategies that can take unequal shares;
    a ``STRATEGY@balance`` given directly must be one of them."""
    from gradsync.bench.worker import BALANCE, balanced, strategy_of
    from gradsync.strategies import STRATEGIES

    def can(name: str) -> bool:
        made = STRATEGIES[strategy_of(name)]
        return made.mean_over_workers and made.waits_recorded

    for name in names:
        if balanced(name) and not can(name):
            parser_error(f"{name}: BalanceBatches needs a strategy that averages gradients over workers and whose "
                         f"waits gradsync times (allreduce, ps, p3, casync-*, hybrid, ...); {strategy_of(name)} is not one")
    if not wanted:
        return names
    out = []
    for name in names:
        out.append(name)
        if "@" in name:
            continue
        if can(name):
            out.append(f"{name}@{BALANCE}")
        else:
            print(f"note: {name} runs without BalanceBatches: it does not average gradients over workers, or waits "
                  "where gradsync cannot time it")
    return out


def _overrides(items: list[str], strategies: list[str], parser_error) -> dict[str, dict]:
    """``["ps.fuse_kb=0"]`` -> ``{"ps": {"fuse_kb": 0}}``; values are JSON (numbers, true/false) or strings;
    True/False/None in any case are the booleans and None."""
    out: dict[str, dict] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        name, dot, option = key.partition(".")
        if not (eq and dot and option) or name not in strategies:
            parser_error(f"--set {item!r}: expected STRATEGY.KEY=VALUE with STRATEGY one of {', '.join(strategies)}")
        words = {"true": True, "false": False, "none": None, "null": None}
        if raw.lower() in words:  # Python's spelling too: a string "False" would be truthy
            value = words[raw.lower()]
        else:
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
        out.setdefault(name, {})[option] = value
    return out


def _config(args, strategies: list[str], overrides: dict[str, dict], np: int, rate: float | None) -> dict:
    """One run: ``np`` workers, links of ``rate`` bits/s (undilated; None = loopback)."""
    from gradsync.models import get_model

    hints = get_model(args.model).options.get("strategy_options", {})
    dilation = args.dilation or max(1.0, (rate or 0.0) / args.auto_real_rate)  # None: --dilation auto
    workload = {"model": args.model, "batch_size": args.batch_size, "optimizer": args.optimizer,
                "lr": args.lr, "seed": args.seed, "compute": args.compute, "dilation": dilation}
    return {"workload": workload, "strategies": strategies, "np": np, "servers": args.servers,
            "steps": args.steps, "warmup": args.warmup, "threads": args.threads, "check_steps": args.check_steps,
            "rounds": args.rounds, "per_round": -(-args.steps // args.rounds), "rate_bps": rate,
            "rank_rates_bps": {str(r): bps for r, bps in args.rank_rates.items()} if rate is not None else {},
            "slow": str(args.slow), "ranks_per_host": args.ranks_per_host, "server_hosts": args.server_hosts,
            "delay_ms": args.delay if rate is not None else 0.0,
            "dilation": dilation, "machine": args.machine_hosts, "trace": bool(args.trace), "tune": args.tune, "tune_steps": args.tune_steps,
            "options": {s: _options(s, hints, overrides) for s in strategies}}


def _options(label: str, hints: dict, overrides: dict) -> dict:
    """A bench label's strategy options: the model's hints, ``--set``, and the ``+SPEC`` compressor."""
    name, plus, spec = label.partition("@")[0].partition("+")
    name = name.removesuffix(":flat")
    options = {**hints.get(name, {}), **overrides.get(name, {}), **overrides.get(label, {})}
    return {**options, "compression": spec} if plus else options


def _check_options(config: dict, parser_error) -> None:
    """Build each strategy once here, so a bad option is an argument error, not a crash in the ranks."""
    from gradsync.bench.worker import strategy_of
    from gradsync.errors import ConfigError
    from gradsync.strategies import resolve

    per_round = config["per_round"]
    for name, options in config["options"].items():
        try:
            made = resolve(strategy_of(name), **options)
        except ConfigError as exc:
            parser_error(str(exc))
        if made.period > 1 and per_round % made.period:
            print(f"gradsync bench: warning: {name} synchronizes every {made.period} steps but a round measures "
                  f"{per_round}; its mean step covers part of a period (use --steps {made.period * config['rounds']} "
                  f"or a multiple)", file=sys.stderr)
