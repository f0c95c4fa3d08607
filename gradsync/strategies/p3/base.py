"""What ``p3`` and ``ps-sliced`` share: set-up, the worker's hook points and pushes, checkpoints.

Parameters are laid end to end in forward order and cut into slices of ``slice_params`` elements,
spread round-robin over the servers (:mod:`gradsync.strategies.slicing`). The forward order is
learned in the first step and agreed (rank 0's); the plan, the per-slice optimizers and the
communication threads start at the first ``optimizer.step()``. A worker pushes each slice as soon
as backward has produced every gradient in it, through one
:class:`~gradsync.strategies.scheduler.PrioritySender` keyed ``(step, priority)`` (an older step's
message goes first); slices ready together that one rank serves share a message, in priority
order (:mod:`.wire`); the options that differ between the two strategies are attributes:
``priority`` (False: FIFO within a step), ``credit_mb`` (bytes in flight; None: no limit) and
``overlap`` (whether ``step()`` returns at once and the next forward waits per module).

Hosts of several workers (``SyncContext.two_level``, on Gloo: BytePS's and P3's local
aggregation, per slice): each host's first worker, its *leader*, is the only rank of the host
that talks to servers. The host's other workers push each ready slice message to their leader
(intra-host, same wire format, same ``(step, priority)`` keys, under their own credit); the
leader adds its host's pushes of a slice, its own included, and once the host is complete for it
pushes the host's sum, with how many of the host's workers used each parameter, to the slice's
server, by priority and under the credit as any push. A server counts a leader's push as its
host's workers. The answer goes to the leader, which forwards each answer message to its host's
workers as it arrives (so the next forward's per-module wait still ends slice by slice).
Co-located servers are the leaders, so a host's NIC carries one push and one answer per slice;
dedicated servers hear only the leaders. Messages inside the host stay out of
``Transport.bytes_sent``. One worker a host (or ``hosts="flat"``): every worker pushes for itself.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable

from gradsync import runtime
from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.base import Strategy, SyncContext, served_bytes_per_host, worker_hosts
from gradsync.strategies.optstate import StateLayout, gather, install
from gradsync.strategies.overlap import (Arrivals, ForwardOrder, Gradients, SliceOptimizers, check_elementwise_flag,
                                         check_sliceable, hyper, out_of_step)
from gradsync.strategies.p3.serving import SliceServing
from gradsync.strategies.coded import CodedBlocks
from gradsync.strategies.p3.wire import CODED, PUSH, TAG, Wire
from gradsync.strategies.scheduler import PrioritySender
from gradsync.strategies.slicing import SlicePlan
from gradsync.transport import TwoLevel


class SlicedServer(SliceServing, Strategy):
    """A sliced parameter server; subclasses fix or take ``priority``, ``credit_mb`` and ``overlap``."""

    uses_servers = True
    mean_over_workers = True
    priority: bool | Callable[[str, int], float]
    credit_mb: float | None
    overlap: bool

    def __init__(self, slice_params: int = 50_000, elementwise_optimizer: bool | None = None,
                 compression: str | None = None, error_feedback: bool = False):
        if isinstance(slice_params, bool) or not isinstance(slice_params, int) or slice_params < 1:
            raise ConfigError(f"slice_params must be an integer >= 1 (elements per slice), got {slice_params!r}")
        check_elementwise_flag(elementwise_optimizer)
        self.slice_params = slice_params
        self.elementwise = elementwise_optimizer
        self.coder = None if compression is None else CodedBlocks(compression, error_feedback, self.name)
        """Pushes to a server encoded per slice (:mod:`gradsync.strategies.coded`), or None."""
        self.answer_coder = None if compression is None else CodedBlocks(compression, True, self.name)
        """The servers' answers: each slice's change encoded, always with a residual per slice."""
        self.answer_slots: dict = {}
        self.exact = self.coder is None or self.coder.lossless

    # -- set-up ------------------------------------------------------------------------------------
    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        self.dedicated = topo.num_servers > 0
        self.me, self.workers = topo.rank, topo.worker_ranks
        hosts = [[w] for w in self.workers] if ctx.two_level is None else TwoLevel.plan(topo)[0]
        self.pushers = [h[0] for h in hosts]
        """The ranks that push to servers: every worker, or each host's leader (its first worker)."""
        self.weight = {h[0]: len(h) for h in hosts}
        """Per pusher: how many workers its push counts."""
        mine = next((h for h in hosts if self.me in h), [self.me])
        self.followers = mine[1:] if mine[0] == self.me else []
        """On a leader: its host's other workers, whose pushes it sums and to whom it forwards answers."""
        self.relay = mine[0] if mine[0] != self.me else None
        """On a host's other workers: their leader, the one rank they talk to."""
        self.servers = topo.server_ranks if self.dedicated else self.pushers
        if topo.is_server:
            self.peers = self.pushers
        elif self.relay is not None:
            self.peers = [self.relay]
        else:
            self.peers = [r for r in (self.servers if self.dedicated else self.pushers) if r != self.me] + self.followers
        check_sliceable(self.name, ctx, self.elementwise)
        if self.coder is not None:
            if ctx.transport.device.type != "cpu":
                raise ConfigError(f"{self.name} with compression= runs on Gloo (CPU tensors): its encoded pushes are "
                                  "shorter than the posted receives, which NCCL does not allow; use casync-ps or "
                                  "casync-ring on GPUs")
            self.coder.reset(self.me)
            self.answer_coder.reset(self.me)
            self.answer_slots = {}
        self.optimizer_class = type(ctx.optimizer)  # before distribute wraps it
        self.state_location = "servers" if self.dedicated else ("workers" if topo.num_workers > 1 else "here")
        self.order = ForwardOrder(len(ctx.params))
        self.plan: SlicePlan | None = None
        self.steps, self.open, self.closed = 0, False, False
        self.stopped: dict[int, int] = {}  # worker peer -> the steps it took before it stopped
        self.stopping = False  # our stop messages are queued: no keep-alive may follow them
        self.lock = threading.Lock()
        self.host_lock = threading.Lock()
        self.inside: PrioritySender | None = None

    def _make_plan(self) -> None:
        """Agree on the forward order (rank 0's), slice, and start the communication threads."""
        ctx = self.ctx
        eager, order = self.order.eager(), self.order.agree(ctx.transport, world=self.dedicated)
        plan = SlicePlan(ctx.params, order, self.slice_params, self.servers)
        credit = None if self.credit_mb is None or not self.priority else int(self.credit_mb * 2**20)
        wire = Wire(plan, ctx.params[0].dtype, credit, exact=ctx.transport.device.type != "cpu",
                    slot=None if self.coder is None else self.coder.slot(plan.slice_numel))
        if credit is not None and credit < wire.one:
            raise ConfigError(f"credit_mb={self.credit_mb:g} is less than one slice ({wire.one / 2**20:.3g} MB "
                              f"with slice_params={self.slice_params}): nothing could be sent; raise credit_mb")
        self.prio = self._priorities(plan, order)
        self.plan, self.wire = plan, wire
        self.eager = plan.slices_of(eager)
        self.needs: dict[tuple[int, ...], list[int]] = {}
        self.arrivals = Arrivals(len(plan.slices), ctx.names)
        self.grads = Gradients(plan, ctx.names, "pushed")
        owned = [sl.index for sl in plan.slices if sl.owner == self.me]
        self.updaters = SliceOptimizers(plan, owned, ctx.params, ctx.optimizer, self.optimizer_class)
        self.accum: dict[tuple[int, int], list] = {}
        self.host_accum: dict[tuple[int, int], list] = {}
        self.hyper: dict[int, list[dict]] = {}
        # Receives stay posted between steps: keep-alives when idle, well inside the transport timeout.
        # A leader sends to its host's workers on a sender of their own (loopback), so that the credit
        # holds what crosses the network; a host's other workers send only inside the host.
        idle_s = runtime.current().timeout_s / 3
        outside = [p for p in self.peers if p not in self.followers]
        self.sender = PrioritySender(ctx.transport, credit, idle=(idle_s, lambda: self._keepalive(self.sender, outside)),
                                     counted=self.relay is None)
        self.inside = None if not self.followers else PrioritySender(
            ctx.transport, credit, name="gradsync-host-sender", counted=False,
            idle=(idle_s, lambda: self._keepalive(self.inside, self.followers)))
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
            self._check_senders()

    def before_forward(self) -> None:
        if self.plan is not None and self.overlap and self.eager:
            self.arrivals.wait(self.eager, self.steps)

    def on_grad_ready(self, index: int) -> None:
        if self.plan is None:
            self.order.got_grad.add(index)
            return
        if not self.open:
            self._open_step()
        ready = self.grads.arrived(index)
        if ready:
            self._push(ready)

    def step(self, apply: Callable[[], Any]) -> Any:
        self._check()
        if self.plan is None:
            self._make_plan()
            self._open_step()
            for i in self.order.got_grad:
                self.grads.ready[i] = True
        elif not self.open:
            self._open_step()
        rest = [k for k, pushed in enumerate(self.pushed) if not pushed]
        if rest:
            self._push(rest)
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
            self._check_senders()

    def _open_step(self) -> None:
        self.open = True
        self.grads.open()
        self.pushed = [False] * len(self.plan.slices)
        if not self.dedicated:  # this step's hyperparameters, for the co-located server's updates
            self.hyper[self.steps] = [hyper(g) for g in self.ctx.optimizer.param_groups]
            self.hyper.pop(self.steps - 4, None)

    def _push(self, ready: list[int]) -> None:
        """Push the slices in ``ready`` (complete at the same moment): one message per group; on a
        host of several workers, to the host's leader, or, on the leader, into the host's sums."""
        wire, step = self.wire, self.steps
        for owner, group in self._groups(ready):
            buf = wire.new(PUSH, group, step)
            for i, k in enumerate(group):
                self.pushed[k] = True
                self._fill(k, wire.payload(buf, i), wire.used(buf, i))
            if self.relay is not None:
                self.sender.put(self._send_priority(group[0], step), buf, self.relay, TAG,
                                what=f"push of slices {group} to rank {self.relay} (host leader)")
            elif self.followers:
                self._add_host(group, step, buf)
            else:
                self._send_push(owner, group, step, buf)

    def _send_push(self, owner: int, group: list[int], step: int, buf) -> None:
        """A pusher's push of ``group`` (message ``buf``) to the slices' server ``owner``."""
        if owner == self.me:
            self._accept(self.me, group, step, buf)
        else:
            if self.coder is not None:
                buf = self._encode(group, step, buf)
            self.sender.put(self._send_priority(group[0], step), buf, owner, TAG,
                            what=f"push of slices {group} to rank {owner}")

    def _encode(self, group: list[int], step: int, buf):
        """The push ``buf`` of ``group`` as a :data:`~gradsync.strategies.p3.wire.CODED` message: each
        slice encoded by its own compressor (and residual), its used flags as they are."""
        wire, names = self.wire, self.ctx.names
        out = wire.new(CODED, group, step)
        for i, k in enumerate(group):
            segments = self.plan.slices[k].segments
            payload = wire.payload(buf, i)
            payload[segments[-1].offset + segments[-1].length:].zero_()  # the last slice's tail
            self.coder.encode(k, payload, wire.coded(out, i), what=f"slice {k} ({names[segments[0].param]!r}..)")
            wire.coded_used(out, i).copy_(wire.used(buf, i))
        return out

    def _add_host(self, slices: list[int], step: int, buf) -> None:
        """A leader: add a push of ``slices`` by one of its host's workers (itself included) to the
        host's sums; push those the whole host has now pushed, grouped by owner and priority."""
        wire, done, size = self.wire, {}, len(self.followers) + 1
        with self.host_lock:
            for i, k in enumerate(slices):
                payload, used = wire.payload(buf, i), wire.used(buf, i)
                acc = self.host_accum.get((k, step))
                if acc is None:
                    self.host_accum[(k, step)] = acc = [payload.clone(), used.clone(), 1]
                else:
                    acc[0].add_(payload)
                    acc[1].add_(used)
                    acc[2] += 1
                if acc[2] == size:
                    done[k] = self.host_accum.pop((k, step))
        for owner, group in self._groups(list(done)):
            out = wire.new(PUSH, group, step)
            for i, k in enumerate(group):
                wire.payload(out, i).copy_(done[k][0])
                wire.used(out, i).copy_(done[k][1])
            self._send_push(owner, group, step, out)

    def _groups(self, slices: list[int]) -> list[tuple[int, list[int]]]:
        """``slices`` by priority, in groups of up to ``wire.group`` with one owner each: ``(owner,
        group)``, in the order of each group's first (most urgent) slice."""
        groups, filling = [], {}
        prio = self.prio if self.priority is not False else None
        for k in (sorted(slices, key=prio.__getitem__) if prio is not None else slices):
            owner = self.plan.slices[k].owner
            group = filling.get(owner)
            if group is None or len(group) == self.wire.group:
                group = filling[owner] = []
                groups.append((owner, group))
            group.append(k)
        return groups

    def _fill(self, k: int, payload, used) -> None:
        """Slice ``k`` of this step's gradients into ``payload``, and which of its parameters have one."""
        params = self.ctx.params
        for j, seg in enumerate(self.plan.slices[k].segments):
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

    def _send_priority(self, k: int, step: int) -> tuple[int, float]:
        """Older steps first, then forward order (equal keys leave in FIFO order)."""
        return step, (self.prio[k] if self.priority is not False else 0.0)

    def _check(self) -> None:
        if self.plan is not None:
            self.arrivals.check()
            self._check_senders()

    def _check_senders(self) -> None:
        self.sender.check()
        if self.inside is not None:
            self.inside.check()

    def _sender_to(self, peer: int) -> PrioritySender:
        return self.inside if peer in self.followers else self.sender

    def close(self) -> None:
        """Workers: wait for the last answers, then end every stream. Safe to call twice."""
        if self.closed or self.ctx.topology.is_server:
            return
        self.closed = True
        if self.plan is None:  # no step was taken; dedicated servers still wait for the plan
            self._make_plan()
        self.flush()
        self._stop_peers()
        self._close_senders()
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
        """As ``ps``: dedicated servers serve every host of workers their share; co-located, one
        server a host (its leader) holds an equal share, as much as a ring all-reduce on even hosts
        (:func:`~gradsync.strategies.base.served_bytes_per_host`)."""
        topo = self.ctx.topology
        leaders = None if topo.num_servers else [ranks[0] for ranks in worker_hosts(topo)]
        return served_bytes_per_host(model_bytes, topo, holders=leaders)

    def describe(self) -> str:
        where = f"{len(self.servers)} dedicated servers" if self.dedicated else f"co-located on {len(self.servers)} workers"
        count = len(self.plan.slices) if self.plan is not None else None
        slices = "slices" if count is None else f"{count} slice{'s' if count != 1 else ''}"
        order = "custom priority" if callable(self.priority) else ("forward priority" if self.priority else "FIFO")
        credit = f", credit {self.credit_mb:g} MB" if self.priority and self.credit_mb else ""
        hosts = f", host sums: {len(self.pushers)} hosts push" if len(self.pushers) < len(self.workers) else ""
        coded = "" if self.coder is None else f", {self.coder.describe()} both ways"
        return (f"{self.name}({where}, {slices} of <= {self.slice_params} params, {order}{credit}, "
                f"{'forward overlap' if self.overlap else 'pull at step'}{hosts}{coded})")
