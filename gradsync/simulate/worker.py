"""The simulated worker: the cluster it runs on (:class:`Network`, :class:`Host`), its threads and
links on the event loop (:class:`Worker`), and the contract of a strategy's model
(:class:`StrategyModel`), which :mod:`gradsync.simulate.models`, :mod:`~gradsync.simulate.compressed`
and :mod:`~gradsync.simulate.averaging` implement.

A model plays one representative worker of a synchronous job (every worker does the same at the
same time) plus the servers it talks to. Its step is the emulated worker's: the forward of each
layer in order, the backward in reverse, each layer's gradients ready at the end of its backward,
then ``step()``. Costs on the wire: a ring all-reduce of B bytes moves ``2 (N-1)/N B`` through each
host's sending and receiving side after ``2 (N-1)`` message latencies; a point-to-point message
moves its bytes after one. Host work (packing copies, the optimizer's update) runs on the worker's
host at the :class:`Host` rates, in series with what the strategy puts after it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

from gradsync.errors import ConfigError
from gradsync.simulate.engine import Link, Sim, Stream
from gradsync.simulate.workload import Workload


@dataclass
class Network:
    """Hosts with full-duplex NICs of ``rate_bps`` (None: unlimited), one-way ``latency_s`` per
    message (wire and software), ``ranks_per_host`` workers sharing a host's NIC and linked to
    each other at ``intra_Bps`` bytes per second (the host's memory or PCIe, shared by its ranks;
    None: unlimited; no latency). ``mesh``: the share of its rate a host's link moves while it
    carries an all-to-all among the job's hosts (flows to or from every other host at once, which
    TCP shares less well than fair shares), relative to one flow; 1: fair shares (the default).
    ``benchmarks/regenerate/mesh_exchange.py`` measures it."""

    rate_bps: float | None
    latency_s: float = 50e-6
    ranks_per_host: int = 1
    intra_Bps: float | None = 12e9
    mesh: float = 1.0

    @property
    def gpus_per_host(self) -> int:
        """The older name of :attr:`ranks_per_host`."""
        return self.ranks_per_host


@dataclass
class Host:
    """Rates of the work a strategy does beside the layers: copies into and out of buckets
    (``copy_Bps``, bytes of gradient per second) and the optimizer's update (``update_Bps``,
    bytes of parameters per second). Defaults: an accelerator's, where both are negligible."""

    copy_Bps: float = 200e9
    update_Bps: float = 100e9
    codec_speed: float = 1.0
    """Compressors' encode and decode run this many times faster than measured on this machine's
    CPU (one thread)."""
    decode_speed: float | None = None
    """Decodes' own speed-up, where it differs from encodes' (a run's, measured: decodes write the
    raw gradient, encodes read it); None: ``codec_speed``."""
    handoff_s: float = 20e-6
    """From one host thread noticing an event to another acting on it (a credit returned by
    the thread that waits for sends to the thread that issues them)."""
    busy_wake_s: float | None = None
    """A blocked thread's wakeup while every core the ranks share is busy: it waits for the
    scheduler to give it one (milliseconds on average, where ``handoff_s`` is an idle core's
    microseconds). None: always ``handoff_s``."""
    cores: int = 0
    """Cores that every rank of the job shares (an emulated cluster on one machine); 0: each host
    has cores to spare, and a woken thread finds one."""
    net_cpu_s: float = 0.0
    """Host CPU per byte a host sends or receives (the kernel's TCP, the transport's copies). Where
    the ranks share ``cores`` it is a load on them beside the ranks' own threads
    (:meth:`Worker.network_load`), which a message end shares the cores with. 0: not counted (the
    default; an emulated cluster's veths on a 2-core VM take 1.2-2 ns, docs/simulate.md)."""
    jitter: float = 0.0
    """How much a host work item's time varies from step to step (its coefficient of variation:
    other processes' threads and memory traffic on the same cores). Where a step waits for the
    same work on N hosts (``hybrid``'s pulls, for every row server's update; the compressed
    strategies' messages and all-gathers, for their senders' work), it waits for the slowest:
    :meth:`Worker.slowest_of`. 0: no variation (the default)."""
    batch_s: float = 0.0
    """Host time a worker's training thread spends making each step's batch before the step, as
    ``gradsync bench``'s loop does, outside the step's time (its record's ``batch_s``). 0: none
    (the default: a data loader that prefetches)."""
    message_s: float = 0.0
    """Host CPU per end of a point-to-point message sent from Python (a send issued, a receive
    taken, with what the strategy's Python does around it), one end at a time per process (the
    interpreter lock): what bounds ``p3`` and ``ps-sliced``, thousands of slice messages a step,
    and ``hybrid``'s row requests and answers on a busy CPU, on a core of its own (where the ranks
    share ``cores``, :meth:`Worker.burst_sharing` slows it). 0: not counted (the default). The
    validation measures it on loopback (benchmarks/regenerate/simulator_matrix.py)."""
    codecs: dict = field(default_factory=dict)
    """Compressors' cost lines measured on the machine this host stands for, by compressor spec
    (as ``--compression`` takes it): ``[encode s, encode s per byte, decode s, decode s per byte,
    wire ratio]``, one thread (:func:`~gradsync.simulate.calibration.calibrate_codecs` writes
    them). A compressor named here is costed by its line, scaled by ``codec_speed`` and
    ``decode_speed`` like a measured one; any other is measured on this machine
    (:func:`~gradsync.simulate.compressed.codec_cost`). Empty: every one measured here (the default)."""


