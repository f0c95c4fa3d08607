"""``casync-ps``: compression-aware parameter server with co-located aggregators (HiPress's CaSync-PS,
Bai et al. SOSP 2021; the BytePS-style push/pull it improves on).

Bucket ``k`` is cut into ``K`` partitions; partition ``j`` is aggregated by worker ``(k + j) mod N``
(HiPress: ``root = key_index % N``), so aggregation, decoding and re-encoding are spread over all
workers. ``K`` is ``N`` for buckets of at least ``partition_mb`` (HiPress's 4 MiB ``partition_byte``),
else 1, or the cost model's choice under ``selective=True``. For each partition:

1. push: every other worker encodes its partition and sends the payload to the aggregator;
2. merge: the aggregator decodes each payload and adds it to its own (exact) partition, re-encodes the
   sum once and sends that payload to every worker; it takes the decoded payload itself, so all
   workers end up with the same values;
3. pull: every worker decodes the aggregator's payload.

Compressors whose payloads add up (fp16, bf16, random-k with a shared seed, and plain buckets) skip
the decode-merge-encode: every worker (the aggregator too) encodes its partition, the aggregator adds
the payloads element-wise and returns the sum. PowerSGD's two all-reduce rounds have no aggregator
form; use ``casync-ring``. Per worker and bucket, with ``K = N``: ``2 (N-1)`` messages of ``1/N`` of the
compressed bucket, as the ring, but only two encodes and ``N`` decodes of a partition.

On hosts of several workers (Gloo; :mod:`gradsync.strategies.compressed.hosts`) only what crosses
hosts is compressed: a bucket is summed inside the host uncompressed (reduce-scatter), each of its R
shards is pushed, merged and pulled as above among the shard's owners (one worker a host, so N is
the number of hosts H and ``K`` is H for large buckets), and the shards are all-gathered inside the
host. ``distribute(..., hosts="flat")`` keeps every worker a peer of every other.
"""
from __future__ import annotations

import torch

from gradsync.compress import Compressor
from gradsync.compress.base import all_finite, from_bytes, to_bytes
from gradsync.compress.powersgd import PowerSGD
from gradsync.errors import ConfigError
from gradsync.strategies import costmodel
from gradsync.strategies.allreduce import MB
from gradsync.strategies.compressed import CompressedSync
from gradsync.transport import wait_all


class CaSyncPS(CompressedSync):
    """Partitions aggregated by co-located workers: push compressed, decode-merge-encode, pull compressed."""

    name = "casync-ps"
    summary = "HiPress CaSync-PS: compressed partitions aggregated by co-located workers"
    algorithm = "ps"

    def __init__(self, compression: str = "onebit", partition_mb: float = 4.0, **options):
        if partition_mb <= 0:
            raise ConfigError(f"partition_mb must be > 0, got {partition_mb}")
        self.partition_bytes = int(partition_mb * MB)
        super().__init__(compression, **options)

    def check_codec(self, probe: Compressor) -> None:
        if isinstance(getattr(probe, "inner", probe), PowerSGD):
            raise ConfigError("casync-ps cannot use powersgd: its two all-reduce rounds have no aggregator form; "
                              "use casync-ring (or the ddp strategy with compression=powersgd)")

    def default_parts(self, nbytes: int) -> int:
        return self.span if nbytes >= self.partition_bytes else 1

    def decide(self, costs: costmodel.Costs, bucket: int, nbytes: int) -> costmodel.Decision:
        return costmodel.decide_ps(costs, bucket, nbytes, self.span)

    def exchange(self, k: int, flat: torch.Tensor) -> None:
        n, me = self.peers.n, self.peers.me
        parts = flat.tensor_split(self.parts[k])
        owner = [(k + j) % n for j in range(len(parts))]
        summable = self.summable_bucket(k)
        first = self.buckets[k].indices[0]
        sends: list = []
        own = {}
        for j, part in enumerate(parts):  # push (aggregators of a merging codec keep theirs exact)
            if owner[j] == me and not summable:
                continue
            message, payload, ctx = self.encode(self.site(k, f"push{j}"), part, param=first)
            own[j] = (payload, ctx)
            if owner[j] != me:
                sends += self.send(message, owner[j], k)
        for j, part in enumerate(parts):  # merge what this worker aggregates, answer everyone
            if owner[j] != me:
                continue
            message, result = (self._sum_payloads(k, j, *own[j]) if summable else self._merge(k, j, part))
            for w in range(n):
                if w != me:
                    sends += self.send(message, w, k)
            if result is not None and self.faults.known is None:
                part.copy_(result)
        for j, part in enumerate(parts):  # pull
            if owner[j] == me:
                continue
            message = self.recv(owner[j], k)
            if summable:
                payload, ctx = own[j]
                decoded = self.decode(self.site(k, f"push{j}"), message, part, ctx=ctx, shape_like=payload)
            else:
                decoded = self.decode(self.site(k, f"pull{j}"), message, part)
            if decoded is not None:
                part.copy_(decoded)
        wait_all(sends)

    def _sum_payloads(self, k: int, j: int, payload, ctx) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Summable codec: add every worker's payload element-wise to this one's, decode once."""
        total = None if payload is None else [p.clone() for p in payload]
        for w in range(self.peers.n):
            if w == self.peers.me:
                continue
            message = self.recv(w, k)
            if self.faults.known is None:
                for t, p in zip(total, from_bytes(message, total)):
                    t.add_(p)
        if self.faults.known is not None:
            return torch.empty(0, dtype=torch.uint8), None
        result = self.decompress(self.site(k, f"push{j}"), total, ctx)
        if not all_finite(result):
            self.faults.note_compression(-1)
            return torch.empty(0, dtype=torch.uint8), None
        return to_bytes(total), result

    def _merge(self, k: int, j: int, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Merging codec: decode every other worker's payload, add to this one's exact partition, re-encode."""
        pull = self.site(k, f"pull{j}")
        total = part.clone()
        for w in range(self.peers.n):
            if w != self.peers.me:
                incoming = self.decode(pull, self.recv(w, k), part)
                if incoming is not None:
                    total.add_(incoming)
        message, payload, ctx = self.encode(pull, total)
        return message, (None if payload is None else self.decompress(pull, payload, ctx))
