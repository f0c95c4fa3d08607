"""The monitors' hook protocol: what a monitor sees of training, with any strategy.

A monitor sees training through three hook points that :func:`gradsync.distribute` calls for
every strategy, so it works with any strategy without knowing which one runs:

- ``on_local_grad(i, grad)``: parameter ``i``'s gradient on this worker, before synchronization
  (after gradient accumulation, from the same backward hook the strategies use);
- ``on_synced()``: just before the optimizer update, where ``p.grad`` holds the mean over workers
  (strategies with ``mean_grads_at_apply``; the others are refused at
  :func:`~gradsync.adapt.monitors.monitor`);
- ``after_step()``: ``optimizer.step()`` returned.

Every value is the same on every worker: what a monitor reduces, it reduces over all of them.
"""
from __future__ import annotations

import torch

from gradsync import runtime
from gradsync.errors import ConfigError


class Monitor:
    """Base class: no-op hooks. ``values()`` returns this monitor's latest readings by name."""

    needs_mean_grads = False
    """Reads ``p.grad`` in :meth:`on_synced` (only strategies with ``mean_grads_at_apply``)."""

    def attach(self, params: list[torch.nn.Parameter], names: list[str], every: int) -> None:
        self.params, self.names, self.every = params, names, every
        self.transport = runtime.current().transport
        self.num_workers = runtime.current().topology.num_workers
        self.step = 0  # optimizer steps seen

    @property
    def active(self) -> bool:
        """Whether this step is monitored (every ``every`` steps; the same on every worker)."""
        return self.step % self.every == 0

    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        pass

    def on_synced(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def values(self) -> dict[str, float]:
        return {}

    def state(self) -> dict:
        """What a worker joining an elastic job needs to report as the others do (JSON values)."""
        return {}

    def load_state(self, state: dict) -> None:
        pass


class EMA:
    """``value = alpha * value + (1 - alpha) * x``; the first sample is taken as is (KungFu's ``ema.hpp``)."""

    def __init__(self, alpha: float):
        if not 0.0 <= alpha < 1.0:
            raise ConfigError(f"an EMA's alpha must be in [0, 1), got {alpha}")
        self.alpha, self.value = alpha, None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.alpha * self.value + (1 - self.alpha) * x
        return self.value
