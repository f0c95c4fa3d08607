"""``gradsync.distribute``: turn a model and its optimizer into a data-parallel pair.

The user's optimizer is wrapped, not replaced (Horovod's habit): its class becomes a subclass of
the original, so ``isinstance`` checks, ``state_dict`` and learning-rate schedulers keep working,
and ``step()`` first lets the strategy synchronize. ``distribute`` also checks that every rank
built the same model, copies rank 0's parameters and buffers to all ranks, and installs the three
hook points of :class:`gradsync.strategies.Strategy` on the model. On a server rank it serves
until the workers shut down, then leaves the process (``exit_servers=True``), so one script serves
both roles.

Why one file of this size: it is the one entry point users call, and every part of it (optimizer
wrapping, model checks, hook installation, state for checkpoints) is used only from here.
"""
from __future__ import annotations

import contextlib
import copy
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn

from gradsync import flight, runtime, trace
from gradsync.consistency import broadcast_model, check_models_match
from gradsync.errors import ConfigError, GradientEditedError, GradsyncError
from gradsync.strategies import Strategy, SyncContext, resolve


class _Sync:
    """Per-optimizer state: the strategy, whether gradient hooks are live, the hook handles, and
    the observer (:class:`gradsync.adapt.Monitors`) that sees local and synchronized gradients."""

    def __init__(self, strategy: Strategy, model: nn.Module, params: list[nn.Parameter], names: list[str]):
        self.strategy = strategy
        self.model, self.params, self.names = model, params, names
        # Unattached copies: the current strategy's, from which an elastic job re-creates it for each
        # new group, and the script's own, which workers joining an elastic job attach first.
        self.template = self.original = copy.deepcopy(strategy)
        self.enabled = True
        self.handles: list = []
        self.closed = False
        self.observer = None
        self.steps = 0  # optimizer steps taken, and the step at which the state was last consolidated
        self.consolidated = 0
        self.clip: float | None = None  # distribute(..., clip_grad_norm=)
        self.backward_queued = False  # the strategy's after_backward is queued on the running backward
        self.sent: dict[int, tuple] = {}  # grad_edits "refused": index -> (grad, version) when it was sent

    def end_backward(self) -> None:
        """The autograd engine's callback at the end of a backward pass that produced gradients."""
        self.backward_queued = False
        self.strategy.after_backward()

    def check_unedited(self) -> None:
        """Under a strategy that sent gradients during backward, refuse one changed since then."""
        sent, self.sent = self.sent, {}
        for index, (grad, version) in sent.items():
            now = self.params[index].grad
            if now is grad and (grad is None or grad._version == version):
                continue
            strategy = self.strategy
            how = "replaced" if now is not grad else "changed in place"
            fix = (f"pass clip_grad_norm=C to gradsync.distribute (clips by the global norm where {strategy.name} "
                   "updates), or " if strategy.clips else "")
            raise GradientEditedError(
                f"rank {runtime.current().topology.rank}: the gradient of {self.names[index]!r} was {how} between "
                f"backward() and optimizer.step() (clip_grad_norm_, GradScaler.unscale_ or an edit), but strategy "
                f"{strategy.name!r} sent it during backward and updates elsewhere, so the change would not reach "
                f"the update. To clip, {fix}use a strategy that synchronizes at the end of backward (allreduce, "
                "ddp, casync-ring, casync-ps, compressed-allgather). For mixed precision use bf16 autocast, "
                "which needs no GradScaler")

    def clipped(self, apply):
        """``apply`` preceded by clipping the gradients it will use to the global norm ``self.clip``."""
        params, clip = self.params, self.clip

        def run():
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], clip)
            return apply()
        return run

    @staticmethod
    def traced(apply):
        """``apply`` recorded as an ``optimizer step`` span on the compute track of the active
        tracer (``gradsync bench --trace``), where the strategy runs the user's optimizer."""
        tracer = trace.current()
        if tracer is None:
            return apply

        def run():
            start = time.perf_counter()
            try:
                return apply()
            finally:
                tracer.span("optimizer step", "compute", start, time.perf_counter())
        return run

    def set_observer(self, observer) -> None:
        if self.observer is not None:
            self.observer.close()
        self.observer = observer

    def observed(self, apply):
        """``apply`` preceded by the observer's look at the synchronized gradients."""
        observer = self.observer

        def run():
            observer.on_synced()
            return apply()
        return run

    def close(self) -> None:
        """Close the strategy and take gradsync's hooks off the model. The gradient hooks live in
        autograd's C++ nodes, out of Python's garbage collector's sight: only removing them lets
        the model, the optimizer state and the strategy be freed."""
        if self.closed:
            return
        self.closed = True
        self.strategy.close()
        self.remove_hooks()
        if self.observer is not None:
            self.observer.close()
        runtime.forget(self.close)

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class _ForwardRestore:
    """A handle that takes a strategy's forward wrapper off the model again."""

    def __init__(self, model: nn.Module):
        self.model = model

    def remove(self) -> None:
        self.model.__dict__.pop("forward", None)


