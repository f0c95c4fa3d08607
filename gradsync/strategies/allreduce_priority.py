"""Priority-scheduled all-reduce with forward overlap: ByteScheduler's idea (Peng et al., SOSP 2019).

Gradients are laid end to end in forward order and cut into partitions of ``partition_params``
elements (:mod:`gradsync.strategies.slicing`); partition ``k`` has priority ``k``, so the layers the
next forward needs first are all-reduced first. At most ``credit_mb`` of all-reduces are queued
in the transport at once, so a partition that becomes ready near the end of backward (the first
layers) overtakes queued partitions of later layers. As each all-reduce completes, its partition
is averaged and updated at once by a per-partition optimizer (the user's class and
hyperparameters; exact for elementwise optimizers), and the next forward runs each module as soon
as its partitions are updated (the ``on_params_needed`` hook point), crossing the step barrier.

**One agreed order, no deadlock.** Collectives must be issued in the same order on every rank,
but gradients become ready at slightly different times on each. So rank 0 alone schedules: when
credit allows, it picks its highest-priority ready partition, sends the decision ``int64[2] =
(partition, step)`` to every other worker (one control tag, point to point, in order) and issues
the all-reduce. Every other rank issues all-reduces strictly in the order of rank 0's decisions,
each once that partition is filled locally. This cannot deadlock: rank 0 only decides partitions
of the step it is in; every rank fills every partition of that step by its ``optimizer.step()``
at the latest (partitions of unused parameters as zeros), and filling waits for nothing but the
same partition's previous all-reduce, which every rank has already issued.

Wire: per partition, one all-reduce of ``numel + segments`` elements; the trailing elements are
"used" flags (a worker that did not use a parameter contributes zero; one no worker used keeps
``grad = None`` and its update is skipped, as in DDP). Decisions and the shutdown message
``(-1, step)`` are the only other traffic, with a keep-alive ``(-2, step)`` whenever rank 0 has had
nothing to decide for a third of the transport timeout (training paused between steps). Must
match across ranks: the model and the optimizer.
Tune ``partition_params`` (ByteScheduler: 1M by default, ~8M suggested for all-reduce) and
``credit_mb`` (4-64M parameters in its tuner); ``gradsync bench --tune`` searches both.
"""
from __future__ import annotations

import heapq
import threading
from collections import deque
from typing import Any, Callable

import torch

from gradsync import runtime
from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.base import Strategy, SyncContext, host_ring_bytes
from gradsync.strategies.overlap import (Arrivals, ForwardOrder, Gradients, SliceOptimizers, check_elementwise_flag,
                                         check_sliceable, hyper, out_of_step)
from gradsync.strategies.optstate import StateLayout, gather, install
from gradsync.strategies.slicing import SlicePlan
from gradsync.transport import check_peer

CONTROL_TAG = 0x4253
STOP, KEEPALIVE = -1, -2  # decisions that name no partition: the schedule ended; nothing to do yet


