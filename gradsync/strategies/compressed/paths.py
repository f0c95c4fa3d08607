"""The three ways a compressed strategy's bucket travels, chosen once per bucket at attach.

- :class:`PlainBucket`: selective compression left it plain. All-reduced straight from backward,
  as the ``allreduce`` strategy does (no thread hand-off; two-level on hosts of several workers),
  with its used flags and a fault report (workers with a fault, their rank, their parameter)
  summed as its last elements: the report names the rank exactly when one worker has the fault,
  and counts them otherwise.
- :class:`SummedBucket`: its codec's payloads add up in one all-reduce (fp16, bf16, random-k,
  identity) and the strategy sums such buckets in one round (``casync-ring``). Compressed and
  all-reduced from backward too, with a tail of used flags and the fault report (count, code,
  rank, parameter).
- :class:`ExchangedBucket`: everything else (and summed buckets on hosts of several workers).
  Handed to the communication thread, which runs the strategy's
  :meth:`~gradsync.strategies.compressed.CompressedSync.exchange` (among each shard's owners,
  between uncompressed sums and copies inside the host: :mod:`.hosts`); its used flags go in
  one all-reduce of one flag per parameter after every such bucket.

Each path launches (:meth:`launch`, from backward), waits (:meth:`wait`), finishes (:meth:`finish`:
the averaged gradients in the bucket, or the error every worker raises) and says how many workers
used each gradient (:meth:`used`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradsync.compress import CompressionError, Compressor, NonFiniteGradientError
from gradsync.compress.base import Payload, all_finite
from gradsync.errors import GradsyncError
from gradsync.strategies.allreduce import Bucket
from gradsync.strategies.compressed.faults import FAULT_COMPRESSION, FAULT_NONFINITE, Fault


class PlainBucket:
    """A bucket all-reduced uncompressed from backward, its flags and fault report in the same message."""

    threaded = False
    precedence = 1
    """Which error is raised when buckets of several paths have one: the thread's first, then plain, then summed."""

    def __init__(self, sync):
        self.sync = sync

    def launch(self, k: int, bucket: Bucket) -> None:
        sync = self.sync
        fault = sync.faults.find(bucket)
        report = [1.0, fault.rank, fault.param] if fault is not None else [0.0, 0.0, 0.0]
        bucket.buffer[bucket.numel:].copy_(torch.tensor(bucket.used + report))
        bucket.handle = sync.ctx.transport.allreduce_async(
            bucket.buffer, what=f"all-reduce of plain bucket {k} ({sync.ctx.names[bucket.indices[0]]!r}..)",
            group=sync.ctx.two_level)

    def wait(self, bucket: Bucket) -> None:
        bucket.handle.wait()

    def finish(self, k: int, bucket: Bucket) -> GradsyncError | None:
        """Average the sum; the error every worker raises if one had a fault."""
        sync = self.sync
        bucket.buffer[:bucket.numel].div_(sync.n)
        faulty, rank, param = bucket.buffer[-3:].tolist()
        if not faulty:
            return None
        if faulty == 1:
            return sync.faults.error(Fault(FAULT_NONFINITE, int(rank), int(param)), k, bucket)
        return NonFiniteGradientError(
            f"gradients in bucket {k} ({sync.ctx.names[bucket.indices[0]]!r}..) have NaN/Inf elements on "
            f"{int(faulty)} workers; nothing was applied (every worker raises this). Lower the learning rate, "
            "clip gradients, or skip the step.")

    def used(self, bucket: Bucket, counts: list[float]) -> list[float]:
        return bucket.buffer[bucket.numel:bucket.numel + len(bucket.indices)].tolist()


@dataclass
class _Summed:
    """A summed bucket in flight: the payload's all-reduces and the tail's (used flags, then
    faulty-worker count, code, rank, parameter)."""

    handles: list
    codec: Compressor
    payload: Payload
    ctx: Any
    tail: torch.Tensor


