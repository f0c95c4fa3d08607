"""A discrete-event simulator of the strategies' schedules: predictions before renting a cluster.

- :mod:`gradsync.simulate.engine`: the event loop (streams, transfers sharing links max-min fairly);
- :mod:`gradsync.simulate.workload`: the layers and parameter sizes a worker computes (the compute
  profiles the emulated cluster replays);
- :mod:`gradsync.simulate.models`: the simulated worker, and the schedules of the bucketed,
  parameter-server and sliced strategies, planned by the strategy's own code;
  :mod:`gradsync.simulate.compressed`, :mod:`gradsync.simulate.averaging`,
  :mod:`gradsync.simulate.hybrid` and :mod:`gradsync.simulate.rare` the others';
- :func:`build`: the model of one strategy; :func:`simulate`: one strategy, one model, one
  cluster shape -> a record with ``gradsync bench``'s fields.
"""
from __future__ import annotations

import statistics

from gradsync.errors import ConfigError
from gradsync.simulate import averaging, compressed
from gradsync.simulate.engine import Sim, SimulationError
from gradsync.simulate.hosts import aggregation
from gradsync.simulate.hybrid import Hybrid
from gradsync.simulate.models import Buckets, ParameterServers, Slices
from gradsync.simulate.rare import RareSync
from gradsync.simulate.worker import Host, Network, StrategyModel, Worker
from gradsync.simulate.workload import Workload, load


