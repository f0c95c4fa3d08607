"""InceptionV3: Szegedy et al., "Rethinking the Inception Architecture for Computer Vision" (CVPR 2016).

A stem of plain convolutions and two max pools takes a 299x299 image to a 35x35 grid; three
Inception-A modules (figure 5), a grid reduction (B), four Inception-C modules with factorised 7x7
convolutions (figure 6) at 17x17, a second reduction (D) and two Inception-E modules with expanded
1x3/3x1 branches (figure 7) at 8x8; global pooling and a linear classifier. Every convolution is
conv-BatchNorm-ReLU with the BatchNorm epsilon 1e-3 of the reference implementation.

The auxiliary classifier taps the 17x17 grid and only runs in training mode, so ``forward`` returns
``(logits, aux_logits)`` while training with ``aux_logits=True`` and ``logits`` otherwise; the
spec's loss handles both. It pools to a ``grid x grid`` map with an adaptive pool rather than the
reference 5x5/3 average pool: at 299x299 both give a 5x5 map (the adaptive windows are 4-5 pixels
wide instead of 5, and no parameter changes), but only the adaptive one works at smaller inputs.

Sizes:
  full: 299x299 images, 1000 classes: 27,161,264 parameters with the auxiliary classifier,
        23,834,568 without.
  tiny: every width divided by 8, 75x75 images (the smallest the stride pattern accepts), an
        auxiliary grid of 3, 10 classes: 363,384 parameters with the auxiliary classifier.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.models.spec import ModelSpec
from gradsync.models.layers import conv_bn, image_spec

AUX_WEIGHT = 0.4  # weight of the auxiliary loss in the TF-slim reference training recipe
_DEFAULTS = {
    "full": {"image_size": 299, "num_classes": 1000, "aux_logits": True},
    "tiny": {"image_size": 75, "num_classes": 10, "aux_logits": True},
}
_SHAPE = {"full": {"divisor": 1, "aux_grid": 5}, "tiny": {"divisor": 8, "aux_grid": 3}}


def conv(
    cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1, padding: int | None = None
) -> nn.Sequential:
    return conv_bn(cin, cout, kernel, stride, padding=padding, eps=1e-3)


class Branches(nn.Module):
    """Parallel branches concatenated along channels: the Inception module itself."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


def _pool_branch(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.AvgPool2d(3, 1, padding=1), conv(cin, cout, 1))


