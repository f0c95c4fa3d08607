"""What the compressed strategies share: buckets, one communication thread, compression sites, faults.

``casync-ring`` and ``casync-ps`` (HiPress's CaSync, Bai et al. SOSP 2021) and their baseline
``compressed-allgather`` differ only in :meth:`CompressedSync.exchange`, which turns one bucket of this
worker's (already averaged) gradients into the bucket of everyone's. Everything else is here:

- **Bulk synchronization.** Gradients are fused into buckets in backward order (``bucket_mb``, the
  first ``first_bucket_mb``; :func:`gradsync.strategies.allreduce.plan_buckets`), so small gradients
  travel together and a compressor's per-call cost is paid per bucket, not per bias vector.
- **Overlap.** A bucket goes to the communication thread as soon as it is full (and every earlier
  one went), so encoding, sending and decoding overlap the rest of backward; ``optimizer.step()``
  waits for the last bucket. The thread's collectives use a process group of their own.
- **Compression sites.** Each place that compresses (a worker's own gradient, a ring hop that
  re-encodes a merged sum, a PS aggregator re-encoding its result) has its own compressor instance,
  built by :func:`gradsync.compress.build` with a key every rank derives alike, so state (residuals,
  momentum, error feedback) is fed back at the site that lost it, and shared seeds agree.
- **Selective compression** (``selective=True``): :mod:`gradsync.strategies.costmodel` decides per
  bucket whether to compress (and for ``casync-ps`` into how many partitions); ``decisions`` holds
  the choices. A bucket it leaves plain is all-reduced straight from backward, as the ``allreduce``
  strategy does (no thread hand-off), with its used flags and fault report in the same message, so
  where nothing pays to compress the strategy costs what ``allreduce`` costs.
- **Used flags.** After the compressed buckets, one all-reduce of one flag per parameter tells how
  many workers produced each gradient: zero leaves ``grad = None``, as in DDP (exact strategies'
  semantics). Plain buckets carry theirs as the all-reduce's last elements.
- **Faults.** Before its first message for a bucket a worker checks its gradients for NaN/Inf. A
  worker with a fault (or a compressor error, e.g. fp16 overflow) keeps taking part in the bucket's
  message pattern but sends headers only, carrying the fault (code, rank, parameter); every receiver
  passes it on. When the pattern ends every worker knows, and each raises
  :class:`~gradsync.compress.NonFiniteGradientError` (or ``CompressionError``) naming the rank and the
  parameter: no rank raises while the others hang. A plain bucket's all-reduce sums three more
  elements (workers with a fault, their rank, their parameter), which name the rank exactly when one
  worker has the fault and count them otherwise.

Wire (no pickle): every message is ``transport.send_bytes``: an ``int64[4]`` header (body length,
fault code, fault rank, fault parameter) and a body that is one payload in the self-describing format
of :func:`gradsync.compress.base.to_bytes`.

Why one file of this size: the buckets, the communication thread and the fault path are shared by
three strategies and change together; each strategy's own exchange lives in its own module.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from gradsync import flight, runtime, trace
from gradsync.compress import CompressionError, Compressor, NonFiniteGradientError, PowerSGD, build, parse_spec
from gradsync.compress.base import Payload, all_finite, from_bytes, message_problem, to_bytes
from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies import costmodel
from gradsync.strategies.allreduce import MB, Bucket, BucketedSync
from gradsync.strategies.base import SyncContext, ring_bytes
from gradsync.transport import check_peer, payload_limit

FAULT_NONFINITE, FAULT_COMPRESSION = 1, 2
TAG_BASE = 0x43530000  # + bucket index: this family's point-to-point tags


@dataclass(frozen=True)
class Fault:
    code: int
    rank: int
    param: int
    """Index of the parameter, or -1 for a merged sum (a ring hop or an aggregator re-encoding)."""

    @property
    def info(self) -> tuple[int, int, int]:
        return (self.code, self.rank, self.param)


@dataclass
class _Summed:
    """A bucket whose payloads add up in one all-reduce, in flight from the training thread: the
    payload's all-reduces and the tail's (used flags, then faulty-worker count, code, rank, parameter)."""

    handles: list
    codec: Compressor
    payload: Payload
    ctx: Any
    tail: torch.Tensor


class CompressedSync(BucketedSync):
    """Base of the compressed strategies: override :meth:`exchange` (and ``algorithm`` for the cost model)."""

    algorithm = "ring"
    sums_in_one_round = False
    """Whether buckets whose codec sums in one all-reduce (fp16, bf16, random-k, identity) skip the
    communication thread: compressed and all-reduced from backward like ``allreduce``'s buckets."""

    def __init__(self, compression: str = "onebit", error_feedback: bool = False, selective: bool = False,
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0, broadcast_buffers: bool = True,
                 **compressor_options: Any):
        name, options = parse_spec(compression)
        options.update(compressor_options)
        probe = build(name, **options)  # a bad name or option fails here, not in backward
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ConfigError(f"bucket sizes must be > 0 MB, got bucket_mb={bucket_mb}, first_bucket_mb={first_bucket_mb}")
        self.codec_name, self.codec_options = name, options
        self.error_feedback = error_feedback
        self.broadcast_buffers = broadcast_buffers
        self.selective = selective
        self.summable = probe.summable
        self.one_round = probe.summable and not isinstance(probe, PowerSGD)
        self.exact = probe.lossless
        self.bucket_mb, self.first_bucket_mb = bucket_mb, first_bucket_mb
        self.check_codec(probe)

    def check_codec(self, probe: Compressor) -> None:
        """Reject a compressor this algorithm cannot use (ConfigError)."""

    # -- setup ---------------------------------------------------------------------------------------
    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        self.group = ctx.transport.new_worker_group()  # our thread's collectives, apart from the script's
        self.workers = topo.worker_ranks
        self.n = topo.num_workers
        self.me = topo.worker_ranks.index(topo.rank) if topo.is_worker else -1
        self.sites: dict[str, Compressor] = {}
        self.error: BaseException | None = None  # the thread's failure: it has stopped
        self.step_fault: GradsyncError | None = None  # a fault every worker agreed on: the thread goes on
        self.closed = False
        self.ratio = 1.0
        # encodes and decodes on this rank so far, each [calls, raw bytes, seconds]: what the
        # compressors cost where the ranks met them (gradsync bench records it; the simulator's
        # validation replays it)
        self._codec_work = {"encode": [0, 0, 0.0], "decode": [0, 0, 0.0]}
        self._codec_lock = threading.Lock()
        params = ctx.params
        # Past the gradients: used flags and the fault report of a plain (all-reduced) bucket.
        self._make_buckets(list(reversed(range(len(params)))), int(self.bucket_mb * MB),
                           int(self.first_bucket_mb * MB), extra=lambda group: len(group) + 3)
        self.flags = torch.zeros(len(params), dtype=torch.float32)
        self.direct, self.threaded = [False] * len(self.buckets), len(self.buckets)
        self.summed = [False] * len(self.buckets)
        if topo.is_worker:
            self.decisions = self._decide()
            self.compressed = [d.compress for d in self.decisions]
            self.parts = [d.parts for d in self.decisions]
            self.direct = [self.selective and not d.compress for d in self.decisions]
            self.summed = [self.sums_in_one_round and self.one_round and not plain for plain in self.direct]
            self.threaded = sum(1 for plain, summed in zip(self.direct, self.summed) if not (plain or summed))
        self.queue: deque[int] = deque()
        self.done = 0
        self.cv = threading.Condition()
        self.thread = None
        if topo.is_worker:
            self.thread = threading.Thread(target=self._run, name=f"gradsync-{self.name}", daemon=True)
            self.thread.start()

    def _decide(self) -> list[costmodel.Decision]:
        """Per bucket: compress or not, and partitions (for ``ps``). Without ``selective``: always compress."""
        sizes = [b.numel * b.buffer.element_size() for b in self.buckets]
        dtype = self.buckets[0].buffer.dtype if self.buckets else torch.float32
        encode, decode, ratio = costmodel.measure_codec(lambda: build(self.codec_name, **self.codec_options), dtype)
        self.ratio = ratio
        if not self.selective:
            self.costs = None
            return [costmodel.Decision(k, s, True, self.default_parts(s), 0.0, 0.0) for k, s in enumerate(sizes)]
        latency, per_byte = costmodel.measure_link(self._allreduce, self.n)
        mine = costmodel.Costs(latency, per_byte, encode, decode, ratio).as_tensor()
        self.ctx.transport.allreduce(mine, op="max", what="cost model figures", group=self.group)
        self.costs = costmodel.Costs.from_tensor(mine)  # the slowest worker's figures, alike on every rank
        self.ratio = self.costs.ratio
        return [self.decide(self.costs, k, s) for k, s in enumerate(sizes)]

    def default_parts(self, nbytes: int) -> int:
        return 1

    def decide(self, costs: costmodel.Costs, bucket: int, nbytes: int) -> costmodel.Decision:
        return costmodel.decide_ring(costs, bucket, nbytes, self.n, self.summable)

    # -- hook points: BucketedSync's on_grad_ready and step ----------------------------------------
    def synchronize(self) -> None:
        """Send what backward did not (unused parameters), wait for every bucket, set averaged gradients."""
        for k in range(self.next_launch, len(self.buckets)):
            self._send(k)
        plain = [k for k, direct in enumerate(self.direct) if direct]
        summed = [k for k, yes in enumerate(self.summed) if yes]
        for k in plain:
            self.buckets[k].handle.wait()
        for k in summed:
            for handle in self.buckets[k].handle.handles:
                handle.wait()
        recorder, what = flight.current(), "wait for the compressed buckets"
        with self.cv, recorder.waiting_for(what) if recorder is not None else contextlib.nullcontext():
            began, done = time.monotonic(), self.done
            while self.done < self.threaded and self.error is None:
                if self.done != done:  # a bucket finished: the wait's progress
                    began, done = time.monotonic(), self.done
                if not self.cv.wait(runtime.poll_s(since=began)):  # the thread may be blocked in a receive
                    runtime.check_progress(what, since=began)
        faults = (*map(self._plain_fault, plain), *map(self._summed_finish, summed))
        error = self.error or self.step_fault or next((e for e in faults if e is not None), None)
        self.deferred = self.step_fault = None
        if error is None and self.threaded:
            for k, bucket in enumerate(self.buckets):
                for slot, i in enumerate(bucket.indices):
                    self.flags[i] = 0.0 if self.direct[k] or self.summed[k] else bucket.used[slot]
            self.ctx.transport.allreduce(self.flags, what="all-reduce of the used flags")
        counts = self.flags.tolist()
        for k, bucket in enumerate(self.buckets):
            used = None
            if self.direct[k]:
                used = bucket.buffer[bucket.numel:bucket.numel + len(bucket.indices)].tolist()
            elif self.summed[k]:
                used = bucket.handle.tail[:len(bucket.indices)].tolist()
            for slot, i in enumerate(bucket.indices):
                count = used[slot] if used is not None else counts[i]
                self.ctx.params[i].grad = bucket.views[slot] if count else None
            bucket.reset()
        self.done = 0
        self.next_launch = 0
        if isinstance(error, (NonFiniteGradientError, CompressionError)):
            self._defer(error)  # agreed by every worker through the fault headers
        elif error is not None:
            raise error

    def _launch(self, k: int) -> None:
        self.next_launch = k + 1
        bucket = self.buckets[k]
        if self.direct[k]:
            bucket.handle = self._launch_plain(k, bucket)
            return
        if self.summed[k]:
            bucket.handle = self._launch_summed(k, bucket)
            return
        bucket.handle = True  # handed to the thread: no more gradients into it this step
        with self.cv:
            self.queue.append(k)
            self.cv.notify_all()

    def _launch_plain(self, k: int, bucket: Bucket):
        """All-reduce a bucket selective compression left plain, with its used flags and fault report."""
        fault = self._check(bucket)
        report = [1.0, fault.rank, fault.param] if fault is not None else [0.0, 0.0, 0.0]
        bucket.buffer[bucket.numel:].copy_(torch.tensor(bucket.used + report))
        return self.ctx.transport.allreduce_async(
            bucket.buffer, what=f"all-reduce of plain bucket {k} ({self.ctx.names[bucket.indices[0]]!r}..)")

    def _launch_summed(self, k: int, bucket: Bucket) -> _Summed:
        """Compress bucket ``k`` (averaged first, so a half-precision sum cannot overflow where the
        mean would not) and all-reduce its payload and tail, from backward. A worker with a fault
        sends zeros and says so in the tail, so every worker learns who and raises the same error."""
        flat = bucket.buffer[:bucket.numel]
        flat.div_(self.n)
        fault = self._check(bucket)
        codec = self.site(k, "all")
        payload = ctx = None
        if fault is None:
            try:
                payload, ctx = self._timed_compress(codec, flat)
            except CompressionError:
                fault = Fault(FAULT_COMPRESSION, self.ctx.topology.rank, bucket.indices[0])
        if payload is None:
            payload, ctx = codec.compress(torch.zeros_like(flat))
        report = [1.0, float(fault.code), float(fault.rank), float(fault.param)] if fault else [0.0] * 4
        tail = torch.tensor(bucket.used + report, dtype=torch.float64)
        t, what = self.ctx.transport, f"all-reduce of compressed bucket {k} ({self.ctx.names[bucket.indices[0]]!r}..)"
        handles = [t.allreduce_async(part, what=what) for part in payload]
        handles.append(t.allreduce_async(tail, what=what))
        return _Summed(handles, codec, payload, ctx, tail)

    def _summed_finish(self, k: int) -> GradsyncError | None:
        """Decompress summed bucket ``k`` into its gradients; the error every worker raises, if any."""
        bucket = self.buckets[k]
        sent: _Summed = bucket.handle
        faulty, code, rank, param = sent.tail[-4:].tolist()
        if faulty == 1:
            return self._fault_error(Fault(int(code), int(rank), int(param)), k)
        if faulty:
            return NonFiniteGradientError(
                f"gradients in bucket {k} ({self.ctx.names[bucket.indices[0]]!r}..) were non-finite or beyond "
                f"{self.codec_name}'s range on {int(faulty)} workers; nothing was applied (every worker raises "
                "this). Lower the learning rate, clip gradients, or skip the step.")
        total = self.decompress(sent.codec, sent.payload, sent.ctx)
        if not all_finite(total):  # the same sum on every worker: all raise this
            return CompressionError(f"the sum over workers of bucket {k} ({self.ctx.names[bucket.indices[0]]!r}..) "
                                    f"overflowed {self.codec_name}'s range; use bf16, or scale the loss down")
        bucket.buffer[:bucket.numel].copy_(total)
        return None

    def _plain_fault(self, k: int) -> GradsyncError | None:
        """Average plain bucket ``k`` after its sum; the error every worker raises if one had a fault."""
        bucket = self.buckets[k]
        bucket.buffer[:bucket.numel].div_(self.n)
        faulty, rank, param = bucket.buffer[-3:].tolist()
        if not faulty:
            return None
        if faulty == 1:
            return self._fault_error(Fault(FAULT_NONFINITE, int(rank), int(param)), k)
        return NonFiniteGradientError(
            f"gradients in bucket {k} ({self.ctx.names[bucket.indices[0]]!r}..) have NaN/Inf elements on "
            f"{int(faulty)} workers; nothing was applied (every worker raises this). Lower the learning rate, "
            "clip gradients, or skip the step.")

    # -- the communication thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.queue and not self.closed:
                        self.cv.wait()
                    if not self.queue:
                        return
                    k = self.queue.popleft()
                try:
                    self._sync(k)
                except (NonFiniteGradientError, CompressionError) as exc:  # the pattern was completed
                    self.step_fault = self.step_fault or exc
                with self.cv:
                    self.done += 1
                    self.cv.notify_all()
        except BaseException as exc:  # handed to the training thread, raised at its next step()
            with self.cv:
                self.error = exc
                self.cv.notify_all()

    def _sync(self, k: int) -> None:
        bucket = self.buckets[k]
        flat = bucket.buffer[:bucket.numel]
        flat.div_(self.n)
        self.fault = self._check(bucket)
        if self.n > 1:
            self.exchange(k, flat)
        if self.fault is not None:
            raise self._fault_error(self.fault, k)

    def _check(self, bucket: Bucket) -> Fault | None:
        if all_finite(bucket.buffer[:bucket.numel]):
            return None
        slot = next(s for s, v in enumerate(bucket.views) if not all_finite(v))
        return Fault(FAULT_NONFINITE, self.ctx.topology.rank, bucket.indices[slot])

    def _fault_error(self, fault: Fault, k: int) -> GradsyncError:
        bucket = self.buckets[k]
        what = (f"gradient of {self.ctx.names[fault.param]!r}" if fault.param >= 0 else
                f"the merged sum of bucket {k} ({self.ctx.names[bucket.indices[0]]!r}..)")
        if fault.code == FAULT_NONFINITE:
            return NonFiniteGradientError(
                f"{what} on rank {fault.rank} has NaN/Inf elements; nothing was applied (every worker raises "
                "this). Lower the learning rate or clip gradients; with torch.amp.GradScaler the step is "
                "skipped instead (every gradient is NaN).")
        return CompressionError(f"compressing {what} on rank {fault.rank} with {self.codec_name} failed (out of "
                                "its range, e.g. fp16 overflow); use bf16, or scale the loss down. Every worker "
                                "raises this.")

    # -- what the algorithms use -----------------------------------------------------------------------
    def exchange(self, k: int, flat: torch.Tensor) -> None:
        """Replace ``flat`` (this worker's averaged bucket ``k``) by the sum over workers, in place."""
        raise NotImplementedError

    def site(self, k: int, where: str) -> Compressor:
        """The compressor instance of one compression site of bucket ``k`` (alike keys on every rank)."""
        key = f"{k}/{where}"
        if key not in self.sites:
            if self.compressed[k]:
                self.sites[key] = build(self.codec_name, key=key, worker=self.me,
                                        error_feedback=self.error_feedback, **self.codec_options)
            else:
                self.sites[key] = build("none")
        return self.sites[key]

    def summable_bucket(self, k: int) -> bool:
        """Whether bucket ``k``'s payloads add up (plain buckets always do)."""
        return self.summable or not self.compressed[k]

    def compress(self, codec: Compressor, tensor: torch.Tensor | None, param: int = -1) -> tuple[Payload | None, Any]:
        """``codec.compress(tensor)``, or ``(None, None)`` once a fault is known (or this is one)."""
        if self.fault is not None or tensor is None:
            return None, None
        try:
            return self._timed_compress(codec, tensor)
        except CompressionError:
            self.fault = Fault(FAULT_COMPRESSION, self.ctx.topology.rank, param)
            return None, None

    def _timed_compress(self, codec: Compressor, tensor: torch.Tensor) -> tuple[Payload, Any]:
        """``codec.compress(tensor)``, counted in :meth:`host_work` and traced as an ``encode``."""
        start = time.perf_counter()
        out = codec.compress(tensor)
        self._count("encode", start, tensor.numel() * tensor.element_size())
        return out

    def encode(self, codec: Compressor, tensor: torch.Tensor | None, param: int = -1
               ) -> tuple[torch.Tensor, Payload | None, Any]:
        """``(message, payload, ctx)``; an empty message once a fault is known (or this is one)."""
        payload, ctx = self.compress(codec, tensor, param)
        if payload is None:
            return torch.empty(0, dtype=torch.uint8), None, None
        return to_bytes(payload), payload, ctx

    def decode(self, codec: Compressor, message: torch.Tensor, like: torch.Tensor, ctx: Any = None,
               shape_like: Payload | None = None) -> torch.Tensor | None:
        """The tensor in ``message`` (None once a fault is known); ``ctx`` defaults to one for ``like``."""
        if self.fault is not None:
            return None
        return self.decompress(codec, from_bytes(message, shape_like), codec.context_for(like) if ctx is None else ctx)

    def decompress(self, codec: Compressor, payload: Payload, ctx: Any) -> torch.Tensor:
        """``codec.decompress(payload, ctx)``, counted in :meth:`host_work` and traced as a
        ``decode`` with the raw bytes it made."""
        start = time.perf_counter()
        out = codec.decompress(payload, ctx)
        self._count("decode", start, out.numel() * out.element_size())
        return out

    def _count(self, kind: str, start: float, nbytes: int) -> None:
        end = time.perf_counter()
        with self._codec_lock:  # the training thread's summed buckets and the communication thread's
            work = self._codec_work[kind]
            work[0] += 1
            work[1] += nbytes
            work[2] += end - start
        tracer = trace.current()
        if tracer is not None:
            tracer.span(kind, "comm", start, end, bytes=nbytes)

    def host_work(self) -> dict[str, list]:
        """This rank's encodes and decodes since :meth:`attach`, each ``[calls, raw bytes,
        seconds]`` (``gradsync bench`` records them per step as ``codec_work``)."""
        with self._codec_lock:
            return {kind: list(work) for kind, work in self._codec_work.items()}

    def send(self, message: torch.Tensor, worker: int, k: int) -> list:
        info = self.fault.info if self.fault is not None else (0, -1, -1)
        body = message if self.fault is None else message[:0]
        return self.ctx.transport.send_bytes(body, self.workers[worker], TAG_BASE + k, info=info,
                                             what=f"compressed bucket {k} to rank {self.workers[worker]}")

    def recv(self, worker: int, k: int) -> torch.Tensor:
        message, info = self.ctx.transport.recv_bytes(self.workers[worker], TAG_BASE + k,
                                                      limit=payload_limit(self.buckets[k].numel),
                                                      device=self.ctx.params[0].device,
                                                      what=f"compressed bucket {k} from rank {self.workers[worker]}")
        if info[0] and self.fault is None:
            self.fault = Fault(*info)
        if message.numel() and self.fault is None:
            problem = message_problem(message)
            check_peer(problem is None, self.workers[worker], f"compressed bucket {k}", problem)
        return message

    def _allreduce(self, tensor: torch.Tensor) -> None:
        self.ctx.transport.allreduce(tensor, what="compressed all-reduce", group=self.group)

    # -- the rest of the contract ----------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join()
        if self.ctx.topology.is_worker and self.error is None:
            self.ctx.transport.allreduce(torch.zeros(1), what="end of the compression group", group=self.group)
        self.ctx.transport.free_group(self.group)

    def min_bytes_per_host(self, model_bytes: int) -> float:
        return ring_bytes(model_bytes * self.ratio, self.ctx.topology.num_workers)

    def report(self) -> str:
        """The per-bucket decisions, one line each (selective compression's cost model, or "always")."""
        return "\n".join(d.row() for d in getattr(self, "decisions", []))

    def describe(self) -> str:
        codec = self.codec_name + ("".join(f",{k}={v}" for k, v in self.codec_options.items())
                                   if self.codec_options else "")
        text = f"{self.name}({codec}{', error feedback' if self.error_feedback else ''}, {len(self.buckets)} buckets"
        if self.selective and hasattr(self, "decisions"):
            total = sum(d.nbytes for d in self.decisions) or 1
            chosen = [d for d in self.decisions if d.compress]
            share = sum(d.nbytes for d in chosen) / total
            text += f", selective: compresses {len(chosen)}/{len(self.decisions)} buckets ({share:.0%} of bytes)"
        return text + ")"

