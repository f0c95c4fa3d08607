"""``gradsync simulate --validate``: the simulator against recorded runs of the emulated cluster.

The matrix ships as JSON (:data:`MATRIX`): groups of ``gradsync bench --compute emulated`` records,
each group with the command that produced it. For every record the simulator is run on the same
shape (model, batch, workers, servers, link rate) and its throughput compared with the measured
one. Reported per cell: measured, predicted, error; overall: the median and largest absolute
error; in how many cells the simulator places the strategy among the others of its group (one
model, worker count, rate and server count) as the measurement does (strategies within 3 % of
each other, measured or predicted, count as tied); and in how many groups the strategy predicted
fastest (``gradsync advise``'s pick) is the measured best or within 5 % of it.

Each run is simulated on its own host and network (:mod:`gradsync.simulate.hostmodel`): the host
rates of the machine that recorded the matrix (:mod:`gradsync.simulate.calibration`, kept in it),
corrected for the run's dilation, its ranks per core and the memory rate they met. Targets: median
absolute error <= 5 %, every cell <= 10 %, ranking agreement in >= 90 % of cells, advice in >= 90 %
of groups.
"""
from __future__ import annotations

import json
import os
import statistics

from gradsync.bench.report import CPU_BOUND
from gradsync.simulate import Host, Network, build, load, simulate
from gradsync.simulate.calibration import (calibrate, calibrate_codecs, handoff_latencies, measure_busy_wake,
                                           measure_handoff)
from gradsync.simulate.hostmodel import (LATENCY_S, codec_speeds, flat_of, host_of, memory_met, options_of,
                                         record_network, run_options, updates_met)

# the replay's own, and the measurements and corrections it runs on, named here for its users
__all__ = ["HELD_OUT", "MATRIX", "SHIPPED", "calibrate", "calibrate_codecs", "cell_host", "cell_network", "codec_speeds", "group_hosts",
           "handoff_latencies", "measure_busy_wake", "measure_handoff", "memory_met", "options_of", "record_host",
           "record_network", "replay", "report", "run_options", "summary", "updates_met"]
MATRIX = os.path.join(os.path.dirname(__file__), "validation.json")
HELD_OUT = os.path.join(os.path.dirname(__file__), "held_out.json")
"""Cells the matrix was not fitted to: other models, worker counts and link rates
(``gradsync simulate --validate held-out``; recorded by benchmarks/regenerate/simulator_matrix.py
``--held-out``)."""
SHIPPED = {"shipped": MATRIX, "held-out": HELD_OUT}
"""The matrices ``gradsync simulate --validate NAME`` knows by name."""
TIE = 0.03
ADVICE = 0.05


