"""NoiseScale: the gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018).

From "An Empirical Model of Large-Batch Training", appendix A.1: each worker's local gradient
norm (batch ``b``) and the synchronized gradient's norm (batch ``N b``), smoothed by separate EMAs
of numerator and denominator as KungFu does. Cost: one pass over the local gradients, a pass over
``1/N`` of the synchronized ones (each worker squares its share) and one all-reduce of two scalars.
"""
from __future__ import annotations

import math

import torch

from gradsync import runtime
from gradsync.adapt.monitors.base import EMA, Monitor
from gradsync.errors import ConfigError


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a tensor's elements, as a float64 scalar (one pass, no temporary)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        flat = t.view(-1)
        return torch.dot(flat, flat).double()
    return torch.linalg.vector_norm(t, dtype=torch.float32).double().square()


class NoiseScale(Monitor):
    """The gradient noise scale ``B_simple``: the batch size beyond which a larger batch stops paying.

    With ``b`` samples per worker, ``B = N b`` in all, ``|G_b|^2`` the mean over workers of their local
    gradients' squared norms and ``|G_B|^2`` the synchronized gradient's, the unbiased estimates are
    ``|G|^2 = (B |G_B|^2 - b |G_b|^2) / (B - b)`` and ``tr(Sigma) = (|G_b|^2 - |G_B|^2) / (1/b - 1/B)``;
    each goes through its own EMA (``alpha``; reported as ``grad_sq_norm`` and ``grad_trace_cov``) and
    ``noise_scale`` is their ratio. Needs two or more workers
    (with one, ``b == B`` and nothing can be told apart): ``noise_scale`` is then ``nan``.

    ``batch_size``: samples per worker per step; keep it current when it changes
    (:class:`gradsync.adapt.AdaptiveBatchSize` does).
    """

    needs_mean_grads = True

    def __init__(self, batch_size: int, alpha: float = 0.9):
        if batch_size < 1:
            raise ConfigError(f"NoiseScale: batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.alpha = alpha
        self._s, self._g = EMA(alpha), EMA(alpha)
        self._local: list[torch.Tensor] = []
        self.readings: dict[str, float] = {}

    def attach(self, params, names, every) -> None:
        super().attach(params, names, every)
        self._local = []  # readings of a step that failed midway (elastic recovery) must not count
        # The synchronized gradient is the same on every worker: each squares its share of the
        # parameters (balanced by size) and the all-reduce adds the shares up.
        load = [0] * self.num_workers
        self.share = [False] * len(params)
        me = runtime.current().topology.rank
        for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
            w = load.index(min(load))
            load[w] += params[i].numel()
            self.share[i] = w == me

    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        if self.active:
            self._local.append(_sq(grad))

    def on_synced(self) -> None:
        if not self.active:
            return
        device = self.transport.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        local = torch.stack(self._local).sum().to(device) if self._local else zero
        self._local = []
        mine = [_sq(p.grad) for p, own in zip(self.params, self.share) if own and p.grad is not None]
        big = torch.stack(mine).sum().to(device) if mine else zero
        t = torch.stack([local, big])
        self.transport.allreduce(t, what="noise scale norms")
        small_sq, big_sq = float(t[0]) / self.num_workers, float(t[1])
        b, B = self.batch_size, self.batch_size * self.num_workers
        if B == b:
            self.readings = {"noise_scale": math.nan, "grad_sq_norm": big_sq}
            return
        g2 = (B * big_sq - b * small_sq) / (B - b)
        trace = (small_sq - big_sq) / (1 / b - 1 / B)
        s, g = self._s.update(trace), self._g.update(g2)
        self.readings = {"noise_scale": s / g if g else math.inf, "grad_sq_norm": g, "grad_trace_cov": s}

    @property
    def value(self) -> float:
        return self.readings.get("noise_scale", math.nan)

    def state(self) -> dict:
        return {"s": self._s.value, "g": self._g.value, "readings": self.readings}

    def load_state(self, state: dict) -> None:
        self._s.value, self._g.value, self.readings = state["s"], state["g"], dict(state["readings"])

    def values(self) -> dict[str, float]:
        return dict(self.readings)
