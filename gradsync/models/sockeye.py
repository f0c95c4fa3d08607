"""Sockeye-style RNN translation model: the third model of the P3 paper (Jayarajan et al., SysML 2019),
which trained Sockeye 1.5's RNN model (Hieber et al., 2017) on IWSLT'15 English-Vietnamese.

The P3 configuration is 2:2 LSTM layers, 512 hidden units and MLP attention. As in Sockeye's RNN
encoder the first encoder layer is bidirectional (256 cells each way, outputs concatenated) and the
second is unidirectional; the decoder is two 512-cell LSTM layers. MLP attention (Bahdanau et al.
2015) scores each source position as ``v . tanh(W_s s_j + W_h h_t)``; the decoder's top state and the
context vector are combined by ``tanh(W_c [h_t; c_t])`` into the hidden state the output layer reads.
Vocabularies are IWSLT'15 en-vi's as released by Luong and Manning (2015): 17,191 English and
7,709 Vietnamese words; embeddings are 512 wide and untied.

One simplification, for speed on CPUs: the decoder does not feed the previous attentional state
back into its input (Luong's "input feeding"), so each LSTM runs over the whole sentence in one
call and attention is computed for all target positions at once. The parameter tensors, their
order in the forward pass and their sizes match the model above apart from the first decoder
layer's input width (512 instead of 1,024), which is what a synchronisation strategy sees.

Parameter count at full size: 25,634,333 =
  source embedding 17,191 x 512 = 8,801,792; target embedding 7,709 x 512 = 3,947,008;
  encoder: bidirectional LSTM 2 x 788,480 = 1,576,960, LSTM 512 -> 512 2,101,248;
  decoder: two LSTMs 512 -> 512, 4,202,496;
  attention: source projection 262,144, query projection 262,656, score vector 512;
  combination 1,024 -> 512 524,800; output layer 512 -> 7,709 3,954,717.
Where do the gradients go: 65 % of the parameters are in the three vocabulary-sized matrices, the
output layer's being the first gradient backward produces and the last weight forward needs.

Synthetic batch: uniform random source and target sentences of ``seq_len`` tokens, no padding; the
decoder is teacher-forced on the target shifted right.

Sizes:
  full: the P3 configuration above, sentences of 25 tokens (about the mean length of IWSLT'15 en-vi).
  tiny: vocabularies 2,000 / 1,000, embeddings 64, 64 cells, 12 tokens: 398,504 parameters.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from gradsync.models.spec import ModelSpec
from gradsync.models.layers import resolve_options, token_cross_entropy

_DEFAULTS = {"full": {"seq_len": 25}, "tiny": {"seq_len": 12}}
_SHAPE = {
    "full": dict(source_vocab=17_191, target_vocab=7_709, embed_dim=512, hidden=512),
    "tiny": dict(source_vocab=2_000, target_vocab=1_000, embed_dim=64, hidden=64),
}


class MLPAttention(nn.Module):
    """Bahdanau's additive attention: ``score(h_t, s_j) = v . tanh(W_s s_j + W_h h_t)``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.source_projection = nn.Linear(hidden, hidden, bias=False)
        self.query_projection = nn.Linear(hidden, hidden)
        self.score = nn.Linear(hidden, 1, bias=False)

    def forward(self, queries: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """``queries`` (batch, T, hidden), ``memory`` (batch, S, hidden): contexts (batch, T, hidden)."""
        keys = self.source_projection(memory).unsqueeze(1)           # batch, 1, S, hidden
        energy = torch.tanh(keys + self.query_projection(queries).unsqueeze(2))  # batch, T, S, hidden
        weights = self.score(energy).squeeze(-1).softmax(dim=-1)     # batch, T, S
        return weights @ memory


class SockeyeRNN(nn.Module):
    """Encoder-decoder LSTM with MLP attention; ``forward(source, target_in)`` returns next-token logits."""

    def __init__(self, *, source_vocab: int, target_vocab: int, embed_dim: int, hidden: int):
        super().__init__()
        self.source_embedding = nn.Embedding(source_vocab, embed_dim)
        self.encoder = nn.ModuleList([
            nn.LSTM(embed_dim, hidden // 2, batch_first=True, bidirectional=True),
            nn.LSTM(hidden, hidden, batch_first=True),
        ])
        self.target_embedding = nn.Embedding(target_vocab, embed_dim)
        self.decoder = nn.ModuleList([
            nn.LSTM(embed_dim, hidden, batch_first=True),
            nn.LSTM(hidden, hidden, batch_first=True),
        ])
        self.attention = MLPAttention(hidden)
        self.combine = nn.Linear(2 * hidden, hidden)
        self.output = nn.Linear(hidden, target_vocab)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        memory = self.source_embedding(source)
        for lstm in self.encoder:
            memory, _ = lstm(memory)
        states = self.target_embedding(target_in)
        for lstm in self.decoder:
            states, _ = lstm(states)
        context = self.attention(states, memory)
        return self.output(torch.tanh(self.combine(torch.cat([states, context], dim=-1))))


def _make_batch(batch_size: int, generator: torch.Generator, seq_len: int, source_vocab: int, target_vocab: int):
    source = torch.randint(source_vocab, (batch_size, seq_len), generator=generator)
    target = torch.randint(target_vocab, (batch_size, seq_len + 1), generator=generator)
    return (source, target[:, :-1]), target[:, 1:]


def spec(size: str, **options) -> ModelSpec:
    """Sockeye-style RNN translation model at ``size``; option: ``seq_len``."""
    opts = resolve_options("sockeye-rnn", size, options, _DEFAULTS)
    shape = _SHAPE[size]
    return ModelSpec(
        "sockeye-rnn",
        size,
        lambda: SockeyeRNN(**shape),
        functools.partial(_make_batch, seq_len=opts["seq_len"], source_vocab=shape["source_vocab"],
                          target_vocab=shape["target_vocab"]),
        token_cross_entropy,
        "Sockeye 1.5 RNN translation (P3's third model): 2:2 LSTM 512, MLP attention, IWSLT'15 en-vi vocabularies",
        opts,
    )
