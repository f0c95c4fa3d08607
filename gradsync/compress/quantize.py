"""Quantizers: each element becomes one of a few levels, sent as packed 2- to 8-bit codes.

- ``tbq`` (Strom, Interspeech 2015, threshold binary quantization; HiPress's TBQ): add the residual,
  send ``+tau`` / ``-tau`` / ``0`` for elements above ``tau`` / below ``-tau`` / in between, keep the rest
  as the next residual (error feedback is part of the algorithm). 2 bits per element.
- ``terngrad`` (Wen et al., NeurIPS 2017): clip to ``clip`` standard deviations, then each element
  becomes ``s * sign(x)`` with probability ``|x| / s`` (``s = max |x|``), else 0. Unbiased for the
  clipped gradient; 2 bits per element plus one scale.
- ``qsgd`` (Alistarh et al., NeurIPS 2017): per bucket of ``bucket_size`` elements, ``|x| / ||bucket||_2``
  is rounded stochastically to one of ``levels`` levels; unbiased, with variance at most
  ``min(d / levels**2, sqrt(d) / levels) ||x||^2`` (d the bucket size). Codes are ``2 levels + 1``
  signed values, packed in 2, 4 or 8 bits, plus one float32 norm per bucket.
- ``int8``, ``int4``: deterministic round-to-nearest to ``[-127, 127]`` / ``[-7, 7]`` times one
  absolute-maximum scale per bucket of 128 (the quantized outer gradients of DiLoCo's descendants).

Stochastic rounding draws from the instance's own generator seeded with ``seed``; strategies give
each rank a different seed so that ranks' rounding errors are independent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from gradsync.compress import bits
from gradsync.compress.base import Compressor, Context, Payload, flat
from gradsync.errors import ConfigError

# Ternary codes: 0 -> 0, 1 -> +scale, 2 -> -scale.
_TERNARY = torch.tensor([0.0, 1.0, -1.0])


def _ternary_codes(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """1 where ``keep`` and ``x >= 0``, 2 where ``keep`` and ``x < 0``, else 0: ``keep << (x < 0)``
    on bytes (nested ``torch.where`` over Python ints makes int64 temporaries, 8x slower)."""
    codes = keep.to(torch.uint8)
    codes <<= (x < 0).view(torch.uint8)
    return codes


def _ternary_values(payload: Payload, ctx: Context) -> torch.Tensor:
    codes = bits.unpack(payload[0], 2, ctx.numel).long()
    return _TERNARY.to(codes.device)[codes] * payload[1].float()[0]


@dataclass
class _Seeded:
    seed: int = 0
    """Seed of this instance's random generator (strategies derive one per rank and gradient)."""
    _gen: torch.Generator = field(init=False, repr=False, compare=False, default=None)

    def uniform(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``n`` draws in [0, 1) from the host generator (the same sequence on every device), on ``device``."""
        if self._gen is None:
            self._gen = torch.Generator().manual_seed(self.seed)
        return torch.rand(n, generator=self._gen).to(device)


@dataclass
class TBQ(Compressor):
    """Threshold binary quantization with a residual."""

    name: ClassVar[str] = "tbq"
    threshold: float = 0.5
    """``tau``: elements whose magnitude (with residual) exceeds it are sent as ``+-tau``. HiPress's
    documented default; it must suit the gradients' scale (too large and nothing is sent for many steps)."""
    residual: torch.Tensor | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        if not self.threshold > 0:
            raise ConfigError(f"tbq threshold must be > 0, got {self.threshold}")

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        if self.residual is not None and self.residual.numel() == x.numel():
            x = x + self.residual
        keep = x.abs() > self.threshold
        codes = _ternary_codes(x, keep)
        self.residual = x - _TERNARY.to(x.device)[codes.long()] * self.threshold
        threshold = torch.tensor([self.threshold], device=x.device)
        return [bits.pack(codes, 2), threshold], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return _ternary_values(payload, ctx).to(ctx.dtype).view(ctx.shape)


@dataclass
class TernGrad(_Seeded, Compressor):
    """Stochastic ternarization with gradient clipping."""

    name: ClassVar[str] = "terngrad"
    clip: float | None = 2.5
    """Clip elements to ``clip`` standard deviations of the gradient first (the paper's 2.5); None: no clipping."""

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        if self.clip is not None and x.numel() > 1:
            bound = float(self.clip * x.std())
            x = x.clamp(-bound, bound)
        size = x.abs()
        scale = size.max() if x.numel() else x.new_zeros(())
        keep = self.uniform(x.numel(), x.device).mul_(scale) < size
        return [bits.pack(_ternary_codes(x, keep), 2), scale.reshape(1)], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return _ternary_values(payload, ctx).to(ctx.dtype).view(ctx.shape)


@dataclass
class QSGD(_Seeded, Compressor):
    """Bucketed stochastic quantization to ``levels`` levels."""

    name: ClassVar[str] = "qsgd"
    levels: int = 127
    """Quantization levels ``s`` per sign (GRACE's default 127: codes fit in 8 bits; 7 -> 4 bits; 1 -> 2 bits)."""
    bucket_size: int = 128
    """Elements sharing one norm (GRACE's default 128); smaller buckets: less variance, more norms sent."""

    def __post_init__(self):
        if not 1 <= self.levels <= 127:
            raise ConfigError(f"qsgd levels must be in 1..127, got {self.levels}")
        if self.bucket_size < 1:
            raise ConfigError(f"qsgd bucket_size must be >= 1, got {self.bucket_size}")
        self.width = bits.width_for(2 * self.levels + 1)

    def _buckets(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, -x.numel() % self.bucket_size)).view(-1, self.bucket_size)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        buckets = self._buckets(x)
        norms = buckets.norm(dim=1, keepdim=True)
        scaled = (buckets.abs() / norms.clamp(min=torch.finfo(torch.float32).tiny) * self.levels).view(-1)
        level = scaled.floor()
        level += self.uniform(level.numel(), level.device) < scaled - level
        codes = (torch.where(buckets.view(-1) >= 0, level, -level) + self.levels)[: x.numel()]
        return [bits.pack(codes, self.width), norms.view(-1)], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        codes = bits.unpack(payload[0], self.width, ctx.numel).float() - self.levels
        codes = torch.nn.functional.pad(codes, (0, -ctx.numel % self.bucket_size)).view(-1, self.bucket_size)
        values = codes * payload[1].float().unsqueeze(1) / self.levels
        return values.view(-1)[: ctx.numel].to(ctx.dtype).view(ctx.shape)


