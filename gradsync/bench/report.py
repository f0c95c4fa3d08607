"""Turn per-rank measurements into records, a table and charts.

Throughput is global: ``num_workers * batch_size / step_time`` for each step after warm-up, where a
step's time is the slowest worker's. We report its median with min and max, because the machine
is noisy and a mean would let one preempted step move the result. A strategy that synchronizes
every ``period`` steps (``local-sgd``, ``diloco``) is the exception: its step time is the mean over
the measured steps (whole periods where each round measures a multiple of it), since its median
step sends nothing. With ``--dilation K`` every time
is divided by K before anything else, so records are in undilated (real-cluster) units.

The physical bound of a run: ``T_compute`` is one worker's step without communication (the
compute-only steps, measured under the same load), ``T_comm_min`` the bytes the busiest host
must move for the strategy's traffic pattern (``Strategy.min_bytes_per_host``) over its link rate.
``ideal = N * B / T_compute``; ``bound = N * B / max(T_compute, T_comm_min)`` (which is the ideal on
loopback, where the rate is unknown), and ``efficiency = measured / bound``.

``optimizer_s``: the median ``optimizer.step()`` of the measured steps (the slowest worker's each
step; undilated like every time): for strategies that synchronize gradients in ``backward()``, the
host's own update, at the memory rate the run met.

``batch_s``: the median time the slowest worker took to make a measured step's batch, before the
step's timer starts (so not in ``step_s``; undilated like every time): on an emulated cluster it
is work on the cores the ranks share.

``worker_step_s``: the median over the measured steps of the workers' mean time for each step
(undilated like every time). ``step_s``, the slowest worker's, exceeds it by what the job loses to
workers that do not start and end their steps together (stragglers, batches that take each
worker a different time).

``host_work``: the strategy's own host work per measured step, rank 0's, by kind (the compressed
strategies' ``encode`` and ``decode``, ``hybrid``'s row server's ``update``): ``calls``, raw
``bytes`` (``update``: the partitions updated) and ``seconds`` (undilated), the means over the
measured steps; absent where the strategy counts none. With the compressors' cost lines it gives
the rate the run's codecs met, and with the host's rates the memory rate the server's updates met
(``gradsync simulate --validate`` replays both).

``host_tx_bytes_per_step`` and ``host_rx_bytes_per_step``: on an emulated cluster, the bytes each
host's link sent and received per step, from the link's own device counters (Ethernet frames:
headers, acknowledgements and the job's small control messages included) over whole rounds,
warm-up included, from a quiet point to a settled end (no step's tail left out: HostLinks), the busiest
host's, and per host (``hosts_tx_bytes_per_step``, ``hosts_rx_bytes_per_step``; hosts in order, a
host of servers alone included). Beside ``min_bytes_per_host`` they show how close a strategy's
traffic comes to its pattern's minimum (``host_link_over_min``: the busiest host's busier direction
over it); ``bytes_per_step`` is what the strategy itself counts sending, per worker. The straggler
monitor's link probe (after a round's tenth step and every hundredth after; one rank a host) is left
out of them: ``host_probe_bytes`` is the most one host's link carried of it (16 MiB each way a ring
neighbour, against ResNet-50's 97 MiB a step or DGC's 0.2 MiB).

``slow``: the stragglers of the run (``--slow``), as ``RANK:FACTOR,...`` (empty for none): those
workers' emulated compute took FACTOR times as long. ``rank_rates_bps``: the ranks whose host had a
link of its own rate (``--net RATE,rankN=RATE``), ``{rank: bits/s}``; ``net`` names them too. The
bound keeps the default rate ``net_bps`` (and ``t_compute_s``, the slowest worker's compute, includes
a slow rank), so a slow link shows as a lower efficiency.

``host_cpu_busy``: the share of this machine's cores that were busy during the measured steps
(rank 0's machine; on an emulated cluster, every emulated host's). With emulated compute, near 1
means the run measured the host's CPU rather than the emulated cluster: at :data:`CPU_BOUND` and
above the report says so. (Real compute on the CPU keeps it busy by design.)

``samples_per_s_each``: the workers' own rates summed (per step, each worker's batch over its own
step time; the median over the measured steps). A synchronous strategy's workers step together, so
it is ``samples_per_s`` give or take noise; without a barrier (``pair-averaging``, ``ps-async``) a
fast worker runs ahead of a slow one, and this is what the job trains when it runs for a time
rather than a number of steps (``samples_per_s`` counts every step at its slowest worker's pace).

``stragglers``: the workers that held the others back (:mod:`gradsync.stragglers`: ``rank``,
``cause`` (``compute``, ``between steps``, ``link``), ``ratio`` (its time over the others', or the
other links' rate over its), ``held_s`` (what the others waited for it a step)), as found at the end
of most rounds, and ``straggler_rounds`` (in how many of the rounds); ``named`` says it in a word
(the table's ``slow`` column: ``1 compute``, ``-`` for no one) and ``named_share`` is the share of
the rounds that found it (what an experiment's relations check). ``slower``, ``hidden``,
``hidden_share`` and ``hidden_rounds`` say the same of the workers slower than the others that held
no one back, their extra time hidden behind communication (:func:`gradsync.stragglers.slower`; in
the ``slow`` column in parentheses: ``(1 compute)``). Both count only the rounds long enough to read
(:data:`gradsync.stragglers.SETTLED` steps a worker: ``0/0`` and ``-`` for a shorter run). ``paces`` holds every worker's
readings at the end of each round (seconds a step computing, between steps and waiting, and the
Gbit/s of the links from its ring neighbours), from which the verdicts came.
"""
from __future__ import annotations

