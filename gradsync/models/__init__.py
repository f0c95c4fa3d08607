"""Model zoo for benchmarks: hand-written, no torchvision dependency.

Every model is registered in :data:`MODELS` under its public name and built at a *size*:
``full`` (the published architecture and parameter count) or ``tiny`` (reduced width/depth
and input size, for CPU runs). ``get_model("resnet50:tiny")`` returns a :class:`ModelSpec`
that knows how to build the module, make a deterministic synthetic batch and compute the loss.

Adding a model is one line in :data:`MODELS` plus a module with a ``spec(size, **options)``
function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

SIZES = ("full", "cpu", "tiny")
"""``full``: the published model; ``tiny``: reduced for CPU runs (every model); ``cpu``: only models
whose point is their size (embedding tables): real row counts at narrow widths. Each model checks
its own sizes and lists them in its error."""


@dataclass
class ModelSpec:
    """A buildable model plus its synthetic data and loss.

    ``make_batch(batch_size, generator)`` must be deterministic given the generator's state,
    return ``(inputs, target)`` where ``inputs`` is a tuple of positional arguments to the
    module's forward, and ``loss(output, target)`` a scalar tensor.
    """

    name: str
    size: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    description: str = ""
    options: dict = field(default_factory=dict)
    lookups: dict[str, Callable[[tuple[torch.Tensor, ...]], torch.Tensor]] = field(default_factory=dict)
    """For each embedding module (by name), the row ids it reads, from the batch's inputs. Emulated
    compute uses it to give embedding tables gradients on exactly those rows."""

    def batch(self, batch_size: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The batch for one (seed) value: same seed, same batch, on every machine."""
        generator = torch.Generator().manual_seed(seed)
        return self.make_batch(batch_size, generator)


def _registry() -> dict[str, Callable[..., ModelSpec]]:
    from gradsync.models import bert, inception, lstm, mobilenet, recsys, resnet, sockeye, transformer, vgg, toy

    return {
        "resnet50": resnet.spec,
        "vgg19": vgg.spec,
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
                raise ValueError(f"model {name!r}: your own models take no options")
            return user.load(name)
        raise ValueError(f"unknown model {base!r}; valid models: {', '.join(sorted(registry))}, or "
                         "package.module:function for your own (see gradsync.models.user)")
    return registry[base](size, **options)  # each model checks its own sizes
