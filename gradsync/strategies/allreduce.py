"""Bucketed, overlapped ring all-reduce: the Horovod / PyTorch DDP design (Sergeev & Del Balso 2018;
Li et al., VLDB 2020).

Gradients are fused into buckets of about ``bucket_mb`` megabytes (the first one ``first_bucket_mb``,
so the first all-reduce starts early) in the order backward produces them. A bucket is all-reduced
as soon as all its gradients are ready, while backward continues: divided by the number of workers
as it is packed (as DDP does), then summed. Buckets are launched strictly in index order, which
keeps every rank issuing the same collectives in the same order. The end of backward waits for
them and points each ``p.grad`` at its place in the bucket; ``step()`` runs the local optimizer.

Wire: per bucket, one all-reduce of ``numel + n_params`` elements in the gradients' dtype. The last
``n_params`` elements are "used" flags, so the sum tells how many workers produced each gradient:
zero means no worker used that parameter this step and its ``grad`` stays ``None`` (as in DDP),
without a second collective. Buckets start in reverse registration order; after the first step
they are rebuilt in the order gradients actually arrived on rank 0 (broadcast, so all agree).

``compression=NAME`` all-reduces each bucket's payload instead of its gradients, for compressors
whose payloads add up in one round (fp16, bf16, random-k with a shared seed; Horovod's
``Compression.fp16``); the bucket is divided by the number of workers before compressing, so a
half-precision sum cannot overflow where the average would not. Others need ``casync-ring``.

Must match across ranks: the model (checked by ``distribute``). Tune ``bucket_mb``: larger buckets
mean fewer, more efficient all-reduces but later first send (Horovod uses 64-128 MB, DDP 25 MB).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gradsync.compress import CompressionError, PowerSGD, build, parse_spec
from gradsync.compress.base import all_finite
from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.base import Strategy, SyncContext, fill_slot, host_ring_bytes
from gradsync.strategies.buffers import BufferBroadcast

MB = 1024 * 1024
PACK_BYTES = 256 * 1024
"""Gradients that arrived are copied into their bucket once this many bytes of them wait: one
call for many small gradients, and at most this much copying left when a bucket's last one comes."""


@dataclass
class Bucket:
    indices: list[int]
    views: list[torch.Tensor]
    """``views[slot]``: the bucket region of parameter ``indices[slot]``, shaped like it."""
    numel: int
    buffer: torch.Tensor
    pending: int = 0
    ready: list[bool] = field(default_factory=list)
    used: list[float] = field(default_factory=list)
    handle: Any = None
    arrived: list[int] = field(default_factory=list)
    """Slots whose gradient backward produced since they were last packed."""
    arrived_bytes: int = 0
    packed: list[bool] = field(default_factory=list)

    def reset(self) -> None:
        self.pending = len(self.indices)
        self.ready = [False] * len(self.indices)
        self.used = [0.0] * len(self.indices)
        self.packed = [False] * len(self.indices)
        self.arrived, self.arrived_bytes = [], 0
        self.handle = None

    def mark(self, slot: int) -> None:
        """Backward produced (or added to) the gradient of ``slot``'s parameter; count each slot once."""
        self.arrived.append(slot)
        self.arrived_bytes += self.views[slot].numel() * self.views[slot].element_size()
        if not self.ready[slot]:
            self.ready[slot] = True
            self.pending -= 1

    def pack(self, params: list[torch.Tensor], slots: list[int], divisor: int) -> None:
        """Copy the current ``grad`` of ``slots`` into the buffer divided by ``divisor`` (zeros and
        "unused" for ``None``): one copy and one division call for all of them when every gradient
        is there, the common case."""
        if not slots:
            return
        grads = [params[self.indices[s]].grad for s in slots]
        views = [self.views[s] for s in slots]
        if all(g is not None for g in grads):
            torch._foreach_copy_(views, grads)
            if divisor != 1:
                torch._foreach_div_(views, divisor)
            for s in slots:
                self.used[s], self.packed[s] = 1.0, True
            return
        for s, view, grad in zip(slots, views, grads):
            self.used[s], self.packed[s] = fill_slot(view, grad), True
            if divisor != 1:
                view.div_(divisor)

    def pack_arrived(self, params: list[torch.Tensor], divisor: int) -> None:
        slots, self.arrived, self.arrived_bytes = self.arrived, [], 0
        self.pack(params, slots, divisor)

    def pack_rest(self, params: list[torch.Tensor], divisor: int) -> None:
        """Before launch: what arrived since the last pack, then every slot never packed this pass
        (parameters backward did not reach; an earlier pass inside ``no_sync`` may have left them a
        gradient, which counts)."""
        self.pack_arrived(params, divisor)
        self.pack(params, [s for s, done in enumerate(self.packed) if not done], divisor)

