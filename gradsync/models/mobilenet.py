"""MobileNetV2: Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks" (CVPR 2018).

A 3x3/2 stem, seventeen inverted-residual blocks (1x1 expansion by t, 3x3 depthwise, linear 1x1
projection, residual when the shape is kept) following Table 2 of the paper, a 1x1 convolution to
1280 channels, global pooling and a linear classifier. BatchNorm after every convolution, ReLU6
everywhere except after the projections. Few parameters but many small tensors: a good stress test
for per-tensor synchronisation overhead.

Sizes:
  full: width 1.0, 224x224 images, 1000 classes: 3,504,872 parameters.
  tiny: width 0.5 with the last layer scaled to 320 channels, 32x32 images, 10 classes:
        535,370 parameters.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.models.spec import ModelSpec
from gradsync.models.layers import conv_bn, image_spec

# Table 2: (expansion t, output channels c, repeats n, first stride s).
BLOCKS = (
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
    (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
)
_DEFAULTS = {
    "full": {"image_size": 224, "num_classes": 1000},
    "tiny": {"image_size": 32, "num_classes": 10},
}
_SHAPE = {"full": {"width": 1.0, "last_channels": 1280}, "tiny": {"width": 0.5, "last_channels": 320}}


def round_channels(channels: float, divisor: int = 8) -> int:
    """Round to a multiple of ``divisor`` (vector-friendly widths), never dropping more than 10%."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded


class InvertedResidual(nn.Module):
    """Expand (skipped when t = 1), depthwise 3x3, then a linear projection: ReLU there would destroy
    information in the narrow bottleneck (section 3.2 of the paper)."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int):
        super().__init__()
        hidden = cin * expansion
        layers = [conv_bn(cin, hidden, 1, act=nn.ReLU6)] if expansion != 1 else []
        layers += [
            conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
            conv_bn(hidden, cout, 1, act=None),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 with every block width multiplied by ``width``."""

    def __init__(self, *, width: float = 1.0, last_channels: int = 1280, num_classes: int = 1000):
        super().__init__()
        cin = round_channels(32 * width)
        layers = [conv_bn(3, cin, 3, 2, act=nn.ReLU6)]
        for expansion, channels, repeats, stride in BLOCKS:
            cout = round_channels(channels * width)
            for index in range(repeats):
                layers.append(InvertedResidual(cin, cout, stride if index == 0 else 1, expansion))
                cin = cout
        layers.append(conv_bn(cin, last_channels, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(last_channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(images), 1), 1))


def spec(size: str, **options) -> ModelSpec:
    """MobileNetV2 at ``size``; options: ``image_size``, ``num_classes``."""
    return image_spec(
        "mobilenet_v2",
        size,
        options,
        _DEFAULTS,
        lambda opts: MobileNetV2(num_classes=opts["num_classes"], **_SHAPE[size]),
        "MobileNetV2 (Sandler et al. 2018), width 1.0 inverted residuals with BatchNorm",
    )
