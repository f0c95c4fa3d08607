"""One rank of ``gradsync bench``: ``python -m gradsync.bench.worker RUN_DIR``.

Reads ``RUN_DIR/config.json`` (written by :mod:`gradsync.bench.cli`), then on every rank:

1. compute-only: the same training steps with no strategy at all, on every worker at once (so
   CPU contention is the same as in the real run): the step time without communication;
2. for each strategy: build the model from the seed, ``distribute`` it, run ``warmup + per_round``
   timed steps (forward, backward, ``optimizer.step``, ``zero_grad``; batches made beforehand),
   and record per-step time (the slowest worker's), bytes sent and peak resident memory (on an
   emulated cluster also each host link's bytes per step, read by rank 0: :class:`HostLinks`);
3. check that all workers hold the same parameters; rank 0 saves its final parameters
   ``RUN_DIR/<strategy>.pt`` for the parent's comparison with the single-process reference;
4. repeat 1-3 for ``rounds`` rounds, then rank 0 writes ``RUN_DIR/results.json``;
5. replay each strategy in float64 for ``check_steps`` steps (``RUN_DIR/<strategy>.check.pt``).
Server ranks only take part in the strategies that use servers.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import sys
import threading
import time

import torch

import gradsync
from gradsync import flight, runtime, stragglers, trace
from gradsync.consistency import all_hold_rank0s
from gradsync.bench.workload import Workload

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _release_free_memory() -> None:
    """Give memory freed earlier back to the OS (glibc ``malloc_trim``), so a measurement starts clean."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the peak then includes what the allocator kept from before


class PeakMemory:
    """Samples this process's resident set every few milliseconds; reports the peak above start.

    Freed memory is returned to the OS first, so memory an earlier strategy left in the
    allocator's free lists does not hide this one's peak (allocations themselves stay fast:
    no special malloc settings, which cost real-compute steps up to 2x in page faults).
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        _release_free_memory()
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def host_cpu() -> tuple[int, int] | None:
    """This machine's CPU time so far, ``(busy, total)`` in clock ticks over all cores (``/proc/stat``;
    None elsewhere). Busy excludes idle and I/O wait."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - ticks[3] - ticks[4], total


class HostLinks:
    """Each emulated host's link counters (:func:`gradsync.cluster.counters.link_bytes`), read by
    one rank through ``/proc/PID/net/dev`` of a rank on each host. A round's count runs from the
    start of its first step, when nothing is in flight (``settle_first``: from the end of that
    step once the strategy has settled, where the warm-up has a step after it: a strategy decides
    in its first step, ``hybrid`` probing its partition counts), to the end of its last once the
    strategy has settled (:meth:`~gradsync.strategies.base.Strategy.settle`): ``total``, each
    host's ``[tx, rx]`` bytes, over ``steps``, the steps counted, warm-up included.

    Whole rounds, because a strategy whose step returns before its traffic is done (``p3``,
    ``allreduce-priority``) carries most of a step's bytes into the next, and its first step's
    whole (it learns the order then): windows closed at each step's end hold the warm-up's tail in
    place of the last step's, and over a few measured steps read up to a step's bytes over their
    number too much or too little. Every strategy measured on hosts sends the same bytes each step;
    the strategy's own count per step (``step_bytes``) shows where one does not.

    The straggler monitor's link probe (after a round's tenth step) is not the strategy's traffic: what
    the links carry while it runs (:meth:`probe`, its ``watch``) is left out of ``total`` and kept
    in ``probe_bytes`` (each way, 16 MiB a ring neighbour on another host)."""

    def __init__(self, pids: list[int], settle_first: bool = False):
        self.pids, self.first, self.total, self.steps = pids, None, None, 0
        self.probe_bytes = [[0, 0] for _ in pids]
        self.settle_first = settle_first

    def read(self) -> list[tuple[int, int]]:
        from gradsync.cluster.counters import link_bytes

        return [link_bytes(pid) for pid in self.pids]

    def start(self) -> None:
        self.first, self.total, self.steps = self.read(), None, 0
        self.probe_bytes = [[0, 0] for _ in self.pids]

    def step(self) -> None:
        self.steps += 1

    @contextlib.contextmanager
    def probe(self):
        """Around the link probe (:attr:`gradsync.stragglers.Pace.probe_watch`): its bytes, apart."""
        before = self.read()
        yield
        for kept, n, m in zip(self.probe_bytes, self.read(), before):
            kept[0] += n[0] - m[0]
            kept[1] += n[1] - m[1]

    def end(self) -> None:
        """Close the round, once the strategy has settled: what crossed each link since ``start``,
        less the probe's."""
        self.total = [[a - b - c for a, b, c in zip(n, m, p)]
                      for n, m, p in zip(self.read(), self.first, self.probe_bytes)]


