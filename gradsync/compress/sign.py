"""One bit per element: the sign, with or without a scale.

- ``onebit`` (Seide et al., Interspeech 2014, "1-bit SGD"; BytePS/HiPress ``onebit``): a sign bit per
  element plus two scales, the mean of the non-negative elements and the mean of the negative ones.
  Reconstruction keeps the sum of each group, so ``sum(decompress(x)) == sum(x)`` (up to rounding).
  Use it with error feedback, as Seide did.
- ``signsgd`` (Bernstein et al., ICML 2018): the sign alone; decompresses to +-1 (zero counts as +1).
  Magnitude is gone, so the learning rate sets the step; an aggregator that re-encodes the sum of
  decoded signs takes the majority vote.
- ``scaled-sign`` (the compressor inside EF-signSGD, Karimireddy et al., ICML 2019): the sign times
  ``mean |x|``. Registered with error feedback as ``efsignsgd``.

Wire: ``ceil(n / 8)`` bytes of packed bits plus 8 (``onebit``) or 4 (``scaled-sign``) bytes of scale,
about 32x smaller than float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from gradsync.compress import bits
from gradsync.compress.base import Compressor, Context, Payload, flat


def _decode(payload: Payload, ctx: Context, positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """``positive`` where the sign bit is set, else ``negative``, in the gradient's dtype and shape."""
    return bits.select(payload[0], ctx.numel, positive.to(ctx.dtype), negative.to(ctx.dtype)).view(ctx.shape)


@dataclass
class OneBit(Compressor):
    """Sign bit per element; the non-negative and the negative elements each decode to their group's mean."""

    name: ClassVar[str] = "onebit"

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        positive = x >= 0
        count = torch.count_nonzero(positive)
        total, magnitude = x.sum(), torch.linalg.vector_norm(x, 1)
        pos_sum, neg_sum = (total + magnitude) / 2, (total - magnitude) / 2  # no masked copy of x
        scales = torch.stack([pos_sum / count.clamp(min=1), neg_sum / (x.numel() - count).clamp(min=1)])
        return [bits.pack(positive, 1), scales], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        scales = payload[1].float()
        return _decode(payload, ctx, scales[0], scales[1])


@dataclass
class SignSGD(Compressor):
    """The sign alone, decoded as +-1."""

    name: ClassVar[str] = "signsgd"

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        return [bits.pack(flat(tensor) >= 0, 1)], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        one = torch.ones(())
        return _decode(payload, ctx, one, -one)


@dataclass
class ScaledSign(Compressor):
    """The sign times the mean magnitude (``||x||_1 / n``)."""

    name: ClassVar[str] = "scaled-sign"

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        scale = x.abs().mean() if x.numel() else x.new_zeros(())
        return [bits.pack(x >= 0, 1), scale.reshape(1)], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        scale = payload[1].float()[0]
        return _decode(payload, ctx, scale, -scale)