def _check_arguments(model, optimizer) -> None:
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


def _trainable(model: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [p for _, p in named], [n for n, _ in named]


def _check_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], model: nn.Module) -> None:
    known = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            if id(p) not in known:
                raise ConfigError(f"optimizer param_groups[{g}]['params'][{k}] (shape {list(p.shape)}) "
                                  "is not a parameter of the model passed to distribute")


def _install_hooks(model: nn.Module, params: list[nn.Parameter], sync: _Sync) -> None:
    strategy = sync.strategy

    at_end = type(strategy).after_backward is not Strategy.after_backward
    watch = strategy.grad_edits == "refused"
    queue_callback = torch.autograd.Variable._execution_engine.queue_callback

    def ready(index):
        def hook(param):
            if not sync.enabled:
                return
            if at_end and not sync.backward_queued:  # once per backward pass, as DDP's reducer does
                sync.backward_queued = True
                queue_callback(sync.end_backward)
            if sync.observer is not None:
                sync.observer.on_local_grad(index, param.grad)
            strategy.on_grad_ready(index)
            if watch:
                grad = param.grad
                sync.sent[index] = (grad, None if grad is None else grad._version)
        return hook

    def before_forward(_module, _args):
        sync.backward_queued = False  # a backward that failed never ran its callback
        strategy.before_forward()

    sync.handles = [p.register_post_accumulate_grad_hook(ready(i)) for i, p in enumerate(params)]
    sync.handles.append(model.register_forward_pre_hook(before_forward))
    if type(strategy).on_params_needed is not Strategy.on_params_needed:
        index = {id(p): i for i, p in enumerate(params)}
        for module in model.modules():
            owned = tuple(index[id(p)] for p in module.parameters(recurse=False) if id(p) in index)
            if owned:
                sync.handles.append(module.register_forward_pre_hook(
                    lambda _module, _args, owned=owned: strategy.on_params_needed(owned)))
    if type(strategy).on_lookup is not Strategy.on_lookup:
        index = {id(p): i for i, p in enumerate(params)}
        for module in model.modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and id(module.weight) in index:
                sync.handles.append(module.register_forward_pre_hook(
                    lambda _module, args, kwargs, i=index[id(module.weight)]:
                        strategy.on_lookup(i, args[0] if args else kwargs["input"]), with_kwargs=True))
    # A checkpoint must not catch parameters still in flight (p3 finishes them lazily).
    sync.handles.append(model.register_state_dict_pre_hook(lambda *_args: strategy.flush()))
    # Nor may a late arrival overwrite parameters just loaded.
    sync.handles.append(model.register_load_state_dict_pre_hook(lambda *_args: strategy.flush()))
    sync.handles.append(model.register_load_state_dict_post_hook(lambda *_args: strategy.after_load()))
    forward = strategy.wrap_forward(model.forward)
    if forward is not None:
        model.forward = forward
        sync.handles.append(_ForwardRestore(model))


