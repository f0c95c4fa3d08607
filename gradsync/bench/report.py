"""Turn per-rank measurements into records, a table and a chart.

Throughput is global: ``num_workers * batch_size / step_time`` for each step after warm-up, where a
step's time is the slowest worker's. We report its median with min and max, because the machine
is noisy and a mean would let one preempted step move the result.
"""
from __future__ import annotations

import statistics

# max_abs_diff, max_rel_diff and correct come from the float64 replay (``check_steps`` steps);
# fp32_max_abs_diff compares the timed fp32 run itself with an fp32 reference, for information.
FIELDS = ["strategy", "model", "np", "servers", "batch_size", "steps", "samples_per_s",
          "samples_per_s_min", "samples_per_s_max", "step_s", "compute_s", "comm_overhead_s",
          "bytes_per_step", "peak_mem_mb", "max_abs_diff", "max_rel_diff", "correct"]


def summarize(raw: dict, compute_times: list[float], config: dict, check: dict | None,
              fp32_max_abs_diff: float) -> dict:
    """One JSON record for one strategy (see :data:`FIELDS`, plus a few descriptive extras)."""
    warm = config["warmup"]
    times, compute = raw["times"], compute_times  # warm-up already dropped, in every round
    samples = config["np"] * config["workload"]["batch_size"]
    rates = [samples / t for t in times]
    step_s, compute_s = statistics.median(times), statistics.median(compute)
    record = {
        "strategy": raw["strategy"], "describe": raw["describe"], "model": config["workload"]["model"],
        "np": config["np"], "servers": config["servers"], "batch_size": config["workload"]["batch_size"],
        "steps": len(times), "warmup": warm, "rounds": config["rounds"], "threads": config["threads"],
        "samples_per_s": statistics.median(rates), "samples_per_s_min": min(rates),
        "samples_per_s_max": max(rates), "step_s": step_s, "compute_s": compute_s,
        "comm_overhead_s": step_s - compute_s, "bytes_per_step": raw["bytes_per_step"],
        "peak_mem_mb": raw["peak_mem_mb"], "workers_max_diff": raw["workers_max_diff"],
        "fp32_max_abs_diff": fp32_max_abs_diff, "check_steps": config["check_steps"],
        "max_abs_diff": None, "max_rel_diff": None, "correct": None,
    }
    if check is not None:
        record.update(check)
        if not raw["exact"]:
            record["correct"] = None  # not expected to match the synchronous reference
    return record


def table(records: list[dict]) -> str:
    head = (f"{'strategy':<11} {'samples/s':>10} {'(min-max)':>15} {'step ms':>8} {'compute':>8} "
            f"{'comm ovh':>9} {'MB/step':>8} {'peak MB':>8} {'f64 |diff|':>10} {'correct':>8} {'fp32 |diff|':>11}")
    lines = [head, "-" * len(head)]
    for r in records:
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        correct = {True: "yes", False: "NO", None: "n/a"}[r["correct"]]
        lines.append(
            f"{r['strategy']:<11} {r['samples_per_s']:>10.1f} "
            f"{'(' + format(r['samples_per_s_min'], '.0f') + '-' + format(r['samples_per_s_max'], '.0f') + ')':>15} "
            f"{r['step_s'] * 1e3:>8.1f} {r['compute_s'] * 1e3:>8.1f} {r['comm_overhead_s'] * 1e3:>9.1f} "
            f"{r['bytes_per_step'] / 2**20:>8.2f} {r['peak_mem_mb']:>8.1f} {diff:>10} {correct:>8} {r['fp32_max_abs_diff']:>11.1e}")
    return "\n".join(lines)


def chart(records: list[dict], path: str, title: str) -> None:
    """Throughput with min-max whiskers, and step time split into compute and communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in records]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rate = [r["samples_per_s"] for r in records]
    err = [[r["samples_per_s"] - r["samples_per_s_min"] for r in records],
           [r["samples_per_s_max"] - r["samples_per_s"] for r in records]]
    left.bar(names, rate, yerr=err, capsize=4, color="tab:blue")
    left.set_ylabel("samples/s (median, min-max)")
    left.set_title("Global throughput")
    compute = [r["compute_s"] * 1e3 for r in records]
    overhead = [max(r["comm_overhead_s"], 0) * 1e3 for r in records]
    right.bar(names, compute, label="compute only", color="tab:gray")
    right.bar(names, overhead, bottom=compute, label="communication overhead", color="tab:orange")
    right.set_ylabel("ms per step (median)")
    right.set_title("Step time")
    right.legend(loc="lower center", framealpha=0.9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