import json
import os
import statistics

# max_abs_diff, max_rel_diff and correct come from the float64 replay (``check_steps`` steps);
# fp32_max_abs_diff compares the timed fp32 run itself with an fp32 reference, for information.
FIELDS = ["strategy", "model", "np", "servers", "batch_size", "steps", "samples_per_s",
          "samples_per_s_min", "samples_per_s_max", "step_s", "compute_s", "comm_overhead_s",
          "bytes_per_step", "peak_mem_mb", "max_abs_diff", "max_rel_diff", "correct",
          "net", "compute", "bound_samples_per_s", "efficiency", "min_bytes_per_host", "host_cpu_busy",
          "stragglers"]

CPU_BOUND = 0.9
"""A run whose measured steps kept this share of the host's cores busy is reported as CPU-bound."""


def summarize(raw: dict, compute_times: list[float], config: dict, check: dict | None,
              fp32_max_abs_diff: float) -> dict:
    """One JSON record for one strategy (see :data:`FIELDS`, plus a few descriptive extras)."""
    warm, k = config["warmup"], config.get("dilation", 1.0)
    times = [t / k for t in raw["times"]]  # warm-up already dropped, in every round
    compute = [t / k for t in compute_times]
    samples = config["np"] * config["workload"]["batch_size"]
    rates = [samples / t for t in times]
    period = raw.get("period", 1)  # every step synchronizes, or one in `period` (local-sgd, diloco)
    step_s = statistics.median(times) if period == 1 else statistics.fmean(times)
    compute_s = statistics.median(compute)
    record = {
        "strategy": raw["strategy"], "describe": raw["describe"], "model": config["workload"]["model"],
        "np": config["np"], "servers": config["servers"], "batch_size": config["workload"]["batch_size"],
        "ranks_per_host": config.get("ranks_per_host", 1), "server_hosts": config.get("server_hosts", "own"),
        "steps": len(times), "warmup": warm, "rounds": config["rounds"], "threads": config["threads"],
        "samples_per_s": statistics.median(rates) if period == 1 else samples / step_s, "samples_per_s_min": min(rates),
        "samples_per_s_max": max(rates), "step_s": step_s, "compute_s": compute_s,
        "comm_overhead_s": step_s - compute_s, "bytes_per_step": raw["bytes_per_step"],
        "peak_mem_mb": raw["peak_mem_mb"], "server_peak_mem_mb": raw.get("server_peak_mem_mb", 0.0),
        "stats": raw.get("stats", {}), "workers_max_diff": raw["workers_max_diff"],
        "fp32_max_abs_diff": fp32_max_abs_diff, "check_steps": config["check_steps"],
        "max_abs_diff": None, "max_rel_diff": None, "correct": None, "host_cpu_busy": cpu_busy(raw.get("host_cpu")),
        "slow": config.get("slow", ""),
        **bound(raw["min_bytes_per_host"], compute_s, samples, config),
    }
    if period > 1:
        record["period"] = period
        if raw.get("step_bytes"):  # the measured steps' own: a round's warm-up holds a share of the syncs
            record["bytes_per_step"] = statistics.fmean(raw["step_bytes"])
    if raw.get("optimizer_times"):  # the user's optimizer.step(), the slowest worker's, per step
        record["optimizer_s"] = statistics.median(t / k for t in raw["optimizer_times"])
    if raw.get("mean_times"):  # each step's time, the workers' mean
        record["worker_step_s"] = statistics.median(t / k for t in raw["mean_times"])
    if raw.get("step_rates"):  # every worker at its own pace: what a job without a barrier trains
        record["samples_per_s_each"] = config["workload"]["batch_size"] * statistics.median(raw["step_rates"]) * k
    if raw.get("batch_times"):  # making the batch, before the step's timer starts
        record["batch_s"] = statistics.median(t / k for t in raw["batch_times"])
    if raw.get("host_links"):
        record.update(link_bytes_per_step(raw["host_links"]))
        if record["min_bytes_per_host"]:
            record["host_link_over_min"] = (max(record["host_tx_bytes_per_step"], record["host_rx_bytes_per_step"])
                                            / record["min_bytes_per_host"])
    if raw.get("share_history"):  # a @balance label: the shares BalanceBatches ended the last round with
        record["shares"] = raw["share_history"][-1][1]
    record.update(straggler_verdict(raw.get("stragglers", []), raw.get("slower")))
    if raw.get("paces"):  # every worker's pace at the end of each round, from which the verdicts came
        record["paces"] = raw["paces"]
    work = [w for w in raw.get("host_work") or [] if w]
    if work:
        record["host_work"] = {kind: {"calls": statistics.fmean(w[kind][0] for w in work),
                                      "bytes": statistics.fmean(w[kind][1] for w in work),
                                      "seconds": statistics.fmean(w[kind][2] for w in work) / k}
                               for kind in work[0]}
    record["efficiency"] = record["samples_per_s"] / record["bound_samples_per_s"]
    if check is not None:
        record.update(check)
        if not raw["exact"]:
            record["correct"] = None  # not expected to match the synchronous reference
    return record


