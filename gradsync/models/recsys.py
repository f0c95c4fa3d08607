"""Recommendation model: DLRM (Naumov et al., "Deep Learning Recommendation Model for
Personalization and Recommendation Systems", 2019), its Criteo Kaggle configuration.

Thirteen dense features go through a bottom MLP (13-512-256-64-16); each of 26 categorical features
reads one row of its own embedding table (width 16); the pairwise dot products of the 27 vectors,
next to the bottom MLP's output, feed a top MLP (512-256-1) and a logistic loss. The tables hold
more than 99.9 % of the parameters and a batch reads at most ``batch`` rows of each: the other
workload (with language models) that sparse synchronisation is for.

Table sizes are the category counts of the Criteo Kaggle Display Advertising data as DLRM's
preprocessing reports them (33.8 million rows in all). Category ids are drawn from a Zipf law per
table (p(k) proportional to 1 / (k + 1)^ZIPF_EXPONENT), so a few ids are hot and most are rare, as in
click logs; the label is a fixed function of the dense features (what it is does not matter here).

Sizes:
  full: the Kaggle table sizes (33,762,577 rows), width 16: 540,677,217 parameters, 540,201,232 of
    them in the tables.
  cpu: every table capped at 1,000,000 rows (5,569,296 rows): 89,584,721 parameters (358 MB).
  tiny: tables capped at 1,000 rows, width 8, MLPs 13-32-8 and 32-1: 146,081 parameters.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from gradsync.models.spec import ModelSpec
from gradsync.models.layers import resolve_options

KAGGLE_TABLES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
ZIPF_EXPONENT = 1.05
DENSE_FEATURES = 13
_SHAPE = {
    "full": dict(cap=None, dim=16, bottom=(512, 256, 64), top=(512, 256)),
    "cpu": dict(cap=1_000_000, dim=16, bottom=(512, 256, 64), top=(512, 256)),
    "tiny": dict(cap=1_000, dim=8, bottom=(32,), top=(32,)),
}
_DEFAULTS = {size: {"sparse": False} for size in _SHAPE}


def _mlp(widths: list[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if k < len(widths) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP on dense features, one embedding table per categorical feature, dot interaction, top MLP."""

    def __init__(self, *, rows: tuple[int, ...], dim: int, bottom: tuple[int, ...], top: tuple[int, ...],
                 sparse: bool = False):
        super().__init__()
        self.bottom = _mlp([DENSE_FEATURES, *bottom, dim], last_activation=True)
        self.tables = nn.ModuleList(nn.Embedding(n, dim, sparse=sparse) for n in rows)
        for table in self.tables:
            nn.init.uniform_(table.weight, -table.num_embeddings ** -0.5, table.num_embeddings ** -0.5)
        vectors = len(rows) + 1
        self.top = _mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_activation=False)
        self.register_buffer("pairs", torch.triu_indices(vectors, vectors, offset=1), persistent=False)

    def forward(self, dense: torch.Tensor, categories: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x] + [table(categories[:, k]) for k, table in enumerate(self.tables)], dim=1)
        dots = vectors @ vectors.transpose(1, 2)
        return self.top(torch.cat([x, dots[:, self.pairs[0], self.pairs[1]]], dim=1)).squeeze(1)


@functools.lru_cache(maxsize=64)
def _zipf_cdf(rows: int, exponent: float) -> torch.Tensor:
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-exponent)
    cdf = weights.cumsum(0)
    return cdf / cdf[-1]


def zipf_ids(count: int, rows: int, generator: torch.Generator, exponent: float = ZIPF_EXPONENT) -> torch.Tensor:
    """``count`` ids in ``[0, rows)`` with p(k) proportional to ``1 / (k + 1)^exponent`` (inverse CDF)."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    return torch.searchsorted(_zipf_cdf(rows, exponent), u).clamp_(max=rows - 1)


def table_rows(size: str) -> tuple[int, ...]:
    cap = _SHAPE[size]["cap"]
    return KAGGLE_TABLES if cap is None else tuple(min(n, cap) for n in KAGGLE_TABLES)


def _make_batch(batch_size: int, generator: torch.Generator, rows: tuple[int, ...]):
    dense = torch.randn(batch_size, DENSE_FEATURES, generator=generator)
    categories = torch.stack([zipf_ids(batch_size, n, generator) for n in rows], dim=1)
    label = (dense[:, 0] + 0.5 * dense[:, 1] > 0).float()
    return (dense, categories), label


def spec(size: str, **options) -> ModelSpec:
    """DLRM at ``size``; option ``sparse`` (the tables produce sparse gradients)."""
    opts = resolve_options("recsys", size, options, _DEFAULTS)
    shape, rows = _SHAPE[size], table_rows(size)
    lookups = {f"tables.{k}": (lambda inputs, k=k: inputs[1][:, k]) for k in range(len(rows))}
    return ModelSpec(
        "recsys",
        size,
        lambda: DLRM(rows=rows, dim=shape["dim"], bottom=shape["bottom"], top=shape["top"], sparse=opts["sparse"]),
        functools.partial(_make_batch, rows=rows),
        nn.functional.binary_cross_entropy_with_logits,
        f"DLRM (Naumov et al. 2019), Criteo Kaggle configuration, {sum(rows):,} embedding rows",
        opts,
        lookups,
    )