def replay(path: str = MATRIX, rates: dict | None = None, steps: int = 8, warmup: int = 3) -> dict:
    """Every cell of the matrix at ``path``: measured against simulated, and the summary."""
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
            net = record_network(matrix, rec, cores)
            name, options = run_options(rec)
            # as many steps as a round of the run measured, after its warm-up (the rounds repeat it)
            run_warmup = rec.get("warmup", warmup)
            run_steps = run_warmup + rec["steps"] // rec.get("rounds", 1) if "steps" in rec else steps
            sim = simulate(name, workloads[key], rec["np"], net, host=host,
                           servers=rec.get("servers", 0), options=options, steps=max(run_steps, steps),
                           warmup=max(run_warmup, warmup), flat=flat_of(rec["strategy"]))
            cpu = rec.get("host_cpu_busy")
            cells.append({"model": rec["model"], "np": rec["np"], "net_bps": rec["net_bps"],
                          "servers": rec.get("servers", 0), "ranks_per_host": net.ranks_per_host,
                          "hosts": sim.get("hosts", "flat"), "strategy": rec["strategy"],
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
    met = [memory_met(rec, rates, cores, work.nbytes)
           if build(*options_of(rec["strategy"]), rec.get("servers", 0)).updates_locally else updates_met(rec, rates, cores)
           for rec, work in zip(records, workloads)]
    seen = [m for m in met if m is not None]
    during = statistics.median(seen) if seen else None
    out = []
    for rec, shown in zip(records, met):
        memory, source = ((shown, "run") if shown is not None else (during, "group") if during is not None
                          else (None, "probes"))
        out.append((host_of(rec, rates, cores, memory, codecs), source))
    return out


def record_host(matrix: dict, group: dict, record: dict) -> tuple:
    """One record of ``group`` (of ``matrix``, as loaded from its JSON) as :func:`replay` simulates
    it: its ``(Host, Workload)``, on the group's rates of its own time where it has them."""
    records = group["records"]
    works = [load(*_workload_key(r)) for r in records]
    rates = {**matrix["host_rates"], **group.get("host_rates", {})}
    codecs = {**matrix.get("codecs", {}), **group.get("codecs", {})}
    i = records.index(record)
    return group_hosts(records, works, rates, matrix.get("cores", os.cpu_count() or 1), codecs)[i][0], works[i]


def _latest(path: str | None, model: str, np: int, rate_bps: float, strategy: str, servers: int,
            ranks_per_host: int = 1) -> tuple:
    """The matrix at ``path`` (the shipped one by default) and the latest ``(group, record)`` of a
    cell of it, or None where it has no record of that cell."""
    with open(path or MATRIX) as f:
        matrix = json.load(f)
    cell = (model, np, rate_bps, strategy, servers, ranks_per_host)
    latest = [(group, rec) for group in matrix["groups"] for rec in group["records"]
              if (rec["model"], rec["np"], rec["net_bps"], rec["strategy"], rec.get("servers", 0),
                  rec.get("ranks_per_host", 1)) == cell][-1:]
    return matrix, (latest[0] if latest else None)


def cell_host(model: str, np: int, rate_bps: float, strategy: str, servers: int = 0,
              path: str | None = None, ranks_per_host: int = 1) -> tuple:
    """The host and workload on which the replay simulates the latest record of a cell of the
    matrix at ``path`` (the shipped one by default), and where they come from, in words; the
    simulator's default host (batch 32) where the matrix has no record of it."""
    matrix, latest = _latest(path, model, np, rate_bps, strategy, servers, ranks_per_host)
    if latest is None:
        return Host(), load(model, 32, None), "the simulator's default host (no record of this cell in the matrix)"
    group, rec = latest
    return (*record_host(matrix, group, rec), f"the host of the matrix's record from `{group['command']}`")


def cell_network(model: str, np: int, rate_bps: float, strategy: str, servers: int = 0, path: str | None = None,
                 ranks_per_host: int = 1):
    """The network on which the replay simulates the latest record of a cell of the matrix at
    ``path`` (the shipped one by default; :func:`record_network`): fair shares where it has no record."""
    matrix, latest = _latest(path, model, np, rate_bps, strategy, servers, ranks_per_host)
    return record_network(matrix, latest[1]) if latest else Network(rate_bps, matrix.get("latency_s", LATENCY_S),
                                                                     ranks_per_host=ranks_per_host)


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
        groups.setdefault(_group_of(c), []).append(c)
    ranked = sum(_ranked_alike(c, groups[_group_of(c)]) for c in cells)
    advised = sum(_first_pick_good(g) for g in groups.values())
    signed = [c["error"] for c in cells]
    return {"cells_counted": len(cells), "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors, default=None), "groups": len(groups), "ranked_alike": ranked,
            "advice_good": advised, "median_error": statistics.median(signed) if signed else None,
            "fast_cells": sum(e > 0 for e in signed)}


def _group_of(cell: dict) -> tuple:
    """The cluster shape whose strategies a cell is ranked among: model, workers, link rate,
    dedicated servers and workers per host."""
    return cell["model"], cell["np"], cell["net_bps"], cell["servers"], cell.get("ranks_per_host", 1)


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
    lines = [f"{'model':<10} {'np':>5} {'net':>9} {'strategy':<20} {'measured':>9} {'simulated':>9} {'error':>7}"]
    for c in result["cells"]:
        net = "loopback" if c["net_bps"] is None else f"{c['net_bps'] / 1e9:g} Gbit/s"
        per_host = c.get("ranks_per_host", 1)
        np = f"{c['np'] // per_host}x{per_host}" if per_host > 1 else str(c["np"])  # hosts x workers each
        lines.append(f"{c['model']:<10} {np:>5} {net:>9} {c['strategy']:<20} {c['measured']:>9.1f} "
                     f"{c['simulated']:>9.1f} {c['error']:>+7.1%}"
                     + (f"  (cpu-bound: {c['host_cpu_busy']:.0%} busy, not counted)" if c["cpu_bound"] else ""))
    lines.append(f"\n{result['cells_counted']} of {len(result['cells'])} cells counted: median |error| {result['median_abs_error']:.1%}, largest "
                 f"{result['max_abs_error']:.1%}; ranked among their group's strategies as measured: {result['ranked_alike']} "
                 f"of {result['cells_counted']} cells (ties within {TIE:.0%}); the predicted best is the measured best "
                 f"or within {ADVICE:.0%} of it in {result['advice_good']} of {result['groups']} groups")
    if result["cells_counted"]:  # a bias shows as errors of one sign
        lines.append(f"signed: median error {result['median_error']:+.1%}; the simulator faster than the run in "
                     f"{result['fast_cells']} of {result['cells_counted']} counted cells")
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