def link_bytes_per_step(links: dict) -> dict:
    """From each host's ``[tx, rx]`` bytes over the rounds (``total``) and their ``steps``
    (:class:`gradsync.bench.worker.HostLinks`): the mean per step of each host's
    (``hosts_tx_bytes_per_step``, ``hosts_rx_bytes_per_step``) and of the busiest host's; and
    ``host_probe_bytes``, the most one host's link carried of the straggler monitor's link probes,
    which the rest leaves out."""
    tx = [host[0] / links["steps"] for host in links["total"]]
    rx = [host[1] / links["steps"] for host in links["total"]]
    out = {"host_tx_bytes_per_step": max(tx), "host_rx_bytes_per_step": max(rx),
           "hosts_tx_bytes_per_step": tx, "hosts_rx_bytes_per_step": rx}
    if links.get("probe"):
        out["host_probe_bytes"] = max(max(host) for host in links["probe"])
    return out


# A window shorter than this many clock ticks per core (100 ms at the usual 100 Hz) is too coarse to
# give a share: a few ticks, each charged whole to whatever a core was doing when it fired.
MIN_TICKS_PER_CORE = 10


def save_records(records: list[dict], path: str) -> None:
    """The records as JSON at ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)


def cpu_busy(ticks: list | None, cores: int | None = None) -> float | None:
    """Busy share of the host's cores over the measured steps, from per-step ``[busy, total]`` ticks;
    None when there are none, or when the steps together lasted less than :data:`MIN_TICKS_PER_CORE`
    ticks per core (``cores``: this machine's, by default)."""
    cores = cores or os.cpu_count() or 1
    total = sum(t for _, t in ticks or [])
    if total < MIN_TICKS_PER_CORE * cores:
        return None
    return sum(b for b, _ in ticks) / total


def cpu_bound_note(records: list[dict]) -> str | None:
    """A warning naming the emulated-compute runs that kept the host's CPU busy (None if none did).

    Real compute keeps the cores busy by design (the model runs on them); emulated compute sleeps
    like a GPU, so there a busy CPU is the communication outrunning this machine."""
    hot = [r for r in records if r["compute"] != "real" and r.get("host_cpu_busy") is not None
           and r["host_cpu_busy"] >= CPU_BOUND]
    if not hot:
        return None
    runs = ", ".join(f"{r['strategy']} at {r['net']} ({r['host_cpu_busy']:.0%})" for r in hot)
    return (f"note: the host CPU was busy through the measured steps of {runs}: the figures measure this "
            "machine, not the emulated cluster; raise --dilation (e.g. --dilation auto:500mbit).")


def shared_cores_note(records: list[dict], cores: int | None = None) -> str | None:
    """A warning naming the emulated runs whose ranks outnumbered this machine's cores at a dilation
    below that ratio (None if none did): each emulated host then had less than a core's time for
    the host work it does for real (making gradients, copies, Gloo, the optimizer), which slows its
    communication beyond the emulated cluster's (docs/emulation.md)."""
    cores = cores or os.cpu_count() or 1
    short = [r for r in records if r["compute"] != "real" and r.get("net_bps")
             and r.get("dilation", 1.0) < (r["np"] + r.get("servers", 0)) / cores]
    if not short:
        return None
    ranks = max(r["np"] + r.get("servers", 0) for r in short)
    runs = ", ".join(sorted({f"{r['np'] + r.get('servers', 0)} ranks at {r['net']} (dilation {r.get('dilation', 1.0):g})"
                             for r in short}))
    return (f"note: {runs} on {cores} cores: each emulated host had less than a core's time for its host work; "
            f"--dilation {ranks / cores:g} or more gives each one.")


def bound(min_bytes: float, compute_s: float, samples: int, config: dict) -> dict:
    """The physical bound of one strategy's run (see the module docstring)."""
    rate = config.get("rate_bps")
    comm_s = None if rate is None else min_bytes * 8 / rate
    ideal = samples / compute_s
    limit = ideal if comm_s is None else samples / max(compute_s, comm_s)
    workload = config["workload"]
    delay = config.get("delay_ms", 0.0)
    ranks = config.get("rank_rates_bps") or {}
    net = "loopback" if rate is None else f"{rate / 1e9:g} Gbit/s" + (f" +{delay:g}ms" if delay else "")
    if ranks:  # the hosts of these ranks have links of their own: "1 Gbit/s (rank 3: 0.25)"
        net += " (" + ", ".join(f"rank {r}: {bps / 1e9:g}" for r, bps in sorted(ranks.items(), key=lambda i: int(i[0]))) + ")"
    where = {"machine": config["machine"]["name"]} if config.get("machine") else {}
    return {**where, "net": net, "net_bps": rate, "rank_rates_bps": ranks, "delay_ms": delay,
            "compute": workload.get("compute", "real"), "dilation": config.get("dilation", 1.0),
            "t_compute_s": compute_s, "t_comm_min_s": comm_s, "min_bytes_per_host": min_bytes,
            "ideal_samples_per_s": ideal, "bound_samples_per_s": limit}


def straggler_verdict(rounds: list[list], slower: list[list] | None = None) -> dict:
    """The verdict found at the end of most rounds (each ``[[rank, cause, ratio, held_s], ...]``),
    and, given the rounds' hidden slower workers (:func:`gradsync.stragglers.slower`, as ``rounds``),
    those found at the end of most rounds."""
    out = dict(zip(("stragglers", "straggler_rounds", "named", "named_share"), _most(rounds)))
    if slower is not None:
        out.update(zip(("slower", "hidden_rounds", "hidden", "hidden_share"), _most(slower)))
    return out


def _most(rounds: list[list]) -> tuple[list[dict], str, str, float]:
    if not rounds:
        return [], "0/0", "-", 0.0
    keys = [tuple((s[0], s[1]) for s in found) for found in rounds]
    common = max(set(keys), key=keys.count)
    found = [{"rank": r, "cause": c, "ratio": x, "held_s": h} for r, c, x, h in rounds[keys.index(common)]]
    return found, f"{keys.count(common)}/{len(keys)}", _word(found), keys.count(common) / len(keys)


def _word(found: list[dict]) -> str:
    return ",".join(f"{s['rank']} {s['cause']}" for s in found) or "-"


def slow_column(record: dict) -> str:
    """``1 compute``: who held the others back in most rounds; ``(1 compute)``: a worker slower
    than the others whose extra time hid behind communication; ``-``: no one."""
    named, hidden = _word(record.get("stragglers") or []), _word(record.get("slower") or [])
    if hidden == "-":
        return named
    return f"({hidden})" if named == "-" else f"{named} ({hidden})"


def table(records: list[dict]) -> str:
    w = max([11] + [len(r["strategy"]) for r in records])
    n = max([12] + [len(r["net"]) for r in records])  # "1 Gbit/s (rank 3: 0.25)" is wider than most
    head = (f"{'strategy':<{w}} {'np':>3} {'net':>{n}} {'samples/s':>10} {'(min-max)':>15} {'bound':>8} {'eff':>5} "
            f"{'host MB':>8} {'min MB':>8} "
            f"{'step ms':>8} {'compute':>8} {'comm ovh':>9} {'MB/step':>8} {'peak MB':>8} {'f64 |diff|':>10} "
            f"{'correct':>8} {'fp32 |diff|':>11} {'cpu':>4}  slow")
    lines = [head, "-" * len(head)]
    for r in records:
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        correct = {True: "yes", False: "NO", None: "n/a"}[r["correct"]]
        cpu = "-" if r.get("host_cpu_busy") is None else f"{r['host_cpu_busy']:.0%}"
        link = "-" if "host_tx_bytes_per_step" not in r else \
            f"{max(r['host_tx_bytes_per_step'], r['host_rx_bytes_per_step']) / 2**20:.2f}"
        lines.append(
            f"{r['strategy']:<{w}} {r['np']:>3} {r['net']:>{n}} {r['samples_per_s']:>10.1f} "
            f"{'(' + format(r['samples_per_s_min'], '.0f') + '-' + format(r['samples_per_s_max'], '.0f') + ')':>15} "
            f"{r['bound_samples_per_s']:>8.1f} {r['efficiency']:>5.2f} {link:>8} {r['min_bytes_per_host'] / 2**20:>8.2f} "
            f"{r['step_s'] * 1e3:>8.1f} {r['compute_s'] * 1e3:>8.1f} {r['comm_overhead_s'] * 1e3:>9.1f} "
            f"{r['bytes_per_step'] / 2**20:>8.2f} {r['peak_mem_mb']:>8.1f} {diff:>10} {correct:>8} {r['fp32_max_abs_diff']:>11.1e} {cpu:>4}  {slow_column(r)}")
    return "\n".join(lines)


COLOURS = {"ddp": "tab:gray", "allreduce": "tab:blue", "ps": "tab:orange", "ps-async": "tab:brown",
           "p3": "tab:red", "ps-sliced": "tab:pink", "allreduce-priority": "tab:purple", "casync-ring": "tab:green",
           "casync-ps": "tab:olive", "compressed-allgather": "tab:cyan", "sma": "goldenrod", "pair-averaging": "navy",
           "hybrid": "black"}
"""One colour per strategy in every chart gradsync draws (bench, simulate, sweeps)."""
VARIANTS = ["", "//", "..", "xx", "\\\\", "++"]
LINES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))]


