"""``casync-ring``: compression-aware ring all-reduce (HiPress's CaSync on a ring, Bai et al. SOSP 2021).

A compressor whose payloads add up (fp16, bf16, random-k with a shared seed, PowerSGD, and plain
buckets under selective compression) needs no help: the payload itself is all-reduced
(:meth:`gradsync.compress.Compressor.reduce`, one Gloo/NCCL ring).

Any other compressor (onebit, TBQ, TernGrad, QSGD, top-k, DGC, ...) goes decode-merge-encode around
the ring. Bucket ``k`` is cut into ``N`` chunks; worker ``r``:

1. reduce-scatter, ``N-1`` hops: encode its own chunk ``r`` and send it to ``r+1``; at each hop,
   receive chunk ``c`` from ``r-1``, decode it, add its own (exact) chunk ``c``, and re-encode the
   partial sum for the next hop. The send of one hop is still on the wire while the next chunk is
   decoded, merged and encoded: encoding overlaps communication (and the communication thread
   overlaps both with backward);
2. after the last hop it holds the full sum of chunk ``r+1``: encode it once, and take the decoded
   payload as its own result, so every worker ends up with the same values;
3. all-gather, ``N-1`` hops: pass each finished chunk's payload on unchanged; every worker decodes it.

Per worker and bucket: ``2 (N-1)`` messages of ``1/N`` of the compressed bucket (the ring's optimal
volume, times the compression ratio), ``N`` encodes and ``2N-1`` decodes of a chunk. Each compression
site (the chunk a worker starts, each re-encoding hop, each finished chunk) keeps its own compressor
state, so error feedback corrects the error where it was made. Lossy, so not ``exact`` (with
``compression="none"`` it equals the plain reduction, which the tests check).

On hosts of several workers (Gloo; :mod:`gradsync.strategies.compressed.hosts`) only what crosses
hosts is compressed: a bucket is summed inside the host uncompressed (reduce-scatter), the ring above
runs over the H hosts for each of its R shards, by the shard's owners (one worker a host, R rings
at once; summable payloads are all-reduced among them), and the shards are all-gathered inside the
host. A host's link then carries ``2 (H-1)/H`` of the compressed bucket instead of R ranks' rings,
and each worker encodes and decodes 1/R of it. ``distribute(..., hosts="flat")`` keeps every worker
in one ring.
"""
from __future__ import annotations

import torch

from gradsync.compress import CompressionError, NonFiniteGradientError, build, parse_spec
from gradsync.compress.base import all_finite
from gradsync.compress.powersgd import PowerSGD
from gradsync.strategies.allreduce import AllReduce, BucketedSync
from gradsync.strategies.compressed import CompressedSync
from gradsync.transport import wait_all


def compressed_allreduce(compression: str | None, error_feedback: bool = False, **options) -> "BucketedSync":
    """The gradient strategy that all-reduces buckets through ``compression`` where another
    strategy composes one (``hybrid``'s dense part, ``diloco``'s outer gradients): ``allreduce``
    without a codec or with one whose payloads add up (the payload all-reduced), else
    ``casync-ring`` (decode-merge-encode around the ring). ``options``: bucket sizes, buffers."""
    if compression is None:
        return AllReduce(**options)
    name, codec_options = parse_spec(compression)
    probe = build(name, **codec_options)
    if probe.summable and not isinstance(probe, PowerSGD):
        return AllReduce(compression=compression, error_feedback=error_feedback, **options)
    return CaSyncRing(compression=compression, error_feedback=error_feedback, **options)


