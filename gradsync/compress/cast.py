"""Lossless passthrough and half-precision casts (Horovod's ``Compression.fp16``, PyTorch's
``fp16_compress_hook`` / ``bf16_compress_hook``).

Casts are summable: the sum of the half-precision payloads is a half-precision sum. Error bounds
(per element, round to nearest): fp16 ``|x - y| <= 2**-11 |x| + 2**-25`` for ``|x| <= 65504`` (the
second term is half the smallest subnormal; values under ``2**-24`` flush to zero); bf16
``|x - y| <= 2**-8 |x|`` over float32's whole range. fp16 cannot hold ``|x| > 65504``: compressing
such a gradient raises rather than sending Inf (Horovod #326). Sum in a reduce can also overflow;
:meth:`Compressor.reduce` checks for that, and dividing by the world size first (as the DDP hook
does) avoids it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from gradsync.compress.base import CompressionError, Compressor, Context, Payload, all_finite

FP16_MAX = 65504.0


@dataclass
class Identity(Compressor):
    """No compression: the gradient itself (a reference point and the lossless case of every strategy)."""

    name: ClassVar[str] = "none"
    summable: ClassVar[bool] = True
    lossless: ClassVar[bool] = True

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        return [tensor.reshape(-1).contiguous()], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return payload[0].to(ctx.dtype).view(ctx.shape)


@dataclass
class Cast(Compressor):
    """Send the gradient in a narrower float type (2 bytes per element instead of 4)."""

    summable: ClassVar[bool] = True
    wire_dtype: ClassVar[torch.dtype]

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        out = tensor.reshape(-1).to(self.wire_dtype)
        if self.wire_dtype == torch.float16 and tensor.dtype != torch.float16 and not all_finite(out):
            peak = float(tensor.abs().max())
            raise CompressionError(f"a value of magnitude {peak:.3g} exceeds float16's range ({FP16_MAX:g}); "
                                   "use bf16, or scale the loss down")
        return [out.contiguous()], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return payload[0].to(ctx.dtype).view(ctx.shape)


@dataclass
class FP16(Cast):
    """IEEE half precision: 10 mantissa bits, range +-65504."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@dataclass
class BF16(Cast):
    """bfloat16: float32's exponent range with 7 mantissa bits (never overflows a float32 gradient)."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
