"""Sparsifiers: send a few elements as (value, index) pairs, or values alone at shared random indices.

- ``topk``: the ``k = ceil(ratio * n)`` largest magnitudes, exactly (``torch.topk``).
- ``randomk``: ``k`` elements at indices drawn from a generator every rank seeds alike (GRACE: from
  the tensor's name and the step), so only values cross the wire and payloads are summable.
  ``unbiased=True`` scales by ``n / k`` (Stich et al. 2018 use it unscaled, with error feedback).
- ``dgc`` (Lin et al., ICLR 2018, Deep Gradient Compression): momentum correction (accumulate the
  velocity, not the gradient), local gradient clipping, a threshold estimated from a random sample
  instead of a full sort (exact top-k only among the elements over it when too many pass), momentum
  factor masking (sent elements' momentum is cleared), and warm-up (density 25 %, 6.25 %, 1.56 %,
  0.4 %, then ``ratio``, over ``warmup_steps``). DGC applies momentum itself: use it with plain SGD
  (``momentum=0``) and the learning rate you would use with momentum.
- ``graddrop`` (Aji & Heafield, EMNLP 2017, "Sparse Communication for Distributed Gradient Descent"):
  drop the ``drop_ratio`` smallest magnitudes (threshold from a sample), keep them as a residual.

Wire: values in float32 plus int32 indices (``randomk``: values only). Top-k and its relatives are
not summable: ranks pick different indices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from gradsync.compress.base import Compressor, Context, Payload, flat
from gradsync.errors import ConfigError

MIN_SAMPLE = 1024  # tensors up to this size get an exact threshold


@dataclass
class SparseContext(Context):
    indices: torch.Tensor | None = None  # randomk: the shared indices (not sent)


def _check_ratio(name: str, what: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ConfigError(f"{name} {what} must be in (0, 1], got {value}")


def _count(ratio: float, n: int) -> int:
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


def _scatter(payload: Payload, ctx: Context, indices: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(ctx.numel, dtype=torch.float32, device=payload[0].device)
    out.index_put_((indices.long().to(out.device),), payload[0].float(), accumulate=True)
    return out.to(ctx.dtype).view(ctx.shape)


def _sampled_indices(magnitude: torch.Tensor, density: float, sample_rate: float,
                     gen: torch.Generator) -> torch.Tensor:
    """Indices of about ``density * n`` largest elements, the threshold estimated from a sample; at most
    ``ceil(density * n)`` (an exact top-k among those over the threshold when too many pass)."""
    n = magnitude.numel()
    k = _count(density, n)
    if n <= MIN_SAMPLE:
        return magnitude.topk(k, sorted=False).indices
    sample = magnitude[torch.randint(0, n, (max(MIN_SAMPLE, int(sample_rate * n)),), generator=gen)]
    threshold = sample.topk(_count(density, sample.numel()), sorted=False).values.min()
    chosen = (magnitude >= threshold).nonzero().view(-1)
    if chosen.numel() > k:
        chosen = chosen[magnitude[chosen].topk(k, sorted=False).indices]
    return chosen


def _sparse_payload(x: torch.Tensor, indices: torch.Tensor) -> Payload:
    return [x[indices].contiguous(), indices.to(torch.int32)]


@dataclass
class TopK(Compressor):
    """The ``ratio`` share of elements with the largest magnitudes."""

    name: ClassVar[str] = "topk"
    ratio: float = 0.3
    """Share of elements kept (GRACE's default 0.3; DGC-style training uses 0.001-0.01)."""

    def __post_init__(self):
        _check_ratio("topk", "ratio", self.ratio)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        indices = x.abs().topk(_count(self.ratio, x.numel()), sorted=False).indices
        return _sparse_payload(x, indices), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return _scatter(payload, ctx, payload[1])


@dataclass
class RandomK(Compressor):
    """``ratio`` of the elements at random indices shared by every rank."""

    name: ClassVar[str] = "randomk"
    summable: ClassVar[bool] = True
    shared_seed: ClassVar[bool] = True
    ratio: float = 0.3
    """Share of elements kept (GRACE's default 0.3)."""
    seed: int = 0
    """Must be equal on every rank for a given gradient (strategies derive it from the parameter's name)."""
    unbiased: bool = False
    """Scale the kept values by ``n / k`` so the expectation equals the gradient."""
    calls: int = field(init=False, repr=False, default=0)
    _last: SparseContext | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        _check_ratio("randomk", "ratio", self.ratio)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls)
        self.calls += 1
        indices = torch.randperm(x.numel(), generator=gen)[: _count(self.ratio, x.numel())].to(x.device)
        self._last = SparseContext(tensor.shape, tensor.dtype, indices)
        return [x[indices]], self._last

    def context_for(self, tensor: torch.Tensor) -> Context:
        """The indices of this instance's latest ``compress``, which every rank shares."""
        return self._last

    def decompress(self, payload: Payload, ctx: SparseContext) -> torch.Tensor:
        out = _scatter(payload, ctx, ctx.indices)
        if self.unbiased and ctx.indices.numel():
            out *= ctx.numel / ctx.indices.numel()
        return out