@dataclass
class Int8(Compressor):
    """Deterministic round-to-nearest to signed integers, one absolute-maximum scale per bucket.

    Each bucket of ``bucket_size`` elements is scaled so its largest magnitude becomes ``q``
    (127 for ``int8``, 7 for ``int4``), rounded to the nearest integer code in ``[-q, q]`` and sent
    as packed ``bits``-bit codes plus one float32 scale per bucket. The error of an element is at
    most half its bucket's step (``max |x| / 2q``), with no randomness: what the quantized
    outer gradients of Streaming DiLoCo and INTELLECT-1 send (Douillard et al. 2025, 4 bits;
    Jaghouar et al. 2024, int8). Biased, so pair it with error feedback where the error would
    accumulate (``error_feedback=True``)."""

    name: ClassVar[str] = "int8"
    bits: ClassVar[int] = 8
    bucket_size: int = 128
    """Elements sharing one scale; smaller buckets: finer scales, more of them sent (4 bytes each)."""

    def __post_init__(self):
        if self.bucket_size < 1:
            raise ConfigError(f"{self.name} bucket_size must be >= 1, got {self.bucket_size}")
        self.q = (1 << (self.bits - 1)) - 1

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        buckets = torch.nn.functional.pad(x, (0, -x.numel() % self.bucket_size)).view(-1, self.bucket_size)
        scales = buckets.abs().amax(dim=1, keepdim=True) / self.q
        codes = (buckets / scales.clamp(min=torch.finfo(torch.float32).tiny)).round_().add_(self.q)
        return [bits.pack(codes.view(-1)[: x.numel()], self.bits), scales.view(-1)], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        codes = bits.unpack(payload[0], self.bits, ctx.numel).float() - self.q
        codes = torch.nn.functional.pad(codes, (0, -ctx.numel % self.bucket_size)).view(-1, self.bucket_size)
        values = codes * payload[1].float().unsqueeze(1)
        return values.view(-1)[: ctx.numel].to(ctx.dtype).view(ctx.shape)


@dataclass
class Int4(Int8):
    """:class:`Int8` with 4-bit codes in ``[-7, 7]``: 4.25 bits per element at the default bucket."""

    name: ClassVar[str] = "int4"
    bits: ClassVar[int] = 4
