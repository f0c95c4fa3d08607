"""BERT-base: Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding" (NAACL 2019), trained with its own pre-training objective on synthetic text.

Encoder: word (30,522), position (512) and segment (2) embeddings summed and layer-normalised, then
12 post-norm Transformer layers (hidden 768, 12 heads, feed-forward 3072, GELU, LayerNorm eps 1e-12)
and the tanh pooler over the first token: 109,482,240 parameters (:meth:`Bert.encoder_param_count`).

Objective (the paper's, section 3.1): masked-LM plus next-sentence prediction. The masked-LM head
(dense 768 + GELU + LayerNorm, then a projection onto the vocabulary) reuses the word-embedding
matrix as its projection, so the model has tied weights whose gradient sums two uses; the
next-sentence head is a linear layer on the pooler, which is what gives the pooler a gradient.
Heads add 622,650 + 1,538 parameters: 110,106,428 in all at full size.

Synthetic batch: uniform random tokens, the first half of each sequence segment A and the rest B;
15% of positions (at least one) replaced by the [MASK] id and predicted; a random
next-sentence label. The target packs both labels into one ``(batch, seq_len + 1)`` tensor: columns
``[:seq_len]`` are the masked-LM labels (-100 where nothing is predicted), the last column the
next-sentence label.

Sizes:
  full: BERT-base, sequences of 128 tokens (pre-training phase 1).
  tiny: BERT-tiny's shape (Turc et al. 2019: 2 layers, hidden 128, 2 heads, feed-forward 512), a
        vocabulary of 2,000, 128 positions, sequences of 32 tokens: 685,952 parameters in the
        encoder and pooler, 704,978 in all.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.errors import ConfigError
from gradsync.models.spec import ModelSpec
from gradsync.models.layers import TransformerLayer, resolve_options

MASK_ID = 103  # [MASK] in the uncased BERT vocabulary
MASK_FRACTION = 0.15
IGNORE = -100  # cross_entropy's default ignore_index
_DEFAULTS = {"full": {"seq_len": 128}, "tiny": {"seq_len": 32}}
_SHAPE = {
    "full": dict(vocab_size=30522, dim=768, layers=12, heads=12, ffn_dim=3072, max_positions=512),
    "tiny": dict(vocab_size=2000, dim=128, layers=2, heads=2, ffn_dim=512, max_positions=128),
}


class PretrainingHeads(nn.Module):
    """Masked-LM head (projection tied to the word embeddings) and next-sentence head."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__()
        self.transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim, eps=1e-12))
        self.vocab_bias = nn.Parameter(torch.zeros(vocab_size))
        self.next_sentence = nn.Linear(dim, 2)

    def forward(self, hidden: torch.Tensor, pooled: torch.Tensor, word_embeddings: torch.Tensor):
        token_logits = F.linear(self.transform(hidden), word_embeddings, self.vocab_bias)
        return token_logits, self.next_sentence(pooled)


class Bert(nn.Module):
    """BERT encoder + pooler + pre-training heads; ``forward`` returns ``(token_logits, pair_logits)``."""

    def __init__(
        self, *, vocab_size: int, dim: int, layers: int, heads: int, ffn_dim: int, max_positions: int
    ):
        super().__init__()
        self.words = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_positions, dim)
        self.segments = nn.Embedding(2, dim)
        self.embedding_norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(
            TransformerLayer(dim, heads, ffn_dim, eps=1e-12) for _ in range(layers)
        )
        self.pooler = nn.Linear(dim, dim)
        self.heads = PretrainingHeads(dim, vocab_size)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        embedded = self.words(tokens) + self.positions(positions) + self.segments(segments)
        hidden = self.embedding_norm(embedded)
        for layer in self.layers:
            hidden = layer(hidden)
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        return self.heads(hidden, pooled, self.words.weight)

    def encoder_param_count(self) -> int:
        """Parameters of the encoder and pooler alone: what "BERT-base has 110M parameters" counts."""
        head_only = {id(p) for p in self.heads.parameters()}
        return sum(p.numel() for p in self.parameters() if id(p) not in head_only)


def _init_weights(module: nn.Module) -> None:
    # BERT's N(0, 0.02) initialisation: PyTorch's N(0, 1) embeddings, reused as the output projection,
    # would start the masked-LM loss far above log(vocab_size).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear):
        nn.init.zeros_(module.bias)


def _make_batch(batch_size: int, generator: torch.Generator, seq_len: int, vocab_size: int):
    tokens = torch.randint(vocab_size, (batch_size, seq_len), generator=generator)
    segments = (torch.arange(seq_len) >= seq_len // 2).long().repeat(batch_size, 1)
    # A fixed count per sequence, not a coin flip per token, so that no sequence has nothing to predict.
    count = max(1, round(MASK_FRACTION * seq_len))
    masked = torch.rand(batch_size, seq_len, generator=generator).argsort(dim=1)[:, :count]
    labels = torch.full_like(tokens, IGNORE).scatter(1, masked, tokens.gather(1, masked))
    inputs = tokens.scatter(1, masked, MASK_ID)
    is_next = torch.randint(2, (batch_size, 1), generator=generator)
    return (inputs, segments), torch.cat([labels, is_next], dim=1)


def pretraining_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """Masked-LM cross-entropy over the predicted positions plus next-sentence cross-entropy."""
    token_logits, pair_logits = output
    token_loss = F.cross_entropy(
        token_logits.flatten(0, 1), target[:, :-1].flatten(), ignore_index=IGNORE
    )
    return token_loss + F.cross_entropy(pair_logits, target[:, -1])


def spec(size: str, **options) -> ModelSpec:
    """BERT-base (or BERT-tiny's shape) with the pre-training objective; option: ``seq_len``."""
    opts = resolve_options("bert-base", size, options, _DEFAULTS)
    shape = _SHAPE[size]
    if opts["seq_len"] > shape["max_positions"]:
        limit = shape["max_positions"]
        raise ConfigError(f"seq_len {opts['seq_len']} exceeds the {limit} learned positions")
    return ModelSpec(
        "bert-base",
        size,
        lambda: Bert(**shape),
        functools.partial(_make_batch, seq_len=opts["seq_len"], vocab_size=shape["vocab_size"]),
        pretraining_loss,
        "BERT-base (Devlin et al. 2019), tied masked-LM head plus next-sentence head",
        opts,
    )