# Deep Gradient Compression's warm-up: density per stage before reaching the target ratio.
DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.004)


@dataclass
class DGC(Compressor):
    """Deep Gradient Compression: sampled-threshold top-k on momentum-corrected, accumulated gradients."""

    name: ClassVar[str] = "dgc"
    ratio: float = 0.001
    """Density sent after warm-up (the paper's 99.9 % sparsity)."""
    sample_rate: float = 0.001
    """Share of elements sampled to estimate the threshold (HiPress's 0.001; the paper samples 0.1-1 %)."""
    momentum: float = 0.9
    """Momentum applied inside the compressor (momentum correction); the optimizer must not add its own."""
    clip_norm: float | None = None
    """Local gradient clipping: scale this worker's gradient to at most this L2 norm before accumulating
    (the paper clips to the global threshold times ``N**-0.5``); None: off."""
    warmup_steps: int = 0
    """Steps over which density falls through 25 %, 6.25 %, 1.56 %, 0.4 % to ``ratio`` (the paper: 4 epochs)."""
    seed: int = 0
    calls: int = field(init=False, repr=False, default=0)
    _u: torch.Tensor | None = field(init=False, repr=False, default=None)
    _v: torch.Tensor | None = field(init=False, repr=False, default=None)
    _gen: torch.Generator | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        _check_ratio("dgc", "ratio", self.ratio)
        _check_ratio("dgc", "sample_rate", self.sample_rate)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"dgc momentum must be in [0, 1), got {self.momentum}")

    def density(self) -> float:
        if self.calls < self.warmup_steps:
            return max(self.ratio, DGC_WARMUP[self.calls * len(DGC_WARMUP) // self.warmup_steps])
        return self.ratio

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        g = flat(tensor)
        if self.clip_norm is not None:
            g = g * min(1.0, self.clip_norm / max(float(g.norm()), 1e-12))
        if self._u is None or self._u.numel() != g.numel():
            self._u, self._v = torch.zeros_like(g), torch.zeros_like(g)
            self._gen = torch.Generator().manual_seed(self.seed)
        self._u.mul_(self.momentum).add_(g)
        self._v.add_(self._u)
        indices = _sampled_indices(self._v.abs(), self.density(), self.sample_rate, self._gen)
        self.calls += 1
        payload = _sparse_payload(self._v, indices)
        self._v[indices] = 0
        self._u[indices] = 0
        return payload, Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return _scatter(payload, ctx, payload[1])


@dataclass
class GradDrop(Compressor):
    """Drop the smallest ``drop_ratio`` of magnitudes into a residual; send the rest."""

    name: ClassVar[str] = "graddrop"
    drop_ratio: float = 0.99
    """Share of elements dropped each step (the paper's 99 %; HiPress uses 0.999)."""
    sample_rate: float = 0.001
    """Share of elements sampled to estimate the threshold."""
    seed: int = 0
    _residual: torch.Tensor | None = field(init=False, repr=False, default=None)
    _gen: torch.Generator | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        if not 0 <= self.drop_ratio < 1:
            raise ConfigError(f"graddrop drop_ratio must be in [0, 1), got {self.drop_ratio}")
        _check_ratio("graddrop", "sample_rate", self.sample_rate)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Context]:
        x = flat(tensor)
        if self._residual is None or self._residual.numel() != x.numel():
            self._residual = torch.zeros_like(x)
            self._gen = torch.Generator().manual_seed(self.seed)
        x = self._residual.add_(x)
        indices = _sampled_indices(x.abs(), 1 - self.drop_ratio, self.sample_rate, self._gen)
        payload = _sparse_payload(x, indices)
        x[indices] = 0
        return payload, Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return _scatter(payload, ctx, payload[1])
