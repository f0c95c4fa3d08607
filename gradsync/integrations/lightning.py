"""PyTorch Lightning: ``Trainer(strategy=GradsyncStrategy("p3"))`` trains with any gradsync strategy.

    import lightning as L  # or: import pytorch_lightning as pl
    from gradsync.integrations.lightning import GradsyncStrategy
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=GradsyncStrategy("p3", options={"slice_params": 50_000}))

Lightning ships as two packages whose Trainers each take only their own strategies: ``lightning``
(``lightning.pytorch``) and ``pytorch_lightning``. ``GradsyncStrategy`` is built on the one the
program has imported (on ``lightning`` when it has imported both or neither and it is installed);
``strategy_class("lightning.pytorch")`` or ``strategy_class("pytorch_lightning")`` names it.

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

Install with ``pip install gradsync[lightning]`` (``lightning``), or beside ``pytorch-lightning``.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
from contextlib import contextmanager
from typing import Any

import gradsync
from gradsync.errors import ConfigError
from gradsync.strategies import Strategy, resolve

PACKAGES = ("lightning.pytorch", "pytorch_lightning")  # ``import lightning``'s Trainer, the standalone one's
_NAMES = {"lightning.pytorch": "GradsyncStrategyLightning", "pytorch_lightning": "GradsyncStrategyPL"}
_classes: dict[str, type] = {}


def strategy_class(package: str | None = None) -> type:
    """``GradsyncStrategy`` for the Trainer of ``package`` (one of :data:`PACKAGES`; None: the one
    this program imported, else the first installed)."""
    if package is None:
        loaded = [p for p in PACKAGES if p in sys.modules]
        installed = [p for p in loaded or PACKAGES if importlib.util.find_spec(p.split(".")[0]) is not None]
        if not installed:
            raise ImportError("gradsync.integrations.lightning needs Lightning: pip install 'gradsync[lightning]' "
                              "(or pytorch-lightning>=2.4)")
        package = installed[0] if len(loaded) != 1 else loaded[0]
    if package not in _NAMES:
        raise ConfigError(f"no Lightning package {package!r}; one of {', '.join(PACKAGES)}")
    if package not in _classes:
        _classes[package] = _make(package)
    return _classes[package]


def __getattr__(name: str):
    if name == "GradsyncStrategy":
        return strategy_class()
    for package, class_name in _NAMES.items():  # how pickle finds a strategy's class again
        if name == class_name:
            return strategy_class(package)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make(package: str) -> type:
    DDPStrategy = importlib.import_module(f"{package}.strategies").DDPStrategy
    _ForwardRedirection = importlib.import_module(f"{package}.strategies.strategy")._ForwardRedirection

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

    GradsyncStrategy.__name__ = GradsyncStrategy.__qualname__ = _NAMES[package]
    GradsyncStrategy.__module__ = __name__
    return GradsyncStrategy