def inception_a(cin: int, pool_channels: int, d: int) -> Branches:
    """35x35 module (figure 5): 1x1, 5x5, double 3x3 and pooled branches; 224 + pool_channels out."""
    return Branches(
        conv(cin, 64 // d, 1),
        nn.Sequential(conv(cin, 48 // d, 1), conv(48 // d, 64 // d, 5)),
        nn.Sequential(conv(cin, 64 // d, 1), conv(64 // d, 96 // d, 3), conv(96 // d, 96 // d, 3)),
        _pool_branch(cin, pool_channels // d),
    )


def reduction_b(cin: int, d: int) -> Branches:
    """35x35 -> 17x17: strided convolutions beside a max pool, shrinking the grid without a bottleneck."""
    return Branches(
        conv(cin, 384 // d, 3, 2, padding=0),
        nn.Sequential(
            conv(cin, 64 // d, 1), conv(64 // d, 96 // d, 3), conv(96 // d, 96 // d, 3, 2, padding=0)
        ),
        nn.MaxPool2d(3, 2),
    )


def inception_c(cin: int, c7: int, d: int) -> Branches:
    """17x17 module (figure 6): 7x7 convolutions factorised into 1x7 and 7x1; 768 out."""
    c7 //= d
    return Branches(
        conv(cin, 192 // d, 1),
        nn.Sequential(conv(cin, c7, 1), conv(c7, c7, (1, 7)), conv(c7, 192 // d, (7, 1))),
        nn.Sequential(
            conv(cin, c7, 1), conv(c7, c7, (7, 1)), conv(c7, c7, (1, 7)), conv(c7, c7, (7, 1)),
            conv(c7, 192 // d, (1, 7)),
        ),
        _pool_branch(cin, 192 // d),
    )


def reduction_d(cin: int, d: int) -> Branches:
    """17x17 -> 8x8, the second grid reduction; 1280 out."""
    return Branches(
        nn.Sequential(conv(cin, 192 // d, 1), conv(192 // d, 320 // d, 3, 2, padding=0)),
        nn.Sequential(
            conv(cin, 192 // d, 1), conv(192 // d, 192 // d, (1, 7)), conv(192 // d, 192 // d, (7, 1)),
            conv(192 // d, 192 // d, 3, 2, padding=0),
        ),
        nn.MaxPool2d(3, 2),
    )


def _split_1x3_3x1(channels: int) -> Branches:
    return Branches(conv(channels, channels, (1, 3)), conv(channels, channels, (3, 1)))


def inception_e(cin: int, d: int) -> Branches:
    """8x8 module (figure 7): the 3x3 branches fan out into parallel 1x3 and 3x1; 2048 out."""
    return Branches(
        conv(cin, 320 // d, 1),
        nn.Sequential(conv(cin, 384 // d, 1), _split_1x3_3x1(384 // d)),
        nn.Sequential(conv(cin, 448 // d, 1), conv(448 // d, 384 // d, 3), _split_1x3_3x1(384 // d)),
        _pool_branch(cin, 192 // d),
    )


def auxiliary_head(cin: int, num_classes: int, d: int, grid: int) -> nn.Sequential:
    """Pool to grid x grid, 1x1 to 128, a grid x grid convolution to 768 (one value per map), linear."""
    return nn.Sequential(
        nn.AdaptiveAvgPool2d(grid),
        conv(cin, 128 // d, 1),
        conv(128 // d, 768 // d, grid, padding=0),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(768 // d, num_classes),
    )


class InceptionV3(nn.Module):
    """InceptionV3 with every width divided by ``divisor`` (the module widths are multiples of 16)."""

    def __init__(
        self, *, num_classes: int = 1000, aux_logits: bool = True, divisor: int = 1, aux_grid: int = 5
    ):
        super().__init__()
        d = divisor
        self.to_17x17 = nn.Sequential(
            conv(3, 32 // d, 3, 2, padding=0), conv(32 // d, 32 // d, 3, padding=0),
            conv(32 // d, 64 // d, 3), nn.MaxPool2d(3, 2),
            conv(64 // d, 80 // d, 1), conv(80 // d, 192 // d, 3, padding=0), nn.MaxPool2d(3, 2),
            inception_a(192 // d, 32, d), inception_a(256 // d, 64, d), inception_a(288 // d, 64, d),
            reduction_b(288 // d, d),
            *(inception_c(768 // d, c7, d) for c7 in (128, 160, 160, 192)),
        )
        self.aux = auxiliary_head(768 // d, num_classes, d, aux_grid) if aux_logits else None
        self.to_8x8 = nn.Sequential(
            reduction_d(768 // d, d), inception_e(1280 // d, d), inception_e(2048 // d, d)
        )
        self.fc = nn.Linear(2048 // d, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        grid17 = self.to_17x17(images)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(self.to_8x8(grid17), 1), 1))
        if self.aux is None or not self.training:
            return logits
        return logits, self.aux(grid17)


def inception_loss(
    output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy of the main logits, plus AUX_WEIGHT times that of the auxiliary logits if any."""
    if isinstance(output, tuple):
        logits, aux = output
        return F.cross_entropy(logits, target) + AUX_WEIGHT * F.cross_entropy(aux, target)
    return F.cross_entropy(output, target)


def spec(size: str, **options) -> ModelSpec:
    """InceptionV3 at ``size``; options: ``image_size``, ``num_classes``, ``aux_logits``."""
    return image_spec(
        "inception_v3",
        size,
        options,
        _DEFAULTS,
        lambda opts: InceptionV3(
            num_classes=opts["num_classes"], aux_logits=opts["aux_logits"], **_SHAPE[size]
        ),
        "InceptionV3 (Szegedy et al. 2016) with BatchNorm and the auxiliary classifier",
        loss=inception_loss,
    )
