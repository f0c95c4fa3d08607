"""``gradsync simulate --validate``: the simulator against recorded runs of the emulated cluster.

The matrix ships as JSON (:data:`MATRIX`): groups of ``gradsync bench --compute emulated`` records,
each group with the command that produced it. For every record the simulator is run on the same
shape (model, batch, workers, servers, link rate) and its throughput compared with the measured
one. Reported per cell: measured, predicted, error; overall: the median and largest absolute
error; in how many cells the simulator places the strategy among the others of its group (one
model, worker count, rate and server count) as the measurement does (strategies within 3 % of
each other, measured or predicted, count as tied); and in how many groups the strategy predicted
fastest (``gradsync advise``'s pick) is the measured best or within 5 % of it.

Host work in an emulated run is this machine's CPU (copies, the optimizer's update), divided by
the run's dilation like every other time, and shared by the ranks on its cores. So the host rates
of the machine that recorded the matrix (:func:`calibrate`, kept in it) are multiplied by the
dilation and divided by the ranks per core, at the fraction of their rate that the memory gave the
ranks working at once in the run (:func:`_host`). Targets: median absolute error <= 5 %, every
cell <= 10 %, ranking agreement in >= 90 % of cells, advice in >= 90 % of groups.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import time

from gradsync.bench.report import CPU_BOUND

MATRIX = os.path.join(os.path.dirname(__file__), "validation.json")
TIE = 0.03
ADVICE = 0.05


def calibrate(numel: int = 1 << 25, repeats: int = 3, *, start_at: float | None = None,
              seconds: float | None = None, handoff_repeats: int = 100) -> dict:
    """This machine's copy and optimizer-update rates (bytes/s, one thread, 128 MB: memory, not cache):
    the median of ``repeats``, or of as many as fit in ``seconds`` each (from the wall-clock time
    ``start_at``, so that processes started apart measure at the same time). The update is the
    benchmark's own optimizer's (``gradsync bench``'s ``sgd``: momentum and weight decay), so that
    the two cannot differ. Also this machine's thread handoff (:func:`measure_handoff`, unless
    ``handoff_repeats`` is 0)."""
    import torch

    from gradsync.bench.workload import OPTIMIZERS

    torch.set_num_threads(1)
    src, dst = torch.randn(numel), torch.empty(numel)
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = OPTIMIZERS["sgd"][0]([param], 0.01)
    opt.step()  # the momentum buffer exists from here
    dst.copy_(src)  # and the copy's destination is touched: no page faults while timed

    def rate(fn) -> float:
        times, until = [], None if seconds is None else time.time() + seconds

        def more() -> bool:
            return len(times) < repeats if until is None else not times or time.time() < until

        while more():
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return numel * 4 / statistics.median(times)

    handoff = {"handoff_s": measure_handoff(handoff_repeats)} if handoff_repeats else {}
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    return {"copy_Bps": rate(lambda: dst.copy_(src)), "update_Bps": rate(opt.step), **handoff}


def measure_handoff(repeats: int = 100) -> float:
    """This machine's ``Host.handoff_s``: from one Python thread setting an event to another thread,
    blocked on it, running again, while a third thread keeps running Python (the strategies'
    processes have several threads wanting the interpreter lock); the median of ``repeats``."""
    return statistics.median(handoff_latencies(repeats))


def measure_busy_wake(repeats: int = 300) -> float:
    """This machine's ``Host.busy_wake_s``: a thread handoff as :func:`measure_handoff` times it,
    while every core is busy (the measuring process's spinning thread and a spinning process on
    each other core), so that the woken thread waits for the scheduler to give it a core; the
    mean of ``repeats`` (milliseconds, where the idle median is microseconds)."""
    import subprocess
    import sys

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range((os.cpu_count() or 1) - 1)]
    try:
        time.sleep(0.5)  # they run by now
        return statistics.fmean(handoff_latencies(repeats))
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def handoff_latencies(repeats: int) -> list[float]:
    """``repeats`` thread handoffs as :func:`measure_handoff` times them, in seconds."""
    import threading

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    latencies = []
    try:
        for _ in range(repeats):
            event, woke = threading.Event(), []
            waiter = threading.Thread(target=lambda: (event.wait(), woke.append(time.perf_counter())))
            waiter.start()
            time.sleep(0.001)  # the waiter is blocked by now
            start = time.perf_counter()
            event.set()
            waiter.join()
            latencies.append(woke[0] - start)
    finally:
        stop.set()
        busy.join()
    return latencies


def calibrate_codecs(specs: list[str]) -> dict:
    """This machine's encode/decode cost lines and ratio of each compressor (as the simulator uses them)."""
    from gradsync.compress import parse_spec
    from gradsync.simulate.compressed import codec_cost

    out = {}
    for spec in specs:
        name, options = parse_spec(spec)
        c = codec_cost(name, options, 1.0)
        out[spec] = [c.encode.a, c.encode.b, c.decode.a, c.decode.b, c.ratio]
    return out