def _refuse_grad_scaler(sync: _Sync) -> None:
    raise GradientEditedError(
        f"rank {runtime.current().topology.rank}: a torch.amp.GradScaler calls optimizer.step(), but strategy "
        f"{sync.strategy.name!r} sent the gradients during backward, still multiplied by the loss scale, and "
        "updates elsewhere: the update would use them scaled, and could not skip a step whose gradients "
        "overflowed. For mixed precision use bf16 autocast, which needs no GradScaler, or a strategy that "
        "synchronizes at the end of backward (allreduce, ddp, casync-ring, casync-ps, compressed-allgather)")


def _wrap_optimizer(optimizer: torch.optim.Optimizer, sync: _Sync) -> torch.optim.Optimizer:
    base = type(optimizer)
    # A torch LR scheduler created before distribute has replaced ``step`` on the instance by a
    # wrapper around the class's step, which would hide ours and train without synchronizing.
    # Synchronize around that wrapper instead, keeping its attributes (the scheduler checks them).
    own_step = optimizer.__dict__.pop("step", None)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        apply = sync.traced(own_step if own_step is not None else lambda: base.step(self))
        if getattr(self, "found_inf", None) is not None and sync.strategy.grad_edits == "refused":
            _refuse_grad_scaler(sync)
        sync.check_unedited()
        if sync.clip is not None and sync.strategy.grad_edits != "refused":
            apply = sync.clipped(apply)
        if sync.observer is None:
            sync.strategy.step(apply)
        else:
            sync.strategy.step(sync.observed(apply))
            sync.observer.after_step()
        sync.steps += 1
        recorder = flight.current()
        if recorder is not None:
            recorder.step += 1
        return loss

    step.__dict__.update(getattr(own_step, "__dict__", {}))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward passes inside this block are not synchronized;
        the next backward outside it sends the accumulated gradients."""
        sync.enabled = False
        try:
            yield
        finally:
            sync.enabled = True

    def flush(self):
        """Wait until every synchronization in flight has finished: parameters are then current
        (strategies that overlap the next forward with communication, such as ``p3``, otherwise
        finish a parameter only when the next forward reaches it)."""
        sync.strategy.flush()

    def close(self):
        """End synchronization: close the strategy (dedicated servers leave their loop) and remove
        gradsync's hooks, so that the model and this optimizer can be freed. Also done at
        ``gradsync.shutdown()``; calling it twice is harmless."""
        sync.close()

    def switch_strategy(self, strategy, **options):
        """Continue with another strategy from the next step on, keeping parameters and optimizer
        state (KungFu's strategy adaptation). Collective: every worker calls it after the same step,
        with the same strategy. Parameters in flight are finished first; state spread over the
        workers (``ps``, ``p3``) is gathered and handed to the new strategy."""
        new = resolve(strategy, **options)
        _check_backend(new, runtime.current().transport)
        old = sync.strategy
        topo = runtime.current().topology
        if topo.num_servers and (old.uses_servers or new.uses_servers):
            raise ConfigError(f"{rank_and_strategy()}: cannot switch strategies in a job with dedicated servers "
                              "(they serve one strategy until shutdown); use co-located servers")
        if sync.observer is not None and not new.mean_grads_at_apply and any(
                m.needs_mean_grads for m in sync.observer):
            raise ConfigError(f"{rank_and_strategy()}: the attached monitors read synchronized gradients, which "
                              f"strategy {new.name!r} does not produce")
        _check_clip(sync.clip, new)
        template = copy.deepcopy(new)
        detach(self)
        try:
            reattach(self, new)
        except BaseException:
            sync.remove_hooks()  # whatever the failed attach installed
            reattach(self, copy.deepcopy(sync.template))  # train on with the old strategy, not unsynchronized
            raise
        sync.template = template
        return new

    def rank_and_strategy() -> str:
        return f"rank {runtime.current().topology.rank}, strategy {sync.strategy.name}"

    def _check_server_state(doing: str) -> None:
        strategy = sync.strategy
        if strategy.state_location == "servers" and not strategy.moves_server_state:
            raise GradsyncError(f"{rank_and_strategy()}: the optimizer state lives on the dedicated servers of "
                                f"{strategy.name!r} and cannot be {doing}; checkpoint the model, or use co-located "
                                "servers (or ps, whose servers hand their state over)")

    def consolidate_state_dict(self):
        """Collective over the workers (every worker calls it, after the same step): gather the
        optimizer state that ``ps`` (co-located or dedicated servers), ``p3`` and ``hybrid`` keep
        spread over the ranks, so that ``state_dict()`` on any worker returns all of it (as
        ``ZeroRedundancyOptimizer`` does). Other strategies need no call; it is harmless there."""
        _check_server_state("gathered")
        sync.strategy.gather_state()
        sync.consolidated = sync.steps

    def state_dict(self):
        """The whole optimizer state, as torch lays it out (see :mod:`gradsync.strategies.optstate`)."""
        where = sync.strategy.state_location
        if sync.steps:
            _check_server_state("saved")
        if where in ("workers", "servers") and sync.consolidated != sync.steps:
            holder = "the dedicated servers hold" if where == "servers" else "each worker holds"
            raise GradsyncError(f"{rank_and_strategy()}: {holder} the optimizer state of the parameters they "
                                "serve; call optimizer.consolidate_state_dict() on every worker after the last "
                                "step, then state_dict() on any of them")
        if where == "here":
            sync.strategy.gather_state()
        return base.state_dict(self)

    def load_state_dict(self, state_dict):
        """Load on every worker (a collective where the state is spread: the strategy hands it to
        the ranks that update, dedicated servers included)."""
        _check_server_state("loaded here; load it before gradsync.distribute (the servers run the same "
                            "script and take it then)")
        base.load_state_dict(self, state_dict)
        sync.strategy.load_state()
        sync.consolidated = sync.steps

    members = {"step": step, "no_sync": no_sync, "flush": flush, "close": close,
               "consolidate_state_dict": consolidate_state_dict, "state_dict": state_dict,
               "load_state_dict": load_state_dict, "switch_strategy": switch_strategy,
               "strategy": property(lambda self: sync.strategy),
               # torch.amp.GradScaler then hands step() the overflow flag (``found_inf``) instead of
               # unscaling: its unscale does not bump the version counters check_unedited reads.
               "_step_supports_amp_scaling": property(lambda self: sync.strategy.grad_edits == "refused"),
               "__module__": base.__module__, "__doc__": base.__doc__}
    optimizer.__class__ = type(base.__name__, (base,), members)
    optimizer._gradsync = sync
    return optimizer


def detach(optimizer, *, failed: bool = False) -> None:
    """Take the strategy off (finishing what is in flight and gathering spread optimizer state into
    the user's optimizer, unless ``failed``: after a peer died, only local clean-up is possible)."""
    sync = optimizer._gradsync
    old = sync.strategy
    if not failed:
        old.flush()
        if old.state_location in ("here", "workers"):
            old.gather_state()
    try:
        old.close()
    except Exception:
        if not failed:
            raise
    sync.remove_hooks()
    runtime.forget(sync.close)


def reattach(optimizer, strategy: Strategy) -> None:
    """Attach ``strategy`` (fresh, not attached before) to a distributed optimizer whose strategy was
    taken off by :func:`detach`, on the current process group; hand it the optimizer state."""
    sync = optimizer._gradsync
    base = type(optimizer).__mro__[1]
    wrapped, optimizer.__class__ = optimizer.__class__, base  # strategies take the user's class at attach
    try:
        strategy.attach(SyncContext(sync.model, optimizer, sync.params, sync.names, runtime.current().transport,
                                    runtime.current().topology, clip_grad_norm=sync.clip))
    finally:
        optimizer.__class__ = wrapped
    sync.strategy = strategy
    _install_hooks(sync.model, sync.params, sync)
    strategy.load_state()
    sync.consolidated = sync.steps
    runtime.on_shutdown(sync.close)


def _check_backend(strategy: Strategy, transport) -> None:
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


def _check_clip(clip: float | None, strategy: Strategy) -> None:
    if clip is None:
        return
    if isinstance(clip, bool) or not (isinstance(clip, (int, float)) and 0 < clip < float("inf")):
        raise ConfigError(f"clip_grad_norm must be a positive finite number, got {clip!r}")
    if strategy.grad_edits == "refused" and not strategy.clips:
        raise ConfigError(f"strategy {strategy.name!r} updates each piece of the model as it arrives and cannot "
                          "clip by the global gradient norm; use allreduce, ddp, casync-ring, casync-ps or "
                          "compressed-allgather (which also let you call clip_grad_norm_ yourself), or ps")


def distribute(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str | Strategy = "allreduce",
               *, exit_servers: bool = True, clip_grad_norm: float | None = None,
               **options: Any) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` a synchronized data-parallel step. Returns the same optimizer.

    Args:
        model: the model every rank built identically (checked).
        optimizer: its optimizer, over (a subset of) ``model``'s parameters.
        strategy: a registered name (``"allreduce"``, ``"ps"``, ``"ps-async"``, ``"ddp"``, ...)
            or a strategy object such as ``gradsync.AllReduce(bucket_mb=25)``.
        exit_servers: on a parameter-server rank, leave the process once serving is over
            (the default, so the same script runs on workers and servers).
        clip_grad_norm: clip the mean gradient to this global L2 norm before every update, where
            the update happens (on the servers for ``ps``). Under strategies that synchronize at
            the end of backward (``allreduce``, ``ddp``, ``casync-*``, ``compressed-allgather``)
            this equals calling ``torch.nn.utils.clip_grad_norm_`` between backward and step;
            under ``sma`` and ``pair-averaging`` it clips each worker's own gradient.
        **options: passed to the strategy's constructor when ``strategy`` is a name.

    Gradients on workers are the mean over workers (see :mod:`gradsync.strategies.base`); under
    strategies whose ``grad_edits`` is ``"synced"`` they are in ``p.grad`` when ``backward()``
    returns. Elsewhere a gradient changed between backward and step raises
    :class:`~gradsync.errors.GradientEditedError` instead of training a different model.
    Call ``optimizer.step()`` once per backward, or use ``with optimizer.no_sync():`` for all
    but the last backward of an accumulation.
    """
    _check_arguments(model, optimizer)
    strategy = resolve(strategy, **options)
    _check_clip(clip_grad_norm, strategy)
    rt = runtime.current()
    _check_backend(strategy, rt.transport)
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
    params, names = _trainable(model)
    _check_optimizer(optimizer, params, model)
    world = strategy.uses_servers
    check_models_match(model, rt.transport, world=world)
    # A worker joining a running elastic job holds a fresh model: comparing digests would be wasted.
    joining = rt.elastic is not None and rt.elastic.gen > 0 and rt.elastic.any_new
    broadcast_model(model, rt.transport, world=world, compare_first=not joining)
    sync = _Sync(strategy, model, params, names)
    sync.clip = clip_grad_norm
    strategy.attach(SyncContext(model, optimizer, params, names, rt.transport, topology,
                                clip_grad_norm=clip_grad_norm))
    runtime.on_shutdown(sync.close)
    if topology.is_server:
        strategy.serve()
        return _leave_server(exit_servers, optimizer)
    _install_hooks(model, params, sync)
    return _wrap_optimizer(optimizer, sync)


def _leave_server(exit_servers: bool, optimizer):
    if exit_servers:
        runtime.shutdown()
        sys.exit(0)
    return optimizer
