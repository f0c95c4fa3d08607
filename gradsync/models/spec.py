"""What every model of the zoo is: a :class:`ModelSpec` (a module builder, a deterministic batch
maker and a loss) at one of the :data:`SIZES`. Model modules import it from here; the registry in
:mod:`gradsync.models` imports them."""
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
