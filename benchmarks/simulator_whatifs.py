"""The shipped validation with one mechanism of the compressed and averaging strategies' models taken out at a time.

    python benchmarks/simulator_whatifs.py

Replays ``gradsync/simulate/validation.json`` (``gradsync.simulate.validate.replay``) as shipped,
then with each of these changed, and prints the compressed strategies' cells (``*``: a CPU-bound
cell, not counted) and the summary:

- ``probes``: every cell's memory rate from the probes around its group, not from the runs;
- ``no waits``: the work before a message or all-gather not waiting for the slowest host;
- ``no message ends``: ``Worker.ends_s`` at 0 (every strategy's message ends, not only these);
- ``no wakes``: a blocked thread wakes at the idle handoff (every strategy's wakes);
- ``cold codec``: the 4-worker, 1 Gbit/s compressed group's codec line replaced by a cold probe's
  (a decode's constant 1.6 ms a call; :data:`COLD_ONEBIT`);
- ``no connection order``: ``pair-averaging``'s pull requests not queued behind the models their
  sender is serving the same peer (its cells only).

Last, the ``pair-averaging`` cell at 4 workers on 1 Gbit/s simulated for longer than a round of
its run (its median moves with the peers' picks), beside every recording of that command.

First it prints, for each group whose records carry ``optimizer_s``, the memory rate each run met
(``validate.memory_met``) beside the probes taken around the group.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from contextlib import contextmanager

from gradsync.simulate import averaging, build, compressed, load, simulate, validate, worker
from gradsync.simulate.engine import Stream

COLD_ONEBIT = [0.0005262060000989421, 4.923799038383009e-10, 0.0016220285706367576, 7.396159856440376e-11,
               0.03125143051147461]
"""onebit's encode and decode lines (constant s, s per byte) and ratio from a probe without a warm
call, on the machine that recorded the compressed groups (what ``measure_codec`` measured before it
warmed each size)."""


@contextmanager
def patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def show(label: str, result: dict, strategies=compressed.COMPRESSED) -> None:
    cells = [c for c in result["cells"] if c["strategy"].split("+")[0] in strategies]
    print(f"{label}:")
    for c in cells:
        print(f"  {c['model']} {c['np']}w {c['net_bps'] / 1e9:g} Gbit/s {c['strategy']:<22} "
              f"{c['error']:+6.1%}{'  *' if c['cpu_bound'] else ''}")
    over = sum(abs(c["error"]) > 0.1 for c in result["cells"] if not c["cpu_bound"])
    print(f"  all cells: median |error| {result['median_abs_error']:.1%}, largest {result['max_abs_error']:.1%}, "
          f"{over} over 10 %, ranked alike {result['ranked_alike']} of {result['cells_counted']}, "
          f"advice {result['advice_good']} of {result['groups']}")


def memory_rates(matrix: dict) -> None:
    cores = matrix.get("cores", 2)
    for i, group in enumerate(matrix["groups"]):
        records = [r for r in group["records"] if r.get("optimizer_s")]
        if not records:
            continue
        rates = {**matrix["host_rates"], **group.get("host_rates", {})}
        probes = [rates[key]["update_Bps"] for key in ("concurrent", "concurrent_after") if key in rates]
        print(f"group {i}: {group['command']}")
        print(f"  probes around it: {', '.join(f'{p:.2f}' for p in probes)}")
        for r in records:
            if build(r["strategy"].split("+")[0], servers=r.get("servers", 0)).updates_locally:
                nbytes = load(*validate._workload_key(r)).nbytes  # the record's own compute profile
                print(f"  {r['strategy']:<22} its run met {validate.memory_met(r, rates, cores, nbytes):.2f}")


def main() -> None:
    with open(validate.MATRIX) as f:
        matrix = json.load(f)
    memory_rates(matrix)
    show("shipped", validate.replay())
    with patched(validate, "memory_met", lambda *a, **k: None):
        show("probes", validate.replay())
    with patched(compressed.CompressedBuckets, "waited", lambda self, hosts: 1.0):
        show("no waits", validate.replay())
    with patched(worker.Worker, "ends_s", lambda self, ends, message_s=None: 0.0):
        show("no message ends", validate.replay())
    with patched(worker.Worker, "wake_s", lambda self: self.host_rates.handoff_s):
        show("no wakes", validate.replay())
    cold = json.loads(json.dumps(matrix))
    for group in cold["groups"]:
        r = group["records"][0] if group["records"] else {}
        if r.get("np") == 4 and r.get("net_bps") == 1e9 and "codecs" in group:
            group["codecs"] = {"onebit": COLD_ONEBIT}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cold.json")
        with open(path, "w") as f:
            json.dump(cold, f)
        show("cold codec", validate.replay(path))
    show("pair-averaging, shipped", validate.replay(), ("pair-averaging",))
    with patched(averaging.PairAveraging, "_connection", lambda self, src, dst: Stream(self.wk.sim, "apart")):
        show("no connection order", validate.replay(), ("pair-averaging",))
    pair_averaging_longer(matrix)


def pair_averaging_longer(matrix: dict) -> None:
    """The 4-worker, 1 Gbit/s ``pair-averaging`` cell over more steps than a round of its run, and
    every recording of it in the matrix at the shipped record's dilation (current and superseded)."""
    cell = lambda r: r["strategy"] == "pair-averaging" and r["np"] == 4 and r["net_bps"] == 1e9
    i, group = [(i, g) for i, g in enumerate(matrix["groups"]) if any(cell(r) for r in g["records"])][-1]
    rec = next(r for r in group["records"] if cell(r))
    recorded = [r["samples_per_s"] for g in matrix["groups"] for r in g["records"] + g.get("superseded", [])
                if cell(r) and r.get("dilation") == rec.get("dilation")]  # the same command's runs
    host, work = validate.record_host(matrix, group, rec)
    net = validate.record_network(matrix, rec)
    steps = (rec["warmup"] + rec["steps"] // rec.get("rounds", 1), 60, 120)
    predicted = [simulate("pair-averaging", work, 4, net, host=host, steps=n, warmup=rec["warmup"])["samples_per_s"]
                 for n in steps]
    runs = ", ".join(f"{x:.1f}" for x in recorded)
    print(f"pair-averaging 4w 1 Gbit/s at dilation {rec.get('dilation', 1):g}: recorded {runs} "
          f"(mean {statistics.fmean(recorded):.1f}); simulated on group {i}'s rates "
          + ", ".join(f"{v:.1f} ({n} steps)" for n, v in zip(steps, predicted)))


if __name__ == "__main__":
    main()
