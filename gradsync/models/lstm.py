"""Big LSTM language model: Jozefowicz et al., "Exploring the Limits of Language Modeling" (2016),
the "BIG LSTM-2048-512" shape on the One Billion Word benchmark (LM1B).

A 793,471-word embedding table of width 512, one LSTM layer of 2048 cells whose output is projected
to 512 (``nn.LSTM(proj_size=512)``, the LSTMP of Sak et al. 2014), and an untied softmax over the
whole vocabulary. The two vocabulary-sized matrices hold 99% of the parameters. A batch of
32 x 20 tokens reads fewer than 640 rows of the embedding table, so its gradient is almost all
zeros: the case that sparse synchronisation is for. With ``sparse=True`` the embedding produces
sparse gradients (``nn.Embedding(sparse=True)``). The softmax is computed over the full
vocabulary (the paper sampled 8,192 classes), so its gradient is dense and the output logits are
``batch x seq_len x 793,471``.

Parameter count at full size: 822,761,343 =
  embedding 793,471 x 512 = 406,257,152;
  LSTM 4 x 2048 x (512 + 512) + 2 x 4 x 2048 biases + 2048 x 512 projection = 9,453,568;
  softmax 512 x 793,471 + 793,471 bias = 407,050,623.

Synthetic batch: token ids are frequency ranks drawn from a Zipf law (p(k) proportional to
1 / (k + 1)^ZIPF_EXPONENT), like word frequencies in LM1B, so the rows a batch touches resemble a real
batch's; the target is the input shifted by one token.

Sizes:
  full: the paper's model, 20-token sequences (its unroll length).
  tiny: vocabulary 2,000, embedding 64, 256 cells projected to 64, 20 tokens: 407,504 parameters.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from gradsync.models import ModelSpec
from gradsync.models.layers import resolve_options, token_cross_entropy

ZIPF_EXPONENT = 1.0
_DEFAULTS = {"full": {"seq_len": 20, "sparse": False}, "tiny": {"seq_len": 20, "sparse": False}}
_SHAPE = {
    "full": dict(vocab_size=793_471, embed_dim=512, hidden=2048),
    "tiny": dict(vocab_size=2000, embed_dim=64, hidden=256),
}


class LSTMLanguageModel(nn.Module):
    """Embedding -> LSTM with output projection back to ``embed_dim`` -> softmax over the vocabulary."""

    def __init__(self, *, vocab_size: int, embed_dim: int, hidden: int, sparse: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, sparse=sparse)
        self.lstm = nn.LSTM(embed_dim, hidden, proj_size=embed_dim, batch_first=True)
        self.softmax = nn.Linear(embed_dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.embedding(tokens))
        return self.softmax(outputs)


def zipf_tokens(shape: tuple[int, ...], vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids drawn with probability proportional to ``1 / (id + 1)^ZIPF_EXPONENT``."""
    weights = torch.arange(1, vocab_size + 1, dtype=torch.float64).pow(-ZIPF_EXPONENT)
    count = torch.Size(shape).numel()
    return torch.multinomial(weights, count, replacement=True, generator=generator).view(shape)


def _make_batch(batch_size: int, generator: torch.Generator, seq_len: int, vocab_size: int):
    tokens = zipf_tokens((batch_size, seq_len + 1), vocab_size, generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def spec(size: str, **options) -> ModelSpec:
    """Big LSTM language model at ``size``; options: ``seq_len``, ``sparse`` (sparse embedding grads)."""
    opts = resolve_options("lstm-lm", size, options, _DEFAULTS)
    shape = _SHAPE[size]
    return ModelSpec(
        "lstm-lm",
        size,
        lambda: LSTMLanguageModel(sparse=opts["sparse"], **shape),
        functools.partial(_make_batch, seq_len=opts["seq_len"], vocab_size=shape["vocab_size"]),
        token_cross_entropy,
        "Big LSTM-2048-512 language model (Jozefowicz et al. 2016), 793k-word untied vocabulary",
        opts,
    )
