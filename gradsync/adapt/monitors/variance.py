"""GradientVariance: the variance over workers of each gradient coordinate, summed and as a norm.

Exact: an extra all-reduce of the squared gradients (KungFu's ``MonitorGradientVarianceOptimizer``;
one more model-sized all-reduce per step). Sampled: the same over a fixed random subset of
coordinates (the same on every worker), scaled up.
"""
from __future__ import annotations

import math

import torch

from gradsync.adapt.monitors.base import Monitor
from gradsync.errors import ConfigError


class GradientVariance(Monitor):
    """Variance over workers of every gradient coordinate, ``Var_k = E_w[g_k^2] - (E_w[g_k])^2``.

    Reports ``grad_variance`` (the sum over coordinates) and ``grad_variance_norm`` (the L2 norm of
    the variance vector). ``sample=None``: exact, one extra all-reduce of the squared gradients per
    monitored step (KungFu's variance monitor). ``sample=k`` (an int) or a fraction in (0, 1]: the same
    over ``k`` coordinates drawn once with ``seed`` (so the same on every worker), scaled to the
    whole model; one all-reduce of ``2k`` numbers. ``sample=1.0`` equals the exact value.
    """

    needs_mean_grads = True

    def __init__(self, sample: int | float | None = None, seed: int = 0):
        if sample is not None and (sample <= 0 or (isinstance(sample, float) and sample > 1)):
            raise ConfigError(f"GradientVariance: sample must be a count >= 1 or a fraction in (0, 1], got {sample}")
        self.sample, self.seed = sample, seed
        self.readings: dict[str, float] = {}

    def attach(self, params, names, every) -> None:
        super().attach(params, names, every)
        sizes = [p.numel() for p in params]
        self.total = sum(sizes)
        self.offsets = [0]
        for n in sizes[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        device = params[0].device if params else torch.device("cpu")
        if self.sample is None:
            self.picks = None
            self.count = self.total
            self.buffer = torch.zeros(self.total, dtype=torch.float32, device=device)
            return
        count = self.sample if isinstance(self.sample, int) else max(1, round(self.sample * self.total))
        count = min(count, self.total)
        gen = torch.Generator().manual_seed(self.seed)
        if count * 4 >= self.total:
            chosen = torch.randperm(self.total, generator=gen)[:count]
        else:  # without a permutation of the whole model: draw with replacement, keep distinct ones
            distinct = torch.unique(torch.randint(self.total, (count * 2,), generator=gen))
            chosen = distinct[torch.randperm(distinct.numel(), generator=gen)[:count]]
        chosen = chosen.sort().values
        self.count = chosen.numel()
        # Per parameter: the positions picked inside it, and where they go in the sample.
        self.picks, start = [], 0
        for i, (offset, n) in enumerate(zip(self.offsets, sizes)):
            end = int(torch.searchsorted(chosen, offset + n))
            if end > start:
                self.picks.append((i, (chosen[start:end] - offset).to(device), start, end))
            start = end
        self.by_param = {i: (idx, a, b) for i, idx, a, b in self.picks}
        self.buffer = torch.zeros(2 * self.count, dtype=torch.float32, device=device)

    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        if not self.active:
            return
        if self.picks is None:
            start = self.offsets[index]
            torch.mul(grad.reshape(-1), grad.reshape(-1), out=self.buffer[start:start + grad.numel()])
            return
        if index in self.by_param:
            idx, a, b = self.by_param[index]
            values = grad.reshape(-1).index_select(0, idx).float()
            self.buffer[a:b] = values
            self.buffer[self.count + a:self.count + b] = values * values

    def on_synced(self) -> None:
        if not self.active:
            return
        n = self.num_workers
        if self.picks is None:
            # Squared local gradients of the parameters this worker did not use are zero.
            for i, p in enumerate(self.params):
                if p.grad is None:
                    self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].zero_()
            self.transport.allreduce(self.buffer, what="gradient variance (squared gradients)")
            mean = torch.cat([torch.zeros(p.numel(), device=self.buffer.device) if p.grad is None
                              else p.grad.reshape(-1).float() for p in self.params])
            var = (self.buffer / n - mean * mean).clamp_min_(0)
            scale = 1.0
        else:
            self.transport.allreduce(self.buffer, what="gradient variance (sampled coordinates)")
            mean, sq = self.buffer[:self.count] / n, self.buffer[self.count:] / n
            var = (sq - mean * mean).clamp_min_(0)
            scale = self.total / self.count
        var64 = var.double()
        self.readings = {"grad_variance": float(var64.sum()) * scale,
                         "grad_variance_norm": math.sqrt(float(var64.pow(2).sum()) * scale)}
        self.buffer.zero_()

    def values(self) -> dict[str, float]:
        suffix = "" if self.picks is None else "_sampled"
        return {k + suffix: v for k, v in self.readings.items()}
