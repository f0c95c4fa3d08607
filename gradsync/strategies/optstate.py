"""Optimizer state for checkpoints, when the update does not run in the user's optimizer alone.

Four strategies keep optimizer state somewhere other than ``optimizer.state``:

- co-located ``ps`` runs the user's optimizer on each worker for the parameters that worker
  serves: each worker holds the state of its own partition only;
- ``p3`` updates each slice with its own optimizer instance on the slice's server;
- ``allreduce-priority`` updates each partition with its own instance, on every worker;
- ``hybrid`` updates each embedding table's row ranges on their servers, one instance per table
  and server.

For ``optimizer.state_dict()`` gradsync assembles the state torch itself would have made, whole
tensors keyed by parameter, in the user's optimizer; for ``load_state_dict()`` it cuts that state
back into the pieces the strategy updates. A checkpoint therefore moves between strategies, and to
and from plain PyTorch. Assembling state spread over workers is a collective (sum for the
tensor-shaped entries, each element held by exactly one worker; max for the per-parameter
scalars such as Adam's ``step``), like ``ZeroRedundancyOptimizer.consolidate_state_dict()``.

Which entries are tensor-shaped and which are scalars is learned once per parameter group by
stepping a two-element probe with the group's hyperparameters.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from gradsync.errors import ConfigError

Piece = tuple[int, int, int, dict]
"""``(parameter index, first element, number of elements, that piece's optimizer state)``."""


class StateLayout:
    """Per parameter group: the optimizer's state entries, each ``"tensor"`` (shaped like the
    parameter), ``"scalar"`` (a 0-d tensor), ``"number"`` (a Python int or float) or ``"none"``
    (stored as ``None``)."""

    def __init__(self, optimizer_class: type, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]):
        self.params = params
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.group = [group_of.get(id(p)) for p in params]
        probes = [self._probe(optimizer_class, group) for group in optimizer.param_groups]
        self.entries = [{key: kind for key, (kind, _) in probe.items()} for probe in probes]
        self.dtypes = [{key: dtype for key, (_, dtype) in probe.items()} for probe in probes]

    @staticmethod
    def _probe(optimizer_class: type, group: dict) -> dict[str, tuple[str, torch.dtype | None]]:
        ref = group["params"][0]
        probe = nn.Parameter(torch.zeros(2, dtype=ref.dtype, device=ref.device))
        hyper = {k: v for k, v in group.items() if k != "params"}
        opt = optimizer_class([{**hyper, "params": [probe]}])
        probe.grad = torch.ones_like(probe)
        try:
            opt.step()
        except RuntimeError:  # an optimizer of sparse gradients only (SparseAdam)
            opt = optimizer_class([{**hyper, "params": [probe]}])
            probe.grad = torch.ones_like(probe).to_sparse()
            opt.step()
        entries = {}
        for key, value in opt.state[probe].items():
            if value is None:
                entries[key] = ("none", None)
            elif torch.is_tensor(value) and value.shape == probe.shape:
                entries[key] = ("tensor", value.dtype)
            elif torch.is_tensor(value) and value.dim() == 0:
                entries[key] = ("scalar", value.dtype)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):  # SparseAdam's step
                entries[key] = ("number", type(value))
            else:
                raise ConfigError(f"{optimizer_class.__name__} keeps state entry {key!r} as {type(value).__name__}; "
                                  "gradsync can checkpoint only tensor, 0-d tensor, number and None entries")
        return entries

    def of(self, i: int) -> dict[str, str]:
        """The state entries of parameter ``i`` (empty for one the optimizer does not hold)."""
        g = self.group[i]
        return {} if g is None else self.entries[g]


def gather(layout: StateLayout, pieces: Iterable[Piece], transport=None, world: bool = False) -> dict[int, dict]:
    """Whole-tensor state per parameter index from ``pieces``; with ``transport``, the union over
    every worker's pieces (a collective: every worker calls it; ``world``: every rank, servers
    too). Parameters no piece covers (never updated) get no entry, as in torch. With one rank
    holding whole state and the others none, this hands that state to every rank."""
    params = layout.params
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    scalars: dict[tuple[int, str], int] = {}
    for i, p in enumerate(params):
        for key, kind in layout.of(i).items():
            if kind == "tensor":
                tensors[(i, key)] = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            elif kind in ("scalar", "number"):
                scalars[(i, key)] = len(scalars)
    scalar_values = torch.full((len(scalars) + len(params),), -torch.inf, dtype=torch.float64)
    has = scalar_values[len(scalars):]  # 1 where some piece holds the parameter's state
    for i, start, length, state in pieces:
        has[i] = 1.0
        for key, kind in layout.of(i).items():
            value = state.get(key)
            if kind == "tensor" and value is not None:
                tensors[(i, key)][start:start + length].copy_(value.reshape(-1))
            elif kind in ("scalar", "number") and value is not None:
                scalar_values[scalars[(i, key)]] = max(scalar_values[scalars[(i, key)]].item(), float(value))
    if transport is not None:
        for (i, key), value in tensors.items():
            transport.allreduce(value, world=world, what=f"gathering optimizer state {key!r} of parameter {i}")
        transport.allreduce(scalar_values, op="max", world=world, what="gathering the optimizer's per-parameter scalars")
    state: dict[int, dict] = {}
    for i, p in enumerate(params):
        if has[i].item() <= 0:
            continue
        entry = {}
        for key, kind in layout.of(i).items():
            if kind == "tensor":
                entry[key] = tensors[(i, key)].view_as(p)
            elif kind in ("scalar", "number"):
                dtype = layout.dtypes[layout.group[i]][key]
                value = scalar_values[scalars[(i, key)]].item()
                entry[key] = torch.tensor(value, dtype=dtype) if kind == "scalar" else dtype(value)
            else:
                entry[key] = None
        state[i] = entry
    return state


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[float]:
    """Every param group's numeric hyperparameters (``lr``, ``momentum``, each of Adam's ``betas``,
    ...) as one flat list, in a fixed order (groups, then sorted keys); see :func:`set_hyperparameters`."""
    flat = []
    for group in optimizer.param_groups:
        for key in sorted(k for k in group if k != "params"):
            value = group[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat.append(float(value))
            elif isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
                flat.extend(float(v) for v in value)
    return flat


def set_hyperparameters(optimizer: torch.optim.Optimizer, flat: list[float]) -> None:
    """The inverse of :func:`hyperparameters`, keeping each entry's type."""
    values = iter(flat)
    for group in optimizer.param_groups:
        for key in sorted(k for k in group if k != "params"):
            value = group[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                group[key] = type(value)(next(values))
            elif isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
                group[key] = tuple(type(v)(next(values)) for v in value)


def cut(layout: StateLayout, whole: dict, i: int, start: int, length: int) -> dict:
    """The state of elements ``[start, start + length)`` of parameter ``i``, from its whole state."""
    piece = {}
    for key, value in whole.items():
        kind = layout.of(i).get(key)
        if kind == "tensor":
            piece[key] = value.detach().reshape(-1)[start:start + length].clone()
        else:
            piece[key] = value.clone() if torch.is_tensor(value) else value
    return piece


def install(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], state: dict[int, dict]) -> None:
    """Make ``state`` (per parameter index) the whole of ``optimizer.state``."""
    optimizer.state.clear()
    for i, entry in state.items():
        optimizer.state[params[i]] = entry