def options_of(label: str) -> tuple[str, dict]:
    """``casync-ring+topk:ratio=0.01`` -> ``("casync-ring", {"compression": "topk:ratio=0.01"})``."""
    name, _, spec = label.partition("@")[0].partition("+")
    return name, ({"compression": spec} if spec else {})


def run_options(record: dict) -> tuple[str, dict]:
    """The strategy and options a recorded run ran with: its label's (:func:`options_of`) and, for
    ``hybrid``, the partition count its probes chose (its ``describe``), by which the model lays
    the rows out over the servers: per server, as the option counts them (the probes' fit may
    choose a count between two multiples of the servers: the nearer)."""
    name, options = options_of(record["strategy"])
    if name == "hybrid" and "partitions" not in options:
        found = re.search(r"(\d+) partitions per table", record.get("describe", ""))
        servers = record.get("servers", 0) or record["np"]
        if found:
            options["partitions"] = max(1, round(int(found.group(1)) / servers))
    return name, options


def _host(record: dict, rates: dict, cores: int, memory: float | None = None, codecs: dict | None = None):
    """The host of one recorded run: the recording machine's rates, divided by the dilation (which
    divides every time) and shared by the ranks on its cores; where two or more ranks work at once,
    at the fraction of a lone process's rates that the memory gave them in the run. The compressors'
    work, a pass or two over each bucket, runs at the copies' fraction, unless the run counted its
    encodes and decodes (``host_work``): then at the speeds they met (:func:`codec_speeds`).

    That fraction moves from minute to minute on a cloud VM, so it is taken where the run shows it,
    ``memory`` (:func:`memory_met`), for copies and updates alike; without it, from a probe of every
    core copying at once (``concurrent``), taken just before the group's run (the mean of it and
    ``concurrent_after`` where the group probed once more after its run). The network's CPU per
    byte is the one measured nearest the run's real link rate, at the recording machine's speed
    (:func:`_net_cpu`)."""
    from gradsync.simulate import Host

    ranks = record["np"] + record.get("servers", 0)
    share = max(1.0, ranks / cores)
    batch = record.get("batch_s", 0.0)
    if not isinstance(batch, (int, float)) or batch < 0:
        from gradsync.errors import ConfigError

        raise ConfigError(f"record {record.get('strategy', '?')!r} ({record['np']} workers): batch_s must be a time "
                          f">= 0 in seconds, got {batch!r}; record it again with gradsync bench")
    k = record.get("dilation", 1.0)
    together = [rates[key] for key in ("concurrent", "concurrent_after") if key in rates and min(ranks, cores) > 1]
    fraction = {key: statistics.fmean([t[key] for t in together] or [1.0]) for key in ("copy_Bps", "update_Bps")}
    if memory is not None and min(ranks, cores) > 1:
        fraction = {"copy_Bps": memory, "update_Bps": memory}
    copy, update = (rates[key] * fraction[key] for key in ("copy_Bps", "update_Bps"))
    wake = rates.get("busy_wake_s")
    met = codec_speeds(record, codecs or {})
    encode, decode = met if met is not None else (fraction["copy_Bps"] * k / share, None)
    return Host(copy * k / share, update * k / share, codec_speed=encode, decode_speed=decode,
                handoff_s=rates.get("handoff_s", 20e-6) * share / k, message_s=rates.get("message_s", 0.0) / k,
                busy_wake_s=None if wake is None else wake / k, cores=cores, jitter=_jitter(rates.get("jitter"), ranks),
                net_cpu_s=_net_cpu(rates, record) / k, batch_s=batch, codecs=codecs or {})


