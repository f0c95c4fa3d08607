"""Adaptive training (KungFu, Mai et al., OSDI 2020): monitors, policies, elastic resizing.

- :mod:`gradsync.adapt.monitor`: gradient noise scale, gradient variance, throughput, link rates;
- :mod:`gradsync.adapt.policy`: the policy hooks and their :class:`Controller`;
- :mod:`gradsync.adapt.builtin`: the built-in policies;
- :mod:`gradsync.adapt.data`: sharding that stays exact when the batch or the worker count changes;
- :mod:`gradsync.adapt.elastic`: growing and shrinking a running job (``gradsync run --elastic``).

The model-averaging strategies (``sma``, ``pair-averaging``) are strategies like any other, in
:mod:`gradsync.strategies`.
"""
from gradsync.adapt.builtin import AdaptiveBatchSize, ScheduledResize, StrategySwitch
from gradsync.adapt.data import GlobalBatches
from gradsync.adapt.monitor import EMA, GradientVariance, Monitor, Monitors, NoiseScale, Throughput, links, monitor
from gradsync.adapt.policy import Controller, Policy

__all__ = ["AdaptiveBatchSize", "Controller", "EMA", "GlobalBatches", "GradientVariance", "Monitor", "Monitors",
           "NoiseScale", "Policy", "ScheduledResize", "StrategySwitch", "Throughput", "links", "monitor"]
