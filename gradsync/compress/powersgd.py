"""PowerSGD (Vogels et al., NeurIPS 2019): a rank-``r`` approximation ``P Q^T`` by one step of power
iteration, warm-started from the previous step's ``Q``.

A gradient of shape ``(n, ...)`` is viewed as an ``n x m`` matrix ``M``. Alone (``compress``):
``P = M Q``, orthonormalize ``P``, ``Q = M^T P``; the payload is ``P`` and ``Q`` (``(n + m) r`` floats).
Across ranks (``reduce``, what makes PowerSGD fit a ring): ``P_i = M_i Q`` is all-reduced, orthonormalized
(the same on every rank), then ``Q_i = M_i^T P`` is all-reduced; ``P (sum Q_i)^T = P P^T sum M_i`` is the
projection of the summed gradient. Every rank must start from the same ``Q`` (same ``seed``), and
warm starts keep them equal.

Tensors that would not shrink at least ``min_compression_rate`` times (vectors, biases, small
matrices) are sent whole, as PyTorch's ``powerSGD_hook`` does. PowerSGD is biased: use it with error
feedback (PyTorch's default). Defaults follow PyTorch's ``PowerSGDState`` (rank 1, warm start on).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from gradsync.compress.base import Compressor, Context, Payload, flat
from gradsync.errors import ConfigError


def orthonormalize(p: torch.Tensor, tolerance: float = 1e-5) -> torch.Tensor:
    """Gram-Schmidt on the columns, in place. A column that is (numerically) in the span of the ones
    before it becomes zero: normalizing its rounding noise would add a spurious direction."""
    for i in range(p.shape[1]):
        col = p[:, i]
        before = col.norm()
        if i:
            col -= p[:, :i] @ (p[:, :i].T @ col)
        after = col.norm()
        if after <= tolerance * before or after == 0:
            col.zero_()
        else:
            col /= after
    return p


@dataclass
class PowerSGD(Compressor):
    """Low-rank compression by power iteration."""

    name: ClassVar[str] = "powersgd"
    summable: ClassVar[bool] = True  # through reduce(): two all-reduces of P and Q
    shared_seed: ClassVar[bool] = True
    rank: int = 1
    """Rank ``r`` of the approximation (PyTorch's default 1; typically 1-4, up to 32 for some NLP models)."""
    warm_start: bool = True
    """Start each power iteration from the previous step's ``Q`` (better approximation, ``m r`` floats kept)."""
    min_compression_rate: float = 2.0
    """Send a tensor whole unless ``(n + m) r`` is at least this many times smaller than ``n m``."""
    seed: int = 0
    """Seeds the first ``Q``; must be equal on every rank for ``reduce``."""
    _q: torch.Tensor | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        if self.rank < 1:
            raise ConfigError(f"powersgd rank must be >= 1, got {self.rank}")

    def _matrix(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor`` as an ``n x m`` float32 matrix, or None when it is sent whole."""
        if tensor.dim() < 2 or tensor.numel() == 0:
            return None
        n = tensor.shape[0]
        m = tensor.numel() // n
        if (n + m) * self.rank * self.min_compression_rate > n * m:
            return None
        return tensor.reshape(n, m).float().contiguous()

    def _start(self, matrix: torch.Tensor) -> torch.Tensor:
        """The ``m x r`` starting ``Q``; ``r`` at most ``min(n, m)``, past which columns of ``P`` would be
        rounding noise that Gram-Schmidt blows up to unit length."""
        n, m = matrix.shape
        rank = min(self.rank, n, m)
        if self._q is None or self._q.shape != (m, rank) or not self.warm_start:
            gen = torch.Generator().manual_seed(self.seed)
            self._q = torch.randn(m, rank, generator=gen).to(matrix.device)
        return self._q

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        matrix = self._matrix(tensor)
        if matrix is None:
            return [flat(tensor).clone()], Context(tensor.shape, tensor.dtype)
        p = orthonormalize(matrix @ self._start(matrix))
        self._q = matrix.T @ p
        return [p, self._q.clone()], Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        if len(payload) == 1:
            return payload[0].to(ctx.dtype).view(ctx.shape)
        return (payload[0].float() @ payload[1].float().T).to(ctx.dtype).view(ctx.shape)

    def reduce(self, tensor: torch.Tensor, allreduce: Callable[[torch.Tensor], None]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        matrix = self._matrix(tensor)
        if matrix is None:
            total = flat(tensor).clone()
            allreduce(total)
            return total.to(tensor.dtype).view(tensor.shape), tensor
        p = matrix @ self._start(matrix)
        allreduce(p)
        orthonormalize(p)
        q = matrix.T @ p
        mine = (p @ q.T).to(tensor.dtype).view(tensor.shape)
        allreduce(q)
        self._q = q
        return (p @ q.T).to(tensor.dtype).view(tensor.shape), mine