def codec_speeds(record: dict, codecs: dict) -> tuple[float, float] | None:
    """How many times faster than its cost lines (``codecs``: spec -> the recording machine's
    :func:`calibrate_codecs` line) the run's compressor encoded and decoded, in the run's
    (undilated) time: for each, the lines' time for the calls and bytes of a measured step over the
    seconds they took (the record's ``host_work``, :mod:`gradsync.bench.report`). A rank's codec
    shares its core with the other ranks' threads and the memory with their passes; the run shows
    what that cost, the lines alone do not. None where the record has no such count or no line."""
    work = record.get("host_work") or {}
    if not ("encode" in work and "decode" in work):
        return None
    from gradsync.errors import ConfigError
    from gradsync.simulate.compressed import recorded_line
    from gradsync.strategies import resolve

    name, options = options_of(record["strategy"])
    strategy = resolve(name, **options)
    line = recorded_line(codecs, strategy.codec_name, strategy.codec_options)
    if line is None:
        return None
    speeds = []
    for kind, (a, b) in (("encode", line[0:2]), ("decode", line[2:4])):
        counted = work[kind] if isinstance(work[kind], dict) else {}
        calls, nbytes, seconds = (counted.get(field) for field in ("calls", "bytes", "seconds"))
        if not all(isinstance(v, (int, float)) for v in (calls, nbytes, seconds)) or not seconds > 0 or calls <= 0:
            raise ConfigError(f"record {record['strategy']!r} ({record['np']} workers): host_work {kind} must have calls "
                              f"and seconds > 0, got {work[kind]!r}; record it again with gradsync bench")
        speeds.append((a * calls + b * nbytes) / seconds)
    return speeds[0], speeds[1]


def memory_met(record: dict, rates: dict, cores: int, update_bytes: float) -> float | None:
    """The fraction of a lone process's update rate that the ranks' own ``optimizer.step()`` met in
    a recorded run (``optimizer_s``, undilated; every rank updates ``update_bytes`` at once, shared
    by the ranks per core), or None if the record has none. Only for strategies whose step is the
    update alone (:attr:`~gradsync.simulate.worker.StrategyModel.updates_locally`)."""
    seconds = record.get("optimizer_s")
    if seconds is None:
        return None
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        from gradsync.errors import ConfigError

        raise ConfigError(f"record {record.get('strategy', '?')!r} ({record['np']} workers): optimizer_s must be a "
                          f"time > 0 in seconds, got {seconds!r}; record it again with gradsync bench")
    share = max(1.0, (record["np"] + record.get("servers", 0)) / cores)
    return update_bytes / seconds * share / (record.get("dilation", 1.0) * rates["update_Bps"])


def updates_met(record: dict, rates: dict, cores: int) -> float | None:
    """The fraction of a lone process's rates that ``hybrid``'s row server met in a recorded run:
    its updates (the record's ``host_work["update"]``: rank 0's server's partition bytes and
    seconds a measured step, undilated) against what the model's update of as many bytes takes at
    the group's lone rates, shared by the ranks per core (a zeroed gradient and the rows added,
    ``ZEROED_PASSES + 1`` copies of the partitions, and the optimizer over them; the rows added,
    about 1 % of the partitions on ``lstm-lm:cpu``, left out), as :func:`memory_met` reads an update
    on the training thread. None if the record has no such count."""
    from gradsync.simulate.worker import ZEROED_PASSES

    work = (record.get("host_work") or {}).get("update")
    if work is None:
        return None
    nbytes, seconds = (work.get(key) if isinstance(work, dict) else None for key in ("bytes", "seconds"))
    if not all(isinstance(v, (int, float)) and v > 0 for v in (nbytes, seconds)):
        from gradsync.errors import ConfigError

        raise ConfigError(f"record {record.get('strategy', '?')!r} ({record['np']} workers): host_work update must "
                          f"have bytes and seconds > 0, got {work!r}; record it again with gradsync bench")
    share = max(1.0, (record["np"] + record.get("servers", 0)) / cores)
    lone = nbytes * ((ZEROED_PASSES + 1) / rates["copy_Bps"] + 1 / rates["update_Bps"])
    return lone * share / (record.get("dilation", 1.0) * seconds)


def record_network(matrix: dict, record: dict):
    """The :class:`~gradsync.simulate.Network` of a recorded run: its link rate, the matrix's
    latency, and the all-to-all's share of the rate measured on the recording machine
    (``host_rates.mesh``, benchmarks/regenerate/mesh_exchange.py) for the run's hosts at its link's real rate
    (the emulated rate over the dilation); 1 where none was measured."""
    from gradsync.simulate import Network

    hosts = record["np"] + record.get("servers", 0)
    real = record["net_bps"] / record.get("dilation", 1.0)
    mesh = _mesh(matrix.get("host_rates", {}).get("mesh"), hosts, real)
    return Network(record["net_bps"], matrix.get("latency_s", 50e-6), mesh=mesh)


