"""Big LSTM language model: Jozefowicz et al., "Exploring the Limits of Language Modeling" (2016),
the "BIG LSTM-2048-512" shape on the One Billion Word benchmark (LM1B).

A 793,471-word embedding table of width 512, one LSTM layer of 2048 cells whose output is projected
to 512 (``nn.LSTM(proj_size=512)``, the LSTMP of Sak et al. 2014), and an untied output layer over
the whole vocabulary. The two vocabulary-sized matrices hold 99% of the parameters. A batch of
32 x 20 tokens reads fewer than 640 rows of the embedding table, so its gradient is almost all
zeros: the case that sparse synchronisation is for. With ``sparse=True`` the embedding tables
produce sparse gradients (``nn.Embedding(sparse=True)``).

Output layer (option ``softmax``):
  ``full``: a softmax over the whole vocabulary (``nn.Linear``); its gradient is dense and the
    logits are ``batch x seq_len x vocab``.
  ``sampled``: the paper's sampled softmax (Jean et al. 2015) with ``num_sampled`` (8,192) negative
    classes shared by the batch, drawn without replacement from the same Zipf law as the tokens.
    The output weights and biases are embedding tables (``softmax.classes``, ``softmax.biases``)
    read at the targets and the negatives, so their gradients touch only those rows, as in the
    LM1B models that Parallax trained. No log-Q correction and no removal of accidental hits: the
    loss is a plain softmax over [target, negatives], which changes nothing about what moves on the
    wire. The forward takes ``(tokens, targets, negatives)``.

Parameter count at full size: 822,761,343 =
  embedding 793,471 x 512 = 406,257,152;
  LSTM 4 x 2048 x (512 + 512) + 2 x 4 x 2048 biases + 2048 x 512 projection = 9,453,568;
  softmax 512 x 793,471 + 793,471 bias = 407,050,623 (the same with ``softmax=sampled``).

Synthetic batch: token ids are frequency ranks drawn from a Zipf law (p(k) proportional to
1 / (k + 1)^ZIPF_EXPONENT), like word frequencies in LM1B, so the rows a batch touches resemble a real
batch's; the target is the input shifted by one token.

Sizes:
  full: the paper's model, 20-token sequences (its unroll length), full softmax.
  cpu: LM1B's vocabulary (793,471 rows per table) at width 64, 512 cells projected to 64, sampled
    softmax: 102,656,767 parameters (411 MB), 99.7% of them in the three vocabulary tables. Real row
    counts, so the touched-row statistics are LM1B's; memory a 2-core machine can hold 4 times.
  tiny: vocabulary 2,000, embedding 64, 256 cells projected to 64, 20 tokens, full softmax:
    407,504 parameters.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from gradsync.errors import ConfigError
from gradsync.models.spec import ModelSpec
from gradsync.models.layers import resolve_options, token_cross_entropy

ZIPF_EXPONENT = 1.0
_COMMON = {"seq_len": 20, "sparse": False, "num_sampled": 8192}
_DEFAULTS = {"full": {**_COMMON, "softmax": "full"}, "cpu": {**_COMMON, "softmax": "sampled"},
             "tiny": {**_COMMON, "softmax": "full"}}
_SHAPE = {
    "full": dict(vocab_size=793_471, embed_dim=512, hidden=2048),
    "cpu": dict(vocab_size=793_471, embed_dim=64, hidden=512),
    "tiny": dict(vocab_size=2000, embed_dim=64, hidden=256),
}


class SampledSoftmax(nn.Module):
    """Logits of each position's target and of the batch's shared negative classes (label 0 is the target).

    The class weights and biases are embedding tables, read once per forward at the targets and the
    negatives together, so their gradients touch only those rows.
    """

    def __init__(self, vocab_size: int, dim: int, sparse: bool = False):
        super().__init__()
        self.classes = nn.Embedding(vocab_size, dim, sparse=sparse)
        self.biases = nn.Embedding(vocab_size, 1, sparse=sparse)
        nn.init.normal_(self.classes.weight, std=dim ** -0.5)
        nn.init.zeros_(self.biases.weight)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([targets.reshape(-1), negatives])
        weights, biases = self.classes(ids), self.biases(ids).squeeze(-1)
        n = targets.numel()
        true = (hidden * weights[:n].view_as(hidden)).sum(-1) + biases[:n].view_as(targets)
        negative = hidden @ weights[n:].T + biases[n:]
        return torch.cat([true.unsqueeze(-1), negative], dim=-1)


class LSTMLanguageModel(nn.Module):
    """Embedding -> LSTM with output projection back to ``embed_dim`` -> softmax over the vocabulary
    (``softmax="full"``) or sampled softmax (``"sampled"``: forward takes targets and negatives too)."""

    def __init__(self, *, vocab_size: int, embed_dim: int, hidden: int, sparse: bool = False,
                 softmax: str = "full"):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, sparse=sparse)
        self.lstm = nn.LSTM(embed_dim, hidden, proj_size=embed_dim, batch_first=True)
        if softmax == "full":
            self.softmax = nn.Linear(embed_dim, vocab_size)
        elif softmax == "sampled":
            self.softmax = SampledSoftmax(vocab_size, embed_dim, sparse)
        else:
            raise ConfigError(f"lstm-lm softmax must be 'full' or 'sampled', got {softmax!r}")

    def forward(self, tokens: torch.Tensor, *sampled: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.embedding(tokens))
        return self.softmax(outputs, *sampled)


@functools.lru_cache(maxsize=8)
def _zipf_weights(vocab_size: int, exponent: float) -> torch.Tensor:
    return torch.arange(1, vocab_size + 1, dtype=torch.float64).pow(-exponent)


def zipf_tokens(shape: tuple[int, ...], vocab_size: int, generator: torch.Generator,
                exponent: float = ZIPF_EXPONENT, replacement: bool = True) -> torch.Tensor:
    """Ids drawn with probability proportional to ``1 / (id + 1)^exponent`` (``replacement=False``:
    distinct ids, as a candidate sampler draws them)."""
    count = torch.Size(shape).numel()
    return torch.multinomial(_zipf_weights(vocab_size, exponent), count, replacement=replacement,
                             generator=generator).view(shape)


def _make_batch(batch_size: int, generator: torch.Generator, seq_len: int, vocab_size: int,
                num_sampled: int | None):
    tokens = zipf_tokens((batch_size, seq_len + 1), vocab_size, generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if num_sampled is None:
        return (inputs,), targets
    negatives = zipf_tokens((min(num_sampled, vocab_size),), vocab_size, generator, replacement=False)
    return (inputs, targets, negatives), targets


def _sampled_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of [target, negatives] logits: the target is class 0 at every position."""
    flat = logits.reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long))


