"""Parameter slicing: the model's parameters, in forward order, cut into equal slices.

P3 (Jayarajan et al., SysML 2019) cuts every large parameter into slices of ``slice_params``
elements (40,000 in its code, 50,000 in its paper) so that a slice of the first layer can overtake
the rest of a 400 MB layer, and spreads them round-robin over the servers. gradsync goes one step
further and lays *all* parameters end to end in forward order before cutting: small tensors
(biases, norms) share a slice with their neighbours instead of each paying a message, and every
slice has the same size, so every message has one size (no padding but in the last slice).

A slice's **priority is its index**: slices near the input come first, which is the order the next
forward pass needs them. Slice ``k`` belongs to server ``servers[k % len(servers)]``.

The plan depends only on the parameter shapes, the order and ``slice_params``, so every rank
that is given the same order builds the same plan (the order is agreed by broadcast).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + length)`` of parameter ``param`` (flattened) sit at ``offset`` in a slice."""

    param: int
    start: int
    length: int
    offset: int


@dataclass
class Slice:
    index: int
    owner: int
    segments: list[Segment]

    @property
    def numel(self) -> int:
        return sum(s.length for s in self.segments)


class SlicePlan:
    """Slices of ``params`` taken in ``order``, at most ``slice_params`` elements each, owners round-robin."""

    def __init__(self, params: list[torch.Tensor], order: list[int], slice_params: int, servers: list[int]):
        self.slices: list[Slice] = []
        self.of_param: list[list[int]] = [[] for _ in params]
        """``of_param[i]``: the slices holding part of parameter ``i``, in order."""
        current: list[Segment] = []
        fill = 0
        for i in order:
            start, numel = 0, params[i].numel()
            while start < numel:
                take = min(slice_params - fill, numel - start)
                current.append(Segment(i, start, take, fill))
                start += take
                fill += take
                if fill == slice_params:
                    self._close(current, servers)
                    current, fill = [], 0
        if current:
            self._close(current, servers)
        self.slice_numel = max((s.numel for s in self.slices), default=0)
        self.max_segments = max((len(s.segments) for s in self.slices), default=0)

    def _close(self, segments: list[Segment], servers: list[int]) -> None:
        k = len(self.slices)
        self.slices.append(Slice(k, servers[k % len(servers)], segments))
        for seg in segments:
            if not self.of_param[seg.param] or self.of_param[seg.param][-1] != k:
                self.of_param[seg.param].append(k)

    def slices_of(self, indices) -> list[int]:
        """The slices holding any part of the parameters ``indices``, ascending."""
        return sorted({k for i in indices for k in self.of_param[i]})


def flat_view(param: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The part of ``param`` (its data, no autograd) that ``seg`` covers."""
    return param.detach().view(-1)[seg.start:seg.start + seg.length]