def _net_cpu(rates: dict, record: dict) -> float:
    """Host CPU per byte sent or received in a recorded run (undilated): the one measured nearest its
    link's real rate (``net_cpu_s``, benchmarks/regenerate/mesh_exchange.py), scaled from the speed of the
    machine that measured it to the speed of the one that recorded the run, by their lone copy rates
    (``net_cpu_copy_Bps`` against the group's ``copy_Bps``: the kernel's TCP copies bytes); 0 if none
    was measured."""
    real = (record.get("net_bps") or 0) / record.get("dilation", 1.0)
    seconds = _nearest_rate(rates.get("net_cpu_s"), real, 0.0)
    measured_at = _nearest_rate(rates.get("net_cpu_copy_Bps"), real, 0.0)
    if seconds and measured_at and rates.get("copy_Bps"):
        seconds *= measured_at / rates["copy_Bps"]
    return seconds


def _mesh(measured: dict | None, hosts: int, real_bps: float) -> float:
    """``measured``: host count -> real link rate (bit/s) -> the mesh's share. The largest count
    measured up to ``hosts`` (an all-to-all among more hosts loses at least as much), at the
    measured rate nearest ``real_bps`` (by ratio); 1 if none was."""
    counts = [int(n) for n in (measured or {}) if int(n) <= hosts]
    return _nearest_rate(measured[str(max(counts))], real_bps, 1.0) if counts else 1.0


def _nearest_rate(by_rate: dict | None, real_bps: float, default: float) -> float:
    """``by_rate``: real link rate (bit/s) -> a figure measured at it; the one measured nearest
    ``real_bps`` (by ratio), or ``default`` if none was (or the link has no rate)."""
    if not by_rate or not real_bps:
        return default
    return by_rate[min(by_rate, key=lambda rate: abs(math.log(float(rate) / real_bps)))]


def _jitter(measured: dict | None, ranks: int) -> float:
    """The host's jitter for ``ranks`` ranks on the machine: measured per rank count
    (benchmarks/regenerate/server_jitter.py), the largest count up to ``ranks``; 0 if none was."""
    counts = [int(n) for n in (measured or {}) if int(n) <= ranks]
    return measured[str(max(counts))] if counts else 0.0


def replay(path: str = MATRIX, rates: dict | None = None, steps: int = 8, warmup: int = 3) -> dict:
    """Every cell of the matrix at ``path``: measured against simulated, and the summary."""
    from gradsync.simulate import load, simulate

    with open(path) as f:
        matrix = json.load(f)
    given = rates
    rates = rates or matrix.get("host_rates") or calibrate()  # those of the machine that recorded it
    cores = matrix.get("cores", os.cpu_count() or 1)
    cells, workloads = [], {}
    for group in matrix["groups"]:
        # a group recorded with the machine's rates of its own time uses them (unless rates are given)
        here = rates if given else {**rates, **group.get("host_rates", {})}
        codecs = {**matrix.get("codecs", {}), **group.get("codecs", {})}  # and its compressors' costs
        keys = [_workload_key(rec) for rec in group["records"]]
        for key in keys:
            if key not in workloads:
                workloads[key] = load(*key)
        hosts = group_hosts(group["records"], [workloads[key] for key in keys], here, cores, codecs)
        for rec, key, (host, source) in zip(group["records"], keys, hosts):
            net = record_network(matrix, rec)
            name, options = run_options(rec)
            # as many steps as a round of the run measured, after its warm-up (the rounds repeat it)
            run_warmup = rec.get("warmup", warmup)
            run_steps = run_warmup + rec["steps"] // rec.get("rounds", 1) if "steps" in rec else steps
            sim = simulate(name, workloads[key], rec["np"], net, host=host,
                           servers=rec.get("servers", 0), options=options, steps=max(run_steps, steps),
                           warmup=max(run_warmup, warmup))
            cpu = rec.get("host_cpu_busy")
            cells.append({"model": rec["model"], "np": rec["np"], "net_bps": rec["net_bps"],
                          "servers": rec.get("servers", 0), "strategy": rec["strategy"],
                          "cpu_bound": cpu is not None and cpu >= CPU_BOUND, "host_cpu_busy": cpu,
                          "measured": rec["samples_per_s"], "simulated": sim["samples_per_s"],
                          "error": sim["samples_per_s"] / rec["samples_per_s"] - 1, "command": group["command"],
                          "memory_from": source, "codecs_met": host.decode_speed is not None})  # from a run's counts
    own = [g["host_rates"] for g in matrix["groups"] if "host_rates" in g]
    sources = {key: sum(c["memory_from"] == key for c in cells) for key in ("run", "group", "probes")}
    return {"cells": cells, "rates": rates, "group_rates": [] if given else own, "memory_from": sources,
            "codecs_met": sum(c["codecs_met"] for c in cells), **summary(cells)}


