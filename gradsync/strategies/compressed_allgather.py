"""``compressed-allgather``: the baseline compression-aware strategies are measured against.

Each worker compresses its bucket, every payload is all-gathered, and each worker decodes all ``N``
payloads and sums them: what GRACE's all-gather communicator and open-source DGC on Horovod do when
payloads cannot be summed. Simple and exact in its merging (no re-encoding), but every worker
receives ``N-1`` whole compressed buckets (vs ``2 (N-1)/N`` of one for a ring) and decodes ``N``, so
traffic and decode time grow with the number of workers, and so does memory (``N`` payloads held at
once). Summation is in rank order on every worker, so all end up with the same values.

On hosts of several workers (:mod:`gradsync.strategies.compressed.hosts`) the workers of a host sum
their buckets inside it uncompressed, and each all-gathers its shard's payload among that shard's
owners, one worker per host: a host takes in ``H-1`` payloads of the bucket (H hosts) instead of one
per worker elsewhere.
"""
from __future__ import annotations

import torch

from gradsync.compress import Compressor
from gradsync.compress.base import from_bytes, message_problem
from gradsync.compress.powersgd import PowerSGD
from gradsync.errors import ConfigError
from gradsync.strategies.base import worker_hosts
from gradsync.strategies.compressed import CompressedSync
from gradsync.transport import check_peer, payload_limit


class CompressedAllGather(CompressedSync):
    """Compress, all-gather every payload, decode and sum locally."""

    name = "compressed-allgather"
    summary = "the compression baseline: all-gather payloads, decode and sum (GRACE, DGC)"

    def check_codec(self, probe: Compressor) -> None:
        if isinstance(getattr(probe, "inner", probe), PowerSGD):
            raise ConfigError("compressed-allgather does not take powersgd (its factors are all-reduced); "
                              "use casync-ring")

    def exchange(self, k: int, flat: torch.Tensor) -> None:
        codec = self.site(k, "all")
        message, payload, ctx = self.encode(codec, flat, param=self.buckets[k].indices[0])
        messages, infos = self.ctx.transport.allgather_bytes(message, info=self.faults.header, group=self.peers.group,
                                                             limit=payload_limit(flat.numel()),
                                                             what=f"all-gather of compressed bucket {k}")
        for info in infos:
            self.faults.note_header(info)
        if self.faults.known is not None:
            return
        for w, received in enumerate(messages):
            problem = None if w == self.peers.me else message_problem(received)
            check_peer(problem is None, self.peers.ranks[w], f"compressed bucket {k}", problem)
        total = torch.zeros_like(flat)
        for w, received in enumerate(messages):
            total += self.decompress(codec, payload if w == self.peers.me else from_bytes(received, payload), ctx)
        flat.copy_(total)

    def min_bytes_per_host(self, model_bytes: int) -> float:
        # Payloads are not summed on the way: a host takes in one payload of the bucket from every
        # other host (its workers sum inside it first; one rank a host: every other worker's).
        return (len(worker_hosts(self.ctx.topology)) - 1) * model_bytes * self.ratio