def host_links(config: dict) -> HostLinks | None:
    """On an emulated cluster, rank 0's reader of every host's link (collective over every rank:
    each names its process); None elsewhere and on every other rank."""
    if config["rate_bps"] is None or config.get("machine"):
        return None
    topo, transport = gradsync.topology(), runtime.current().transport
    pids = torch.zeros(topo.world_size, dtype=torch.int64, device=transport.device)
    pids[topo.rank] = os.getpid()
    transport.allreduce(pids, world=True, what="gather of the ranks' processes")
    return HostLinks([int(pids[ranks[0]]) for ranks in topo.hosts], settle_first=config["warmup"] >= 2) \
        if topo.rank == 0 else None


def timed_steps(model, optimizer, work: Workload, total: int, label: str = "compute only",
                cpu: list | None = None, updates: list | None = None, host_work: list | None = None,
                batches: list | None = None, links: HostLinks | None = None, sent: list | None = None,
                ctl=None) -> list[float]:
    """Run ``total`` training steps; per-step seconds. ``cpu``: gets each step's host CPU ticks
    ``[busy, total]`` appended (an emulated cluster shares this machine's cores: a run that keeps
    them busy measures the host, not the emulated cluster). ``updates``: gets each step's
    ``optimizer.step()`` seconds appended. ``host_work``: gets each step's host work of the
    strategy appended (:meth:`~gradsync.strategies.base.Strategy.host_work`, that step's part).
    ``batches``: gets the seconds each step's batch took to make appended (before the step's
    timer starts, and so not in its time). ``links``: closes a step of its counters at each step's end.
    ``sent``: gets the transport's bytes sent so far appended after each step. ``ctl``: a
    :class:`~gradsync.adapt.Controller` whose policies run around each step, as in a user's loop
    (its ``steps`` drive the loop, each worker trains on its share of the global batch, and the
    policies' work between two steps counts in the second one's time)."""
    topo = gradsync.topology()
    spec = work.spec()
    tracer = trace.current()
    times = []
    done = optimizer.strategy.host_work() if host_work is not None else None
    if links is not None:
        links.start()
    between, ended = 0.0, None
    for step in (range(total) if ctl is None else ctl.steps(total)):
        made = time.perf_counter()
        if ctl is not None and ended is not None:
            between = made - ended  # the controller's policies, after the last step and before this one
        shares = None
        if ctl is not None:
            ctl.share()  # this worker's part of the step's global batch, which the loop slices below
            shares = ctl.step_sizes if len(set(ctl.step_sizes)) > 1 else None
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers, shares)
        if batches is not None:
            batches.append(time.perf_counter() - made)
        before = host_cpu() if cpu is not None else None
        start = time.perf_counter()
        loss = spec.loss(model(*inputs), target)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        stepped = time.perf_counter()
        optimizer.zero_grad()
        end = time.perf_counter()
        times.append(end - start + between)
        if links is not None:
            links.step()
            if step == 0 and links.settle_first:  # the first step's decisions are not a step's traffic
                optimizer.strategy.settle()
                links.start()
        if sent is not None:
            sent.append(runtime.current().transport.bytes_sent)
        if updates is not None:
            updates.append(stepped - backward)
        if done is not None:
            now = optimizer.strategy.host_work()
            host_work.append({kind: [a - b for a, b in zip(now[kind], done.get(kind, [0] * len(now[kind])))]
                              for kind in now})
            done = now
        if before is not None:
            after = host_cpu()
            cpu.append([after[0] - before[0], after[1] - before[1]])
        if tracer is not None:  # the step, and the training loop's calls within it (the host's view)
            tracer.span(f"{label} step {step}", "step", start, end)
            for name, a, b in (("forward + loss", start, forward), ("backward()", forward, backward),
                               ("optimizer.step()", backward, stepped), ("zero_grad()", stepped, end)):
                tracer.span(name, "step", a, b)
        ended = time.perf_counter()
    return times


