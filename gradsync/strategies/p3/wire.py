"""The sliced parameter servers' wire protocol (``p3``, ``ps-sliced``; no pickle).

A message is a ``uint8`` buffer: an ``int64[2 + group]`` header ``(kind << 32 | count, step,
slice, ...)``, then per slice ``slice_numel`` values and one "used" flag per segment (a worker that
did not use a parameter contributes zero; a parameter no worker used keeps ``grad = None`` on the
server, so the optimizer skips it, as in DDP). A message carries up to ``group`` slices for one
rank: those ready at the same moment, consecutive in that rank's priority order, as every message
pays a fixed CPU price at both ends (a Python wake-up, a Gloo send and receive).

``group`` is how many slices fit in half of ``most`` bytes (``p3``'s credit; at most
:data:`MOST_SLICES` and :data:`MOST_BYTES`): two messages fit in the credit, so the next one is on the link while the
sender learns that the previous one completed (a group as large as the credit leaves the link
idle between messages: ResNet-50 at 0.78-0.81 of the bound against 0.88-0.91), and preemption
stays within the credit. Without a credit (``ps-sliced``), or with one under four slices, a
message carries one slice. Receives are posted ahead at the largest size: Gloo lands a shorter
message in a longer receive, so a message is as long as its slices. Backends whose receives must
match the send's length (NCCL) get ``exact``: one slice a message, every message at full length.
A push compressed with ``compression=`` (:mod:`gradsync.strategies.coded`) is kind :data:`CODED`:
the same header, then per slice its encoded *slot* (a fixed size per codec) and its used flags;
the receiving server decodes it into a plain push. Its answer is :data:`CODED_ANSWER`, laid out
alike: per slice the encoded change of the slice's values (flags unused). Such messages are shorter than the receives,
which Gloo allows; compression therefore needs Gloo. One tag; between two ranks messages arrive in
the order sent. A stream ends with :data:`POSTED`
stop messages, which fill exactly the receives the peer still has posted; keep-alives fill idle
streams, well inside the transport's timeout.
"""
from __future__ import annotations

import torch

from gradsync.strategies.slicing import SlicePlan

PUSH, ANSWER, STOP, KEEPALIVE, CODED, CODED_ANSWER = 1, 2, 3, 4, 5, 6
TAG = 0x5033
POSTED = 4
"""Receives each rank keeps posted per peer (Gloo moves a message once its receive is posted)."""
MOST_SLICES = 64
"""The most slices in one message (tiny slices: a header of at most 66 words)."""
MOST_BYTES = 4 * 2**20
"""The most bytes of slices in one message (each of the POSTED receives per peer is as long)."""


class Wire:
    """The message layout: views into one ``uint8`` buffer of up to ``group`` slices."""

    def __init__(self, plan: SlicePlan, dtype: torch.dtype, most: int | None = None, exact: bool = False,
                 slot: int | None = None):
        self.dtype, self.numel, self.flags = dtype, plan.slice_numel, max(plan.max_segments, 1)
        self.size = torch.empty((), dtype=dtype).element_size()
        self.block = (self.numel + self.flags) * self.size  # one slice's bytes
        self.one = 8 * 3 + self.block  # the bytes of a one-slice message
        fits = 1 if most is None or exact else (min(most // 2, MOST_BYTES) - 16) // (8 + self.block)
        self.group = max(1, min(fits, MOST_SLICES))
        self.exact = exact
        self.header_bytes = 8 * (2 + self.group)
        self.slot = slot
        """The bytes of one encoded slice (``compression=``), or None."""
        flags = self.flags * self.size
        self.coded_block = 0 if slot is None else -(-(slot + flags) // 8) * 8  # 8-byte aligned slots
        self.nbytes = self.header_bytes + self.group * max(self.block, self.coded_block)
        """The longest message: what every receive is posted with."""

    def new(self, kind: int, slices: list[int], step: int) -> torch.Tensor:
        """A message of ``kind`` for ``slices`` (at most :attr:`group`; none for a stop or keep-alive)."""
        count = len(slices)
        buf = torch.empty(self.length(count, kind), dtype=torch.uint8)
        words = [kind << 32 | count, step, *slices] + [0] * (self.group - count)
        buf[:self.header_bytes].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
        return buf

    def length(self, count: int, kind: int = PUSH) -> int:
        """The bytes of a message of ``count`` slices (every message at full length where ``exact``)."""
        if self.exact:
            return self.nbytes
        return self.header_bytes + count * (self.coded_block if kind in (CODED, CODED_ANSWER) else self.block)

    def header(self, buf: torch.Tensor) -> tuple[int, int, int, list[int]]:
        """``(kind, count, step, slices)``; ``count`` as sent, which the caller checks against :attr:`group`."""
        words = buf[:self.header_bytes].view(torch.int64).tolist()
        count = words[0] & 0xFFFFFFFF
        return words[0] >> 32, count, words[1], words[2:2 + min(count, self.group)]

    def payload(self, buf: torch.Tensor, i: int = 0) -> torch.Tensor:
        """The values of the message's ``i``-th slice."""
        start = self.header_bytes + i * self.block
        return buf[start:start + self.numel * self.size].view(self.dtype)

    def used(self, buf: torch.Tensor, i: int = 0) -> torch.Tensor:
        """The used flags of the message's ``i``-th slice."""
        end = self.header_bytes + (i + 1) * self.block
        return buf[end - self.flags * self.size:end].view(self.dtype)

    def coded(self, buf: torch.Tensor, i: int = 0) -> torch.Tensor:
        """The encoded slot (``uint8``) of a :data:`CODED` or :data:`CODED_ANSWER` message's ``i``-th slice."""
        start = self.header_bytes + i * self.coded_block
        return buf[start:start + self.slot]

    def coded_used(self, buf: torch.Tensor, i: int = 0) -> torch.Tensor:
        """The used flags of a :data:`CODED` message's ``i``-th slice."""
        start = self.header_bytes + i * self.coded_block + self.slot
        return buf[start:start + self.flags * self.size].view(self.dtype)
