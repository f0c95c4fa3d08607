"""A compressed strategy on hosts of several workers: only what crosses hosts is compressed.

Where the job's hosts run several workers on Gloo (``SyncContext.two_level``), a bucket the
communication thread exchanges takes the three steps of the two-level all-reduce
(:mod:`gradsync.transport.twolevel`), with the strategy's own exchange in the middle:

1. reduce-scatter inside the host, uncompressed: the bucket is cut into S shards (S: the most
   workers any host runs) and local worker ``j`` ends with the host's sum of shard ``j``;
2. the strategy's compressed exchange (:meth:`CompressedSync.exchange
   <gradsync.strategies.compressed.CompressedSync.exchange>`: a ring, a PS, an all-gather) of
   each shard among its owners, one worker per host: H peers instead of N. A host's workers use its
   NIC in parallel, and each encodes and decodes 1/S of the bucket;
3. all-gather inside the host, uncompressed.

A host with fewer workers than S (an uneven layout: hosts of 2 and 1) sums its bucket whole, and
its worker ``j`` runs step 2 for every shard ``s`` with ``s % L == j`` (L: its workers), one after
the other.

Faults. Each shard carries a tail of S slots ``(flag, code, rank, parameter)``. In step 1 every
local worker writes its own fault (a NaN/Inf gradient) into its slot, so the owners learn every
fault of their host before step 2, whose message headers carry it to the other hosts; in step 3
each owner writes the fault it knows after step 2 (its host's, another host's, a codec failure, a
sum out of range) into its shards' first slot, and every worker takes the first shard's. Every
shard's owners span every host, so every worker raises the same error: a NaN/Inf gradient names
its worker and parameter, a codec failure the owner that encoded its host's sum.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.compress import CompressionError, NonFiniteGradientError
from gradsync.strategies.compressed.faults import FAULT_COMPRESSION, FAULT_NONFINITE, Fault

SLOT = 4
"""Words of one fault slot: flag, code, rank, parameter."""


@dataclass(frozen=True)
class Peers:
    """The workers one exchange runs among: every worker (flat), or the owners of one shard, one a host."""

    ranks: list[int]
    """Their global ranks; an exchange numbers them 0..n-1."""
    me: int
    """This rank's number among them."""
    group: Any
    """Their process group, for the exchange's collectives."""
    shard: int | None = None
    """The shard of the bucket exchanged, or None: the whole bucket (flat)."""

    @property
    def n(self) -> int:
        return len(self.ranks)


class HostShards:
    """Steps 1-3 for one compressed strategy on one rank: its private host groups and the shards it owns."""

    def __init__(self, sync, hosts):
        rank = sync.ctx.topology.rank
        self.sync, self.hosts = sync, hosts
        self.slot = hosts.local_ranks.index(rank)
        self.owned = [Peers(ranks, ranks.index(rank), group, s) for s, (ranks, group) in sorted(hosts.cross.items())]
        self.num_hosts = len(self.owned[0].ranks)

    def exchange(self, k: int, flat: torch.Tensor) -> None:
        """Replace ``flat`` (this worker's averaged bucket ``k``) by the sum over workers, in place."""
        sync, s = self.sync, self.hosts.shards
        piece = math.ceil(flat.numel() / s)
        rows = flat.new_zeros(s, piece + SLOT * s)  # shard s: its elements (zero-padded), then S fault slots
        chunks = flat.split(piece)
        for row, chunk in zip(rows, chunks):
            row[:chunk.numel()].copy_(chunk)
        if sync.faults.known is not None:  # this worker's own fault, in its slot of every shard
            rows[:, piece + SLOT * self.slot:piece + SLOT * (self.slot + 1)] = self._words(sync.faults.known)
        t = sync.ctx.transport
        t.host_reduce_scatter(rows.view(-1), group=self.hosts, what=f"host sum of compressed bucket {k}")
        for peers in self.owned:  # the host's faults, before any message leaves it
            fault = self._first(rows[peers.shard, piece:])
            if fault is not None:
                sync.faults.note(fault)
        for peers in self.owned:
            self._among(peers, k, rows[peers.shard, :piece])
        for peers in self.owned:  # what this owner knows now, for the host's other workers
            rows[peers.shard, piece:] = 0
            if sync.faults.known is not None:
                rows[peers.shard, piece:piece + SLOT] = self._words(sync.faults.known)
        t.host_all_gather(rows.view(-1), group=self.hosts, what=f"host copy of compressed bucket {k}")
        # The first shard's fault, alike on the host's workers even where two owners failed to encode
        # their host's sum, and across hosts where each shard's owners agreed on one.
        fault = next((f for f in (self._first(row[piece:]) for row in rows) if f is not None), None)
        if fault is not None:
            sync.faults.known = fault
        for row, chunk in zip(rows, chunks):
            chunk.copy_(row[:chunk.numel()])

    def _among(self, peers: Peers, k: int, shard: torch.Tensor) -> None:
        """The strategy's exchange of ``shard`` among ``peers``; an error all of them agreed on
        becomes a fault, so that step 3 still runs and carries it to the host."""
        sync = self.sync
        sync.peers = peers
        try:
            sync.exchange(k, shard)
        except (NonFiniteGradientError, CompressionError) as exc:
            code = FAULT_NONFINITE if isinstance(exc, NonFiniteGradientError) else FAULT_COMPRESSION
            sync.faults.note(Fault(code, sync.ctx.topology.rank, -1))
        finally:
            sync.peers = sync.flat

    @staticmethod
    def _first(tail: torch.Tensor) -> Fault | None:
        """The first fault in a shard's slots, if any (a summed flag: each slot has one writer)."""
        for flag, code, rank, param in tail.view(-1, SLOT).tolist():
            if flag:
                return Fault(int(code), int(rank), int(param))
        return None

    @staticmethod
    def _words(fault: Fault) -> torch.Tensor:
        return torch.tensor([1.0, *fault.info])
