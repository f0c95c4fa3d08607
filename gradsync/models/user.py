"""Your own model in ``gradsync bench --model package.module:function`` (and anywhere a model name goes).

The protocol: ``function()`` takes no arguments and returns ``(model, make_batch, loss)``:

- ``model``: a freshly built ``nn.Module`` (the bench calls ``function`` once per strategy, after
  seeding torch, so every rank builds the same model);
- ``make_batch(batch_size, generator)``: ``(inputs, target)`` drawn only from ``generator`` (a
  ``torch.Generator``), where ``inputs`` is a tensor or a tuple of the forward's positional arguments;
- ``loss(output, target)``: a scalar tensor.

It may instead return a :class:`~gradsync.models.ModelSpec`, which is what the shipped models'
``spec(size)`` functions return (``--model gradsync.models.toy:spec`` is the toy model). The module
must be importable where the ranks run (the current directory is on their path).
"""
from __future__ import annotations

import importlib
import os
import sys

import torch
from torch import nn

from gradsync.errors import ConfigError
from gradsync.models.spec import ModelSpec


def is_user_model(name: str) -> bool:
    """``package.module:function``: a dotted or plain module path, a colon, an identifier."""
    module, sep, function = name.partition(":")
    return bool(sep) and function.isidentifier() and all(part.isidentifier() for part in module.split("."))


def _function(name: str):
    module_name, _, function_name = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model {name!r}: cannot import module {module_name!r} ({exc}); run from the directory "
                         "that holds it, or install it") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"model {name!r}: module {module_name!r} has no function {function_name!r}")
    return function


def _triple(name: str, function) -> tuple:
    result = function()
    if isinstance(result, ModelSpec):
        return result
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ConfigError(f"model {name!r}: the function must return (model, make_batch, loss) or a ModelSpec, "
                         f"got {type(result).__name__}")
    model, make_batch, loss = result
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {name!r}: the first value returned must be an nn.Module, got {type(model).__name__}")
    for what, value in (("make_batch", make_batch), ("loss", loss)):
        if not callable(value):
            raise ConfigError(f"model {name!r}: {what} (returned by the function) is not callable")
    return result


def load(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``package.module:function``, checked on a batch of 2."""
    function = _function(name)
    first = _triple(name, function)
    if isinstance(first, ModelSpec):
        return first
    _, make_batch, loss = first

    def batch(batch_size: int, generator: torch.Generator):
        inputs, target = make_batch(batch_size, generator)
        return (inputs if isinstance(inputs, tuple) else (inputs,)), target

    spec = ModelSpec(name, "user", lambda: _triple(name, function)[0], batch, loss,
                     description=f"{name} (your model)")
    _check(name, first[0], spec)
    return spec


def _check(name: str, model: nn.Module, spec: ModelSpec) -> None:
    try:
        inputs, target = spec.batch(2, seed=0)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's code, named
        raise ConfigError(f"model {name!r}: make_batch(2, generator) failed: {exc!r}") from None
    try:
        value = spec.loss(model(*inputs), target)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"model {name!r}: loss(model(*inputs), target) on a batch of 2 failed: {exc!r}") from None
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()):
        raise ConfigError(f"model {name!r}: loss must return a scalar float tensor, got "
                         f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else list(value.shape)}")
