"""Adaptive training (KungFu, Mai et al., OSDI 2020): monitors, policies, elastic resizing.

- :mod:`gradsync.adapt.monitors`: gradient noise scale, gradient variance, throughput, link rates;
- :mod:`gradsync.adapt.policy`: the policy hooks and their :class:`Controller`;
- :mod:`gradsync.adapt.builtin`: the built-in policies;
- :mod:`gradsync.adapt.data`: sharding that stays exact when the batch, the shares or the worker count change;
- :mod:`gradsync.adapt.elastic`: growing and shrinking a running job (``gradsync run --elastic``).

The model-averaging strategies (``sma``, ``pair-averaging``) are strategies like any other, in
:mod:`gradsync.strategies`.

Importing the package does not import torch: its public names load their module on first use
(PEP 562), so ``gradsync run``, which reads :mod:`gradsync.adapt.durable`'s checkpoints, imports
no torch.
"""
from gradsync._lazy import lazy_names

# Public name -> the module that defines it (each of these imports torch).
_LAZY = {
    **{name: "gradsync.adapt.builtin" for name in ("AdaptiveBatchSize", "BalanceBatches", "ScheduledResize",
                                                   "StopFile", "StrategySwitch", "balanced_shares")},
    "GlobalBatches": "gradsync.adapt.data",
    **{name: "gradsync.adapt.monitors" for name in ("EMA", "GradientVariance", "Monitor", "Monitors", "NoiseScale", "Stragglers",
                                                   "Throughput", "links", "monitor")},
    **{name: "gradsync.adapt.policy" for name in ("Controller", "Policy")},
}

__all__ = sorted(_LAZY)
lazy_names(__name__, _LAZY)