def group_hosts(records: list[dict], workloads: list, rates: dict, cores: int, codecs: dict | None = None) -> list[tuple]:
    """``(Host, source)`` for each record of one group: at the memory rate its run met where its
    step is the update alone (:func:`memory_met`, source ``"run"``), else the median of what the
    group's runs met, within minutes of it (``"group"``), else the probes' (``"probes"``); its
    compressor at the speeds the run met, where it counted them (:func:`codec_speeds`, with the
    group's cost lines ``codecs``)."""
    from gradsync.simulate import build

    met = [memory_met(rec, rates, cores, work.nbytes)
           if build(*options_of(rec["strategy"]), rec.get("servers", 0)).updates_locally else updates_met(rec, rates, cores)
           for rec, work in zip(records, workloads)]
    seen = [m for m in met if m is not None]
    during = statistics.median(seen) if seen else None
    out = []
    for rec, shown in zip(records, met):
        memory, source = ((shown, "run") if shown is not None else (during, "group") if during is not None
                          else (None, "probes"))
        out.append((_host(rec, rates, cores, memory, codecs), source))
    return out


def record_host(matrix: dict, group: dict, record: dict) -> tuple:
    """One record of ``group`` (of ``matrix``, as loaded from its JSON) as :func:`replay` simulates
    it: its ``(Host, Workload)``, on the group's rates of its own time where it has them."""
    from gradsync.simulate import load

    records = group["records"]
    works = [load(*_workload_key(r)) for r in records]
    rates = {**matrix["host_rates"], **group.get("host_rates", {})}
    codecs = {**matrix.get("codecs", {}), **group.get("codecs", {})}
    i = records.index(record)
    return group_hosts(records, works, rates, matrix.get("cores", os.cpu_count() or 1), codecs)[i][0], works[i]


def _latest(path: str | None, model: str, np: int, rate_bps: float, strategy: str, servers: int) -> tuple:
    """The matrix at ``path`` (the shipped one by default) and the latest ``(group, record)`` of a
    cell of it, or None where it has no record of that cell."""
    with open(path or MATRIX) as f:
        matrix = json.load(f)
    cell = (model, np, rate_bps, strategy, servers)
    latest = [(group, rec) for group in matrix["groups"] for rec in group["records"]
              if (rec["model"], rec["np"], rec["net_bps"], rec["strategy"], rec.get("servers", 0)) == cell][-1:]
    return matrix, (latest[0] if latest else None)


def cell_host(model: str, np: int, rate_bps: float, strategy: str, servers: int = 0,
              path: str | None = None) -> tuple:
    """The host and workload on which the replay simulates the latest record of a cell of the
    matrix at ``path`` (the shipped one by default), and where they come from, in words; the
    simulator's default host (batch 32) where the matrix has no record of it."""
    from gradsync.simulate import Host, load

    matrix, latest = _latest(path, model, np, rate_bps, strategy, servers)
    if latest is None:
        return Host(), load(model, 32, None), "the simulator's default host (no record of this cell in the matrix)"
    group, rec = latest
    return (*record_host(matrix, group, rec), f"the host of the matrix's record from `{group['command']}`")


def cell_network(model: str, np: int, rate_bps: float, strategy: str, servers: int = 0, path: str | None = None):
    """The network on which the replay simulates the latest record of a cell of the matrix at
    ``path`` (the shipped one by default; :func:`record_network`): fair shares where it has no record."""
    from gradsync.simulate import Network

    matrix, latest = _latest(path, model, np, rate_bps, strategy, servers)
    return record_network(matrix, latest[1]) if latest else Network(rate_bps, matrix.get("latency_s", 50e-6))