def plan_buckets(params: list[torch.Tensor], order: list[int], cap_bytes: int,
                 first_cap_bytes: int) -> list[list[int]]:
    """Split ``order`` into consecutive groups of one dtype/device and at most ``cap_bytes`` each."""
    groups: list[list[int]] = []
    size, cap = 0, first_cap_bytes
    for i in order:
        p = params[i]
        nbytes = p.numel() * p.element_size()
        same_kind = groups and (params[groups[-1][0]].dtype, params[groups[-1][0]].device) == (p.dtype, p.device)
        if groups and same_kind and size + nbytes <= cap:
            groups[-1].append(i)
            size += nbytes
            continue
        if groups:
            cap = cap_bytes
        groups.append([i])
        size = nbytes
    return groups


class BucketedSync(Strategy):
    """Buckets launched as backward produces their gradients. The per-gradient hook counts; arrived
    gradients are copied into their bucket (and divided by ``divisor``) one call per
    :data:`PACK_BYTES` of them, and once every gradient of a bucket exists the rest is packed and the
    bucket launched, strictly in index order so every rank issues the same collectives in the same order. Subclasses implement
    ``_launch(k)`` and ``synchronize()`` (``allreduce``, and the compressed strategies).

    ``synchronize()`` runs at the end of each backward pass (:meth:`after_backward`), as DDP's reducer
    does: the buckets overlap backward, and when ``backward()`` returns every ``p.grad`` is the mean
    over workers, so clipping, ``GradScaler.unscale_`` and gradient edits act on what the update uses.
    A second backward before ``step()`` (outside ``no_sync``) all-reduces the accumulated gradients
    again, which adds the new mean to the old one, as DDP does. ``step()`` synchronizes only when no
    hooked backward ran since the last step (every backward inside ``no_sync``)."""

    mean_grads_at_apply = True
    mean_over_workers = True
    grad_edits = "synced"
    synced = False
    """Whether the gradients were synchronized by a backward pass since the last step."""
    deferred: GradsyncError | None = None
    """A fault every worker agreed on at the end of backward (a NaN/Inf gradient, a value out of a
    codec's range): the gradients are then NaN on every worker and ``step()`` raises this. With
    ``torch.amp.GradScaler`` the step is skipped on every worker instead, as under DDP."""

    divisor = 1
    """What gradients are divided by as they are packed (``allreduce``: the number of workers, so
    the sum is the mean; the compressed strategies divide where their codec needs it)."""
    broadcast_buffers = True
    """Before each training-mode forward, give every worker worker 0's buffers (BatchNorm
    statistics), as DDP does by default (:mod:`gradsync.strategies.buffers`)."""

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        self.buffer_sync = BufferBroadcast(ctx.model, ctx.transport) if self.broadcast_buffers else None

    def before_forward(self) -> None:
        if self.buffer_sync:
            self.buffer_sync()

    def _make_buckets(self, order: list[int], cap_bytes: int, first_cap_bytes: int, extra: int) -> None:
        """``self.buckets`` over ``order``; each buffer has ``extra(group)`` elements past the gradients."""
        params = self.ctx.params
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[Bucket, int]] = {}
        for group in plan_buckets(params, order, cap_bytes, first_cap_bytes):
            numel = sum(params[i].numel() for i in group)
            first = params[group[0]]
            buffer = torch.zeros(numel + extra(group), dtype=first.dtype, device=first.device)
            views, offset = [], 0
            for i in group:
                views.append(buffer[offset:offset + params[i].numel()].view_as(params[i]))
                offset += params[i].numel()
            bucket = Bucket(group, views, numel, buffer)
            bucket.reset()
            for slot, i in enumerate(group):
                self.where[i] = (bucket, slot)
            self.buckets.append(bucket)
        self.next_launch = 0

    def on_grad_ready(self, index: int) -> None:
        bucket, slot = self.where[index]
        if bucket.handle is not None:
            raise GradsyncError(
                f"parameter {self.ctx.names[index]!r} received a second gradient after its bucket was "
                "sent. For gradient accumulation, run all but the last backward inside "
                "`with optimizer.no_sync():`")
        bucket.mark(slot)
        if bucket.arrived_bytes >= PACK_BYTES:
            bucket.pack_arrived(self.ctx.params, self.divisor)
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].pending == 0:
            self._send(self.next_launch)

    def _send(self, k: int) -> None:
        """Pack what is left of bucket ``k`` from the gradients as they are now and launch it."""
        self.buckets[k].pack_rest(self.ctx.params, self.divisor)
        self._launch(k)

    def after_backward(self) -> None:
        self.synchronize()
        self.synced = True

    def step(self, apply: Callable[[], Any]) -> Any:
        if not self.synced:
            self.synchronize()
        self.synced = False
        if self.deferred is not None:
            error, self.deferred = self.deferred, None
            raise error
        return apply()

    def _defer(self, error: GradsyncError) -> None:
        """Make every gradient of this step NaN and keep ``error`` for ``step()`` (see ``deferred``)."""
        for bucket in self.buckets:
            bucket.buffer[:bucket.numel].fill_(float("nan"))
            for slot, i in enumerate(bucket.indices):
                self.ctx.params[i].grad = bucket.views[slot]
        self.deferred = error

    def synchronize(self) -> None:
        """Launch what backward did not, wait for every bucket, set ``p.grad`` to the mean."""
        raise NotImplementedError

    def _launch(self, k: int) -> None:
        raise NotImplementedError


