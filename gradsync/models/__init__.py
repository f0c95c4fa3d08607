"""Model zoo for benchmarks: hand-written, no torchvision dependency.

Every model is registered in :func:`_registry` under its public name and built at a *size*:
``full`` (the published architecture and parameter count) or ``tiny`` (reduced width/depth
and input size, for CPU runs). ``get_model("resnet50:tiny")`` returns a :class:`ModelSpec`
that knows how to build the module, make a deterministic synthetic batch and compute the loss.

Adding a model is one line in :func:`_registry` plus a module with a ``spec(size, **options)``
function.
"""
from __future__ import annotations

from typing import Any, Callable

from gradsync.errors import ConfigError
from gradsync.models.spec import SIZES, ModelSpec

__all__ = ["ModelSpec", "SIZES", "get_model", "model_names"]


def _registry() -> dict[str, Callable[..., ModelSpec]]:
    from gradsync.models import bert, inception, lstm, mobilenet, recsys, resnet, sockeye, transformer, vgg, toy

    return {
        "resnet50": resnet.spec,
        "resnet101": resnet.spec_101,
        "vgg19": vgg.spec,
        "vgg16": vgg.spec_16,
        "inception_v3": inception.spec,
        "mobilenet_v2": mobilenet.spec,
        "transformer-nmt": transformer.spec,
        "bert-base": bert.spec,
        "lstm-lm": lstm.spec,
        "sockeye-rnn": sockeye.spec,
        "recsys": recsys.spec,
        "toy": toy.spec,
    }


def model_names() -> list[str]:
    return sorted(_registry())


def get_model(name: str, **options: Any) -> ModelSpec:
    """Resolve ``NAME`` or ``NAME:SIZE`` (size defaults to ``full``), or your own
    ``package.module:function`` (:mod:`gradsync.models.user`), to a :class:`ModelSpec`."""
    base, _, size = name.partition(":")
    size = size or "full"
    registry = _registry()
    if base not in registry:
        from gradsync.models import user

        if user.is_user_model(name) and size not in SIZES:
            if options:
                raise ConfigError(f"model {name!r}: your own models take no options")
            return user.load(name)
        raise ConfigError(f"unknown model {base!r}; valid models: {', '.join(sorted(registry))}, or "
                         "package.module:function for your own (see gradsync.models.user)")
    return registry[base](size, **options)  # each model checks its own sizes