def _workload_key(record: dict) -> tuple:
    """``load()``'s arguments for a record: model, batch size, and the profile of ``emulated[:PROFILE]``."""
    compute = record.get("compute", "emulated")
    return record["model"], record["batch_size"], compute.split(":", 1)[1] if ":" in compute else None


def summary(cells: list[dict]) -> dict:
    """Over the cells that measured the emulated cluster (not the ones that kept this machine's
    CPU busy: those measured the machine, and the bench says so)."""
    cells = [c for c in cells if not c["cpu_bound"]]
    errors = [abs(c["error"]) for c in cells]
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["model"], c["np"], c["net_bps"], c["servers"]), []).append(c)
    ranked = sum(_ranked_alike(c, groups[(c["model"], c["np"], c["net_bps"], c["servers"])]) for c in cells)
    advised = sum(_first_pick_good(g) for g in groups.values())
    return {"cells_counted": len(cells), "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors, default=None), "groups": len(groups), "ranked_alike": ranked,
            "advice_good": advised}


def _ranked_alike(cell: dict, group: list[dict]) -> bool:
    """Whether the simulator puts ``cell`` in the same place among its group's strategies as the
    measurement: against every other strategy, the same order, or a tie (within :data:`TIE`)
    measured or predicted."""
    def tied(a: float, b: float) -> bool:
        return abs(a / b - 1) <= TIE

    for other in group:
        if other is cell or tied(cell["measured"], other["measured"]) or tied(cell["simulated"], other["simulated"]):
            continue
        if (cell["measured"] > other["measured"]) != (cell["simulated"] > other["simulated"]):
            return False
    return True


def _first_pick_good(group: list[dict]) -> bool:
    """Whether the strategy predicted fastest (``gradsync advise``'s first pick among those
    measured) is the measured best or within :data:`ADVICE` of it."""
    pick = max(group, key=lambda c: c["simulated"])
    return pick["measured"] >= (1 - ADVICE) * max(c["measured"] for c in group)


def report(result: dict) -> str:
    lines = [f"{'model':<10} {'np':>3} {'net':>9} {'strategy':<20} {'measured':>9} {'simulated':>9} {'error':>7}"]
    for c in result["cells"]:
        net = "loopback" if c["net_bps"] is None else f"{c['net_bps'] / 1e9:g} Gbit/s"
        lines.append(f"{c['model']:<10} {c['np']:>3} {net:>9} {c['strategy']:<20} {c['measured']:>9.1f} "
                     f"{c['simulated']:>9.1f} {c['error']:>+7.1%}"
                     + (f"  (cpu-bound: {c['host_cpu_busy']:.0%} busy, not counted)" if c["cpu_bound"] else ""))
    lines.append(f"\n{result['cells_counted']} of {len(result['cells'])} cells counted: median |error| {result['median_abs_error']:.1%}, largest "
                 f"{result['max_abs_error']:.1%}; ranked among their group's strategies as measured: {result['ranked_alike']} "
                 f"of {result['cells_counted']} cells (ties within {TIE:.0%}); the predicted best is the measured best "
                 f"or within {ADVICE:.0%} of it in {result['advice_good']} of {result['groups']} groups")
    lines.append(f"host rates of the machine that recorded the runs: copy {result['rates']['copy_Bps'] / 1e9:.1f} GB/s, optimizer update "
                 f"{result['rates']['update_Bps'] / 1e9:.1f} GB/s (one thread)")
    together = result["rates"].get("concurrent")
    if together:
        lines[-1] += (f", {together['copy_Bps']:.2f}x and {together['update_Bps']:.2f}x of that in each of "
                      f"{together['processes']} processes at once")
    own = result.get("group_rates", [])
    if own:
        span = lambda key: f"{min(r[key] for r in own) / 1e9:.1f}-{max(r[key] for r in own) / 1e9:.1f} GB/s"
        lines[-1] += (f"; {len(own)} groups with the rates measured when they were recorded: copy {span('copy_Bps')}, "
                      f"update {span('update_Bps')}")
    sources = result.get("memory_from")
    if sources:
        lines.append(f"the memory rate the ranks met: from the run's own optimizer.step() in {sources['run']} cells, "
                     f"from its group's runs in {sources['group']}, from the probes in {sources['probes']}")
    if result.get("codecs_met"):
        lines.append(f"cells whose compressor ran at the speeds its run's encodes and decodes met: {result['codecs_met']}")
    return "\n".join(lines)
