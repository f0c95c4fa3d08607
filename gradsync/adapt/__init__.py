"""Adaptive training (KungFu, Mai et al., OSDI 2020): monitors, policies, elastic resizing.

- :mod:`gradsync.adapt.monitor`: gradient noise scale, gradient variance, throughput, link rates;
- :mod:`gradsync.adapt.policy`: the policy hooks and their :class:`Controller`;
- :mod:`gradsync.adapt.builtin`: the built-in policies;
- :mod:`gradsync.adapt.data`: sharding that stays exact when the batch or the worker count changes;
- :mod:`gradsync.adapt.elastic`: growing and shrinking a running job (``gradsync run --elastic``).

The model-averaging strategies (``sma``, ``pair-averaging``) are strategies like any other, in
:mod:`gradsync.strategies`.

Importing the package does not import torch: its public names load their module on first use
(PEP 562), so ``gradsync run``, which reads :mod:`gradsync.adapt.durable`'s checkpoints, imports
no torch.
"""
import sys
import types
from importlib import import_module

# Public name -> the module that defines it (each of these imports torch).
_LAZY = {
    **{name: "gradsync.adapt.builtin" for name in ("AdaptiveBatchSize", "ScheduledResize", "StrategySwitch")},
    "GlobalBatches": "gradsync.adapt.data",
    **{name: "gradsync.adapt.monitor" for name in ("EMA", "GradientVariance", "Monitor", "Monitors", "NoiseScale",
                                                   "Throughput", "links", "monitor")},
    **{name: "gradsync.adapt.policy" for name in ("Controller", "Policy")},
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gradsync.adapt' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """``monitor`` is a public function and also a submodule. Importing the submodule makes Python
    set it as a package attribute, which would hide the function (``from gradsync.adapt import
    monitor`` would give the module once anything imported ``gradsync.adapt.monitor``). Keep the
    function; the module stays importable by its full name."""

    def __setattr__(self, name: str, value) -> None:
        if name == "monitor" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