def simulate(strategy: str, workload: Workload, np: int, net: Network, *, host: Host | None = None,
             servers: int = 0, options: dict | None = None, steps: int = 6, warmup: int = 2,
             trace: bool = False, flat: bool = False) -> dict:
    """Simulate ``steps`` steps of ``strategy`` and summarize the ones after ``warmup``, as a
    ``gradsync bench`` record (throughput is global: ``np * batch / step time``). With ``trace``,
    also ``timeline`` (every span: lane, what, start, end, in seconds) and ``step_ends``. On hosts
    of several ranks (``net.ranks_per_host``) the strategy runs its topology-aware schedule
    (:attr:`StrategyModel.hosts`), or, with ``flat``, every rank as its own peer. A strategy that
    communicates every ``H`` steps (``period``) runs whole periods, in the warm-up and after it, and
    its step time is the mean of the measured ones."""
    if steps <= warmup:
        raise SimulationError(f"steps ({steps}) must exceed warmup ({warmup})")
    if servers < 0:
        raise SimulationError(f"servers must be >= 0, got {servers}")
    sim = Sim()
    if trace:
        sim.log = []
    model = build(strategy, options, servers)
    hosts = "flat" if flat else model.hosts
    worker = Worker(sim, workload, np, net, host or Host(), servers, hosts)
    if worker.hosts == "local":
        model = aggregation(model)
    period = getattr(model, "period", 1)
    if period > 1:  # whole periods, warm-up and measured: one synchronization of every fragment each
        measured = -(-max(steps - warmup, 1) // period) * period
        warmup = -(-warmup // period) * period
        steps = warmup + measured
    ends = worker.run(model, steps)
    times = model.step_times(ends)[warmup:]
    samples = np * workload.batch_size
    step_s = statistics.fmean(times) if period > 1 else statistics.median(times)
    compute_s = workload.compute_s
    record = {
        "strategy": strategy, "model": workload.model, "np": np, "servers": servers,
        "batch_size": workload.batch_size, "steps": len(times), "warmup": warmup,
        "samples_per_s": samples / step_s, "samples_per_s_min": samples / max(times),
        "samples_per_s_max": samples / max(min(times), 1e-12), "step_s": step_s, "compute_s": compute_s,
        "comm_overhead_s": step_s - compute_s, "net_bps": net.rate_bps,
        "net": "loopback" if net.rate_bps is None else f"{net.rate_bps / 1e9:g} Gbit/s",
        "compute": "simulated", "source": "gradsync simulate", "events": sim.events,
        "bytes_per_step": worker.bytes_sent() / len(ends), "plan": model.describe(),
    }
    if period > 1:
        record["period"] = period
    if worker.per_host > 1:
        record.update(ranks_per_host=worker.per_host, hosts=worker.hosts, nic_bytes_per_step=worker.nic_bytes() / len(ends))
    if hasattr(model, "dense_bytes"):
        record["dense_bytes"] = model.dense_bytes
        record["min_bytes_per_host"] = model.min_bytes_per_host()
    if trace:
        record["timeline"], record["step_ends"] = sim.log, list(ends)
    return record


# -- choosing the model of a strategy ------------------------------------------------------------------
SIMULATED = ["allreduce", "ddp", "ps", "p3", "ps-sliced", "allreduce-priority", "casync-ring", "casync-ps",
             "compressed-allgather", "sma", "pair-averaging", "ps-async", "hybrid", "local-sgd", "diloco"]


def build(name: str, options: dict | None = None, servers: int = 0) -> StrategyModel:
    """The model of strategy ``name`` with ``options`` (as ``gradsync bench --set``)."""
    from gradsync.strategies import resolve

    if name not in SIMULATED:
        raise ConfigError(f"strategy {name!r} has no simulator model yet; simulated: {', '.join(SIMULATED)}")
    strategy = resolve(name, **dict(options or {}))
    if name == "allreduce":
        if strategy.compression is not None:
            raise ConfigError("the simulator does not model allreduce with compression= yet")
        model = Buckets(strategy, strategy.cap_bytes, strategy.first_cap_bytes, flags=True)
    elif name == "ddp":
        mb = 2**20
        model = Buckets(strategy, int(strategy.options["bucket_cap_mb"] * mb), mb, flags=False,
                        copy_back=not strategy.options["gradient_as_bucket_view"])
    elif name in ("ps", "ps-async", "p3", "ps-sliced") and strategy.coder is not None:
        raise ConfigError(f"the simulator does not model {name} with compression= yet (its pushes would be "
                          "timed uncompressed); casync-ps models compressed pushes to co-located aggregators")
    elif name in ("ps", "ps-async"):
        if strategy.mode == "sync":
            model = ParameterServers(strategy, servers)
        else:
            model = averaging.AsyncServers(strategy, servers)
    elif name in compressed.COMPRESSED:
        model = {"casync-ring": compressed.CaSyncRing, "casync-ps": compressed.CaSyncPS,
                 "compressed-allgather": compressed.CompressedAllGather}[name](strategy)
    elif name in ("sma", "pair-averaging"):
        model = averaging.SMA(strategy) if name == "sma" else averaging.PairAveraging(strategy)
    elif name in ("p3", "ps-sliced"):
        credit = None if strategy.credit_mb is None or not strategy.priority else strategy.credit_mb * 2**20
        model = Slices(strategy, strategy.slice_params, credit, bool(strategy.priority), strategy.overlap,
                       all_reduce=False, servers=servers)
    elif name == "hybrid":
        model = Hybrid(strategy, servers)
    elif name in ("local-sgd", "diloco"):
        model = RareSync(strategy)
    elif name == "allreduce-priority":
        model = Slices(strategy, strategy.partition_params, strategy.credit_mb * 2**20, True, True,
                       all_reduce=True, servers=0)
    model.name = name
    model.hosts = "flat" if isinstance(model, averaging.AsyncServers) else HOSTS.get(name, "flat")
    return model


HOSTS = {"allreduce": "ring", "allreduce-priority": "ring", "sma": "ring", "pair-averaging": "ring", "ps": "local",
         "p3": "local", "ps-sliced": "local", "casync-ring": "local", "casync-ps": "local",
         "compressed-allgather": "local", "hybrid": "ring", "local-sgd": "ring", "diloco": "ring"}
"""Each strategy's schedule on hosts of several ranks (:data:`~gradsync.simulate.worker.HOST_SCHEDULES`),
as the topology-aware strategy runs it on Gloo (docs/launcher.md); the others stay flat, as they run.
``hybrid``'s dense buckets take the two-level ring, its model aggregates its tables' rows inside
the host itself (:mod:`gradsync.simulate.hybrid`)."""


__all__ = ["simulate", "build", "load", "Network", "Host", "SIMULATED", "HOSTS", "Workload", "SimulationError"]
