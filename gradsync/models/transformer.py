"""Transformer-base for translation: Vaswani et al., "Attention Is All You Need" (NeurIPS 2017), in
the configuration Sockeye (Hieber et al., 2018) ships for it.

Six encoder and six decoder layers, d_model 512, 8 heads, feed-forward 2048 with ReLU, sinusoidal
positions added to embeddings scaled by sqrt(d_model). As in Sockeye the layers are pre-norm, with a
final LayerNorm after each stack, and one 32,000-entry joint-BPE vocabulary is shared: the source
embedding, the target embedding and the output projection are the same matrix (three-way tying),
and the output projection keeps its own bias. Every other projection has a bias too, as in
Vaswani et al.

Parameter count at full size (the tied matrix counted once): 60,556,544 =
  embeddings 32,000 x 512 = 16,384,000, plus output bias 32,000;
  encoder 6 x 3,152,384 + final LayerNorm 1,024 = 18,915,328;
  decoder 6 x 4,204,032 + final LayerNorm 1,024 = 25,225,216.

Synthetic batch: uniform random source and target sentences of ``seq_len`` tokens, no padding; the
decoder is teacher-forced on the target shifted right and scored by cross-entropy on the next token.

Sizes:
  full: transformer-base, vocabulary 32,000, sentences of 32 tokens (about the mean BPE length of
        WMT'14 English-German).
  tiny: 2 + 2 layers, d_model 64, 4 heads, feed-forward 256, vocabulary 2,000, 16 tokens:
        363,728 parameters.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.models.spec import ModelSpec
from gradsync.models.layers import (
    TransformerLayer,
    resolve_options,
    sinusoidal_positions,
    token_cross_entropy,
)

_DEFAULTS = {"full": {"seq_len": 32}, "tiny": {"seq_len": 16}}
_SHAPE = {
    "full": dict(vocab_size=32000, dim=512, layers=6, heads=8, ffn_dim=2048),
    "tiny": dict(vocab_size=2000, dim=64, layers=2, heads=4, ffn_dim=256),
}


class TransformerNMT(nn.Module):
    """Encoder-decoder Transformer; ``forward(source, target_in)`` returns next-token logits."""

    def __init__(self, *, vocab_size: int, dim: int, layers: int, heads: int, ffn_dim: int):
        super().__init__()
        self.dim = dim
        self.embedding = nn.Embedding(vocab_size, dim)
        # std dim^-0.5, so that the sqrt(dim) scaling in embed() gives unit scale, like the positions.
        nn.init.normal_(self.embedding.weight, std=dim**-0.5)
        self.encoder = nn.ModuleList(self._layer(dim, heads, ffn_dim, False) for _ in range(layers))
        self.decoder = nn.ModuleList(self._layer(dim, heads, ffn_dim, True) for _ in range(layers))
        self.encoder_norm = nn.LayerNorm(dim)
        self.decoder_norm = nn.LayerNorm(dim)
        self.output_bias = nn.Parameter(torch.zeros(vocab_size))

    @staticmethod
    def _layer(dim: int, heads: int, ffn_dim: int, cross: bool) -> TransformerLayer:
        return TransformerLayer(
            dim, heads, ffn_dim, cross_attention=cross, norm_first=True, activation=nn.ReLU
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        scaled = self.embedding(tokens) * self.dim**0.5
        return scaled + sinusoidal_positions(tokens.shape[1], self.dim, scaled.device)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        memory = self.embed(source)
        for layer in self.encoder:
            memory = layer(memory)
        memory = self.encoder_norm(memory)
        hidden = self.embed(target_in)
        for layer in self.decoder:
            hidden = layer(hidden, memory, causal=True)
        return F.linear(self.decoder_norm(hidden), self.embedding.weight, self.output_bias)


def _make_batch(batch_size: int, generator: torch.Generator, seq_len: int, vocab_size: int):
    source = torch.randint(vocab_size, (batch_size, seq_len), generator=generator)
    target = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator)
    return (source, target[:, :-1]), target[:, 1:]


def spec(size: str, **options) -> ModelSpec:
    """Transformer-base translation model at ``size``; option: ``seq_len``."""
    opts = resolve_options("transformer-nmt", size, options, _DEFAULTS)
    shape = _SHAPE[size]
    return ModelSpec(
        "transformer-nmt",
        size,
        lambda: TransformerNMT(**shape),
        functools.partial(_make_batch, seq_len=opts["seq_len"], vocab_size=shape["vocab_size"]),
        token_cross_entropy,
        "Transformer-base translation (Vaswani et al. 2017), Sockeye-style, tied 32k vocabulary",
        opts,
    )