class _Meta:
    """What the strategies' planning functions read of a parameter."""

    dtype, device = "float32", "meta"

    def __init__(self, numel: int, nbytes: int):
        self._numel, self._size = numel, nbytes // max(numel, 1)

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._size


HOST_SCHEDULES = ("flat", "ring", "local")
"""How a strategy's model treats hosts of several ranks (:attr:`StrategyModel.hosts`): ``flat``,
every rank its own peer (its host's NIC carries all its ranks' traffic); ``ring``, two-level
collectives (reduce-scatter inside the host, each rank's shard all-reduced across the hosts,
all-gather inside); ``local``, local aggregation (the host's ranks sum inside the host, the host
is one peer of the exchange, its result shared inside it: :class:`~gradsync.simulate.hosts.LocalAggregation`)."""

ZEROED_PASSES = 0.5
"""A zeroed buffer the size of a table costs half a copy of its memory: a write without a read
(``zero_`` of 50.8 MB: 4.8 ms where ``copy_`` takes 9.6 ms, one thread, on the 2-core machine
that recorded the validation's hybrid cells). In an emulated run the allocator keeps freed blocks of up to
1 GB, so there are no page faults (gradsync.bench.cli)."""


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0 for one; 0.564 for 2, 1.029 for 4)."""
    return expected_last([0.0] * n, 1.0) if n > 1 else 0.0


def expected_last(means: list[float], sd: float) -> float:
    """E[max of independent normals of ``means`` and standard deviation ``sd``]: the integral of
    one less their joint CDF from the highest mean less 9 sd (below it the joint CDF is at most
    that normal's, under 1e-18), by the midpoint rule; ``max(means)`` without spread."""
    if sd <= 0 or len(means) < 2:
        return max(means)
    import torch

    steps, low, high = 4_000, max(means) - 9 * sd, max(means) + 9 * sd
    h = (high - low) / steps
    x = low + (torch.arange(steps, dtype=torch.float64) + 0.5) * h
    mu = torch.tensor(means, dtype=torch.float64)
    below = torch.special.ndtr((x[:, None] - mu[None, :]) / sd).prod(dim=1).sum().item()
    return high - below * h


class Worker:
    """The representative worker: its accelerator, its host, its NIC, and the step driver."""

    def __init__(self, sim: Sim, workload: Workload, np: int, net: Network, host: Host, servers: int = 0,
                 hosts: str = "flat"):
        if np < 1:
            raise ConfigError(f"workers must be >= 1, got {np}")
        if net.rate_bps is not None and net.rate_bps <= 0:
            raise ConfigError(f"link rate must be > 0, got {net.rate_bps}")
        if not 0 < net.mesh <= 1:
            raise ConfigError(f"mesh efficiency must be in (0, 1], got {net.mesh}")
        if net.ranks_per_host < 1:
            raise ConfigError(f"ranks per host must be >= 1, got {net.ranks_per_host}")
        if hosts not in HOST_SCHEDULES:
            raise ConfigError(f"hosts schedule must be one of {', '.join(HOST_SCHEDULES)}, got {hosts!r}")
        self.sim, self.w, self.net, self.host_rates = sim, workload, net, host
        rate = float("inf") if net.rate_bps is None else net.rate_bps / 8
        self.per_host = per_host = max(1, min(net.ranks_per_host, np))
        self.workers = np  # every rank of the job
        self.intra = Link("intra-host", float("inf") if net.intra_Bps is None else net.intra_Bps)
        # Two-level (HOST_SCHEDULES): the host is the network's peer, its NIC carries the host's
        # one share of each exchange. Flat: every rank is its own peer, and its host's NIC carries
        # the traffic of all its ranks (this rank's links get 1/R of the NIC).
        self.hosts = hosts if per_host > 1 else "flat"
        self.np = -(-np // per_host) if self.hosts != "flat" else np  # the network's peers
        share = rate if self.hosts != "flat" else rate / per_host
        self.tx, self.rx = Link("worker tx", share), Link("worker rx", share)
        # A flat ring in rank order crosses each host's NIC once each way (hosts hold consecutive
        # ranks): the NIC carries one rank's ring traffic, not R ranks', at the NIC's whole rate;
        # the ring's other R-1 edges of the host move as much over its intra-host link.
        ring = 1 / per_host if self.hosts == "flat" else 1
        self.ring_links = [(self.tx, ring), (self.rx, ring)]
        if self.hosts == "flat" and per_host > 1:
            self.ring_links.append((self.intra, per_host - 1))
        # Gloo's point-to-point messages between two hosts in both directions get half the rate
        # each way when each side posts its send before its receive (docs/mechanisms.md; its
        # all-reduce uses both directions at full rate): such exchanges also pass through this
        # one link of the NIC's rate.
        self.duplex = Link("worker send+receive", share)
        self.servers = [(Link(f"server {s} tx", rate), Link(f"server {s} rx", rate)) for s in range(servers)]
        self.gpu = Stream(sim, "accelerator")
        self.host = Stream(sim, "host")
        self.cpu = [self.host]  # the streams that keep a core busy (cpu_stream)
        self.ranks = np + servers
        self.params = workload.params
        self.metas = [_Meta(p.numel, p.nbytes) for p in self.params]
        self.tables_of_layer: dict[int, list[str]] = {}
        for p in self.params:
            if p.name in workload.tables:
                self.tables_of_layer.setdefault(p.layer, []).append(p.name)
        self.local_sent = 0.0
        """Bytes this worker sent to peers on its own host (flat: its ring's edges inside the host,
        its pushes to owners there), which its NIC does not carry."""
        self.step_starts: list[float] = []  # after each step's batch
        self.step_ends: list[float] = []

    @property
    def local_peers(self) -> int:
        """The network's peers on this worker's host, itself included: flat, the host's ranks, which
        reach each other without its NIC; two-level, 1 (the host is the peer)."""
        return self.per_host if self.hosts == "flat" else 1

    def bytes_sent(self) -> float:
        """What this worker has sent so far, point to point and in rings: its share of its
        host's NIC (:meth:`nic_bytes` over the ranks per host), and, flat, what it sent to the
        ranks of its own host (:attr:`local_sent`)."""
        return self.nic_bytes() / self.per_host + self.local_sent

    def nic_bytes(self) -> float:
        """What this worker's host has sent through its NIC so far: flat, its ranks' bytes; two-level,
        the host's."""
        return self.tx.carried * (self.per_host if self.hosts == "flat" else 1)

    def thread(self, name: str) -> Stream:
        """Another serial worker of this host (a communication thread, a collective stream, a server)."""
        return Stream(self.sim, name)

    # -- the wire ----------------------------------------------------------------------------------
    def ring(self, nbytes: float, done: Callable[[], None], name: str = "all-reduce") -> None:
        """A ring all-reduce of ``nbytes`` among the network's peers. Two-level (``hosts="ring"``),
        as :class:`~gradsync.transport.twolevel.TwoLevel` runs it: in parts of at least
        ``PIPELINE_BYTES`` (at most ``PIPELINE_PARTS``), each a reduce-scatter inside the host (each
        rank sends ``(R-1)/R`` of the part over the host's :attr:`intra` link, the R ranks at once),
        the all-reduce of each rank's ``1/R`` shard across the hosts (the R ranks through the NIC at
        once: a ring over the hosts of all the part's bytes), and an all-gather inside the host;
        the host's thread sums part ``i+1`` in the host while part ``i`` crosses the network, then
        gathers part ``i`` (:meth:`_two_level`). The code gathers on a second thread and group, so
        it may sum the next part (or the next buffer) before the last one is gathered: this
        schedule is the one-thread order, which the code never falls behind."""
        r = self.per_host if self.hosts == "ring" else 1
        if r == 1:
            self._across(nbytes, done, name)
        else:
            self._two_level(nbytes, r, done, name)

    def _across(self, nbytes: float, done: Callable[[], None], name: str) -> None:
        """A ring all-reduce of ``nbytes`` among the network's peers, through this host's NIC."""
        n = self.np
        if n == 1:
            self.sim.after(0.0, done)
            return
        if self.hosts == "flat":  # every rank sends its ring's bytes; one of a host's R crosses its NIC
            self.local_sent += 2 * (n - 1) / n * nbytes * (1 - 1 / self.per_host)
        self.sim.transfer(2 * (n - 1) / n * nbytes, self.ring_links, done,
                          latency=2 * (n - 1) * self.net.latency_s, name=name, lane="network")

    def _two_level(self, nbytes: float, r: int, done: Callable[[], None], name: str) -> None:
        """The two-level all-reduce's pipeline: the host's thread runs, in this order, scatter 0,
        then for each next part its scatter, the wait for the previous part's all-reduce across
        hosts and that part's gather, and last the final part's gather; the parts cross the network
        one after another (one process group per shard, its operations in order)."""
        from gradsync.transport.twolevel import PIPELINE_BYTES, PIPELINE_PARTS

        parts = max(1, min(PIPELINE_PARTS, int(nbytes) // PIPELINE_BYTES))
        piece = nbytes / parts
        inside = (r - 1) / r * piece
        crossed: dict[int, bool] = {}
        waiting: dict[int, Callable[[], None]] = {}
        network = self.thread(f"{name}: across hosts")
        ops = [("scatter", 0)]
        for i in range(1, parts):
            ops += [("scatter", i), ("gather", i - 1)]
        ops.append(("gather", parts - 1))

        def arrived(i: int) -> None:
            crossed[i] = True
            if i in waiting:
                waiting.pop(i)()

        def run(k: int) -> None:
            if k == len(ops):
                done()
                return
            kind, i = ops[k]
            if kind == "scatter":
                def scattered() -> None:
                    network.submit(lambda finish: self._across(piece, finish, f"{name} part {i}"),
                                   lambda: arrived(i), what=f"{name} part {i}")
                    run(k + 1)
                self.sim.transfer(inside, [(self.intra, r)], scattered,
                                  name=f"{name} part {i}: reduce-scatter in host", lane="intra-host")
                return
            gather = lambda: self.sim.transfer(inside, [(self.intra, r)], lambda: run(k + 1),
                                               name=f"{name} part {i}: all-gather in host", lane="intra-host")
            if crossed.get(i):
                gather()
            else:
                waiting[i] = gather

        run(0)

    def inside_allreduce_s(self, nbytes: float) -> float:
        """An all-reduce of ``nbytes`` among a host's ranks alone, on its :attr:`intra` link (a
        reduce-scatter and an all-gather, ``(R-1)/R`` of the bytes each, the R ranks at once); 0 flat."""
        r = self.per_host if self.hosts != "flat" else 1
        return 2 * (r - 1) * nbytes / self.intra.rate if r > 1 else 0.0

    def inside(self, nbytes: float, done: Callable[[], None], name: str) -> None:
        """``nbytes`` from each of the host's other ranks to one of them, or back (a local
        aggregation's reduce, or its pull shared inside the host), over the host's :attr:`intra` link."""
        if self.per_host == 1 or self.hosts == "flat":
            done()
            return
        self.sim.transfer(nbytes, [(self.intra, self.per_host - 1)], done, name=name, lane="intra-host")

    def message(self, nbytes: float, uses, done: Callable[[], None], name: str = "message", *,
                mesh: bool = False) -> None:
        """A point-to-point message of ``nbytes`` through ``uses``; ``mesh``: one of an all-to-all
        among the workers' hosts (:meth:`mesh_efficiency`)."""
        self.sim.transfer(nbytes, uses, done, latency=self.net.latency_s, name=name, lane="network",
                          efficiency=self.mesh_efficiency() if mesh else 1.0)

    def mesh_efficiency(self) -> float:
        """The share of a link's rate an all-to-all among the workers' hosts moves
        (:attr:`Network.mesh`): from three hosts on, where each link carries flows from more than
        one peer; two hosts exchange one flow each way."""
        return self.net.mesh if self.np >= 3 else 1.0

    def message_ends(self, interpreter: Stream, ends: float, then: Callable[[], None], message_s: float | None = None) -> None:
        """``ends`` message ends (a send issued, a receive taken) handled by a process's Python
        threads, one at a time under its interpreter lock (``message_s`` each, by default
        :attr:`Host.message_s`, on a core of its own; slowed by the other ranks' threads busy at
        the time where the ranks share cores, :meth:`burst_sharing`), then ``then``."""
        cost = self.ends_s(ends, message_s)
        if cost <= 0:
            then()
        else:
            interpreter.run(cost, then, what="message ends")

    def ends_s(self, ends: float, message_s: float | None = None) -> float:
        """Host time of ``ends`` message ends (a send issued, a receive taken): ``message_s`` each, by
        default :attr:`Host.message_s`, slowed where the ranks share cores (:meth:`burst_sharing`)."""
        cost = ends * (self.host_rates.message_s if message_s is None else message_s)
        return cost * self.burst_sharing() if cost > 0 else 0.0

    def cpu_stream(self, name: str) -> Stream:
        """A serial worker of this rank that keeps a core busy while it works (a Python thread)."""
        stream = Stream(self.sim, name)
        self.cpu.append(stream)
        return stream

    def busy_fraction(self) -> float:
        """The fraction of the time so far that this rank's CPU streams have been at work: the
        ranks do not run in lock step (docs/simulate.md, a traced ``p3`` run), so each of the
        job's ranks is taken to keep a core busy that fraction of the time, independently."""
        return min(1.0, sum(s.busy_s for s in self.cpu) / self.sim.now) if self.sim.now > 0 else 0.0

    def wake_s(self) -> float:
        """How long a thread blocked on an event takes to run once it is set (a credit returned to
        the sending thread, a request or an answer taken): ``handoff_s``, or, where the ranks share
        ``cores``, ``busy_wake_s`` with the chance that every core is busy, taken over the time,
        not at this instant (:meth:`busy_fraction`)."""
        h = self.host_rates
        if h.busy_wake_s is None or h.cores <= 0 or self.sim.now <= 0:
            return h.handoff_s
        u, n = self.busy_fraction(), self.ranks  # P(at least `cores` of n busy): one less the chance of fewer
        busy = 0.0 if h.cores > n else max(0.0, 1.0 - sum(
            math.comb(n, j) * u**j * (1 - u)**(n - j) for j in range(h.cores)))
        return h.handoff_s + busy * max(0.0, h.busy_wake_s - h.handoff_s)

    def burst_sharing(self) -> float:
        """How many times longer a short burst of a waking thread takes where the ranks share
        ``cores``: it runs beside the other ranks' threads that are busy at that moment, each of
        them with the chance :meth:`busy_fraction`, and the network's load on the cores
        (:meth:`network_load`, ``L``): ``E[max(1, (1 + K + L) / cores)]`` with ``K`` of the
        ``ranks - 1`` others busy (binomial). 1 where each host has cores to spare."""
        h = self.host_rates
        load = self.network_load()
        if h.cores <= 0 or (self.ranks <= h.cores and load <= 0):
            return 1.0
        u, others = self.busy_fraction(), self.ranks - 1
        return sum(math.comb(others, j) * u**j * (1 - u)**(others - j) * max(1.0, (1 + j + load) / h.cores)
                   for j in range(others + 1))

    def network_load(self) -> float:
        """The cores that the job's network traffic keeps busy on average so far, where the ranks
        share ``cores`` (:attr:`Host.net_cpu_s` per byte sent or received): every worker sends
        what this one does and receives as much; dedicated servers receive and send it all again."""
        h = self.host_rates
        if h.cores <= 0 or h.net_cpu_s <= 0 or self.sim.now <= 0:
            return 0.0
        ends = 2 * self.bytes_sent() * self.workers * (2 if self.servers else 1)
        return ends * h.net_cpu_s / self.sim.now

    def slowest_of(self, n: int) -> float:
        """The slowest of ``n`` hosts' runs of the same work, as a multiple of its mean: ``1 +
        jitter * E[max of n standard normals]`` (1.11x for 2 hosts at a jitter of 0.19)."""
        return 1.0 + self.host_rates.jitter * expected_max_normal(n)

    def last_of(self, work_s: float, then_s: list[float]) -> float:
        """When the last of several hosts is done, each running the same ``work_s`` (with the host's
        ``jitter``) and then what is its own (``then_s``), less the longest of ``then_s``: the
        work's time as the last one's wait sees it. Alike, ``work_s * slowest_of(n)``; where one
        host's own part is much the longest, ``work_s``: the others' spread ends before it."""
        late = expected_last([work_s + t for t in then_s], self.host_rates.jitter * work_s)
        return late - max(then_s)

    def copy_s(self, nbytes: float) -> float:
        return nbytes / self.host_rates.copy_Bps

    def update_s(self, nbytes: float) -> float:
        return nbytes / self.host_rates.update_Bps

    def table_grad_s(self, layer: int, rows_only: set[str]) -> float:
        """Host time of the embedding tables' gradients of ``layer``: the rows read (a table in
        ``rows_only``, as ``hybrid`` makes them) or a zeroed copy of the whole table with the rows
        added (``nn.Embedding``'s dense gradient). On an accelerator both are negligible."""
        seconds = 0.0
        for name in self.tables_of_layer.get(layer, ()):
            table = self.w.tables[name]
            rows = table.read * table.row_bytes
            seconds += self.copy_s(rows if name in rows_only else ZEROED_PASSES * table.rows * table.row_bytes + rows)
        return seconds

    # -- one step ----------------------------------------------------------------------------------
    def run(self, model: "StrategyModel", steps: int) -> list[float]:
        """Simulate ``steps`` steps; the time each ended."""
        self.steps = steps
        model.bind(self)
        self._step(model, 0, steps)
        self.sim.run()
        if len(self.step_ends) != steps:
            raise ConfigError(f"the {model.name} model stopped after {len(self.step_ends)} of {steps} steps "
                              "(a schedule that never completes)")
        return self.step_ends

    def _step(self, model: "StrategyModel", step: int, steps: int) -> None:
        if self.host_rates.batch_s > 0:  # the batch first, on the training thread's host work
            self.host.run(self.host_rates.batch_s, lambda: self._steps(model, step, steps), what="batch")
        else:
            self._steps(model, step, steps)

    def _steps(self, model: "StrategyModel", step: int, steps: int) -> None:
        layers = self.w.layers
        self.step_starts.append(self.sim.now)

        def forward(i: int) -> None:
            if i == len(layers):
                backward(len(layers) - 1)
                return
            model.before_layer(step, i, lambda: self.gpu.run(layers[i].forward_s, lambda: forward(i + 1),
                                                             what=f"forward {layers[i].name}"))

        def backward(i: int) -> None:
            if i < 0:
                model.after_backward(step, end)
                return

            def ready() -> None:
                model.on_layer_ready(step, i)
                backward(i - 1)

            self.gpu.run(layers[i].backward_s + self.table_grad_s(i, model.row_tables), ready,
                         what=f"backward {layers[i].name}")

        def end() -> None:
            model.step(step, finished)

        def finished() -> None:
            self.step_ends.append(self.sim.now)
            if step + 1 < steps:
                self._step(model, step + 1, steps)

        model.before_forward(step, lambda: forward(0))


class StrategyModel:
    """The hook points of :class:`gradsync.strategies.base.Strategy`, in simulated time."""

    name = "?"
    updates_locally = False
    """Whether the strategy's ``optimizer.step()`` is only the user's optimizer on this worker's
    host (the gradients synchronized in ``backward()``): :meth:`step` is :meth:`local_update`."""
    row_tables: set[str] = frozenset()
    """The embedding tables whose gradient is their rows, not the whole table (``hybrid``'s)."""
    hosts = "flat"
    """Its schedule on hosts of several ranks (:data:`HOST_SCHEDULES`): what the topology-aware
    strategy does there; ``flat`` where it does not know hosts (``ddp``)."""
    shares_host_at_step = False
    """Under local aggregation (``hosts="local"``): whether the host's first rank shares the pulled
    parameters with its other ranks in one broadcast inside ``optimizer.step()`` (``ps``:
    :class:`~gradsync.simulate.hosts.StepShare`) rather than layer by layer before each layer's
    forward (:class:`~gradsync.simulate.hosts.LocalAggregation`)."""

    def __init__(self, strategy):
        self.strategy = strategy  # the real strategy object: its options

    def bind(self, worker: Worker) -> None:
        self.wk = worker

    def describe(self) -> str:
        """What the model decided that a user should know (``hybrid``: the tables on row servers)."""
        return ""

    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        go()

    def before_layer(self, step: int, layer: int, go: Callable[[], None]) -> None:
        go()

    def on_layer_ready(self, step: int, layer: int) -> None:
        pass

    def after_backward(self, step: int, go: Callable[[], None]) -> None:
        go()

    def step(self, step: int, go: Callable[[], None]) -> None:
        go()

    def step_times(self, ends: list[float]) -> list[float]:
        """Each step's time as ``gradsync bench`` takes it, the slowest worker's, from the simulated
        worker's step ends (in lock step, that worker's own), each from its start after its batch."""
        return [b - a for a, b in zip(self.wk.step_starts, ends)]

    def local_update(self, go: Callable[[], None]) -> None:
        """The user's optimizer over every parameter, on this worker's host."""
        self.wk.host.run(self.wk.update_s(self.wk.w.nbytes), go, what="optimizer")
