"""A small model that exercises every awkward case of gradient synchronization.

- tied weights: the output projection reuses the embedding matrix (one parameter, two uses);
- a frozen layer (``requires_grad=False``) that must be neither synchronized nor updated;
- a head that is never used, so its gradient stays ``None`` on every rank;
- a branch used only when a batch's first token is even, so in one step some ranks use it and
  others do not (DDP needs ``find_unused_parameters=True`` for this model);
- BatchNorm, whose statistics depend on each worker's own batch.
About 4,500 parameters: a correctness fixture, not a benchmark.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gradsync.errors import ConfigError
from gradsync.models.spec import ModelSpec


class Toy(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, seq_len: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        # The Tanh before BatchNorm matters: a bias feeding BatchNorm directly has a gradient that is
        # zero in exact arithmetic, and Adam turns the fp32 rounding noise of its sum into lr-sized
        # steps of random sign, so no two summation orders would agree.
        self.body = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, dim), nn.Tanh())
        self.norm = nn.BatchNorm1d(dim)
        self.branch = nn.Linear(dim, dim)
        self.never = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.body(self.frozen(self.embed(tokens).mean(1))))
        if int(tokens[0, 0]) % 2 == 0:  # data-dependent: differs between ranks within a step
            h = h + self.branch(h)
        return self.out(h)


def spec(size: str = "full", **options) -> ModelSpec:
    vocab, seq_len = 50, 8
    if size not in ("full", "tiny"):
        raise ConfigError(f"unknown size {size!r} for model 'toy'; valid sizes: full, tiny (the same model)")
    if options:
        raise ConfigError(f"the toy model takes no options, got {sorted(options)}")

    def make_batch(batch_size: int, g: torch.Generator):
        tokens = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        return (tokens,), torch.randint(0, vocab, (batch_size,), generator=g)

    return ModelSpec("toy", size, lambda: Toy(vocab, seq_len=seq_len), make_batch, F.cross_entropy,
                     description="correctness fixture: tied, frozen, unused and sometimes-used parameters",
                     options={"strategy_options": {"ddp": {"find_unused_parameters": True}}})
