"""What every model of the zoo is: a :class:`ModelSpec` (a module builder, a deterministic batch
maker and a loss) at one of the :data:`SIZES`. Model modules import it from here; the registry in
:mod:`gradsync.models` imports them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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

    def build_meta(self) -> nn.Module:
        """The module on the meta device: every parameter's shape and dtype, no memory, no
        values. Initializers are skipped (:class:`_NoInitOnMeta`): on meta tensors they compute
        nothing, yet run through PyTorch's Python decompositions, which import ``torch._dynamo``
        (about 2 s of a process's start on a 2-core VM) and take seconds for large tables."""
        with torch.device("meta"), _NoInitOnMeta():
            return self.build()

    def batch(self, batch_size: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The batch for one (seed) value: same seed, same batch, on every machine."""
        generator = torch.Generator().manual_seed(seed)
        return self.make_batch(batch_size, generator)


class _NoInitOnMeta(TorchFunctionMode):
    """Calls of ``torch.nn.init``'s functions, and the in-place random fills they are made of, on
    a meta tensor return the tensor as it is: there is no value to set."""

    FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_,
             torch.Tensor.bernoulli_, torch.Tensor.exponential_, torch.Tensor.random_, torch.Tensor.erfinv_,
             torch.Tensor.clamp_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if ((func in self.FILLS or getattr(func, "__module__", None) == "torch.nn.init")
                and isinstance(target, torch.Tensor) and target.is_meta):
            return target
        return func(*args, **kwargs)
