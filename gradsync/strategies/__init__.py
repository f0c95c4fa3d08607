"""Synchronization strategies and their registry.

A strategy is one module with one job: how gradients or parameters move between ranks (see
:mod:`gradsync.strategies.base` for the hook points). :data:`STRATEGIES` maps a public name to a
constructor; adding one is one line, and users may register their own with :func:`register`.
"""
from __future__ import annotations

from typing import Any, Callable

from gradsync.errors import ConfigError, options_error
from gradsync.strategies.allreduce import AllReduce
from gradsync.strategies.allreduce_priority import PriorityAllReduce
from gradsync.strategies.base import Strategy, SyncContext
from gradsync.strategies.casync_ps import CaSyncPS
from gradsync.strategies.casync_ring import CaSyncRing
from gradsync.strategies.compressed_allgather import CompressedAllGather
from gradsync.strategies.ddp import DDP
from gradsync.strategies.hybrid import Hybrid
from gradsync.strategies.p3 import P3, SlicedParameterServer
from gradsync.strategies.pair_averaging import PairAveraging
from gradsync.strategies.ps import AsyncParameterServer, ParameterServer
from gradsync.strategies.sma import SMA

STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "allreduce": AllReduce,
    "allreduce-priority": PriorityAllReduce,
    "ps": ParameterServer,
    "ps-async": AsyncParameterServer,
    "ddp": DDP,
    "p3": P3,
    "ps-sliced": SlicedParameterServer,
    "casync-ring": CaSyncRing,
    "casync-ps": CaSyncPS,
    "compressed-allgather": CompressedAllGather,
    "sma": SMA,
    "pair-averaging": PairAveraging,
    "hybrid": Hybrid,
}


def register(name: str, constructor: Callable[..., Strategy]) -> None:
    """Make ``constructor`` available as ``strategy=name`` everywhere (API, bench, CLI)."""
    STRATEGIES[name] = constructor


def strategy_names() -> list[str]:
    return sorted(STRATEGIES)


def resolve(strategy: str | Strategy, **options: Any) -> Strategy:
    """A strategy object from an object (returned as is) or a registered name plus options."""
    if isinstance(strategy, Strategy):
        if options:
            raise ConfigError("pass options to the strategy's constructor, not next to a strategy object")
        return strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; valid strategies: {', '.join(strategy_names())}")
    constructor = STRATEGIES[strategy]
    fixed = getattr(constructor, "keywords", {})  # a registered functools.partial: not to be undone
    for key, value in options.items():
        if key in fixed and value != fixed[key]:
            raise ConfigError(f"strategy {strategy!r} is {constructor.func.__name__} with {key}={fixed[key]!r}; "
                              f"{key}={value!r} is another strategy (gradsync strategies lists them)")
    try:
        made = constructor(**options)
    except TypeError as exc:
        raise options_error("strategy", strategy, constructor, options, exc) from None
    made.name = strategy  # the name it was asked by (a registered alias, not its class's), which errors quote
    return made


__all__ = ["STRATEGIES", "AllReduce", "CaSyncPS", "CaSyncRing", "CompressedAllGather", "DDP", "Hybrid", "P3", "PairAveraging", "ParameterServer", "SMA", "PriorityAllReduce", "Strategy", "SyncContext",
           "register", "resolve", "strategy_names"]
