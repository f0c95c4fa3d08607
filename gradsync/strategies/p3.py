"""P3: priority-based parameter propagation (Jayarajan et al., SysML 2019), and its ablation ``ps-sliced``.

A parameter server whose traffic is cut into slices and sent in the order the *next forward pass*
needs it. Backward produces the last layer's gradient first and the first layer's last, while the
next forward needs the first layer first; a FIFO parameter server makes the first layer wait behind
everything else. P3's three parts, each an option here so that a benchmark can show its share:

1. **Slicing** (:mod:`gradsync.strategies.slicing`): parameters laid end to end in forward order and
   cut into slices of ``slice_params`` elements, spread round-robin over the servers.
2. **Priority** (``priority=True``): a slice's priority is its position in the forward pass. Each
   process sends through a :class:`~gradsync.strategies.scheduler.PrioritySender` with at most
   ``credit_mb`` in flight, so a newly ready slice near the input overtakes queued later ones;
   servers answer by the same priority. Every message is keyed ``(step, priority)``: an older
   step's message goes first. Without the step, a worker that finished its backward early pushed
   the next step's first layers ahead of the answers a slower worker still waited for (its last
   layers), which slowed that worker further: on VGG-19 the workers fell into alternating long and
   short steps (docs/bench-priority.md, VGG-19 trace).
3. **Forward overlap** (``overlap=True``): ``optimizer.step()`` returns at once; the next forward
   runs each module as soon as *its* slices have arrived (the ``on_params_needed`` hook point).

The pull rides on the push: once a server has every worker's push of a slice it averages them,
updates the slice with the user's optimizer (one instance per slice, same class and
hyperparameters; exact for elementwise optimizers) and answers each worker with the new values.

Servers are the dedicated ranks (``gradsync run --servers S``) or, without any, the workers
themselves (P3's own set-up: one server per machine); a co-located server runs on its worker's
communication threads. ``ps-sliced`` = slicing alone: FIFO order (within a step), no credit, and
``step()`` waits for every slice (pull after aggregation), like ``ps``.

Wire (no pickle; one message size per job, so receives are posted ahead): ``uint8`` buffer =
``int64[2]`` header ``(kind << 32 | slice, step)``, then ``slice_numel`` values, then one "used"
flag per segment (a worker that did not use a parameter contributes zero; a parameter no worker
used keeps ``grad = None`` on the server, so the optimizer skips it, as in DDP). One tag; between
two ranks messages arrive in the order sent. A stream ends with ``POSTED`` stop messages, which
fill exactly the receives the peer still has posted.

Must match across ranks: the model and the optimizer's class and hyperparameters. With dedicated
servers the servers' own optimizer is used, so an LR scheduler in the training loop does not reach
it; co-located servers take each step's hyperparameters from their worker's optimizer.
Parameters are current after the next forward has passed them, or after ``optimizer.flush()``.
Tune ``slice_params`` (P3: 40,000-50,000) and ``credit_mb`` (enough to keep a link busy; too much
and late slices can no longer be overtaken).

Why one file of this size: the worker side and the server loop are the two halves of one protocol
(slice headers, priorities and credit, the forward-order arrivals); each reads best beside the other.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from gradsync import runtime, trace
from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.base import Strategy, SyncContext, ring_bytes
from gradsync.strategies.overlap import (Arrivals, ForwardOrder, SliceOptimizers, check_elementwise_flag,
                                         check_sliceable, hyper, out_of_step)
from gradsync.strategies.optstate import StateLayout, gather, install
from gradsync.strategies.scheduler import PrioritySender
from gradsync.strategies.slicing import SlicePlan, flat_view
from gradsync.transport import check_peer

PUSH, ANSWER, STOP, KEEPALIVE = 1, 2, 3, 4
TAG = 0x5033
POSTED = 4
"""Receives each rank keeps posted per peer (Gloo moves a message once its receive is posted)."""


class Wire:
    """The fixed message layout (module docstring): views into one ``uint8`` buffer."""

    HEADER = 16

    def __init__(self, plan: SlicePlan, dtype: torch.dtype):
        self.dtype, self.numel, self.flags = dtype, plan.slice_numel, max(plan.max_segments, 1)
        size = torch.empty((), dtype=dtype).element_size()
        self.nbytes = self.HEADER + (self.numel + self.flags) * size
        self._payload_end = self.HEADER + self.numel * size

    def new(self, kind: int, index: int, step: int) -> torch.Tensor:
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        header = buf[:self.HEADER].view(torch.int64)
        header[0], header[1] = kind << 32 | index, step
        return buf

    def header(self, buf: torch.Tensor) -> tuple[int, int, int]:
        word, step = buf[:self.HEADER].view(torch.int64).tolist()
        return word >> 32, word & 0xFFFFFFFF, step

    def payload(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.HEADER:self._payload_end].view(self.dtype)

    def used(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self._payload_end:].view(self.dtype)


class P3(Strategy):
    """Sliced, prioritized parameter server with forward overlap (see the module docstring)."""

    name = "p3"
    summary = "P3: slices pushed in forward-pass priority under a credit, next forward starts per layer"
    uses_servers = True
    tune_space = {"credit_mb": [1.0, 4.0, 16.0], "slice_params": [12_500, 50_000, 200_000],
                  "overlap": [True, False]}
    """What ``gradsync bench --tune`` searches (gradsync.bench.tune). Forward overlap is a cost where
    communication is already hidden (docs/bench-priority.md, loopback overhead), so it is tuned too."""

    def __init__(self, slice_params: int = 50_000, credit_mb: float | None = 1.0,
                 priority: bool | Callable[[str, int], float] = True, overlap: bool = True,
                 elementwise_optimizer: bool | None = None):
        if isinstance(slice_params, bool) or not isinstance(slice_params, int) or slice_params < 1:
            raise ConfigError(f"slice_params must be an integer >= 1 (elements per slice), got {slice_params!r}")
        if credit_mb is not None and (not isinstance(credit_mb, (int, float)) or not credit_mb > 0):
            raise ConfigError(f"credit_mb must be > 0 (or None: no limit), got {credit_mb!r}")
        if not isinstance(overlap, bool):
            raise ConfigError(f"overlap must be True or False, got {overlap!r}")
        check_elementwise_flag(elementwise_optimizer)
        if not (isinstance(priority, bool) or callable(priority)):
            raise ConfigError(f"priority must be True (forward order), False (FIFO) or a function "
                              f"(parameter name, forward position) -> number, got {priority!r}")
        if priority is False and not overlap:
            self.name = "ps-sliced"
            self.summary = "P3's slicing alone (FIFO, pull at step): the ablation of p3"
        self.slice_params, self.credit_mb = slice_params, credit_mb
        self.priority, self.overlap = priority, overlap
        self.elementwise = elementwise_optimizer

    # -- set-up ------------------------------------------------------------------------------------
    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        self.dedicated = topo.num_servers > 0
        self.servers = topo.server_ranks if self.dedicated else topo.worker_ranks
        self.me, self.workers = topo.rank, topo.worker_ranks
        if topo.is_server:
            self.peers = self.workers
        else:
            self.peers = [r for r in (self.servers if self.dedicated else self.workers) if r != self.me]
        check_sliceable(self.name, ctx, self.elementwise)
        self.optimizer_class = type(ctx.optimizer)  # before distribute wraps it
        self.state_location = "servers" if self.dedicated else ("workers" if topo.num_workers > 1 else "here")
        self.order = ForwardOrder(len(ctx.params))
        self.plan: SlicePlan | None = None
        self.steps, self.open, self.closed = 0, False, False
        self.stopped: dict[int, int] = {}  # worker peer -> the steps it took before it stopped
        self.stopping = False  # our stop messages are queued: no keep-alive may follow them
        self.lock = threading.Lock()

    def _make_plan(self) -> None:
        """Agree on the forward order (rank 0's), slice, and start the communication threads."""
        ctx = self.ctx
        eager, order = self.order.eager(), self.order.agree(ctx.transport, world=self.dedicated)
        plan = SlicePlan(ctx.params, order, self.slice_params, self.servers)
        wire = Wire(plan, ctx.params[0].dtype)
        credit = None if self.credit_mb is None or not self.priority else int(self.credit_mb * 2**20)
        if credit is not None and credit < wire.nbytes:
            raise ConfigError(f"credit_mb={self.credit_mb:g} is less than one slice ({wire.nbytes / 2**20:.3g} MB "
                              f"with slice_params={self.slice_params}): nothing could be sent; raise credit_mb")
        self.prio = self._priorities(plan, order)
        self.plan, self.wire = plan, wire
        self.eager = plan.slices_of(eager)
        self.needs: dict[tuple[int, ...], list[int]] = {}
        self.arrivals = Arrivals(len(plan.slices), ctx.names)
        owned = [sl.index for sl in plan.slices if sl.owner == self.me]
        self.updaters = SliceOptimizers(plan, owned, ctx.params, ctx.optimizer, self.optimizer_class)
        self.accum: dict[tuple[int, int], list] = {}
        self.hyper: dict[int, list[dict]] = {}
        # Receives stay posted between steps: keep-alives when idle, well inside the transport timeout.
        self.sender = PrioritySender(ctx.transport, credit, idle=(runtime.current().timeout_s / 3, self._keepalive))
        self.threads = [threading.Thread(target=self._receive, args=(peer,), daemon=True,
                                         name=f"gradsync-{self.name}-from-{peer}") for peer in self.peers]
        for thread in self.threads:
            thread.start()

    def _priorities(self, plan: SlicePlan, order: list[int]) -> list[float]:
        """Per slice: its index (forward order), or the minimum of the user's function over its parameters."""
        if not callable(self.priority):
            return [float(k) for k in range(len(plan.slices))]
        position = {i: pos for pos, i in enumerate(order)}
        per_param = {}
        for i, name in enumerate(self.ctx.names):
            value = self.priority(name, position[i])
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ConfigError(f"the priority function returned {value!r} for parameter {name!r}; "
                                  "it must return a number (smaller = sent first)")
            per_param[i] = float(value)
        return [min(per_param[s.param] for s in sl.segments) for sl in plan.slices]

    # -- worker: hook points -------------------------------------------------------------------------
    def on_params_needed(self, indices: tuple[int, ...]) -> None:
        if self.plan is None:  # the first forward: learn the order
            self.order.announced.update(dict.fromkeys(indices))
        elif self.overlap:
            needed = self.needs.get(indices)
            if needed is None:
                needed = self.needs[indices] = self.plan.slices_of(indices)
            self.arrivals.wait(needed, self.steps, indices)
            self.sender.check()

    def before_forward(self) -> None:
        if self.plan is not None and self.overlap and self.eager:
            self.arrivals.wait(self.eager, self.steps)

    def on_grad_ready(self, index: int) -> None:
        if self.plan is None:
            self.order.got_grad.add(index)
            return
        if not self.open:
            self._open_step()
        if self.ready[index]:
            raise GradsyncError(
                f"parameter {self.ctx.names[index]!r} received a second gradient after it was pushed. "
                "For gradient accumulation, run all but the last backward inside `with optimizer.no_sync():`")
        self.ready[index] = True
        for k in self.plan.of_param[index]:
            self.pending[k] -= 1
            if self.pending[k] == 0:
                self._push(k)

    def step(self, apply: Callable[[], Any]) -> Any:
        self._check()
        if self.plan is None:
            self._make_plan()
            self._open_step()
            for i in self.order.got_grad:
                self.ready[i] = True
        elif not self.open:
            self._open_step()
        for k, sl in enumerate(self.plan.slices):
            if not self.pushed[k]:
                self._push(k)
        self.steps += 1
        self.open = False
        for peer, steps in self.stopped.items():
            if self.steps > steps:
                raise self._out_of_step(peer, steps)
        if not self.overlap:
            self.flush()
        return None

    def _out_of_step(self, peer: int, steps: int) -> GradsyncError:
        topo = self.ctx.topology
        return out_of_step(topo.describe(peer), steps, topo.describe(self.me), self.steps)

    def flush(self) -> None:
        if self.plan is not None:
            self.arrivals.wait(range(len(self.plan.slices)), self.steps)
            self.sender.check()

    def _open_step(self) -> None:
        self.open = True
        self.ready = [False] * len(self.ctx.params)
        self.pending = [len(sl.segments) for sl in self.plan.slices]
        self.pushed = [False] * len(self.plan.slices)
        if not self.dedicated:  # this step's hyperparameters, for the co-located server's updates
            self.hyper[self.steps] = [hyper(g) for g in self.ctx.optimizer.param_groups]
            self.hyper.pop(self.steps - 4, None)

    def _push(self, k: int) -> None:
        sl, params = self.plan.slices[k], self.ctx.params
        self.pushed[k] = True
        buf = self.wire.new(PUSH, k, self.steps)
        payload, used = self.wire.payload(buf), self.wire.used(buf)
        for j, seg in enumerate(sl.segments):
            grad = params[seg.param].grad
            part = payload[seg.offset:seg.offset + seg.length]
            if grad is None:
                part.zero_()
                used[j] = 0
            else:
                if grad.is_sparse:
                    raise ConfigError(f"{self.name} sends dense slices; parameter {self.ctx.names[seg.param]!r} "
                                      "has a sparse gradient (use a dense embedding, or the hybrid strategy)")
                part.copy_(grad.reshape(-1)[seg.start:seg.start + seg.length])
                used[j] = 1
        if sl.owner == self.me:
            self._accept(self.me, k, self.steps, payload, used)
        else:
            self.sender.put(self._send_priority(k, self.steps), buf, sl.owner, TAG,
                            what=f"push of slice {k} to rank {sl.owner}")

    def _send_priority(self, k: int, step: int) -> tuple[int, float]:
        """Older steps first, then forward order (equal keys leave in FIFO order)."""
        return step, (self.prio[k] if self.priority is not False else 0.0)

    def _check(self) -> None:
        if self.plan is not None:
            self.arrivals.check()
            self.sender.check()

    # -- server: aggregate, update, answer -----------------------------------------------------------
    def _accept(self, src: int, k: int, step: int, payload: torch.Tensor, used: torch.Tensor) -> None:
        with self.lock:
            acc = self.accum.get((k, step))
            if acc is None:
                self.accum[(k, step)] = acc = [payload.clone(), used.clone(), 1]
            else:
                acc[0].add_(payload)
                acc[1].add_(used)
                acc[2] += 1
            if acc[2] == len(self.workers):
                del self.accum[(k, step)]
                self._update(k, step, acc[0], acc[1].tolist())

    def _update(self, k: int, step: int, total: torch.Tensor, used: list[float]) -> None:
        sl = self.plan.slices[k]
        self.updaters.update(k, total.div_(len(self.workers)), used, self.hyper.get(step))
        answer = self.wire.new(ANSWER, k, step)
        payload, params = self.wire.payload(answer), self.ctx.params
        for seg in sl.segments:
            payload[seg.offset:seg.offset + seg.length].copy_(flat_view(params[seg.param], seg))
        for w in self.workers:
            if w != self.me:
                self.sender.put(self._send_priority(k, step), answer, w, TAG, what=f"pull of slice {k} to rank {w}")
        if self.me in self.workers:
            self.arrivals.mark(k, step)

    def _deliver(self, k: int, step: int, payload: torch.Tensor) -> None:
        params = self.ctx.params
        with torch.no_grad():
            for seg in self.plan.slices[k].segments:
                flat_view(params[seg.param], seg).copy_(payload[seg.offset:seg.offset + seg.length])
        self.arrivals.mark(k, step)

    # -- communication threads -----------------------------------------------------------------------
    def _receive(self, peer: int) -> None:
        """Messages from ``peer``, in order: pushes (we serve), answers (we train), then its stops."""
        t, wire = self.ctx.transport, self.wire
        try:
            posted = deque()
            for _ in range(POSTED):
                buf = torch.empty(wire.nbytes, dtype=torch.uint8)
                posted.append((buf, t.recv_async(buf, peer, TAG, what=f"message from rank {peer}", traced=False)))
            since = time.perf_counter()
            while True:
                buf, handle = posted.popleft()
                handle.wait(background=True)
                kind, k, step = wire.header(buf)
                self._check_header(peer, kind, k, step)
                if kind == STOP:
                    if peer in self.workers:
                        self.stopped[peer] = step
                        if self.steps > step:  # our pushes to it will never be answered
                            self.arrivals.fail(self._out_of_step(peer, step))
                    for _, rest in posted:  # the peer's other stop messages
                        rest.wait(background=True)
                    return
                if kind == PUSH:
                    since = self._trace_arrival(kind, k, peer, since)
                    self._accept(peer, k, step, wire.payload(buf), wire.used(buf))
                elif kind == ANSWER:
                    since = self._trace_arrival(kind, k, peer, since)
                    self._deliver(k, step, wire.payload(buf))
                posted.append((buf, t.recv_async(buf, peer, TAG, what=f"message from rank {peer}", traced=False)))
        except BaseException as exc:  # raised in the training thread by _check()
            self.arrivals.fail(exc)

    def _check_header(self, peer: int, kind: int, k: int, step: int) -> None:
        """A message from ``peer`` must push a slice this rank owns, answer with one ``peer`` owns, or stop."""
        slices = self.plan.slices
        owner = {PUSH: self.me, ANSWER: peer}.get(kind)
        ok = kind in (STOP, KEEPALIVE) or (owner is not None and 0 <= k < len(slices) and slices[k].owner == owner)
        check_peer(ok and step >= 0, peer, "a P3 message", f"kind {kind}, slice {k}, step {step}")

    def _trace_arrival(self, kind: int, k: int, peer: int, since: float) -> float:
        """A span per received slice, from the previous arrival on this stream to this one."""
        now = time.perf_counter()
        tracer = trace.current()
        if tracer is not None:
            first = self.ctx.names[self.plan.slices[k].segments[0].param]
            what = "push" if kind == PUSH else "pull"
            tracer.span(f"{what} slice {k} ({first}) from rank {peer}", "comm", since, now,
                        bytes=self.wire.nbytes, op=f"{what} received", priority=self.prio[k])
        return now

    def _keepalive(self) -> None:
        # After the stop messages a peer has no receive left. Runs on the sending thread, so stop
        # messages put meanwhile are still queued, and a keep-alive's priority sends it before them.
        if not self.stopping:
            for peer in self.peers:
                self.sender.put((math.inf, sys.float_info.max), self.wire.new(KEEPALIVE, 0, self.steps), peer, TAG,
                                what=f"keep-alive to rank {peer}")

    def _stop_peers(self) -> None:
        self.stopping = True
        for peer in self.peers:
            for _ in range(POSTED):
                self.sender.put((math.inf, math.inf), self.wire.new(STOP, 0, self.steps), peer, TAG,
                                what=f"stop to rank {peer}")

    def serve(self) -> None:
        """A dedicated server: slices are served on the receiving threads until every worker stops."""
        self._make_plan()
        for thread in self.threads:
            thread.join()
        self._check()
        self._stop_peers()
        self.sender.close()

    def close(self) -> None:
        """Workers: wait for the last answers, then end every stream. Safe to call twice."""
        if self.closed or self.ctx.topology.is_server:
            return
        self.closed = True
        if self.plan is None:  # no step was taken; dedicated servers still wait for the plan
            self._make_plan()
        self.flush()
        self._stop_peers()
        self.sender.close()
        for thread in self.threads:
            thread.join()
        self._check()

    # -- checkpoints -----------------------------------------------------------------------------------
    def gather_state(self) -> None:
        """Co-located servers: each worker holds the state of the slices it serves."""
        if self.plan is None:  # no step yet: the user's optimizer holds all there is (what was loaded)
            return
        self.flush()
        ctx, spread = self.ctx, self.state_location == "workers"
        layout = StateLayout(self.optimizer_class, ctx.optimizer, ctx.params)
        install(ctx.optimizer, ctx.params, gather(layout, self.updaters.pieces(), ctx.transport if spread else None))

    def load_state(self) -> None:
        if self.plan is not None:
            self.flush()
            ctx = self.ctx
            self.updaters.load(StateLayout(self.optimizer_class, ctx.optimizer, ctx.params), ctx.optimizer.state)

    # -- reports ---------------------------------------------------------------------------------------
    def min_bytes_per_host(self, model_bytes: int) -> float:
        """As ``ps``: dedicated servers serve N workers their share; co-located hosts exchange like a ring."""
        n, s = self.ctx.topology.num_workers, self.ctx.topology.num_servers
        return max(model_bytes, n * model_bytes / s) if s else ring_bytes(model_bytes, n)

    def describe(self) -> str:
        where = f"{len(self.servers)} dedicated servers" if self.dedicated else f"co-located on {len(self.servers)} workers"
        slices = f"{len(self.plan.slices)} slices" if self.plan is not None else "slices"
        order = "custom priority" if callable(self.priority) else ("forward priority" if self.priority else "FIFO")
        credit = f", credit {self.credit_mb:g} MB" if self.priority and self.credit_mb else ""
        return (f"{self.name}({where}, {slices} of <= {self.slice_params} params, {order}{credit}, "
                f"{'forward overlap' if self.overlap else 'pull at step'})")
