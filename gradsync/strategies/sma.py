"""Synchronous model averaging, ``sma`` (CrossBow, Koliousis et al., VLDB 2019; KungFu's
``SynchronousAveragingOptimizer``, itself building on elastic-averaging SGD).

Each worker trains on its own gradients; every step the *parameters* are all-reduced and each
worker moves towards the average: ``v <- (1 - alpha) v + alpha mean_w(v)``, then applies its local
gradient (KungFu's order). The average is of the parameters as they were when the step's forward
pass began, so its all-reduce is launched at that moment (``before_forward``) and runs while
forward and backward compute: communication is hidden behind the whole step.

Not exact: with ``alpha < 1`` workers' models differ, and even with ``alpha = 1`` each applies its
own gradient after averaging. The bench reports its loss next to the synchronous reference.
Wire: one all-reduce per step of all parameters (one flat buffer per dtype), two-level where the
job's hosts run several workers (averaged inside the host first; :mod:`gradsync.transport.twolevel`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from gradsync._lazy import lazy_names
from gradsync.errors import ConfigError
from gradsync.strategies.base import Strategy, SyncContext, host_ring_bytes


class ModelAveraging(Strategy):
    name = "sma"
    summary = "synchronous model averaging (CrossBow, KungFu): parameters averaged behind the step"
    grad_edits = "local"  # each worker steps with its own gradient; parameters are averaged
    exact = False

    def __init__(self, alpha: float = 0.1):
        if not 0.0 < alpha <= 1.0:
            raise ConfigError(f"sma: alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        groups: dict[tuple, list[torch.nn.Parameter]] = {}
        for p in ctx.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self.groups = list(groups.values())
        self.buffers = [torch.empty(sum(p.numel() for p in g), dtype=g[0].dtype, device=g[0].device)
                        for g in self.groups]
        self.handles: list | None = None

    def before_forward(self) -> None:
        if self.handles is not None:  # a second forward in the same step (evaluation, accumulation)
            return
        self.handles = []
        for group, buffer in zip(self.groups, self.buffers):
            torch.cat([p.detach().reshape(-1) for p in group], out=buffer)
            self.handles.append(self.ctx.transport.allreduce_async(buffer, what="sma parameter average",
                                                                     group=self.ctx.two_level))

    def step(self, apply: Callable[[], Any]) -> Any:
        if self.handles is None:
            self.before_forward()
        n = self.ctx.topology.num_workers
        with torch.no_grad():
            for group, buffer, handle in zip(self.groups, self.buffers, self.handles):
                handle.wait()
                buffer.div_(n)
                offset = 0
                for p in group:
                    p.mul_(1 - self.alpha).add_(buffer[offset:offset + p.numel()].view_as(p), alpha=self.alpha)
                    offset += p.numel()
        self.handles = None
        return apply()

    def flush(self) -> None:
        if self.handles is not None:
            for handle in self.handles:
                handle.wait()

    def describe(self) -> str:
        return f"sma(alpha={self.alpha})"

    def min_bytes_per_host(self, model_bytes: int) -> float:
        return host_ring_bytes(model_bytes, self.ctx.topology)

# The old class name, kept as a deprecated alias.
lazy_names(__name__, {}, renamed={"SMA": "gradsync.strategies.ModelAveraging"})
