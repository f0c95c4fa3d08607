"""The monitors attached to one optimizer: :func:`monitor` attaches them, :class:`Monitors` fans the
optimizer's observer hook points out to each, then prints or writes their values."""
from __future__ import annotations

import torch

from gradsync import runtime
from gradsync.adapt.monitors.base import Monitor
from gradsync.errors import ConfigError


class Monitors:
    """The monitors attached to one optimizer (what :func:`monitor` returns).

    ``values()`` (or ``monitors["noise_scale"]``) reads the latest values, the same on every worker;
    ``print_every=k`` prints them on worker 0 every ``k`` steps; ``tensorboard=DIR`` writes them as
    TensorBoard scalars ``gradsync/<name>`` from worker 0 (needs ``pip install tensorboard``).
    """

    def __init__(self, monitors: list[Monitor], print_every: int = 0, tensorboard: str | None = None):
        self.monitors = monitors
        self.print_every = print_every
        self.step = 0
        self.writer = None
        if tensorboard and self.leader:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError("tensorboard=... needs the tensorboard package: pip install tensorboard "
                                  "(or gradsync[tensorboard])") from exc
            self.writer = SummaryWriter(tensorboard)

    @property
    def leader(self) -> bool:
        """Worker 0 now (an elastic job renumbers its workers; TensorBoard stays where it was opened)."""
        return runtime.is_initialized() and runtime.current().topology.rank == 0

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self.monitors:
            out.update(m.values())
        return out

    def __getitem__(self, name: str) -> float:
        return self.values()[name]

    def __iter__(self):
        return iter(self.monitors)

    # the hook points, fanned out
    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        for m in self.monitors:
            m.on_local_grad(index, grad)

    def on_synced(self) -> None:
        for m in self.monitors:
            m.on_synced()

    def after_step(self) -> None:
        for m in self.monitors:
            m.after_step()
            m.step += 1  # what ``Monitor.active`` counts
        self.step += 1
        printing = bool(self.print_every) and self.step % self.print_every == 0 and self.leader
        if not printing and self.writer is None:
            return
        values = self.values()
        if printing:
            print(f"gradsync step {self.step}: " + "  ".join(f"{k}={v:.4g}" for k, v in values.items()), flush=True)
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(f"gradsync/{k}", v, self.step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def monitor(optimizer, *monitors: Monitor, every: int = 1, print_every: int = 0,
            tensorboard: str | None = None) -> Monitors:
    """Attach ``monitors`` to an optimizer returned by :func:`gradsync.distribute`.

    ``every``: monitor every ``every``-th step only (the other steps cost nothing). Collective in
    effect: every worker must attach the same monitors, since they reduce over all workers.
    Replaces monitors attached before. Returns the :class:`Monitors`; ``optimizer.monitors`` too.
    """
    sync = getattr(optimizer, "_gradsync", None)
    if sync is None:
        raise ConfigError("gradsync.adapt.monitor needs an optimizer returned by gradsync.distribute")
    if every < 1:
        raise ConfigError(f"every must be >= 1, got {every}")
    strategy = sync.strategy
    for m in monitors:
        if not isinstance(m, Monitor):
            raise ConfigError(f"{m!r} is not a gradsync.adapt.Monitor")
        if m.needs_mean_grads and not strategy.mean_grads_at_apply:
            raise ConfigError(
                f"{type(m).__name__} reads the synchronized gradient on every worker, which strategy "
                f"{strategy.name!r} does not produce (it updates parameters on servers or per slice); "
                "use allreduce, ddp, casync-ring, casync-ps or compressed-allgather")
        m.attach(sync.params, sync.names, every)
    group = Monitors(list(monitors), print_every, tensorboard)
    sync.set_observer(group)
    return group