class SummedBucket:
    """A bucket compressed and all-reduced from backward: its payloads add up in one round."""

    threaded = False
    precedence = 2

    def __init__(self, sync):
        self.sync = sync

    def launch(self, k: int, bucket: Bucket) -> None:
        """Compress (averaged first, so a half-precision sum cannot overflow where the mean would
        not) and all-reduce payload and tail. A worker with a fault sends zeros and says so in the
        tail, so every worker learns who and raises the same error."""
        sync = self.sync
        flat = bucket.buffer[:bucket.numel]
        flat.div_(sync.n)
        fault = sync.faults.find(bucket)
        codec = sync.site(k, "all")
        payload = ctx = None
        if fault is None:
            try:
                payload, ctx = sync.work.compress(codec, flat)
            except CompressionError:
                fault = Fault(FAULT_COMPRESSION, sync.ctx.topology.rank, bucket.indices[0])
        if payload is None:
            payload, ctx = codec.compress(torch.zeros_like(flat))
        report = [1.0, float(fault.code), float(fault.rank), float(fault.param)] if fault else [0.0] * 4
        tail = torch.tensor(bucket.used + report, dtype=torch.float64)
        t, what = sync.ctx.transport, f"all-reduce of compressed bucket {k} ({sync.ctx.names[bucket.indices[0]]!r}..)"
        handles = [t.allreduce_async(part, what=what) for part in payload]
        handles.append(t.allreduce_async(tail, what=what))
        bucket.handle = _Summed(handles, codec, payload, ctx, tail)

    def wait(self, bucket: Bucket) -> None:
        for handle in bucket.handle.handles:
            handle.wait()

    def finish(self, k: int, bucket: Bucket) -> GradsyncError | None:
        """Decompress the sum into the gradients; the error every worker raises, if any."""
        sync, sent = self.sync, bucket.handle
        faulty, code, rank, param = sent.tail[-4:].tolist()
        if faulty == 1:
            return sync.faults.error(Fault(int(code), int(rank), int(param)), k, bucket)
        if faulty:
            return NonFiniteGradientError(
                f"gradients in bucket {k} ({sync.ctx.names[bucket.indices[0]]!r}..) were non-finite or beyond "
                f"{sync.codec_name}'s range on {int(faulty)} workers; nothing was applied (every worker raises "
                "this). Lower the learning rate, clip gradients, or skip the step.")
        total = sync.decompress(sent.codec, sent.payload, sent.ctx)
        if not all_finite(total):  # the same sum on every worker: all raise this
            return CompressionError(f"the sum over workers of bucket {k} ({sync.ctx.names[bucket.indices[0]]!r}..) "
                                    f"overflowed {sync.codec_name}'s range; use bf16, or scale the loss down")
        bucket.buffer[:bucket.numel].copy_(total)
        return None

    def used(self, bucket: Bucket, counts: list[float]) -> list[float]:
        return bucket.handle.tail[:len(bucket.indices)].tolist()


class ExchangedBucket:
    """A bucket the communication thread exchanges with the strategy's own message pattern."""

    threaded = True
    precedence = 0

    def __init__(self, sync):
        self.sync = sync

    def launch(self, k: int, bucket: Bucket) -> None:
        bucket.handle = True  # handed to the thread: no more gradients into it this step
        self.sync.thread.put(k)

    def wait(self, bucket: Bucket) -> None:
        """The thread's buckets are waited for together (:meth:`ExchangeThread.wait`)."""

    def run(self, k: int, bucket: Bucket) -> None:
        """On the communication thread: average, check, exchange, and raise the fault every worker knows."""
        sync = self.sync
        flat = bucket.buffer[:bucket.numel]
        flat.div_(sync.n)
        sync.faults.begin(bucket)
        if sync.host_form is not None:
            sync.host_form.exchange(k, flat)
        elif sync.n > 1:
            sync.exchange(k, flat)
        sync.faults.raise_known(k, bucket)

    def finish(self, k: int, bucket: Bucket) -> GradsyncError | None:
        return None  # the thread's faults are in Faults.agreed

    def used(self, bucket: Bucket, counts: list[float]) -> list[float]:
        return [counts[i] for i in bucket.indices]