@dataclass
class _Compressed:
    """A compressed bucket in flight: its all-reduces, and what decompresses their sum."""

    handles: list
    codec: Any
    payload: list
    ctx: Any

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


class AllReduce(BucketedSync):
    """Overlapped bucketed all-reduce of gradients among workers, then a local optimizer step."""

    name = "allreduce"
    summary = "bucketed ring all-reduce overlapped with backward (Horovod, DDP)"

    def __init__(self, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0, rebuild_buckets: bool = True,
                 compression: str | None = None, error_feedback: bool = False, broadcast_buffers: bool = True):
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ConfigError(f"bucket sizes must be > 0 MB, got bucket_mb={bucket_mb}, first_bucket_mb={first_bucket_mb}")
        self.compression, self.error_feedback = compression, error_feedback
        self.broadcast_buffers = broadcast_buffers
        if compression is not None:
            name, self.codec_options = parse_spec(compression)
            probe = build(name, **self.codec_options)
            if not probe.summable or isinstance(probe, PowerSGD):
                raise ConfigError(f"allreduce sums payloads in one all-reduce, which {name} cannot do; use "
                                  f"strategy casync-ring (or compressed-allgather) with compression={compression}")
            self.codec_name, self.exact = name, probe.lossless
        self.cap_bytes = int(bucket_mb * MB)
        self.first_cap_bytes = int(min(first_bucket_mb, bucket_mb) * MB)
        self.rebuild = rebuild_buckets
        self.bucket_mb = bucket_mb

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        # Averaged as packed, before the sum, as DDP does: the division overlaps backward instead of
        # following the last all-reduce, and a half-precision sum cannot overflow where the mean would not.
        self.divisor = ctx.topology.num_workers
        self.steps = 0
        self.arrival: list[int] = []
        kept, self._kept = getattr(self, "_kept", None), None
        if kept is not None:  # the buckets the survivors of a shrink agreed on: no learning again
            self.steps = 1
            self.codecs = {}
            self.buckets, self.where, self.next_launch = kept, {}, 0
            for bucket in kept:
                bucket.reset()
                self.where.update({i: (bucket, slot) for slot, i in enumerate(bucket.indices)})
            return
        self._build(list(reversed(range(len(ctx.params)))))

    def adopt(self, previous: Strategy) -> None:
        """The previous buckets, in the order learned at their first step: the same on every
        survivor, whatever the number of workers (the divisor is set anew at :meth:`attach`)."""
        if (type(previous) is type(self) and getattr(previous, "steps", 0) > 0
                and self.compression is None and previous.compression is None
                and (self.cap_bytes, self.first_cap_bytes) == (previous.cap_bytes, previous.first_cap_bytes)):
            self._kept = previous.buckets

    def _build(self, order: list[int]) -> None:
        self.codecs: dict = {}  # per bucket (compression=...): new buckets start with fresh state
        self._make_buckets(order, self.cap_bytes, self.first_cap_bytes, extra=len)  # + used flags

    # -- hook points ---------------------------------------------------------------------------
    def on_grad_ready(self, index: int) -> None:
        if self.steps == 0:
            self.arrival.append(index)
        super().on_grad_ready(index)

    def synchronize(self) -> None:
        """Send what backward did not (unused parameters), wait, and write averaged gradients."""
        for k in range(self.next_launch, len(self.buckets)):
            self._send(k)
        self.deferred = error = None
        for k, bucket in enumerate(self.buckets):
            bucket.handle.wait()
            if self.compression is not None:
                try:
                    self._decompress(k, bucket)
                except CompressionError as exc:  # the same sum on every worker: every worker has it
                    error = error or exc
            self._unpack(bucket)
            bucket.reset()
        if error is not None:
            self._defer(error)
        self.next_launch = 0
        if self.steps == 0 and self.rebuild and len(self.buckets) > 1:
            self._rebuild_from_arrival()
        self.steps += 1

    # -- internals -----------------------------------------------------------------------------
    def _launch(self, k: int) -> None:
        bucket = self.buckets[k]
        bucket.buffer[bucket.numel:].copy_(torch.tensor(bucket.used, dtype=bucket.buffer.dtype))
        what = f"all-reduce of bucket {k} (parameters {self.ctx.names[bucket.indices[0]]!r}..)"
        if self.compression is not None:
            bucket.handle = self._launch_compressed(k, bucket, what)
        else:
            bucket.handle = self.ctx.transport.allreduce_async(bucket.buffer, what=what, group=self.ctx.two_level)
        self.next_launch = k + 1

    def _launch_compressed(self, k: int, bucket: Bucket, what: str) -> "_Compressed":
        grads = bucket.buffer[:bucket.numel]
        codec = self.codecs.get(k)
        if codec is None:
            rank = self.ctx.topology.rank
            codec = self.codecs[k] = build(self.codec_name, key=f"allreduce/{k}", worker=rank,
                                           error_feedback=self.error_feedback, **self.codec_options)
        payload = None
        if all_finite(grads):  # checked here: a NaN that a sparse codec does not sample would vanish
            try:
                payload, ctx = codec.compress(grads)
            except CompressionError:
                payload = None
        if payload is None:  # non-finite or out of range here: send NaN so every worker sees it (never a lone raise)
            payload, ctx = codec.compress(torch.zeros_like(grads))
            for part in payload:
                part.fill_(float("nan"))
        t = self.ctx.transport
        handles = [t.allreduce_async(part, what=what) for part in payload]
        handles.append(t.allreduce_async(bucket.buffer[bucket.numel:], what=what))
        return _Compressed(handles, codec, payload, ctx)

    def _decompress(self, k: int, bucket: Bucket) -> None:
        sent = bucket.handle
        total = sent.codec.decompress(sent.payload, sent.ctx)
        if not all_finite(total):  # the same sum everywhere: every worker raises this
            raise CompressionError(
                f"the {self.codec_name} all-reduce of bucket {k} ({self.ctx.names[bucket.indices[0]]!r}..) holds "
                f"NaN/Inf: a worker's gradient was non-finite or beyond {self.codec_name}'s range. Lower the "
                "learning rate, clip gradients, or use bf16")
        bucket.buffer[:bucket.numel].copy_(total)

    def _unpack(self, bucket: Bucket) -> None:
        counts = bucket.buffer[bucket.numel:].tolist()
        for slot, i in enumerate(bucket.indices):
            # The gradient becomes a view of the bucket: no copy back, no second gradient buffer.
            self.ctx.params[i].grad = bucket.views[slot] if counts[slot] else None

    def _rebuild_from_arrival(self) -> None:
        n = len(self.ctx.params)
        seen = list(dict.fromkeys(self.arrival))
        order = seen + [i for i in reversed(range(n)) if i not in set(seen)]
        agreed = torch.tensor(order, dtype=torch.int64, device=self.ctx.transport.device)
        self.ctx.transport.broadcast(agreed, src=0, what="broadcast of the bucket order")
        order = agreed.tolist()
        if order != [i for b in self.buckets for i in b.indices]:
            self._build(order)

    def min_bytes_per_host(self, model_bytes: int) -> float:
        ratio = 1.0
        if self.compression is not None:  # the payload's size on the wire, per byte of gradient
            from gradsync.compress.base import to_bytes

            sample = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
            payload, _ = build(self.codec_name, **self.codec_options).compress(sample)
            ratio = to_bytes(payload).numel() / (sample.numel() * sample.element_size())
        return host_ring_bytes(model_bytes * ratio, self.ctx.topology)

    def describe(self) -> str:
        codec = "" if self.compression is None else f", compression={self.compression}" + (
            " with error feedback" if self.error_feedback else "")
        hosts = "" if self.ctx.two_level is None else f", two-level over {len(self.ctx.two_level.plan(self.ctx.topology)[0])} hosts"
        return f"allreduce(bucket_mb={self.bucket_mb:g}, buckets={len(self.buckets)}{codec}{hosts})"
