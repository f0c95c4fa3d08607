"""A model of your own in ``gradsync bench`` (the protocol of gradsync.models.user):

    cd examples && gradsync bench --model my_model:build --strategies ddp,allreduce,ps --np 2

``build()`` returns a freshly built model, a batch maker that draws only from the generator it is
given, and a loss.
"""
import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(16 * 16, 10))

    def make_batch(batch_size: int, generator: torch.Generator):
        images = torch.randn(batch_size, 3, 32, 32, generator=generator)
        labels = torch.randint(0, 10, (batch_size,), generator=generator)
        return images, labels

    return model, make_batch, nn.functional.cross_entropy
