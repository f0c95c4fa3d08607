"""The parameter servers' wire protocol, shared by ``ps`` and ``ps-async`` (no pickle).

- Control header ``int64[2] = (op, step)`` on tag :data:`TAG_CONTROL`: ``op`` is
  :data:`OP_STEP` (a worker starts step ``step``), :data:`OP_STOP` (it is done:
  ``gradsync.shutdown``), :data:`OP_SAVE` or :data:`OP_LOAD` (a checkpoint of the servers'
  optimizer state; ``ps`` only) or :data:`OP_PING` (a worker away from training, skipped: a
  server's wait for the next header outlives the workers' pauses, :mod:`gradsync.strategies.keepalive`).
- A push is a *group* of tensors, ``grads.flatten() ++ [used flag per tensor]`` in their dtype, on
  tag ``1 + first index``; a pull is the group's parameter data on the same tag.
- Groups (:func:`plan_groups`) are tensors consecutive in backward order with the same server, up
  to ``fuse_kb``: fusion saves the per-message latency of the many small tensors, biases and norms,
  a model has; ``fuse_kb=0`` sends one message per tensor. The plan is static (the same on every
  rank), so a receiver always knows what a message holds.
- Parameters are partitioned whole across the servers, balanced by size (:func:`partition`).
"""
from __future__ import annotations

import torch

from gradsync.strategies.allreduce import plan_buckets
from gradsync.transport import check_peer

OP_STEP, OP_STOP, OP_SAVE, OP_LOAD, OP_PING = 1, 2, 3, 4, 5
TAG_CONTROL = 0


def check_header(header: torch.Tensor, src: int, ops=(OP_STEP, OP_STOP, OP_SAVE, OP_LOAD, OP_PING)) -> None:
    """A control header from rank ``src`` must name one of ``ops`` and a step >= 0."""
    op, step = header.tolist()
    check_peer(op in ops and step >= 0, src, "a parameter-server step header",
               f"operation {op} and step {step}")


def partition(sizes: list[int], servers: list[int]) -> list[int]:
    """Owner rank of each tensor: largest first onto the least-loaded server (ties: lowest index)."""
    load = {s: 0 for s in servers}
    owner = [servers[0]] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(servers, key=lambda s: (load[s], servers.index(s)))
        owner[i] = s
        load[s] += sizes[i]
    return owner


def plan_groups(params: list[torch.Tensor], owner: list[int], servers: list[int],
                fuse_bytes: int) -> tuple[list[list[int]], list[int]]:
    """``(groups, group_owner)``: per server, its tensors in backward order fused up to ``fuse_bytes``."""
    order = list(reversed(range(len(params))))
    groups: list[list[int]] = []
    group_owner: list[int] = []
    for server in servers:
        mine = [i for i in order if owner[i] == server]
        planned = plan_buckets(params, mine, fuse_bytes, fuse_bytes) if fuse_bytes else [[i] for i in mine]
        groups += planned
        group_owner += [server] * len(planned)
    return groups, group_owner


class Fused:
    """One message: the tensors' data back to back, then (for pushes) one "used" flag per tensor."""

    __slots__ = ("wire", "parts", "used")

    def __init__(self, params: list[torch.Tensor], flags: bool):
        total = sum(p.numel() for p in params)
        first = params[0]
        self.wire = torch.zeros(total + (len(params) if flags else 0), dtype=first.dtype, device=first.device)
        self.parts, offset = [], 0
        for p in params:
            self.parts.append(self.wire[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.used = self.wire[total:] if flags else None
