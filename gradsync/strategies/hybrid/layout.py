"""The hybrid strategy's shared vocabulary: message codes and tags, the row layout of the sparse
tables over the servers, and which optimizers may update only the rows pushed."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
from torch import nn


OP_PULL, OP_PUSH, OP_FLUSH, OP_STOP, OP_PROBE_PUSH, OP_PROBE_PULL, OP_PING = 1, 2, 3, 4, 5, 6, 7
TAG_REQUEST, TAG_ANSWER = 920_001, 920_002
HEADER = 8
TABLES = (nn.Embedding, nn.EmbeddingBag)


def _lr_bits(lr: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(lr)))[0]


def _lr(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class Layout:
    """Each sparse table cut into ``partitions`` contiguous row ranges (fewer for a table with
    fewer rows), table ``t``'s partition ``j`` on ``servers[(j + t) % S]``."""

    partitions: int
    bounds: tuple[torch.Tensor, ...]
    """Per table: ``P_t + 1`` row boundaries."""
    owner: tuple[torch.Tensor, ...]
    """Per table: the server rank of each partition."""

    @classmethod
    def make(cls, rows: list[int], partitions: int, servers: list[int]) -> "Layout":
        bounds, owner = [], []
        for t, n in enumerate(rows):
            p = max(1, min(partitions, n))
            bounds.append(torch.tensor([n * j // p for j in range(p + 1)], dtype=torch.int64))
            owner.append(torch.tensor([servers[(j + t) % len(servers)] for j in range(p)], dtype=torch.int64))
        return cls(partitions, tuple(bounds), tuple(owner))

    def part_of(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(ids, self.bounds[t][1:-1].to(ids.device), right=True)

    def split(self, t: int, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """The positions in ``ids`` that each server holds: ``{server: index tensor}``."""
        owners = self.owner[t].to(ids.device)[self.part_of(t, ids)]
        return {int(s): (owners == s).nonzero().view(-1) for s in torch.unique(self.owner[t])}

    def servers_of(self, t: int) -> list[int]:
        return sorted({int(s) for s in self.owner[t]})

    def ranges(self, t: int, server: int) -> list[tuple[int, int]]:
        b = self.bounds[t].tolist()
        return [(b[j], b[j + 1]) for j, s in enumerate(self.owner[t].tolist()) if s == server]


def lazy_update(optimizer_class: type, hyper: dict) -> bool:
    """Whether this optimizer leaves a row without gradient exactly where it is (then servers update
    only the rows pushed, with a sparse gradient)."""
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        return True
    no_decay = not hyper.get("weight_decay", 0)
    if issubclass(optimizer_class, torch.optim.Adagrad):
        return no_decay
    if issubclass(optimizer_class, torch.optim.SGD):
        return no_decay and not hyper.get("momentum", 0)
    return False