def _over_workers(times: list[float], op: str) -> torch.Tensor:
    """Each step's times, reduced over the workers with ``op``."""
    t = torch.tensor(times, dtype=torch.float64, device=runtime.current().transport.device)
    return runtime.current().transport.allreduce(t, op=op, what="gather of step times")


def slowest(times: list[float]) -> list[float]:
    """Per step, the slowest worker's time: a synchronous step ends when the last worker ends."""
    return _over_workers(times, "max").tolist()


def mean_of_workers(times: list[float]) -> list[float]:
    """Per step, the workers' mean time: below :func:`slowest` by what the step loses to workers
    that do not start or end it together."""
    return (_over_workers(times, "sum") / runtime.current().topology.num_workers).tolist()


def workers_agree(model, chunk: int = 1 << 22) -> float:
    """Largest difference between any worker's parameters and rank 0's.

    Bytewise equal SHA-256 digests on every rank mean 0.0 without moving the model (on CPU). Else
    compared ``chunk`` elements at a time (small parameters packed together): a float64 copy of a
    large model, with rank 0's beside it, would not fit next to four workers' models (VGG-19: 3.4 GB).
    """
    transport = runtime.current().transport
    worst, group, size = 0.0, [], 0
    params = [p.detach().reshape(-1) for p in model.parameters()]
    if transport.device.type == "cpu" and all_hold_rank0s(params, transport, world=False):
        return 0.0
    for i, p in enumerate(params):
        group.append(p)
        size += p.numel()
        if size < chunk and i + 1 < len(params):
            continue
        mine = torch.cat(group) if len(group) > 1 else group[0]
        for start in range(0, mine.numel(), chunk):
            piece = mine[start:start + chunk]
            ref = transport.broadcast(piece.clone(), 0, what="consistency check")
            if piece.numel():
                worst = max(worst, float((piece.double() - ref.double()).abs().max()))
        group, size = [], 0
    diff = torch.tensor([worst], dtype=torch.float64, device=transport.device)
    return float(transport.allreduce(diff, op="max", what="consistency check"))


FLAT = ":flat"
"""A label's suffix for a strategy's flat form on hosts of several workers (``distribute(...,
hosts="flat")``): ``--strategies allreduce,allreduce:flat`` runs both side by side."""


def strategy_of(label: str) -> str:
    """The strategy a bench label runs: ``casync-ring+onebit`` (``--compression``),
    ``allreduce@noise-scale`` (``--monitors``) and ``allreduce:flat`` run ``casync-ring`` and ``allreduce``."""
    return label.partition("@")[0].partition("+")[0].removesuffix(FLAT)


def hosts_of(label: str) -> str:
    """``distribute``'s ``hosts`` for a bench label: ``"flat"`` for a ``STRATEGY:flat`` label."""
    return "flat" if label.partition("@")[0].partition("+")[0].endswith(FLAT) else "auto"


MONITORS = {
    "noise-scale": lambda work: __import__("gradsync.adapt", fromlist=["NoiseScale"]).NoiseScale(work.batch_size),
    "variance": lambda work: __import__("gradsync.adapt", fromlist=["GradientVariance"]).GradientVariance(),
    "variance-sampled": lambda work: __import__("gradsync.adapt", fromlist=["GradientVariance"]).GradientVariance(
        sample=65_536),
}
"""``--monitors`` names: the monitor a ``STRATEGY@NAME`` label attaches (gradsync.adapt)."""


BALANCE = "balance"
"""``STRATEGY@balance`` (``--balance``): the strategy under :class:`gradsync.adapt.BalanceBatches`,
driven by a :class:`~gradsync.adapt.Controller` as in a user's loop. Each round starts from the
shares the previous round ended with, as a long job would hold them."""

BALANCE_EVERY, BALANCE_WARMUP = 5, 2
"""``BalanceBatches(every=, warmup=)`` of a ``@balance`` label: a round is tens of steps."""


def balanced(label: str) -> bool:
    """Whether a bench label runs its strategy under ``BalanceBatches``."""
    return label.partition("@")[2] == BALANCE


def attach_monitor(label: str, optimizer, work: Workload) -> None:
    name = label.partition("@")[2]
    if name and name != BALANCE:
        from gradsync.adapt import monitor

        monitor(optimizer, MONITORS[name](work))


