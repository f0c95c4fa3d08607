"""PyTorch Lightning: ``Trainer(strategy=GradsyncStrategy("p3"))`` trains with any gradsync strategy.

    from gradsync.integrations.lightning import GradsyncStrategy
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=GradsyncStrategy("p3", slice_params=50_000))

It is Lightning's ``DDPStrategy`` (process launching, cluster environments, the process group,
samplers, checkpoint I/O and collectives for logging stay Lightning's) with one change: instead of
wrapping the module in ``DistributedDataParallel``, it hands the module and its optimizer to
:func:`gradsync.distribute`. Lightning's loop then runs unchanged: ``optimizer.step(closure)`` runs
the closure (forward, backward, Lightning's gradient clipping) and then gradsync's step;
``accumulate_grad_batches`` uses the optimizer's ``no_sync``; checkpoints gather spread optimizer
state through ``consolidate_state_dict``.

- ``Trainer(gradient_clip_val=...)`` clips in place after backward: exact under strategies that
  synchronize at the end of backward (``allreduce``, ``ddp``, ``casync-*``); under the others it
  raises :class:`gradsync.GradientEditedError` (pass ``clip_grad_norm=`` here instead, for ``ps``).
- One optimizer per module; every process is a worker (no dedicated servers: co-located ``ps``
  and ``p3`` work).
- ``training_step`` runs through the module's ``__call__`` (Lightning's forward redirection, as
  under ``DDPStrategy``), so gradsync's forward hooks run: P3 waits for a layer's parameters there.
- Not ``"ddp"``: that is Lightning's own ``DDPStrategy``.

Install with ``pip install gradsync[lightning]``.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any

try:
    from pytorch_lightning.strategies import DDPStrategy
    from pytorch_lightning.strategies.strategy import _ForwardRedirection
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("gradsync.integrations.lightning needs PyTorch Lightning: pip install 'gradsync[lightning]' "
                      "(or pytorch-lightning>=2.4)") from exc

import gradsync
from gradsync.errors import ConfigError
from gradsync.strategies import Strategy, resolve


class GradsyncStrategy(DDPStrategy):
    """Lightning's DDP strategy with gradsync's synchronization in place of ``DistributedDataParallel``.

    Args:
        strategy: a gradsync strategy name (``gradsync strategies`` lists them) or object.
        clip_grad_norm: passed to :func:`gradsync.distribute` (clipping where the update happens).
        options: the strategy's options when ``strategy`` is a name (``slice_params=...``).
        **kwargs: Lightning's ``DDPStrategy`` arguments (``accelerator``, ``cluster_environment``,
            ``process_group_backend``, ``timeout``, ``start_method``, ...).
    """

    strategy_name = "gradsync"

    def __init__(self, strategy: str | Strategy = "allreduce", *, clip_grad_norm: float | None = None,
                 options: dict[str, Any] | None = None, **kwargs: Any):
        self._sync = resolve(strategy, **(options or {}))  # a bad name or option fails here
        if self._sync.name == "ddp":
            raise ConfigError("GradsyncStrategy('ddp') would wrap DistributedDataParallel inside Lightning's "
                              "strategy; use Lightning's own Trainer(strategy='ddp')")
        self._clip_grad_norm = clip_grad_norm
        super().__init__(**kwargs)

    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: gradsync takes the module once the optimizers exist."""

    def setup(self, trainer) -> None:
        super().setup(trainer)  # process group, device, optimizers (configure_ddp wraps nothing)
        if not self.optimizers or self.lightning_module is None:
            return  # not fitting (validate, test, predict): nothing to synchronize
        if len(self.optimizers) != 1:
            raise ConfigError(f"GradsyncStrategy synchronizes one optimizer per module; configure_optimizers "
                              f"returned {len(self.optimizers)}")
        topo = gradsync.init()  # adopts Lightning's process group
        if topo.num_servers:
            raise ConfigError("GradsyncStrategy runs every Lightning process as a worker: unset "
                              "GRADSYNC_NUM_SERVERS (ps and p3 serve co-located)")
        fresh = copy.deepcopy(self._sync)  # a strategy object attaches once; each fit gets its own
        self.optimizers = [gradsync.distribute(self.lightning_module, self.optimizers[0], fresh,
                                               clip_grad_norm=self._clip_grad_norm)]

    def training_step(self, *args: Any, **kwargs: Any):
        """Through the module's ``__call__``, so its forward pre-hooks (gradsync's) run first."""
        module = self.lightning_module
        with self.precision_plugin.train_step_context():
            return _ForwardRedirection()(module, module, "training_step", *args, **kwargs)

    @contextmanager
    def block_backward_sync(self):
        """``accumulate_grad_batches``: backward passes before the last one stay local."""
        optimizer = self.optimizers[0] if self.optimizers else None
        if optimizer is None or not hasattr(optimizer, "no_sync"):
            yield None
            return
        with optimizer.no_sync():
            yield None

    def teardown(self) -> None:
        for optimizer in self.optimizers:
            if hasattr(optimizer, "close"):
                optimizer.close()  # finishes what is in flight and removes gradsync's hooks
        super().teardown()
