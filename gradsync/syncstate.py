"""The state that ties one distributed optimizer to its model and strategy.

:func:`gradsync.distribute` makes one :class:`SyncState` per optimizer and keeps it as
``optimizer._gradsync``; the model's hooks (:mod:`gradsync.hooks`), the wrapped optimizer
(:mod:`gradsync.optimizer`) and the adaptive layer (:mod:`gradsync.adapt`) read and update it.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from gradsync import runtime, trace
from gradsync.errors import GradientEditedError
from gradsync.strategies import Strategy


class SyncState:
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
        self.sent: dict[int, tuple] = {}  # refuses_edits: index -> (grad, version) when it was sent
        self.user_step = None  # a torch LR scheduler's wrapper of the user's step, made before distribute
        self.grad_weight = 1.0  # this worker's gradients are multiplied by it before they are sent

    def weigh(self, grad: torch.Tensor | None) -> None:
        """Multiply this worker's gradient by :attr:`grad_weight`, in place, before the strategy sees
        it: with ``num_workers * b_r / B`` the strategies' mean over workers is the gradient of the
        whole global batch ``B`` when worker ``r`` took ``b_r`` of it. Weight 0 zeroes the gradient
        (an empty batch's mean loss is NaN, and NaN times 0 is still NaN)."""
        w = self.grad_weight
        if grad is None or w == 1.0:
            return
        if w == 0.0:
            grad.zero_()
        else:
            grad.mul_(w)

    @property
    def refuses_edits(self) -> bool:
        """The strategy sends gradients during backward and updates elsewhere (``grad_edits == "refused"``),
        so a gradient changed between backward and step cannot reach the update."""
        return self.strategy.grad_edits == "refused"

    def where(self) -> str:
        """``rank R, strategy NAME``: how error messages start."""
        return f"rank {runtime.current().topology.rank}, strategy {self.strategy.name}"

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