def spec(size: str, **options) -> ModelSpec:
    """Big LSTM language model at ``size``; options: ``seq_len``, ``sparse`` (sparse embedding grads),
    ``softmax`` (``full`` or ``sampled``), ``num_sampled`` (negatives per batch, sampled softmax)."""
    opts = resolve_options("lstm-lm", size, options, _DEFAULTS)
    shape = _SHAPE[size]
    sampled = opts["softmax"] == "sampled"
    lookups = {"embedding": lambda inputs: inputs[0]}
    if sampled:
        both = lambda inputs: torch.cat([inputs[1].reshape(-1), inputs[2]])  # noqa: E731
        lookups.update({"softmax.classes": both, "softmax.biases": both})
    return ModelSpec(
        "lstm-lm",
        size,
        lambda: LSTMLanguageModel(sparse=opts["sparse"], softmax=opts["softmax"], **shape),
        functools.partial(_make_batch, seq_len=opts["seq_len"], vocab_size=shape["vocab_size"],
                          num_sampled=opts["num_sampled"] if sampled else None),
        _sampled_loss if sampled else token_cross_entropy,
        f"Big LSTM language model (Jozefowicz et al. 2016), {shape['vocab_size']:,}-word vocabulary, "
        f"{'sampled' if sampled else 'full'} softmax",
        opts,
        lookups,
    )