class PriorityAllReduce(Strategy):
    """Partitioned all-reduce issued by priority under a credit, with per-layer forward waits."""

    name = "allreduce-priority"
    mean_over_workers = True
    summary = "ByteScheduler: partitions all-reduced by priority under a credit, next forward per layer"
    tune_space = {"credit_mb": [4.0, 16.0, 64.0], "partition_params": [250_000, 500_000, 1_000_000]}
    """What ``gradsync bench --tune`` searches (gradsync.bench.tune); ByteScheduler's ranges."""

    def __init__(self, partition_params: int = 1_000_000, credit_mb: float = 16.0,
                 elementwise_optimizer: bool | None = None):
        if isinstance(partition_params, bool) or not isinstance(partition_params, int) or partition_params < 1:
            raise ConfigError(f"partition_params must be an integer >= 1, got {partition_params!r}")
        if not isinstance(credit_mb, (int, float)) or not credit_mb > 0:
            raise ConfigError(f"credit_mb must be > 0, got {credit_mb!r}")
        check_elementwise_flag(elementwise_optimizer)
        self.partition_params, self.credit_mb = partition_params, credit_mb
        self.elementwise = elementwise_optimizer

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        check_sliceable(self.name, ctx, self.elementwise)
        self.optimizer_class = type(ctx.optimizer)
        self.state_location = "here"  # every worker updates every partition
        self.order = ForwardOrder(len(ctx.params))
        self.plan: SlicePlan | None = None
        self.steps, self.open, self.closed = 0, False, False
        self.leader_steps: int | None = None  # followers: rank 0's steps, once it ended the schedule
        self.leader = ctx.topology.rank == 0
        self.followers = [w for w in ctx.topology.worker_ranks if w != ctx.topology.rank] if self.leader else []
        # Our threads issue all-reduces while the script runs: on a group of their own, so that a
        # loss the script all-reduces meanwhile can never be paired with one of our partitions.
        self.group = ctx.transport.new_worker_group()
        # Hosts of several workers: partitions cross the network once per host, on groups of our own too.
        self.hosts = ctx.transport.new_two_level() if ctx.two_level is not None else None

    def _make_plan(self) -> None:
        ctx = self.ctx
        eager, order = self.order.eager(), self.order.agree(ctx.transport, world=False)
        plan = SlicePlan(ctx.params, order, self.partition_params, [0])
        size = ctx.params[0].element_size()
        self.nbytes = [(sl.numel + len(sl.segments)) * size for sl in plan.slices]
        self.credit = int(self.credit_mb * 2**20)
        if self.credit < max(self.nbytes):
            raise ConfigError(f"credit_mb={self.credit_mb:g} is less than one partition ({max(self.nbytes) / 2**20:.3g} MB "
                              f"with partition_params={self.partition_params}): raise credit_mb")
        self.plan = plan
        self.buffers = [torch.zeros(sl.numel + len(sl.segments), dtype=ctx.params[0].dtype, device=ctx.params[0].device)
                        for sl in plan.slices]
        self.eager = plan.slices_of(eager)
        self.needs: dict[tuple[int, ...], list[int]] = {}
        self.arrivals = Arrivals(len(plan.slices), ctx.names)
        self.grads = Gradients(plan, ctx.names, "sent")
        self.updaters = SliceOptimizers(plan, range(len(plan.slices)), ctx.params, ctx.optimizer, self.optimizer_class)
        self.hyper: dict[int, list[dict]] = {}
        self.filled = [-1] * len(plan.slices)  # the step each partition's buffer holds
        self.ready: list = []  # rank 0: heap of (priority, partition, step)
        self.inflight_bytes = 0
        self.launched: deque = deque()
        self.stopping = False
        self.cv = threading.Condition()
        self.threads = [threading.Thread(target=self._guard, args=(self._lead if self.leader else self._follow,),
                                         name="gradsync-schedule", daemon=True),
                        threading.Thread(target=self._guard, args=(self._complete,), name="gradsync-complete", daemon=True)]
        for thread in self.threads:
            thread.start()

    # -- hook points ----------------------------------------------------------------------------------
    def on_params_needed(self, indices: tuple[int, ...]) -> None:
        if self.plan is None:
            self.order.announced.update(dict.fromkeys(indices))
            return
        needed = self.needs.get(indices)
        if needed is None:
            needed = self.needs[indices] = self.plan.slices_of(indices)
        self.arrivals.wait(needed, self.steps, indices)

    def before_forward(self) -> None:
        if self.plan is not None and self.eager:
            self.arrivals.wait(self.eager, self.steps)

    def on_grad_ready(self, index: int) -> None:
        if self.plan is None:
            self.order.got_grad.add(index)
            return
        if not self.open:
            self._open_step()
        for k in self.grads.arrived(index):
            self._fill(k)

    def step(self, apply: Callable[[], Any]) -> Any:
        if self.plan is None:
            self._make_plan()
            self._open_step()
        elif not self.open:
            self._open_step()
        self.arrivals.check()
        for k in range(len(self.plan.slices)):
            if self.filled[k] != self.steps:
                self._fill(k)
        self.steps += 1
        self.open = False
        if self.leader_steps is not None and self.steps > self.leader_steps:
            raise self._out_of_step()
        return None

    def _out_of_step(self) -> GradsyncError:
        topo = self.ctx.topology
        return out_of_step(topo.describe(0), self.leader_steps, topo.describe(topo.rank), self.steps)

    def flush(self) -> None:
        if self.plan is not None:
            self.arrivals.wait(range(len(self.plan.slices)), self.steps)

    def gather_state(self) -> None:
        if self.plan is not None:  # before the first step, the user's optimizer holds all there is
            self.flush()
            ctx = self.ctx
            install(ctx.optimizer, ctx.params,
                    gather(StateLayout(self.optimizer_class, ctx.optimizer, ctx.params), self.updaters.pieces()))

    def load_state(self) -> None:
        if self.plan is not None:
            self.flush()
            ctx = self.ctx
            self.updaters.load(StateLayout(self.optimizer_class, ctx.optimizer, ctx.params), ctx.optimizer.state)

    def _open_step(self) -> None:
        self.open = True
        self.grads.open()
        self.hyper[self.steps] = [hyper(g) for g in self.ctx.optimizer.param_groups]
        self.hyper.pop(self.steps - 4, None)

    def _fill(self, k: int) -> None:
        """Copy partition ``k``'s gradients (zeros where none) and used flags into its buffer; queue it."""
        self.arrivals.wait([k], self.steps)  # its previous all-reduce is finished (almost always at once)
        sl, params, buf = self.plan.slices[k], self.ctx.params, self.buffers[k]
        flags = []
        for seg in sl.segments:
            grad = params[seg.param].grad
            part = buf[seg.offset:seg.offset + seg.length]
            if grad is None:
                part.zero_()
            else:
                part.copy_(grad.reshape(-1)[seg.start:seg.start + seg.length])
            flags.append(0.0 if grad is None else 1.0)
        buf[sl.numel:].copy_(torch.tensor(flags, dtype=buf.dtype))
        with self.cv:
            self.filled[k] = self.steps
            if self.leader:
                heapq.heappush(self.ready, (self.steps, k))  # the older step first, then forward order
            self.cv.notify_all()

    # -- scheduling threads ------------------------------------------------------------------------------
    def _guard(self, loop) -> None:
        try:
            loop()
        except BaseException as exc:
            self.arrivals.fail(exc)
            with self.cv:
                self.cv.notify_all()

    def _lead(self) -> None:
        """Rank 0: the highest-priority ready partition, when credit allows; tell the others, issue it."""
        t, sends = self.ctx.transport, deque()
        idle_s = runtime.current().timeout_s / 3
        while True:
            with self.cv:
                idle = False
                while not self._may_launch() and not (self.stopping and not self.ready) and not idle:
                    idle = not self.cv.wait(idle_s) and not self.ready and not self.launched
                if not idle:
                    if not self.ready:  # stopping
                        break
                    step, k = heapq.heappop(self.ready)
                    self.inflight_bytes += self.nbytes[k]
            if idle:  # training paused: keep the followers' posted receive from timing out
                keepalive = torch.tensor([KEEPALIVE, self.steps], dtype=torch.int64, device=t.device)
                sends += [t.send_async(keepalive, r, CONTROL_TAG, what=f"keep-alive to rank {r}")
                          for r in self.followers]
                continue
            decision = torch.tensor([k, step], dtype=torch.int64, device=t.device)
            sends += [t.send_async(decision, r, CONTROL_TAG, what=f"schedule to rank {r}") for r in self.followers]
            self._launch(k, step)
            while len(sends) > 64:
                sends.popleft().wait(background=True)
        stop = torch.tensor([STOP, self.steps], dtype=torch.int64, device=t.device)
        sends += [t.send_async(stop, r, CONTROL_TAG, what=f"end of schedule to rank {r}") for r in self.followers]
        for handle in sends:
            handle.wait(background=True)

    def _may_launch(self) -> bool:
        if not self.ready:
            return False
        k = self.ready[0][1]
        return not self.launched or self.inflight_bytes + self.nbytes[k] <= self.credit

    def _follow(self) -> None:
        """Other ranks: issue exactly rank 0's decisions, in order, once each partition is filled here."""
        t = self.ctx.transport
        decision = torch.zeros(2, dtype=torch.int64, device=t.device)
        while True:
            t.recv_async(decision, 0, CONTROL_TAG, what="schedule from rank 0", traced=False).wait(background=True)
            k, step = decision.tolist()
            check_peer((k in (STOP, KEEPALIVE) or 0 <= k < len(self.buffers)) and step >= 0, 0,
                       "a schedule decision", f"partition {k} at step {step} (there are {len(self.buffers)})")
            if k == KEEPALIVE:
                continue
            if k == STOP:
                self.leader_steps = step
                if self.steps > step:  # this rank's last partitions will never be scheduled
                    self.arrivals.fail(self._out_of_step())
                return
            with self.cv:
                while self.filled[k] != step and self.arrivals.error is None:
                    self.cv.wait(0.5)
            self.arrivals.check()
            self._launch(k, step)

    def _launch(self, k: int, step: int) -> None:
        what = f"all-reduce of partition {k} ({self.ctx.names[self.plan.slices[k].segments[0].param]!r}..)"
        handle = self.ctx.transport.allreduce_async(self.buffers[k], what=what, group=self.hosts or self.group)
        with self.cv:
            self.launched.append((k, step, handle))
            self.cv.notify_all()

    def _complete(self) -> None:
        """In issue order: average, update the partition's parameters, mark it arrived, return credit."""
        workers = self.ctx.topology.num_workers
        while True:
            with self.cv:
                while not self.launched and not self.stopping:
                    self.cv.wait()
                if not self.launched:
                    return
                k, step, handle = self.launched[0]
            handle.wait(background=True)
            sl, buf = self.plan.slices[k], self.buffers[k]
            used = buf[sl.numel:].tolist()
            self.updaters.update(k, buf[:sl.numel].div_(workers), used, self.hyper.get(step))
            self.arrivals.mark(k, step)
            with self.cv:
                self.launched.popleft()
                self.inflight_bytes -= self.nbytes[k]
                self.cv.notify_all()

    def abandon(self) -> None:
        """After a peer failed: the schedule ends without another partition; rank 0 tells the
        followers straight from the transport, which ends their wait for its next decision."""
        self.closed = True
        if self.plan is None:  # no step was taken: nothing started
            return
        with self.cv:
            self.stopping = True
            self.ready.clear()
            self.cv.notify_all()
        if self.leader:
            stop = torch.tensor([STOP, self.steps], dtype=torch.int64, device=self.ctx.transport.device)
            self.ctx.transport.send_despite_failure([(stop, r, CONTROL_TAG) for r in self.followers])

    def close(self) -> None:
        """Wait for the last updates, end the schedule and the threads. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.plan is None:
            self._make_plan()
        self.flush()
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        for thread in self.threads:
            thread.join()
        self.arrivals.check()
        if self.ctx.topology.is_worker:  # every worker past its last all-reduce on the group: free it
            self.ctx.transport.allreduce(torch.zeros(1), what="end of the partition group", group=self.group)
            self.ctx.transport.free_group(self.group)
            self.ctx.transport.free_group(self.hosts)

    def min_bytes_per_host(self, model_bytes: int) -> float:
        return host_ring_bytes(model_bytes, self.ctx.topology)

    def describe(self) -> str:
        parts = f"{len(self.plan.slices)} partitions" if self.plan is not None else "partitions"
        return (f"allreduce-priority({parts} of <= {self.partition_params} params, credit {self.credit_mb:g} MB, "
                "rank 0 schedules, forward overlap)")