def style(label: str, labels: list[str]) -> tuple[str, int]:
    """The colour of ``label``'s strategy (``casync-ring+onebit@noise-scale`` -> ``casync-ring``) and
    which variant of that strategy it is among ``labels`` (0 for the first, or the plain one)."""
    base = label.split("+")[0].split("@")[0]
    same = [x for x in dict.fromkeys(labels) if x.split("+")[0].split("@")[0] == base]
    return COLOURS.get(base, "tab:gray"), same.index(label) % len(VARIANTS) if label in same else 0


def chart(records: list[dict], path: str, title: str) -> None:
    """Throughput with min-max whiskers, and step time split into compute and communication; each
    strategy in its colour (variants of one strategy hatched), legends outside the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in records]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    rate = [r["samples_per_s"] for r in records]
    err = [[r["samples_per_s"] - r["samples_per_s_min"] for r in records],
           [r["samples_per_s_max"] - r["samples_per_s"] for r in records]]
    styles = [style(n, names) for n in names]
    left.bar(names, rate, yerr=err, capsize=4, color=[c for c, _ in styles], hatch=None, edgecolor="white")
    for bar, (_, variant) in zip(left.patches, styles):
        bar.set_hatch(VARIANTS[variant])
    if all("bound_samples_per_s" in r for r in records):  # compute time vs the fewest bytes over the link
        left.scatter(names, [r["bound_samples_per_s"] for r in records], marker="_", s=900, linewidths=2,
                     color="black", zorder=3, label="physical bound")
        left.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), frameon=False, fontsize=8)
    left.set_ylabel("samples/s (median, min-max)")
    left.set_title("Global throughput")
    compute = [r["compute_s"] * 1e3 for r in records]
    overhead = [max(r["comm_overhead_s"], 0) * 1e3 for r in records]
    right.bar(names, compute, label="compute only", color="lightgray")
    right.bar(names, overhead, bottom=compute, label="communication overhead", color="dimgray")
    right.set_ylabel("ms per step (median)")
    right.set_title("Step time")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=30)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    # Above the plot, where no bar can be: a bar reaching the top would hide under a legend inside.
    right.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=2, frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_charts(records: list[dict], out_dir: str, title: str) -> list[str]:
    """Throughput against link rate (several rates) and against workers (several ``np``), one line
    per strategy; dashed: the bound of the first strategy (against rate) or the ideal, N x one
    worker's compute-only rate (against workers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    rates = sorted({r["net_bps"] for r in records if r["net_bps"] is not None})
    nps = sorted({r["np"] for r in records})
    for axis, values, name in (("net_bps", rates, "throughput_vs_bandwidth.png"), ("np", nps, "throughput_vs_workers.png")):
        if len(values) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4))
        labels = list(dict.fromkeys(r["strategy"] for r in records))
        for strategy in labels:
            points = sorted((r[axis], r["samples_per_s"]) for r in records if r["strategy"] == strategy and r[axis] is not None)
            colour, variant = style(strategy, labels)
            ax.plot([x / 1e9 if axis == "net_bps" else x for x, _ in points], [y for _, y in points], marker="o",
                    label=strategy, color=colour, linestyle=LINES[variant])
        # Against bandwidth, the bound of the first strategy's traffic pattern; against workers, the ideal.
        key, label = (("bound_samples_per_s", f"bound ({records[0]['strategy']} traffic)") if axis == "net_bps"
                      else ("ideal_samples_per_s", "ideal (N x compute only)"))
        bound = sorted({(r[axis], r[key]) for r in records if r[axis] is not None and r["strategy"] == records[0]["strategy"]})
        ax.plot([x / 1e9 if axis == "net_bps" else x for x, _ in bound], [y for _, y in bound], "k--", label=label)
        ax.set_xlabel("link rate (Gbit/s)" if axis == "net_bps" else "workers")
        if axis == "net_bps":
            ax.set_xscale("log")
        ax.set_ylabel("samples/s (median)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
