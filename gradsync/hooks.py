"""The hooks that connect a model to its strategy's hook points (:class:`gradsync.strategies.Strategy`).

Installed by :func:`gradsync.distribute` and again after each ``switch_strategy``; every handle
goes to the optimizer's :class:`~gradsync.syncstate.SyncState`, which removes them at ``close()``.
A hook point the strategy does not override costs the model nothing: no hook is installed for it.
"""
from __future__ import annotations

import torch
from torch import nn

from gradsync import flight, trace
from gradsync.strategies import Strategy


class ForwardRestore:
    """A handle that takes a strategy's forward wrapper off the model again."""

    def __init__(self, model: nn.Module):
        self.model = model

    def remove(self) -> None:
        self.model.__dict__.pop("forward", None)


def install(sync) -> None:
    """Put ``sync.strategy``'s hooks on ``sync.model`` (``sync``: a :class:`~gradsync.syncstate.SyncState`)."""
    model, strategy = sync.model, sync.strategy
    sync.handles = [p.register_post_accumulate_grad_hook(_grad_ready(sync, i)) for i, p in enumerate(sync.params)]
    sync.handles.append(model.register_forward_pre_hook(_before_forward(sync)))
    if _overrides(strategy, "on_params_needed"):
        sync.handles += _params_needed_hooks(model, sync.params, strategy)
    if _overrides(strategy, "on_lookup"):
        sync.handles += _lookup_hooks(model, sync.params, strategy)
    sync.handles += _state_dict_hooks(model, strategy)
    tracer = trace.current()
    if tracer is not None and tracer.path is not None:  # a user's job tracing itself: its layers too
        sync.handles += trace.instrument(model)
    forward = strategy.wrap_forward(model.forward)
    if forward is not None:
        model.forward = forward
        sync.handles.append(ForwardRestore(model))


def _overrides(strategy: Strategy, hook_point: str) -> bool:
    return getattr(type(strategy), hook_point) is not getattr(Strategy, hook_point)


def _grad_ready(sync, index: int):
    """The hook run when parameter ``index``'s gradient has accumulated: the observer sees the local
    gradient, it is weighted (``sync.grad_weight``) and handed to the strategy. Inside ``no_sync`` the
    hook does nothing, so the weight applies once, to the gradient accumulated over micro-batches."""
    strategy = sync.strategy
    at_end = _overrides(strategy, "after_backward")
    watch = sync.refuses_edits
    queue_callback = torch.autograd.Variable._execution_engine.queue_callback

    def hook(param):
        if not sync.enabled:
            return
        if at_end and not sync.backward_queued:  # once per backward pass, as DDP's reducer does
            sync.backward_queued = True
            queue_callback(sync.end_backward)
        if sync.observer is not None:
            sync.observer.on_local_grad(index, param.grad)
        sync.weigh(param.grad)  # in place before it is sent and recorded: the edit check sees it unedited
        strategy.on_grad_ready(index)
        if watch:
            grad = param.grad
            sync.sent[index] = (grad, None if grad is None else grad._version)
    return hook


def _before_forward(sync):
    def hook(_module, _args):
        sync.backward_queued = False  # a backward that failed never ran its callback
        recorder = flight.current()
        if recorder is not None:
            recorder.pace.forward(recorder.waited_s)
        sync.strategy.before_forward()
    return hook


def _params_needed_hooks(model: nn.Module, params: list[nn.Parameter], strategy: Strategy) -> list:
    """One hook per module that owns parameters: the strategy finishes them before the module runs."""
    index = {id(p): i for i, p in enumerate(params)}
    handles = []
    for module in model.modules():
        owned = tuple(index[id(p)] for p in module.parameters(recurse=False) if id(p) in index)
        if owned:
            handles.append(module.register_forward_pre_hook(
                lambda _module, _args, owned=owned: strategy.on_params_needed(owned)))
    return handles


def _lookup_hooks(model: nn.Module, params: list[nn.Parameter], strategy: Strategy) -> list:
    """One hook per embedding: the strategy sees the rows a lookup reads before it reads them."""
    index = {id(p): i for i, p in enumerate(params)}
    handles = []
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and id(module.weight) in index:
            handles.append(module.register_forward_pre_hook(
                lambda _module, args, kwargs, i=index[id(module.weight)]:
                    strategy.on_lookup(i, args[0] if args else kwargs["input"]), with_kwargs=True))
    return handles


def _state_dict_hooks(model: nn.Module, strategy: Strategy) -> list:
    # A checkpoint must not catch parameters still in flight (p3 finishes them lazily),
    # nor may a late arrival overwrite parameters just loaded.
    return [model.register_state_dict_pre_hook(lambda *_args: strategy.flush()),
            model.register_load_state_dict_pre_hook(lambda *_args: strategy.flush()),
            model.register_load_state_dict_post_hook(lambda *_args: strategy.after_load())]
