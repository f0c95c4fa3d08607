"""Collectives on a plain process group, for code that runs inside PyTorch's DDP (no Transport).

A DDP communication hook (:mod:`gradsync.compress.hook`) gets a process group, not gradsync's
transport: these functions are its collectives, with the same checks of what peers send.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync.transport.peers import check_peer


def group_rank_and_size(group=None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    """The job-wide rank of ``group``'s rank ``rank`` (``group`` None: the whole job)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def allreduce_sum_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` (default: the whole job)."""
    dist.all_reduce(tensor, group=group)
    return tensor


def allreduce_sum_async(tensor: torch.Tensor, group=None) -> torch.futures.Future:
    """Start summing ``tensor`` in place over ``group``: a future that completes with the collective."""
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def allgather_bytes(message: torch.Tensor, group=None, *, limit: int,
                    what: str = "all-gather") -> list[torch.Tensor]:
    """Every rank's ``uint8`` message, each at most ``limit`` bytes (lengths first, checked, then one
    padded all-gather)."""
    return allgather_with_info(message, (0, 0, 0), group, limit=limit, what=what)[0]


def allgather_with_info(message: torch.Tensor, info: tuple[int, int, int], group=None, *, limit: int,
                        what: str = "all-gather") -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
    """:func:`allgather_bytes`, and three words of ``info`` from every rank (as in
    :meth:`~gradsync.transport.Transport.send_bytes`)."""
    size = dist.get_world_size(group)
    header = torch.tensor([message.numel(), *info], dtype=torch.int64, device=message.device)
    headers = [torch.empty_like(header) for _ in range(size)]
    dist.all_gather(headers, header, group=group)
    rows = [h.tolist() for h in headers]
    for r, row in enumerate(rows):
        check_peer(0 <= row[0] <= limit, global_rank(group, r), what,
                   f"a length of {row[0]} bytes (at most {limit} expected)")
    longest = max(1, max(row[0] for row in rows))
    padded = torch.zeros(longest, dtype=torch.uint8, device=message.device)
    padded[: message.numel()] = message
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [g[: row[0]] for g, row in zip(gathered, rows)], [tuple(row[1:]) for row in rows]
