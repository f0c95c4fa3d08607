"""ResNet-50 and ResNet-101: He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016).

Bottleneck blocks (1x1 reduce, 3x3, 1x1 expand by 4) in stages of 3, 4, 6 and 3 blocks
(ResNet-101: 3, 4, 23 and 3), with
BatchNorm after every convolution and a projection shortcut wherever the shape changes. The stride
of a downsampling block sits on its 3x3 convolution ("ResNet v1.5", the variant most frameworks
benchmark), which changes no parameter.

Sizes:
  full: base width 64, 224x224 images, 1000 classes: 25,557,032 parameters (ResNet-101: 44,549,160).
  tiny: base width 8, the same blocks, 32x32 images, 10 classes: 376,722 parameters (ResNet-50).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.models.spec import ModelSpec
from gradsync.models.layers import conv_bn, image_spec

EXPANSION = 4
_DEFAULTS = {
    "full": {"image_size": 224, "num_classes": 1000},
    "tiny": {"image_size": 32, "num_classes": 10},
}
_BASE_WIDTH = {"full": 64, "tiny": 8}
DEPTHS = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3)}


class Bottleneck(nn.Module):
    """``relu(body(x) + shortcut(x))`` where the body narrows to ``width`` and widens to 4 * width."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * EXPANSION
        self.body = nn.Sequential(
            conv_bn(cin, width, 1),
            conv_bn(width, width, 3, stride),
            conv_bn(width, cout, 1, act=None),
        )
        needs_projection = stride != 1 or cin != cout
        self.shortcut = conv_bn(cin, cout, 1, stride, act=None) if needs_projection else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """The ImageNet ResNet: 7x7/2 stem, 3x3/2 max-pool, bottleneck stages, global pool, linear."""

    def __init__(
        self, *, base_width: int = 64, depths: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000
    ):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, base_width, 7, 2), nn.MaxPool2d(3, 2, padding=1))
        blocks, cin = [], base_width
        for index, depth in enumerate(depths):
            width = base_width * 2**index
            stride = 1 if index == 0 else 2  # the stem already downsampled 4x before stage 1
            for _ in range(depth):
                blocks.append(Bottleneck(cin, width, stride))
                cin, stride = width * EXPANSION, 1
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(images))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(features, 1), 1))


def spec(size: str, **options) -> ModelSpec:
    """ResNet-50 at ``size``; options: ``image_size``, ``num_classes``."""
    return _spec("resnet50", size, options)


def _spec(depth: str, size: str, options: dict) -> ModelSpec:
    blocks = DEPTHS[depth]
    return image_spec(
        depth,
        size,
        options,
        _DEFAULTS,
        lambda opts: ResNet(base_width=_BASE_WIDTH[size], depths=blocks, num_classes=opts["num_classes"]),
        f"{'ResNet-50' if depth == 'resnet50' else 'ResNet-101'} (He et al. 2016), bottleneck blocks "
        f"{'-'.join(map(str, blocks))} with BatchNorm",
    )


def spec_101(size: str, **options) -> ModelSpec:
    """ResNet-101 at ``size`` (Horovod's scaling benchmark); options as :func:`spec`."""
    return _spec("resnet101", size, options)