def peaks(transport, worker: float = 0.0, server: float = 0.0) -> tuple[float, float]:
    """The largest peak memory of any worker and of any dedicated server (every rank calls this)."""
    mem = torch.tensor([worker, server], dtype=torch.float64, device=transport.device)
    transport.allreduce(mem, op="max", world=True, what="gather of peak memory")
    return float(mem[0]), float(mem[1])


def balancer(name: str, optimizer, work: Workload, shares: list[int] | None):
    """A ``@balance`` label's :class:`~gradsync.adapt.Controller` and its ``BalanceBatches``,
    starting from ``shares`` (None: equal); ``(None, None)`` for any other label."""
    if not balanced(name):
        return None, None
    from gradsync.adapt import BalanceBatches, Controller

    policy = BalanceBatches(every=BALANCE_EVERY, warmup=BALANCE_WARMUP)
    ctl = Controller(optimizer, [policy], batch_size=work.batch_size)
    ctl.set_shares(shares)
    return ctl, policy


def run_strategy(name: str, options: dict, work: Workload, total: int, run_dir: str,
                 links: HostLinks | None = None, shares: list[int] | None = None) -> dict | None:
    """One round of ``name``: its record (None on a dedicated server). ``shares``: where a
    ``@balance`` label's shares start."""
    topo = gradsync.topology()
    transport = runtime.current().transport
    gc.collect()  # the previous strategy's model, held in reference cycles by its hooks and threads
    with PeakMemory() as memory:
        model, optimizer = work.build()
        optimizer = gradsync.distribute(model, optimizer, strategy_of(name), exit_servers=False,
                                        hosts=hosts_of(name), **options)
        if topo.is_server:  # it served until the workers closed the strategy
            peaks(transport, server=memory.peak_mb)
            return None
        attach_monitor(name, optimizer, work)
        hooks = trace.instrument(model) if trace.current() is not None and work.compute == "real" else []
        sent_before = transport.bytes_sent
        cpu = [] if topo.rank == 0 and host_cpu() is not None else None  # one machine: rank 0's view
        updates: list[float] = []
        work_done: list[dict] = []  # this rank's (rank 0 writes the record)
        batches: list[float] = []
        recorder = flight.current()
        recorder.pace = stragglers.Pace(warmup=0)  # this strategy's steps alone (its warm-up steps are the bench's)
        if links is not None:
            recorder.pace.probe_watch = links.probe  # the link probe's bytes are not the strategy's
        counted: list[int] = []
        ctl, policy = balancer(name, optimizer, work, shares)
        with ctl.train() if ctl is not None else contextlib.nullcontext():
            times = timed_steps(model, optimizer, work, total, label=name, cpu=cpu, updates=updates,
                                host_work=work_done, batches=batches, links=links, sent=counted, ctl=ctl)
        # The round's shares by step, as the reference replays them: where it began, then each change.
        start_shares = shares or [work.batch_size] * topo.num_workers
        share_history = None if policy is None else [[0, start_shares], *[[s, list(v)] for s, v in policy.history]]
        readings = stragglers.gather(transport, topo, recorder.pace)
        slow = stragglers.verdict(readings)
        hidden = stragglers.slower(readings, named=slow)
        # a round too short to read (stragglers.SETTLED steps a worker) counts as no reading, as on worker 0
        read = stragglers.settled(readings)
        optimizer.strategy.settle()  # the last step's traffic still in flight (p3's pulls) counts toward its bytes
        sent = transport.bytes_sent - sent_before
        if links is not None:
            links.end()
        optimizer.flush()  # every parameter current, for the saved model (hybrid: more than a step's traffic)
        for hook in hooks:
            hook.remove()
    optimizer.close()  # dedicated servers leave their loop; the model can be freed before the next strategy
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    paces = _over_workers([1.0 / max(t, 1e-9) for t in times], "sum").tolist()  # steps a second, all workers'
    times, means, updates, batches = slowest(times), mean_of_workers(times), slowest(updates), slowest(batches)
    agree = workers_agree(model)
    worker_mb, server_mb = peaks(transport, worker=memory.peak_mb)
    if topo.rank == 0:
        torch.save({n: p.detach() for n, p in model.named_parameters()}, os.path.join(run_dir, f"{name}.pt"))
    return {"strategy": name, "describe": optimizer.strategy.describe(), "times": times, "optimizer_times": updates,
            "mean_times": means, "step_rates": paces, "batch_times": batches, "host_work": work_done,
            "bytes_per_step": sent / total, "peak_mem_mb": worker_mb, "server_peak_mem_mb": server_mb,
            "step_bytes": [b - a for a, b in zip([sent_before, *counted], counted)],
            "workers_max_diff": agree, "stats": {k: v for k, v in getattr(optimizer.strategy, "stats", {}).items() if isinstance(v, (int, float))},
            "exact": bool(optimizer.strategy.exact), "period": optimizer.strategy.period, "model_bytes": model_bytes,
            "host_cpu": cpu,
            "host_links": None if links is None else {"total": links.total, "steps": links.steps,
                                                      "probe": links.probe_bytes},
            "min_bytes_per_host": optimizer.strategy.min_bytes_per_host(model_bytes),
            "stragglers": [[[s.rank, s.cause, s.ratio, s.held_s] for s in slow]] if read else [],
            "slower": [[[s.rank, s.cause, s.ratio, s.held_s] for s in hidden]] if read else [], "paces": [readings],
            "share_history": share_history}


