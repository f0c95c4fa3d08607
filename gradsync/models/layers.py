"""Building blocks shared by the model zoo.

* :func:`resolve_options`, :func:`image_spec` and :func:`token_cross_entropy`: the option checking,
  synthetic images and losses that the ``spec(size, **options)`` functions share, so each model
  file only describes its network.
* :func:`conv_bn`: convolution -> BatchNorm -> activation, the unit of ResNet, MobileNetV2 and
  InceptionV3.
* :class:`Attention`, :class:`TransformerLayer` and :func:`sinusoidal_positions`: the Transformer
  of Vaswani et al. (2017), used post-norm by BERT and pre-norm by the translation model.

Dropout is left out everywhere: it has no parameters, so it changes no count, and without it a
forward pass is a pure function of the batch, which keeps strategy-vs-baseline parity tests exact.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.errors import ConfigError
from gradsync.models.spec import ModelSpec

Options = dict[str, Any]


def resolve_options(model: str, size: str, given: Options, defaults: dict[str, Options]) -> Options:
    """Merge ``given`` over ``defaults[size]``; an unknown size or option raises ConfigError."""
    if size not in defaults:
        raise ConfigError(
            f"unknown size {size!r} for model {model!r}; valid sizes: {', '.join(defaults)}"
        )
    unknown = sorted(set(given) - set(defaults[size]))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} for model {model!r}; "
            f"valid options: {', '.join(sorted(defaults[size]))}"
        )
    return {**defaults[size], **given}


def image_spec(
    name: str,
    size: str,
    options: Options,
    defaults: dict[str, Options],
    build: Callable[[Options], nn.Module],
    description: str,
    loss: Callable[[Any, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> ModelSpec:
    """A :class:`ModelSpec` for an image classifier fed Gaussian images and uniform labels.

    ``defaults`` must give ``image_size`` and ``num_classes`` for every size; ``build`` receives the
    resolved options.
    """
    opts = resolve_options(name, size, options, defaults)

    def make_batch(batch_size: int, generator: torch.Generator):
        side = opts["image_size"]
        images = torch.randn(batch_size, 3, side, side, generator=generator)
        labels = torch.randint(opts["num_classes"], (batch_size,), generator=generator)
        return (images,), labels

    return ModelSpec(name, size, lambda: build(opts), make_batch, loss, description, opts)


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``(batch, length, vocab)`` logits against ``(batch, length)`` ids."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def conv_bn(
    cin: int,
    cout: int,
    kernel: int | tuple[int, int],
    stride: int = 1,
    *,
    padding: int | tuple[int, int] | None = None,
    groups: int = 1,
    act: Callable[..., nn.Module] | None = nn.ReLU,
    eps: float = 1e-5,
) -> nn.Sequential:
    """Conv -> BatchNorm -> ``act``; ``padding`` defaults to keeping the size at stride 1.

    The convolution has no bias because the BatchNorm shift that follows makes one redundant.
    """
    kernel_hw = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    if padding is None:
        padding = tuple((k - 1) // 2 for k in kernel_hw)
    layers = [
        nn.Conv2d(cin, cout, kernel_hw, stride, padding, groups=groups, bias=False),
        nn.BatchNorm2d(cout, eps=eps),
    ]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)


def sinusoidal_positions(length: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """The ``(length, dim)`` position table of Vaswani et al. (2017), section 3.5.

    Channel pair ``(2i, 2i+1)`` holds ``sin, cos`` of ``pos / 10000^(2i/dim)``. It is recomputed per
    call rather than stored, so there is no maximum length and nothing to move between devices.
    """
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    inverse_wavelength = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )
    angles = position * inverse_wavelength
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Multi-head scaled dot-product attention with biased projections (4 * (dim^2 + dim) parameters).

    Keys and values come from ``memory`` when it is given (encoder-decoder attention), else from ``x``.
    """

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key_value = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        source = x if memory is None else memory
        key, value = self.key_value(source).chunk(2, dim=-1)
        query, key, value = (self._split_heads(t) for t in (self.query(x), key, value))
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=causal)
        return self.out(attended.transpose(1, 2).flatten(2))

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        batch, length, _ = t.shape
        return t.view(batch, length, self.heads, -1).transpose(1, 2)


class TransformerLayer(nn.Module):
    """Self-attention, optional encoder-decoder attention, then a two-layer feed-forward network.

    ``norm_first=False`` is the original post-norm layer (BERT); ``norm_first=True`` the pre-norm
    layer (Sockeye's default), which needs a final LayerNorm after the stack. Both have the same
    parameters.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        ffn_dim: int,
        *,
        cross_attention: bool = False,
        norm_first: bool = False,
        activation: Callable[[], nn.Module] = nn.GELU,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.norm_first = norm_first
        self.self_attention = Attention(dim, heads)
        self.cross_attention = Attention(dim, heads) if cross_attention else None
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), activation(), nn.Linear(ffn_dim, dim))
        sublayers = 3 if cross_attention else 2
        self.norms = nn.ModuleList(nn.LayerNorm(dim, eps=eps) for _ in range(sublayers))

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        x = self._sublayer(x, self.norms[0], lambda h: self.self_attention(h, causal=causal))
        if self.cross_attention is not None:
            x = self._sublayer(x, self.norms[1], lambda h: self.cross_attention(h, memory))
        return self._sublayer(x, self.norms[-1], self.ffn)

    def _sublayer(
        self, x: torch.Tensor, norm: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        # Pre-norm leaves the residual path un-normalised, which lets deep stacks train without the
        # careful warm-up post-norm needs; post-norm is kept for BERT because its checkpoints use it.
        if self.norm_first:
            return x + fn(norm(x))
        return norm(x + fn(x))
