"""Models of a user's own, for `gradsync bench --model user_models:NAME` in tests/test_bench.py."""
import torch
from torch import nn


def _batch(batch_size, generator):
    return torch.randn(batch_size, 6, generator=generator), torch.randn(batch_size, 2, generator=generator)


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)), _batch, nn.functional.mse_loss


def not_a_triple():
    return nn.Linear(6, 2)


def not_a_module():
    return "model", _batch, nn.functional.mse_loss


def vector_loss():
    return nn.Linear(6, 2), _batch, lambda out, target: (out - target).abs()


def broken_batch():
    def batch(batch_size, generator):
        raise RuntimeError("no data here")
    return nn.Linear(6, 2), batch, nn.functional.mse_loss