def merge(into: dict | None, record: dict, warmup: int) -> dict:
    """Accumulate one round: measured times (warm-up dropped), worst memory and agreement."""
    times, updates = record["times"][warmup:], record["optimizer_times"][warmup:]
    batches, means = record.get("batch_times", [])[warmup:], record.get("mean_times", [])[warmup:]
    cpu = None if record["host_cpu"] is None else record["host_cpu"][warmup:]
    links = record.get("host_links")  # the whole round's: see HostLinks
    work = record.get("host_work", [])[warmup:]
    rates = record.get("step_rates", [])[warmup:]
    sent = record.get("step_bytes", [])[warmup:]
    if into is None:
        return {**record, "times": times, "optimizer_times": updates, "batch_times": batches, "mean_times": means,
                "host_cpu": cpu, "host_links": links, "host_work": work, "step_rates": rates, "step_bytes": sent}
    into["step_rates"] = into.get("step_rates", []) + rates
    into["step_bytes"] = into.get("step_bytes", []) + sent
    into["times"] += times
    into["optimizer_times"] += updates
    into["batch_times"] = into.get("batch_times", []) + batches
    into["mean_times"] = into.get("mean_times", []) + means
    into["host_work"] = into.get("host_work", []) + work
    if cpu is not None:
        into["host_cpu"] += cpu
    if links is not None:
        into["host_links"] = link_sum(into["host_links"], links)
    into["peak_mem_mb"] = max(into["peak_mem_mb"], record["peak_mem_mb"])
    into["server_peak_mem_mb"] = max(into["server_peak_mem_mb"], record["server_peak_mem_mb"])
    into["stats"] = {k: into["stats"].get(k, 0) + v for k, v in record["stats"].items()
                     if isinstance(v, (int, float))}
    into["workers_max_diff"] = max(into["workers_max_diff"], record["workers_max_diff"])
    into["stragglers"] = into.get("stragglers", []) + record.get("stragglers", [])
    into["slower"] = into.get("slower", []) + record.get("slower", [])
    into["paces"] = into.get("paces", []) + record.get("paces", [])
    into["share_history"] = record.get("share_history")  # the last round's: its parameters are the ones saved
    return into


def link_sum(a: dict, b: dict) -> dict:
    """Two rounds' link counts as one."""
    def add(x: list, y: list) -> list:
        return [[i + j for i, j in zip(m, n)] for m, n in zip(x, y)]

    summed = {"total": add(a["total"], b["total"]), "steps": a["steps"] + b["steps"]}
    if "probe" in a and "probe" in b:
        summed["probe"] = add(a["probe"], b["probe"])
    return summed


def run_check(name: str, options: dict, work: Workload, steps: int, run_dir: str,
              shares: list[int] | None = None) -> None:
    """Replay ``name`` in float64 for ``steps`` steps; rank 0 saves the parameters to compare.
    ``shares``: the workers' fixed shares of each global batch (a ``@balance`` label's last ones)."""
    model, optimizer = work.build()
    optimizer = gradsync.distribute(model, optimizer, strategy_of(name), exit_servers=False, **options)
    if gradsync.topology().is_server:
        return
    ctl = None
    if shares is not None:
        from gradsync.adapt import Controller

        ctl = Controller(optimizer, [], batch_size=work.batch_size)
        ctl.set_shares(shares)
    with ctl.train() if ctl is not None else contextlib.nullcontext():
        timed_steps(model, optimizer, work, steps, ctl=ctl)
    optimizer.close()
    if gradsync.topology().rank == 0:
        torch.save({n: p.detach() for n, p in model.named_parameters()}, os.path.join(run_dir, f"{name}.check.pt"))


