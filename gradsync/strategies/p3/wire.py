"""The sliced parameter servers' wire protocol (``p3``, ``ps-sliced``; no pickle).

One message size per job, so receives are posted ahead: a ``uint8`` buffer = ``int64[2]`` header
``(kind << 32 | slice, step)``, then ``slice_numel`` values, then one "used" flag per segment (a
worker that did not use a parameter contributes zero; a parameter no worker used keeps
``grad = None`` on the server, so the optimizer skips it, as in DDP). One tag; between two ranks
messages arrive in the order sent. A stream ends with :data:`POSTED` stop messages, which fill
exactly the receives the peer still has posted; keep-alives fill idle streams, well inside the
transport's timeout.
"""
from __future__ import annotations

import torch

from gradsync.strategies.slicing import SlicePlan

PUSH, ANSWER, STOP, KEEPALIVE = 1, 2, 3, 4
TAG = 0x5033
POSTED = 4
"""Receives each rank keeps posted per peer (Gloo moves a message once its receive is posted)."""


class Wire:
    """The fixed message layout: views into one ``uint8`` buffer."""

    HEADER = 16

    def __init__(self, plan: SlicePlan, dtype: torch.dtype):
        self.dtype, self.numel, self.flags = dtype, plan.slice_numel, max(plan.max_segments, 1)
        size = torch.empty((), dtype=dtype).element_size()
        self.nbytes = self.HEADER + (self.numel + self.flags) * size
        self._payload_end = self.HEADER + self.numel * size

    def new(self, kind: int, index: int, step: int) -> torch.Tensor:
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        header = buf[:self.HEADER].view(torch.int64)
        header[0], header[1] = kind << 32 | index, step
        return buf

    def header(self, buf: torch.Tensor) -> tuple[int, int, int]:
        word, step = buf[:self.HEADER].view(torch.int64).tolist()
        return word >> 32, word & 0xFFFFFFFF, step

    def payload(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.HEADER:self._payload_end].view(self.dtype)

    def used(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self._payload_end:].view(self.dtype)
