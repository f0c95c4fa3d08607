"""Error feedback (Seide et al. 2014; Karimireddy et al., ICML 2019): remember what compression lost
and add it to the next gradient, so a biased compressor's errors cancel over steps instead of
accumulating. GRACE's ``ResidualMemory`` with ``beta = gamma = 1``.

``ErrorFeedback(inner)`` wraps any compressor and is itself a compressor with the inner one's
properties. It keeps one float32 residual the size of the gradient (the memory cost users see, as
with PyTorch's PowerSGD hook). In ``reduce`` the residual is what this rank's contribution to the sum
lost (for PowerSGD, the projection's error, as PyTorch's hook computes it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gradsync.compress.base import Compressor, Payload


@dataclass
class ErrorFeedback(Compressor):
    """Add the previous step's compression error before compressing."""

    inner: Compressor
    residual: torch.Tensor | None = field(init=False, repr=False, default=None)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"ef-{self.inner.name}"

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.inner.summable

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.inner.lossless

    @property
    def shared_seed(self) -> bool:  # type: ignore[override]
        return self.inner.shared_seed

    def _corrected(self, tensor: torch.Tensor) -> torch.Tensor:
        c = tensor.float()  # the residual is kept in float32 even for half-precision gradients
        if self.residual is not None and self.residual.shape == c.shape:
            c = c + self.residual
        return c

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Any]:
        c = self._corrected(tensor)
        payload, ctx = self.inner.compress(c)
        self.residual = c - self.inner.decompress(payload, ctx)
        if ctx.dtype != tensor.dtype:
            ctx = dataclasses.replace(ctx, dtype=tensor.dtype)
        return payload, ctx

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def context_for(self, tensor: torch.Tensor) -> Any:
        return self.inner.context_for(tensor)

    def reduce(self, tensor: torch.Tensor, allreduce: Callable[[torch.Tensor], None]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._corrected(tensor)
        total, mine = self.inner.reduce(c, allreduce)
        self.residual = c - mine.float()
        return total.to(tensor.dtype), mine.to(tensor.dtype)

    def describe(self) -> str:
        return f"ef({self.inner.describe()})"
