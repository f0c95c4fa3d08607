"""Record the emulated runs that ``gradsync simulate --validate`` replays.

    python benchmarks/regenerate/simulator_matrix.py --out gradsync/simulate/validation.json
    python benchmarks/regenerate/simulator_matrix.py --held-out --out gradsync/simulate/held_out.json

Runs one ``gradsync bench --compute emulated`` per (model, workers, link rate, workers per host) on
the emulated cluster (root needed), with every simulated strategy side by side, and writes the records, each
group with its exact command and the host rates measured just before it (copy and update, alone
and as a fraction of that with every core at it, the fraction again just after the run; a thread
handoff, idle and with every core busy; for a group with ``p3``, ``ps-sliced`` or ``hybrid`` the cost of a message's end too, and for
one with compressed strategies the compressors' costs), as the validation matrix. ``--groups``
picks a subset by index (``--groups ""``: none); ``--held-out`` records :data:`HELD_OUT` instead,
cells of models, worker counts and rates the matrix has none of, which ``gradsync simulate
--validate held-out`` replays to show what the model does away from the cells it was fitted to;
``--message-cost`` measures the host cost of a slice message's end on loopback
(:func:`measure_message_cost`), ``--concurrency`` the rates with every core at it
(:func:`measure_concurrency`), ``--handoff`` a thread handoff
(:func:`gradsync.simulate.calibration.measure_handoff`) and ``--busy-wake`` one with every core busy
(:func:`measure_busy_wake`), and keep them with the matrix's rates.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

EXACT = "ddp,allreduce,ps,p3,ps-sliced,allreduce-priority"
OTHERS = "ddp,sma,pair-averaging,casync-ring,casync-ps,compressed-allgather"
SERVED = "ps,ps-async,p3"
HOSTED = "allreduce,allreduce:flat,ps,ps:flat,p3,p3:flat,ddp"  # hosts of several workers: two-level and flat
TABLES = "allreduce,ps,ddp"  # beside hybrid, which has groups of its own (below)
LM_COMPUTE = "emulated:flops:11.11tflops"  # lstm-lm's shipped V100 rate, on the CPU-sized shape
RARE = "allreduce,local-sgd,diloco"  # with --compression int4: diloco and diloco+int4, local-sgd and local-sgd+int4
RARE_SET = ["local-sgd.H=10", "diloco.H=10", "diloco.fragments=2", "diloco.delay=1"]
CODECS = ["onebit"]  # the compressed strategies' default
MESSAGED = {"p3", "ps-sliced", "hybrid"}  # the strategies whose Python threads handle each message (Host.message_s)
COMPRESSED = {"casync-ring", "casync-ps", "compressed-allgather"}
GROUPS = [  # (model, workers, rate, dedicated servers, strategies[, compute[, rounds]][, {more}])
    ("resnet50", 2, "1gbit", 0, EXACT), ("resnet50", 4, "1gbit", 0, EXACT),
    ("resnet50", 2, "10gbit", 0, EXACT), ("resnet50", 4, "10gbit", 0, EXACT),
    ("vgg19", 2, "1gbit", 0, EXACT), ("vgg19", 2, "10gbit", 0, EXACT),
    ("resnet50", 2, "1gbit", 0, OTHERS), ("resnet50", 4, "1gbit", 0, OTHERS),
    ("resnet50", 2, "10gbit", 0, OTHERS), ("resnet50", 4, "10gbit", 0, OTHERS),
    ("resnet50", 2, "1gbit", 1, SERVED), ("resnet50", 2, "10gbit", 1, SERVED),
    ("lstm-lm:cpu", 2, "1gbit", 0, TABLES, LM_COMPUTE), ("lstm-lm:cpu", 4, "1gbit", 0, TABLES, LM_COMPUTE),
    ("lstm-lm:cpu", 2, "10gbit", 0, TABLES, LM_COMPUTE), ("lstm-lm:cpu", 4, "10gbit", 0, TABLES, LM_COMPUTE),
    # hybrid, whose steps swing by up to 2x (the servers' updates meet the other ranks' threads on
    # two cores): 3 rounds of 12 measured steps. Its records in earlier groups of the shipped
    # matrix (one round, in the groups above) are superseded by these.
    ("lstm-lm:cpu", 2, "1gbit", 0, "hybrid", LM_COMPUTE, 3), ("lstm-lm:cpu", 4, "1gbit", 0, "hybrid", LM_COMPUTE, 3),
    ("lstm-lm:cpu", 2, "10gbit", 0, "hybrid", LM_COMPUTE, 3), ("lstm-lm:cpu", 4, "10gbit", 0, "hybrid", LM_COMPUTE, 3),
    # ps again, after its co-located workers posted their pulls' receives before their answers
    # (Gloo then carries both directions at full rate): these replace ps's records above.
    ("resnet50", 2, "1gbit", 0, "ps"), ("resnet50", 4, "1gbit", 0, "ps"),
    ("resnet50", 2, "10gbit", 0, "ps"), ("resnet50", 4, "10gbit", 0, "ps"),
    ("vgg19", 2, "1gbit", 0, "ps"), ("vgg19", 2, "10gbit", 0, "ps"),
    ("lstm-lm:cpu", 2, "1gbit", 0, "ps", LM_COMPUTE), ("lstm-lm:cpu", 4, "1gbit", 0, "ps", LM_COMPUTE),
    ("lstm-lm:cpu", 2, "10gbit", 0, "ps", LM_COMPUTE), ("lstm-lm:cpu", 4, "10gbit", 0, "ps", LM_COMPUTE),
    # The strategies whose one-round medians at 4 workers and 1 Gbit/s moved by 19-26 % between two
    # recordings (their decoding and averaging threads meet the other ranks' on two cores): 3 rounds.
    ("resnet50", 4, "1gbit", 0, "pair-averaging,casync-ring,casync-ps,compressed-allgather", "emulated", 3),
    # and the compressed strategies at 2 workers, whose casync-ps moved by 8.5 % between two one-round
    # recordings at two cores' time per rank: 3 rounds, replacing their records of group 6.
    ("resnet50", 2, "1gbit", 0, "casync-ring,casync-ps,compressed-allgather", "emulated", 3),
    # Hosts of two workers (``--ranks-per-host 2``: two emulated hosts of two workers behind one
    # link), each topology-aware strategy beside its flat form (``STRATEGY:flat``) and ``ddp``,
    # which stays flat. 4 measured steps (ResNet-50's steps at 1 Gbit/s and 4 workers last about a
    # second of undilated time, four of real time).
    ("resnet50", 4, "1gbit", 0, HOSTED, "emulated", 1, {"ranks_per_host": 2, "steps": 4, "warmup": 2}),
    # and at 10 Gbit/s, 8 measured steps of about 0.2 s, at a real rate of 500 Mbit/s: the hosts'
    # loopback hops add to the cores' work what one worker to a host does not have
    ("resnet50", 4, "10gbit", 0, HOSTED, "emulated", 1,
     {"ranks_per_host": 2, "steps": 8, "warmup": 2, "dilation": "auto:500mbit"}),
    # The strategies that synchronize every H steps, beside allreduce: 20 measured steps a round, two
    # whole periods of H = 10 (a round's mean step holds both synchronizations of every fragment).
    ("resnet50", 4, "1gbit", 0, RARE, "emulated", 1, {"steps": 20, "set": RARE_SET, "compression": "int4"}),
    ("resnet50", 4, "10gbit", 0, RARE, "emulated", 1, {"steps": 20, "set": RARE_SET, "compression": "int4"}),
    # pair-averaging once its answers had a channel of their own, its snapshot two buffers and its
    # peers came in turn: 3 rounds, replacing its records above.
    *(("resnet50", np, rate, 0, "pair-averaging", "emulated", 3) for rate in ("1gbit", "10gbit") for np in (2, 4)),
    # p3 on hosts of two at 1 Gbit/s over 3 rounds, replacing its one-round records of the hosts'
    # group: a round is 4 steps, and p3's threads meet the other ranks' on two cores.
    ("resnet50", 4, "1gbit", 0, "p3,p3:flat", "emulated", 3, {"ranks_per_host": 2, "steps": 4, "warmup": 2}),
    # diloco at 4 workers and 1 Gbit/s over 3 rounds, replacing its one-round records of the
    # rare-communication group (its int4 encodes meet the other ranks' work on two cores)
    ("resnet50", 4, "1gbit", 0, "diloco", "emulated", 3, {"steps": 20, "set": RARE_SET[1:], "compression": "int4"}),
    # The all-reduces on hosts of two as the two-level transport pipelines them (each all-reduce's
    # gather inside the host on a thread of its own, so the next buffer's steps do not wait for
    # it): allreduce, replacing its records of the hosts' groups, and allreduce-priority in both forms.
    *(("resnet50", 4, rate, 0, "allreduce,allreduce-priority,allreduce-priority:flat", "emulated", 1, more)
      for rate, more in (("1gbit", {"ranks_per_host": 2, "steps": 4, "warmup": 2}),
                         ("10gbit", {"ranks_per_host": 2, "steps": 8, "warmup": 2, "dilation": "auto:500mbit"}))),
]
HELD_OUT_STRATEGIES = "allreduce,ps,p3"  # a ring, whole tensors through servers, slices by priority
HELD_OUT = [  # cells the matrix was not fitted to: other models, worker counts and rates (``--held-out``)
    (model, np, rate, 0, HELD_OUT_STRATEGIES, "emulated", 1, {"steps": 8, "warmup": 2})
    for model, shapes in (("inception_v3", ((2, "2gbit"), (3, "5gbit"), (4, "3gbit"))),
                          ("bert-base", ((3, "2gbit"), (4, "5gbit"), (2, "3gbit"))),
                          ("transformer-nmt", ((4, "2gbit"), (2, "5gbit"), (3, "3gbit"))))
    for np, rate in shapes
]
SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "gradsync", "simulate", "validation.json")
SHAPE = ("model", "np", "net_bps", "servers", "batch_size", "compute", "ranks_per_host")


def supersede(groups: list[dict], newer: dict) -> None:
    """Move out of earlier groups' ``records`` the ones that ``newer`` measures again (same shape
    and strategy) into their ``superseded`` list, which the replay skips, saying so in their
    ``note``: the strategy changed after them."""
    again = {_shape(r) for r in newer["records"]}
    for group in groups:
        if group is newer:
            continue
        gone = [r for r in group["records"] if _shape(r) in again]
        if gone:
            group["records"] = [r for r in group["records"] if r not in gone]
            group["superseded"] = group.get("superseded", []) + gone
            names = ", ".join(sorted({r["strategy"] for r in gone}))
            group["note"] = (group.get("note", "") + f" {names}: left out here, measured again later by "
                             f"`{newer['command']}`.").strip()


def _shape(record: dict) -> tuple:
    """A record's shape and strategy label (records from before hosts of several workers have one
    worker to a host)."""
    return tuple(record.get(k, 1 if k == "ranks_per_host" else 0) for k in SHAPE) + (record["strategy"],)


def dilation(np: int, rate: str, servers: int, cores: int | None = None, rank_cores: float = 2.0) -> str:
    """``--dilation auto``, raised to ``rank_cores`` times the ranks per core where auto's K (the
    rate over 1 Gbit/s) is below it: each emulated host then has at least that many cores' time for
    its host work. Four workers on two cores at 1 Gbit/s and K = 1 measure this machine's
    contention, not the cluster (docs/emulation.md: a result is faithful once more dilation no
    longer changes it); ``p3`` there moves from one core's time to two, and little beyond
    (docs/simulate.md), hence two by default."""
    from gradsync.bench.args import AUTO_REAL_RATE
    from gradsync.cluster import parse_rate

    per_core = rank_cores * (np + servers) / (cores or os.cpu_count() or 1)
    return f"{per_core:g}" if per_core > max(1.0, parse_rate(rate) / AUTO_REAL_RATE) else "auto"


def command(model: str, np: int, rate: str, servers: int, strategies: str, out: str,
            compute: str = "emulated", rounds: int = 1, more: dict | None = None, rank_cores: float = 2.0) -> list[str]:
    """The group's ``gradsync bench`` command, writing its records to ``out``: 12 measured steps a
    round after 3 of warm-up, unless ``more`` says otherwise (``steps`` a round, ``warmup``,
    ``dilation``: ``--dilation``'s value, else :func:`dilation`'s), ``more["ranks_per_host"]``
    workers to an emulated host (default 1), ``more["set"]``, ``--set`` options, and
    ``more["compression"]``, ``--compression``."""
    more = more or {}
    per_host = more.get("ranks_per_host", 1)
    return ["gradsync", "bench", "--model", model, "--compute", compute, "--np", str(np), "--net", rate,
            *(["--ranks-per-host", str(per_host)] if per_host > 1 else []),
            *(["--servers", str(servers)] if servers else []),
            "--dilation", more.get("dilation") or dilation(np, rate, servers, rank_cores=rank_cores),
            "--strategies", strategies,
            "--steps", str(more.get("steps", 12) * rounds), "--warmup", str(more.get("warmup", 3)),
            "--rounds", str(rounds), "--check-steps", "0",
            *[arg for setting in more.get("set", []) for arg in ("--set", setting)],
            *(["--compression", more["compression"]] if "compression" in more else []), "--json", out]


def group_command(index: int, out: str, rank_cores: float = 2.0, table: list | None = None) -> list[str]:
    """:func:`command` of ``GROUPS[index]`` (or of ``table[index]``)."""
    model, np, rate, servers, strategies, *rest = (table or GROUPS)[index]
    more = rest.pop() if rest and isinstance(rest[-1], dict) else None
    return command(model, np, rate, servers, strategies, out, *rest, more=more, rank_cores=rank_cores)


def _calibrated(count: int, seconds: float | None = None) -> list[dict]:
    """``calibrate()`` in ``count`` processes at once, under the emulated ranks' allocator settings
    (and large tensors on transparent huge pages, the bench's default): each process's rates.
    With ``seconds``, every process measures each rate for that long from one common start (a few
    seconds ahead: the processes import torch first), so that their work overlaps."""
    from gradsync.bench.cli import emulated_rank_env

    timing = "" if seconds is None else f"start_at={time.time() + 8.0!r}, seconds={seconds!r}, handoff_repeats=0"
    code = ("import json; from gradsync.simulate.calibration import calibrate; "
            f"print(json.dumps(calibrate({timing})))")
    env = {**os.environ, **emulated_rank_env()}
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(count)]
    outs = [run.communicate()[0] for run in runs]
    if any(run.returncode for run in runs):
        raise RuntimeError("calibrate() failed in a child process")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def measure_concurrency(rounds: int = 3, seconds: float = 1.5) -> dict:
    """How fast host work runs while every core of this machine does it at once, as a fraction of
    one process alone: ``calibrate()`` for ``seconds`` per rate in one process, then in one process
    per core over the same seconds (the median of ``rounds`` each; a round at once counts its
    processes' mean). What the cores share (memory bandwidth) shows here; the emulated ranks do
    their host work together, in lock step. On the 2-core machine that recorded the latest groups
    it moves from minute to minute: measurements within one hour gave 0.59-0.95x for copies and
    for updates alike (two ``hybrid`` servers' update of 101.6 MB: 34-36 ms or 55-62 ms each at
    once, 32-41 ms alone, docs/mechanisms.md); on the machine that recorded
    the earlier ones, that update took 68 ms alone and 71-75 ms in each of two at once."""
    cores = os.cpu_count() or 1
    alone = [_calibrated(1, seconds)[0] for _ in range(rounds)]
    together = [_calibrated(cores, seconds) for _ in range(rounds)]
    found = {"processes": cores}
    for key in ("copy_Bps", "update_Bps"):
        busy = statistics.median(sum(run[key] for run in rnd) / len(rnd) for rnd in together)
        found[key] = min(busy / statistics.median(run[key] for run in alone), 1.0)
    return found


def measure_host_rates(processes: int = 5) -> dict:
    """``calibrate()`` in processes with the allocator settings of the emulated runs' ranks (and
    large tensors on transparent huge pages, the bench's default): the fastest of ``processes``,
    and their median thread handoff. One process alone can mislead: in some, every optimizer
    step's 128 MB temporary buffer lands
    on fresh pages and the update runs at a fifth of its usual rate (0.3 instead of 1.6 GB/s),
    while the emulated ranks' updates run at the usual rate (``gradsync bench --trace``: a
    hybrid server's optimizer step over 101.6 MB takes 63-70 ms, 1.5-1.6 GB/s)."""
    runs = [_calibrated(1)[0] for _ in range(processes)]
    rates = {key: max(run[key] for run in runs) for key in ("copy_Bps", "update_Bps")}
    rates["handoff_s"] = statistics.median(run["handoff_s"] for run in runs)
    return {**rates, "busy_wake_s": measure_busy_wake(), "concurrent": measure_concurrency()}


def measure_busy_wake(rounds: int = 5) -> float:
    """``Host.busy_wake_s`` of this machine: the median of ``rounds`` of
    :func:`gradsync.simulate.calibration.measure_busy_wake` (each the mean of 300 wakes)."""
    from gradsync.simulate.calibration import measure_busy_wake as one

    return statistics.median(one() for _ in range(rounds))


MESSAGE_RUN = ["gradsync", "bench", "--model", "resnet50", "--compute", "emulated", "--np", "2",
               "--strategies", "allreduce,ps-sliced", "--steps", "12", "--warmup", "3", "--rounds", "1",
               "--check-steps", "0"]


def measure_message_cost(rates: dict) -> dict:
    """``Host.message_s`` of this machine, from one loopback run (:data:`MESSAGE_RUN`): there
    ``ps-sliced`` (512 slices a step) is bound by its Python threads' handling of the slice
    messages. Gloo over loopback is CPU-bound too, so the simulator's loopback link is first set
    to the rate at which its ``allreduce`` step equals the measured one; then ``message_s`` to
    where its ``ps-sliced`` step does. No cell of the matrix is used."""
    from gradsync.simulate import Host, Network, load, simulate

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        subprocess.run([sys.executable, "-m", "gradsync.cli", *MESSAGE_RUN[1:], "--json", out], check=True)
        with open(out) as f:
            measured = {r["strategy"]: r for r in json.load(f)}
    work = load("resnet50", 32, None)

    def step(strategy: str, rate_bps: float, message_s: float) -> float:
        host = Host(rates["copy_Bps"], rates["update_Bps"], handoff_s=rates.get("handoff_s", 20e-6), message_s=message_s)
        return simulate(strategy, work, 2, Network(rate_bps, 50e-6), host=host, steps=8, warmup=3)["step_s"]

    def solve(f, target: float, lo: float, hi: float) -> float:  # f increasing in its argument
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return lo

    rate = 1 / solve(lambda inv: step("allreduce", 1 / inv, 0.0), measured["allreduce"]["step_s"], 1e-12, 1e-8)
    message_s = solve(lambda c: step("ps-sliced", rate, c), measured["ps-sliced"]["step_s"], 0.0, 5e-3)
    return {"message_s": message_s, "message_run": {
        "command": " ".join(MESSAGE_RUN), "loopback_bps": rate,
        "records": [{k: r.get(k) for k in ("strategy", "step_s", "host_cpu_busy")} for r in measured.values()]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--groups", default=None, help="indices of GROUPS (or HELD_OUT) to record ('' for none; "
                                                       "default: all)")
    parser.add_argument("--held-out", action="store_true",
                        help="record HELD_OUT instead of GROUPS: cells the matrix was not fitted to, replayed with "
                             "the shipped matrix's machine constants where a group has none of its own")
    parser.add_argument("--message-cost", action="store_true",
                        help="measure the slice messages' host cost (Host.message_s) and keep it with the matrix's rates")
    parser.add_argument("--handoff", action="store_true",
                        help="measure a thread handoff (calibration.measure_handoff) and keep it with the matrix's rates, "
                             "for the groups recorded without their own")
    parser.add_argument("--busy-wake", action="store_true",
                        help="measure a thread's wakeup with every core busy (Host.busy_wake_s) and keep it with "
                             "the matrix's rates, for the groups recorded without their own")
    parser.add_argument("--concurrency", action="store_true",
                        help="measure how fast host work runs with every core at it (measure_concurrency) and keep "
                             "it with the matrix's rates, for the groups recorded without their own")
    parser.add_argument("--again", default="",
                        help="indices of GROUPS (or HELD_OUT; recorded on this machine) whose thread handoff and "
                             "message cost to measure again, without running them again (a handoff measured "
                             "before calibration.measure_handoff left out the ones that waited out the switch "
                             "interval; a message cost measured while something else ran)")
    parser.add_argument("--rank-cores", type=float, default=2.0,
                        help="cores' time each emulated rank gets at least: the dilation is raised to this many "
                             "times the ranks per core (default 2)")
    parser.add_argument("--codecs", default="",
                        help="indices of GROUPS (recorded on this machine) whose compressors' costs to measure again, "
                             "as the ranks meet them (calibrate_codecs), without running them again")
    args = parser.parse_args()
    if not args.rank_cores > 0:
        parser.error(f"--rank-cores must be > 0, got {args.rank_cores:g}")
    from gradsync.simulate.calibration import calibrate_codecs

    table = HELD_OUT if args.held_out else GROUPS
    if args.groups is None:
        args.groups = ",".join(str(i) for i in range(len(table)))
    for flag, value in (("--groups", args.groups), ("--codecs", args.codecs), ("--again", args.again)):
        wrong = [i for i in value.split(",") if i and not (i.isdigit() and int(i) < len(table))]
        if wrong:
            parser.error(f"{flag}: no group {', '.join(wrong)} (indices 0-{len(table) - 1} of "
                         f"{'HELD_OUT' if args.held_out else 'GROUPS'})")
    groups, host_rates, codecs, kept = [], None, None, {}
    if os.path.exists(args.out):  # keep the groups already recorded
        with open(args.out) as f:
            kept = json.load(f)
        groups, host_rates, codecs = kept["groups"], kept.get("host_rates"), kept.get("codecs")
    elif args.held_out:  # the machine constants the shipped matrix's replay uses (mesh, jitter, loopback)
        with open(SHIPPED) as f:
            kept = {k: v for k, v in json.load(f).items() if k != "groups"}
        host_rates, codecs = kept.get("host_rates"), kept.get("codecs")
    host_rates = host_rates or measure_host_rates()  # groups recorded without rates of their own
    codecs = codecs or calibrate_codecs(CODECS)
    if args.message_cost:
        found = measure_message_cost({**host_rates, **measure_host_rates()})  # this machine, now
        host_rates = {**host_rates, "message_s": found["message_s"]}
        kept = {**kept, "message_run": found["message_run"], "host_rates": host_rates}
        print(f"message_s {found['message_s'] * 1e6:.0f} us", flush=True)
    if args.handoff:
        found = statistics.median(_calibrated(1)[0]["handoff_s"] for _ in range(5))
        host_rates = {**host_rates, "handoff_s": found}
        kept = {**kept, "host_rates": host_rates}
        print(f"handoff {found * 1e6:.0f} us", flush=True)
    if args.busy_wake:
        found = measure_busy_wake()
        host_rates = {**host_rates, "busy_wake_s": found}
        kept = {**kept, "host_rates": host_rates}
        print(f"busy wake {found * 1e3:.2f} ms", flush=True)
    if args.concurrency:
        host_rates = {**host_rates, "concurrent": measure_concurrency()}
        kept = {**kept, "host_rates": host_rates}
        print(f"with every core at it: {host_rates['concurrent']}", flush=True)
    for index in (int(i) for i in args.groups.split(",") if i):
        model, np, rate, servers, strategies, *_ = table[index]
        rates = measure_host_rates()  # the machine's host work as this group met it
        names = set(strategies.split(","))
        more = table[index][-1] if isinstance(table[index][-1], dict) else {}
        if "compression" in more:  # the labels --compression adds
            names |= {f"{n}+{more['compression']}" for n in names}
        if names & MESSAGED:  # and its Python's per-message cost, where messages can bound the step
            rates["message_s"] = measure_message_cost(rates)["message_s"]
        wanted = (CODECS if names & COMPRESSED else []) + sorted({n.partition("+")[2] for n in names if "+" in n})
        own_codecs = calibrate_codecs(wanted) if wanted else None  # a label's STRATEGY+CODEC too
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "records.json")
            argv = group_command(index, out, rank_cores=args.rank_cores, table=table)
            started = time.monotonic()
            subprocess.run([sys.executable, "-m", "gradsync.cli", *argv[1:]], check=True)
            with open(out) as f:
                records = json.load(f)
        seconds = round(time.monotonic() - started)
        rates["concurrent_after"] = measure_concurrency()  # it moves over minutes: once more, after the run
        shown = " ".join(argv[:-2])  # without the temporary --json
        earlier = [g for g in groups if g["command"] == shown]  # this command recorded before: its
        groups = [g for g in groups if g["command"] != shown]  # records are kept, superseded
        kept_old = [r for g in earlier for r in g.get("superseded", []) + g["records"]]
        groups.append({"command": shown, "seconds": seconds, "host_rates": rates,
                       **({"codecs": own_codecs} if own_codecs else {}), "records": records,
                       **({"superseded": kept_old, "note": "The superseded records come from earlier runs of this "
                           "command."} if kept_old else {})})
        supersede(groups, groups[-1])
        with open(args.out, "w") as f:
            json.dump({**kept, "cores": os.cpu_count(), "latency_s": 50e-6, "host_rates": host_rates, "codecs": codecs,
                       "groups": groups},
                      f, indent=1)
        print(f"group {index} ({model}, {np} workers, {rate}) recorded", flush=True)
    for index in (int(i) for i in args.codecs.split(",") if i):
        shown = " ".join(group_command(index, "", rank_cores=args.rank_cores, table=table)[:-2])
        group = next(g for g in groups if g["command"] == shown)
        group["codecs"], group["codecs_note"] = calibrate_codecs(CODECS), (
            "compressors' costs measured again after the run, on the same machine, under the ranks' allocator "
            "settings (the first measurement, in the recording process, paid fresh pages on every decode)")
        print(f"group {index}: codecs {group['codecs']}", flush=True)
    for index in (int(i) for i in args.again.split(",") if i):
        shown = " ".join(group_command(index, "", rank_cores=args.rank_cores, table=table)[:-2])
        group = next((g for g in groups if g["command"] == shown), None)
        if group is None:
            parser.error(f"--again {index}: {args.out} has no group recorded by `{shown}`")
        rates = group["host_rates"]
        before = {k: rates[k] for k in ("handoff_s", "message_s") if k in rates}
        rates["handoff_s"] = statistics.median(_calibrated(1)[0]["handoff_s"] for _ in range(5))
        if "message_s" in rates:
            rates["message_s"] = measure_message_cost(rates)["message_s"]
        group["again_note"] = f"measured again after the run, on the same machine (before: {before})"
        print(f"group {index}: {({k: rates[k] for k in before})}", flush=True)
    if args.message_cost or args.concurrency or args.handoff or args.busy_wake or args.codecs or args.again:
        with open(args.out, "w") as f:
            json.dump({**kept, "cores": os.cpu_count(), "latency_s": 50e-6, "host_rates": host_rates, "codecs": codecs,
                       "groups": groups}, f, indent=1)


if __name__ == "__main__":
    main()