class CaSyncRing(CompressedSync):
    """Ring all-reduce of compressed buckets: payloads summed directly, or decode-merge-encode per hop."""

    name = "casync-ring"
    summary = "HiPress CaSync: compressed ring, summable payloads all-reduced, else decode-merge-encode"
    sums_in_one_round = True  # fp16, bf16, random-k, identity: all-reduced from backward, no thread

    def exchange(self, k: int, flat: torch.Tensor) -> None:
        if self.summable_bucket(k):
            self._reduce_summable(k, flat)
        else:
            self._ring(k, flat)

    def _reduce_summable(self, k: int, flat: torch.Tensor) -> None:
        codec = self.site(k, "all")
        if isinstance(getattr(codec, "inner", codec), PowerSGD):
            if self._agree_no_fault(k):
                self._reduce_per_gradient(k, flat)
            return
        # A plain bucket cannot fail to encode: no agreement round, a NaN shows in the sum. A shard's
        # owners (hosts of several workers) agree first instead: their sum cannot say whose NaN it is.
        if codec.lossless and self.peers.shard is None:
            self._allreduce(flat)
            if not all_finite(flat):
                fault = self.faults.known
                mine = "" if fault is None else f" (gradient of {self.ctx.names[fault.param]!r} on this rank)"
                raise NonFiniteGradientError(
                    f"the sum over workers of bucket {k} ({self.ctx.names[self.buckets[k].indices[0]]!r}..) holds "
                    f"NaN/Inf: some worker's gradient was non-finite{mine}. Lower the learning rate, clip "
                    "gradients, or skip the step.")
            return
        payload, ctx = self.compress(codec, flat, param=self.buckets[k].indices[0])
        if not self._agree_no_fault(k):
            return
        for part in payload:
            self._allreduce(part)
        total = self.decompress(codec, payload, ctx)
        if not all_finite(total):  # the same sum on every worker: all raise this
            raise CompressionError(f"the sum over workers of bucket {k} ({self.ctx.names[self.buckets[k].indices[0]]!r}..) "
                                   f"overflowed {self.codec_name}'s range; use bf16, or scale the loss down")
        flat.copy_(total)

    def _agree_no_fault(self, k: int) -> bool:
        """Collectives must not start while some worker has a fault: one flag all-reduce, then, if any
        worker has one, a ring pass of headers that tells everyone which."""
        flag = torch.tensor([float(self.faults.known is not None)])
        self._allreduce(flag)
        if float(flag):
            self._share_fault(k)
        return not float(flag)

    def _reduce_per_gradient(self, k: int, flat: torch.Tensor) -> None:
        """PowerSGD compresses matrices: one reduction per gradient of the bucket, in its own shape."""
        bucket = self.buckets[k]
        for slot, view in enumerate(bucket.views):
            codec = self.site(k, f"all#{slot}")
            total, _ = codec.reduce(view, self._allreduce)
            view.copy_(total)

    def _share_fault(self, k: int) -> None:
        """Tell every worker the fault (one ring pass of headers), so all raise the same error."""
        n, me = self.peers.n, self.peers.me
        sends = []
        for _ in range(n - 1):
            sends += self.send(torch.empty(0, dtype=torch.uint8), (me + 1) % n, k)
            self.recv((me - 1) % n, k)
        wait_all(sends)

    def _ring(self, k: int, flat: torch.Tensor) -> None:
        n, me = self.peers.n, self.peers.me
        nxt, prv = (me + 1) % n, (me - 1) % n
        chunks = flat.tensor_split(n)
        sends: list = []
        first = self.buckets[k].indices[0]
        message, _, _ = self.encode(self.site(k, f"start{me}"), chunks[me], param=first)
        merged: torch.Tensor | None = None
        for hop in range(n - 1):  # reduce-scatter
            sends += self.send(message, nxt, k)
            c = (me - hop - 1) % n
            relay = self.site(k, f"hop{c}")
            incoming = self.decode(relay, self.recv(prv, k), chunks[c])
            merged = None if incoming is None else incoming.add_(chunks[c])
            if hop < n - 2:
                message, _, _ = self.encode(relay, merged)
        mine = (me + 1) % n
        final = self.site(k, f"final{mine}")
        message, payload, ctx = self.encode(final, merged)
        if payload is not None:
            chunks[mine].copy_(self.decompress(final, payload, ctx))
        for hop in range(n - 1):  # all-gather of the finished chunks, passed on as they are
            sends += self.send(message, nxt, k)
            c = (me - hop) % n
            message = self.recv(prv, k)
            decoded = self.decode(self.site(k, f"final{c}"), message, chunks[c])
            if decoded is not None:
                chunks[c].copy_(decoded)
        wait_all(sends)
