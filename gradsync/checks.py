"""What :func:`gradsync.distribute` and ``switch_strategy`` check before they attach a strategy:
the arguments, the optimizer's parameters, the backend and ``clip_grad_norm``. Each raises
:class:`~gradsync.errors.ConfigError` with the fix in its message."""
from __future__ import annotations

import torch
from torch import nn

from gradsync import runtime
from gradsync.errors import ConfigError
from gradsync.strategies import Strategy


def check_arguments(model, optimizer) -> None:
    """``distribute(model, optimizer, ...)``: the two objects it needs, with the model's tensors in memory."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"distribute(model, optimizer, ...): model must be a torch.nn.Module, got "
                          f"{type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"distribute(model, optimizer, ...): optimizer must be a torch.optim.Optimizer over the "
                          f"model's parameters, got {type(optimizer).__name__}")
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ConfigError(f"distribute: {meta[0]!r}" + (f" and {len(meta) - 1} more" if len(meta) > 1 else "")
                          + " of the model are on the meta device, without values: materialize the model first "
                          "(model.to_empty(device=...) and initialize or load its weights)")


def trainable(model: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
    """The parameters that get gradients, and their names, in the model's order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [p for _, p in named], [n for n, _ in named]


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Every parameter the optimizer updates belongs to the model."""
    known = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            if id(p) not in known:
                raise ConfigError(f"optimizer param_groups[{g}]['params'][{k}] (shape {list(p.shape)}) "
                                  "is not a parameter of the model passed to distribute")


def check_backend(strategy: Strategy, transport) -> None:
    """Refuse a strategy on a backend it does not run on (``Strategy.backends``): NCCL has no
    receive from whichever peer sends first, which the servers of ``ps-async``, ``hybrid`` and
    ``pair-averaging`` wait on."""
    backend = "nccl" if transport.device.type == "cuda" else "gloo"
    if backend not in strategy.backends:
        names = " or ".join(b.upper() if b == "nccl" else b.capitalize() for b in strategy.backends)
        raise ConfigError(f"rank {runtime.current().topology.rank}: strategy {strategy.name!r} runs on {names} only (its servers "
                          f"receive from whichever peer sends first, which {backend.upper()} cannot); start the job "
                          "with GRADSYNC_BACKEND=gloo (tensors on a GPU are then staged through host memory) or "
                          "pick a strategy that runs on NCCL (`gradsync strategies` lists them)")


def check_clip(clip: float | None, strategy: Strategy) -> None:
    """``clip_grad_norm``: a positive finite number, under a strategy that can clip by the global norm."""
    if clip is None:
        return
    if isinstance(clip, bool) or not (isinstance(clip, (int, float)) and 0 < clip < float("inf")):
        raise ConfigError(f"clip_grad_norm must be a positive finite number, got {clip!r}")
    if strategy.grad_edits == "refused" and not strategy.clips:
        raise ConfigError(f"strategy {strategy.name!r} updates each piece of the model as it arrives and cannot "
                          "clip by the global gradient norm; use allreduce, ddp, casync-ring, casync-ps or "
                          "compressed-allgather (which also let you call clip_grad_norm_ yourself), or ps")
