"""Monitors: what an adaptation policy watches while training runs (KungFu, Mai et al., OSDI 2020).

A monitor sees training through hook points that every strategy calls (:mod:`.base`: the
protocol), and every value it reports is the same on every worker. Built-ins:

- :class:`NoiseScale` (:mod:`.noise`): the gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` of
  McCandlish et al. ("An Empirical Model of Large-Batch Training", 2018, appendix A.1).
- :class:`GradientVariance` (:mod:`.variance`): the variance over workers of each gradient
  coordinate, summed and as a norm; exact, or sampled over a fixed subset of coordinates.
- :class:`Throughput` (:mod:`.throughput`): samples per second and this worker's achieved send rate.
- :class:`Stragglers` (:mod:`.stragglers`): which worker holds the others back and why (compute,
  its code between steps, or its link), from :mod:`gradsync.stragglers`, which runs in every job.

``links(...)`` (:mod:`.throughput`) measures the rate of every link from this worker by timing
point-to-point probes. :func:`monitor` (:mod:`.observer`) attaches monitors to a distributed
optimizer.
"""
from gradsync.adapt.monitors.base import EMA, Monitor
from gradsync.adapt.monitors.noise import NoiseScale
from gradsync.adapt.monitors.observer import Monitors, monitor
from gradsync.adapt.monitors.stragglers import Stragglers
from gradsync.adapt.monitors.throughput import Throughput, links
from gradsync.adapt.monitors.variance import GradientVariance

__all__ = ["EMA", "GradientVariance", "Monitor", "Monitors", "NoiseScale", "Stragglers", "Throughput", "links", "monitor"]
