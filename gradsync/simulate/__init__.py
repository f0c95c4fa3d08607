"""A discrete-event simulator of the strategies' schedules: predictions before renting a cluster.

- :mod:`gradsync.simulate.engine`: the event loop (streams, transfers sharing links max-min fairly);
- :mod:`gradsync.simulate.workload`: the layers and parameter sizes a worker computes (the compute
  profiles the emulated cluster replays);
- :mod:`gradsync.simulate.models`: one model per strategy, planned by the strategy's own code;
- :func:`simulate`: one strategy, one model, one cluster shape -> a record with
  ``gradsync bench``'s fields.
"""
from __future__ import annotations

import statistics

from gradsync.simulate.engine import Sim, SimulationError
from gradsync.simulate.models import SIMULATED, Host, Network, Worker, build
from gradsync.simulate.workload import Workload, load


def simulate(strategy: str, workload: Workload, np: int, net: Network, *, host: Host | None = None,
             servers: int = 0, options: dict | None = None, steps: int = 6, warmup: int = 2,
             trace: bool = False) -> dict:
    """Simulate ``steps`` steps of ``strategy`` and summarize the ones after ``warmup``, as a
    ``gradsync bench`` record (throughput is global: ``np * batch / step time``)."""
    if steps <= warmup:
        raise SimulationError(f"steps ({steps}) must exceed warmup ({warmup})")
    if servers < 0:
        raise SimulationError(f"servers must be >= 0, got {servers}")
    sim = Sim()
    if trace:
        sim.log = []
    worker = Worker(sim, workload, np, net, host or Host(), servers)
    model = build(strategy, options, servers)
    ends = worker.run(model, steps)
    times = [b - a for a, b in zip([0.0] + ends[:-1], ends)][warmup:]
    samples = np * workload.batch_size
    step_s = statistics.median(times)
    compute_s = workload.compute_s
    record = {
        "strategy": strategy, "model": workload.model, "np": np, "servers": servers,
        "batch_size": workload.batch_size, "steps": len(times), "warmup": warmup,
        "samples_per_s": samples / step_s, "samples_per_s_min": samples / max(times),
        "samples_per_s_max": samples / max(min(times), 1e-12), "step_s": step_s, "compute_s": compute_s,
        "comm_overhead_s": step_s - compute_s, "net_bps": net.rate_bps,
        "net": "loopback" if net.rate_bps is None else f"{net.rate_bps / 1e9:g} Gbit/s",
        "compute": "simulated", "source": "gradsync simulate", "events": sim.events,
        "bytes_per_step": worker.bytes_sent() / len(ends),
    }
    if trace:
        record["timeline"] = sim.log
    return record


__all__ = ["simulate", "load", "Network", "Host", "SIMULATED", "Workload", "SimulationError"]
