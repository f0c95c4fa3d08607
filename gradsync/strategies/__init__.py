"""Synchronization strategies and their registry.

A strategy is one module with one job: how gradients or parameters move between ranks (see
:mod:`gradsync.strategies.base` for the hook points). Each class is named for what it does; its
registered name is the short form users pass as ``strategy=``:

============================  =================================================================
``allreduce``                 :class:`AllReduce`
``allreduce-priority``        :class:`PriorityAllReduce` (ByteScheduler)
``ps``                        :class:`ParameterServer`
``ps-async``                  :class:`AsyncParameterServer`
``ddp``                       :class:`TorchDDP` (PyTorch's ``DistributedDataParallel``)
``p3``                        :class:`P3`
``ps-sliced``                 :class:`SlicedParameterServer` (P3's slicing alone)
``casync-ring``               :class:`CaSyncRing`
``casync-ps``                 :class:`CaSyncPS`
``compressed-allgather``      :class:`CompressedAllGather`
``sma``                       :class:`ModelAveraging` (synchronous model averaging)
``pair-averaging``            :class:`PairAveraging`
``hybrid``                    :class:`SparseHybrid` (Parallax)
``diloco``                    :class:`DiLoCo` (outer steps every ``H``, streamed in fragments)
``local-sgd``                 :class:`LocalSGD` (parameters averaged every ``H`` steps)
============================  =================================================================

:data:`STRATEGIES` maps each name to a constructor; adding one is one line, and users add their
own with :func:`register` (also ``gradsync.register``). :func:`names` lists them.
"""
from __future__ import annotations

from typing import Any, Callable

from gradsync._lazy import lazy_names
from gradsync.errors import ConfigError, options_error
from gradsync.strategies.allreduce import AllReduce
from gradsync.strategies.allreduce_priority import PriorityAllReduce
from gradsync.strategies.base import Strategy, SyncContext
from gradsync.strategies.casync_ps import CaSyncPS
from gradsync.strategies.casync_ring import CaSyncRing
from gradsync.strategies.compressed_allgather import CompressedAllGather
from gradsync.strategies.ddp import TorchDDP
from gradsync.strategies.diloco import DiLoCo, LocalSGD
from gradsync.strategies.hybrid import SparseHybrid
from gradsync.strategies.p3 import P3, SlicedParameterServer
from gradsync.strategies.pair_averaging import PairAveraging
from gradsync.strategies.ps import AsyncParameterServer, ParameterServer
from gradsync.strategies.sma import ModelAveraging

STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "allreduce": AllReduce,
    "allreduce-priority": PriorityAllReduce,
    "ps": ParameterServer,
    "ps-async": AsyncParameterServer,
    "ddp": TorchDDP,
    "p3": P3,
    "ps-sliced": SlicedParameterServer,
    "casync-ring": CaSyncRing,
    "casync-ps": CaSyncPS,
    "compressed-allgather": CompressedAllGather,
    "sma": ModelAveraging,
    "pair-averaging": PairAveraging,
    "hybrid": SparseHybrid,
    "diloco": DiLoCo,
    "local-sgd": LocalSGD,
}


def register(name: str, constructor: Callable[..., Strategy]) -> None:
    """Make ``constructor`` available as ``strategy=name`` everywhere (API, bench, CLI)."""
    STRATEGIES[name] = constructor


def names() -> list[str]:
    """The registered names, sorted."""
    return sorted(STRATEGIES)


def resolve(strategy: str | Strategy, **options: Any) -> Strategy:
    """A strategy object from an object (returned as is) or a registered name plus options."""
    if isinstance(strategy, Strategy):
        if options:
            raise ConfigError("pass options to the strategy's constructor, not next to a strategy object")
        return strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; valid strategies: {', '.join(names())}")
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


# Old spellings -> the new ones; reading an old one warns (DeprecationWarning) and returns the new.
lazy_names(__name__, {}, renamed={"DDP": "gradsync.strategies.TorchDDP", "SMA": "gradsync.strategies.ModelAveraging",
                                  "Hybrid": "gradsync.strategies.SparseHybrid",
                                  "strategy_names": "gradsync.strategies.names"})

__all__ = ["STRATEGIES", "AllReduce", "AsyncParameterServer", "CaSyncPS", "CaSyncRing", "CompressedAllGather",
           "DiLoCo", "LocalSGD", "ModelAveraging", "P3", "PairAveraging", "ParameterServer", "PriorityAllReduce", "SlicedParameterServer",
           "SparseHybrid", "Strategy", "SyncContext", "TorchDDP", "names", "register", "resolve"]
