"""``gradsync.distribute``: turn a model and its optimizer into a data-parallel pair.

:func:`distribute` checks that every rank built the same model, copies rank 0's parameters and
buffers to all ranks, attaches the strategy, installs the strategy's hook points on the model
(:mod:`gradsync.hooks`) and wraps the optimizer (:mod:`gradsync.optimizer`). On a server rank it
serves until the workers shut down, then leaves the process (``exit_servers=True``), so one script
serves both roles.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch import nn

from gradsync import hooks, runtime
from gradsync.checks import check_arguments, check_backend, check_clip, check_optimizer, trainable
from gradsync.consistency import broadcast_model, check_models_match
from gradsync.errors import ConfigError
from gradsync.optimizer import wrap
from gradsync.strategies import Strategy, SyncContext, resolve
from gradsync.syncstate import SyncState


def distribute(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str | Strategy = "allreduce",
               *, exit_servers: bool = True, clip_grad_norm: float | None = None, hosts: str = "auto",
               **options: Any) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` a synchronized data-parallel step. Returns the same optimizer.

    Args:
        model: the model every rank built identically (checked).
        optimizer: its optimizer, over (a subset of) ``model``'s parameters.
        strategy: a registered name (``"allreduce"``, ``"ps"``, ``"ps-async"``, ``"ddp"``, ...)
            or a strategy object such as ``gradsync.strategies.AllReduce(bucket_mb=25)``.
        exit_servers: on a parameter-server rank, leave the process once serving is over
            (the default, so the same script runs on workers and servers).
        clip_grad_norm: clip the mean gradient to this global L2 norm before every update, where
            the update happens (on the servers for ``ps``). Under strategies that synchronize at
            the end of backward (``allreduce``, ``ddp``, ``casync-*``, ``compressed-allgather``)
            this equals calling ``torch.nn.utils.clip_grad_norm_`` between backward and step;
            under ``sma`` and ``pair-averaging`` it clips each worker's own gradient.
        hosts: ``"auto"``: where the job's hosts run several workers (on Gloo), the strategies that
            can cross the network once per host do (two-level all-reduce, host sums before a
            parameter server; docs/launcher.md); ``"flat"``: every worker is a peer of every other,
            as with one worker per host.
        **options: passed to the strategy's constructor when ``strategy`` is a name.

    Gradients on workers are the mean over workers (see :mod:`gradsync.strategies.base`); under
    strategies whose ``grad_edits`` is ``"synced"`` they are in ``p.grad`` when ``backward()``
    returns. Elsewhere a gradient changed between backward and step raises
    :class:`~gradsync.errors.GradientEditedError` instead of training a different model.
    Call ``optimizer.step()`` once per backward, or use ``with optimizer.no_sync():`` for all
    but the last backward of an accumulation.
    """
    check_arguments(model, optimizer)
    if hosts not in ("auto", "flat"):
        raise ConfigError(f"hosts={hosts!r}: expected 'auto' (cross the network once per host where hosts run "
                          "several workers) or 'flat' (every worker a peer of every other)")
    strategy = resolve(strategy, **options)
    check_clip(clip_grad_norm, strategy)
    rt = runtime.current()
    check_backend(strategy, rt.transport)
    topology = rt.topology
    if getattr(optimizer, "_gradsync", None) is not None:
        raise ConfigError("this optimizer was already passed to gradsync.distribute")
    if topology.is_server and not strategy.uses_servers:
        return _leave_server(exit_servers, optimizer)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # Accelerate's prepare(model) and hand-written DDP setups do this: DDP's reducer would average
        # every gradient once more, on top of the strategy, and double the traffic.
        warnings.warn(f"rank {topology.rank}: the model handed to gradsync.distribute is already wrapped in "
                      "DistributedDataParallel, so its gradients are all-reduced twice. Pass the bare module "
                      "(model.module), or with Accelerate prepare only the optimizer and data loaders "
                      "(docs/integrations.md)", stacklevel=2)
    params, names = trainable(model)
    check_optimizer(optimizer, model)
    _start_equal(model, rt, world=strategy.uses_servers)
    sync = SyncState(strategy, model, params, names)
    sync.clip = clip_grad_norm
    strategy.attach(SyncContext(model, optimizer, params, names, rt.transport, topology,
                                clip_grad_norm=clip_grad_norm,
                                two_level=rt.transport.two_level if hosts == "auto" else None))
    runtime.on_shutdown(sync.close)
    if topology.is_server:
        strategy.serve()
        return _leave_server(exit_servers, optimizer)
    hooks.install(sync)
    return wrap(optimizer, sync)


def _start_equal(model: nn.Module, rt, *, world: bool) -> None:
    """Check that every rank built the same model, then copy rank 0's values to all."""
    check_models_match(model, rt.transport, world=world)
    # A worker joining a running elastic job holds a fresh model: comparing digests would be wasted.
    joining = rt.elastic is not None and rt.elastic.gen > 0 and rt.elastic.any_new
    broadcast_model(model, rt.transport, world=world, compare_first=not joining)


def _leave_server(exit_servers: bool, optimizer):
    if exit_servers:
        runtime.shutdown()
        sys.exit(0)
    return optimizer