def check_workload(workload: dict) -> Workload:
    """The float64 replay; emulated compute replays without sleeping (dilation 0), only the values matter."""
    emulated = workload.get("compute", "real") != "real"
    return Workload(**{**workload, "dtype": "float64", **({"dilation": 0.0} if emulated else {})})


def tune_strategies(config: dict, work: Workload, run_dir: str) -> dict:
    """``--tune``: for each strategy that declares a ``tune_space``, search it (gradsync.bench.tune)
    and use the best options in the measured rounds. Returns ``{strategy: {"chosen", "probes"}}``."""
    from gradsync.bench import tune
    from gradsync.strategies import STRATEGIES, resolve

    share, warmup, out = tune.broadcaster(runtime.current().transport), config["warmup"], {}
    for name in config["strategies"]:
        options = config["options"].get(name, {})
        space = getattr(resolve(strategy_of(name), **options), "tune_space", None)
        if not space:
            continue

        def probe(candidate, name=name):
            record = run_strategy(name, candidate, work, warmup + config["tune_steps"], run_dir)
            runtime.current().transport.barrier(what=f"end of a {name} tuning probe")
            return None if record is None else tune.median_step(record["times"], warmup)

        chosen, probes = tune.tune(space, tune.starting_point(STRATEGIES[strategy_of(name)], space, options), probe, share)
        config["options"][name] = chosen
        out[name] = {"chosen": chosen, "probes": probes}
    return out


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: the strategies rotated by ``r`` places."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def main(run_dir: str) -> int:
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    torch.set_num_threads(config["threads"])
    work = Workload(**config["workload"])
    total = config["warmup"] + config["per_round"]
    topo = gradsync.init()
    say = print if topo.rank == 0 else (lambda *a, **k: None)
    # Rounds interleave the strategies (compute-only, a, b, c; compute-only, b, c, a; ...), so drift
    # on a shared machine falls on every strategy alike instead of on whichever ran last, and each
    # takes every place in the order (following compute-only, following another strategy) in turn.
    warmup, records, compute, shares = config["warmup"], {}, [], {}
    links = host_links(config)  # rank 0's, on an emulated cluster
    tuning = tune_strategies(config, work, run_dir) if config.get("tune") else {}
    for r in range(config["rounds"]):
        if config["trace"] and r == config["rounds"] - 1:  # the last round, when everything is warm
            trace.start(topo.rank, f"{topo.role} {topo.role_rank} (rank {topo.rank})")
        if topo.is_worker:
            model, optimizer = work.build()
            compute += slowest(timed_steps(model, optimizer, work, total))[warmup:]
            del model, optimizer  # not alive beside the strategies' models (VGG-19: 1.7 GB a worker)
        for name in rotated(config["strategies"], r):
            start = time.perf_counter()
            record = run_strategy(name, config["options"].get(name, {}), work, total, run_dir, links,
                                  shares=shares.get(name))
            if record is not None:
                records[name] = merge(records.get(name), record, warmup)
                if record["share_history"]:
                    shares[name] = record["share_history"][-1][1]
            runtime.current().transport.barrier(what=f"end of {name}")
            say(f"  round {r + 1}/{config['rounds']}  {name:<18} {total} steps in "
                f"{time.perf_counter() - start:.1f} s", flush=True)
    tracer = trace.stop()
    if tracer is not None:
        tracer.save(os.path.join(run_dir, f"trace-{topo.rank}.json"))
    if topo.rank == 0:
        with open(os.path.join(run_dir, "results.json"), "w") as f:
            json.dump({"compute": compute, "records": records, "tuning": tuning}, f)
    if config["check_steps"]:
        check = check_workload(config["workload"])
        for name in config["strategies"]:
            run_check(name, config["options"].get(name, {}), check, config["check_steps"], run_dir,
                      shares=shares.get(name))
            runtime.current().transport.barrier(what=f"end of the {name} check")
        say(f"  float64 replay of every strategy, {config['check_steps']} steps: done", flush=True)
    gradsync.shutdown()
    return 0


if __name__ == "__main__":
    from gradsync.fastexit import exit_now

    exit_now(main(sys.argv[1]))
