"""VGG-19 and VGG-16: Simonyan and Zisserman, "Very Deep Convolutional Networks for Large-Scale
Image Recognition" (ICLR 2015), configurations E and D, without BatchNorm.

Sixteen 3x3 convolutions (with bias, ReLU) in five groups of 2, 2, 4, 4 and 4 (VGG-16: thirteen,
in groups of 2, 2, 3, 3 and 3) separated by 2x2 max pools, an adaptive average pool to 7x7, then fully connected layers 4096-4096-classes. The first
fully connected layer alone holds 72% of the parameters (and of the gradient bytes to synchronise).

Sizes:
  full: 224x224 images, 1000 classes: 143,667,240 parameters (VGG-16: 138,357,544).
  tiny: channels and hidden widths divided by 16, pooled to 1x1 instead of 7x7 (a 32x32 image is
        1x1 after five pools), 32x32 images, 10 classes: 155,454 parameters.
"""
from __future__ import annotations

import torch
from torch import nn

from gradsync.models.spec import ModelSpec
from gradsync.models.layers import image_spec

POOL = "M"
LAYOUT_E = (64, 64, POOL, 128, 128, POOL, 256, 256, 256, 256, POOL,
            512, 512, 512, 512, POOL, 512, 512, 512, 512, POOL)
LAYOUT_D = (64, 64, POOL, 128, 128, POOL, 256, 256, 256, POOL,
            512, 512, 512, POOL, 512, 512, 512, POOL)
LAYOUTS = {"vgg19": LAYOUT_E, "vgg16": LAYOUT_D}
_DEFAULTS = {
    "full": {"image_size": 224, "num_classes": 1000},
    "tiny": {"image_size": 32, "num_classes": 10},
}
_SHAPE = {"full": {"divisor": 1, "pooled": 7}, "tiny": {"divisor": 16, "pooled": 1}}


def _features(divisor: int, layout: tuple = LAYOUT_E) -> nn.Sequential:
    layers, cin = [], 3
    for item in layout:
        if item == POOL:
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, item // divisor, 3, padding=1), nn.ReLU(inplace=True)]
            cin = item // divisor
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """Configuration E with every width divided by ``divisor`` and the classifier fed a pooled grid."""

    def __init__(self, *, divisor: int = 1, pooled: int = 7, num_classes: int = 1000, layout: tuple = LAYOUT_E):
        super().__init__()
        channels, hidden = 512 // divisor, 4096 // divisor
        self.features = _features(divisor, layout)
        # The adaptive pool fixes the classifier's input size whatever the image size.
        self.pool = nn.AdaptiveAvgPool2d(pooled)
        self.classifier = nn.Sequential(
            nn.Linear(channels * pooled * pooled, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(images)), 1))


def spec(size: str, **options) -> ModelSpec:
    """VGG-19 at ``size``; options: ``image_size``, ``num_classes``."""
    return _spec("vgg19", size, options)


def _spec(depth: str, size: str, options: dict) -> ModelSpec:
    config = "E" if depth == "vgg19" else "D"
    return image_spec(
        depth,
        size,
        options,
        _DEFAULTS,
        lambda opts: VGG(num_classes=opts["num_classes"], layout=LAYOUTS[depth], **_SHAPE[size]),
        f"{'VGG-19' if depth == 'vgg19' else 'VGG-16'} (Simonyan & Zisserman 2015), configuration {config} "
        "without BatchNorm",
    )


def spec_16(size: str, **options) -> ModelSpec:
    """VGG-16 at ``size`` (Horovod's scaling benchmark); options as :func:`spec`."""
    return _spec("vgg16", size, options)
