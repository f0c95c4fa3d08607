"""What P3 and ByteScheduler-style strategies share: forward order, per-slice waits, per-slice updates.

- :class:`ForwardOrder`: learns the order in which the first forward pass needs the parameters
  (from ``on_params_needed``) and agrees on rank 0's by broadcast.
- :class:`Arrivals`: which slices are current for the next forward; the training thread waits for
  just the slices a module needs, while communication threads mark arrivals or report an error
  (which the waiting thread raises, so a failed peer is an error, never a hang).
- :class:`SliceOptimizers`: one optimizer instance per slice (the user's class and
  hyperparameters over 1-D views of the parameters' memory), so a slice can be updated as soon as
  its averaged gradient is known. Exact for elementwise optimizers (:data:`ELEMENTWISE`). Their
  state goes in and out of checkpoints through :mod:`gradsync.strategies.optstate`.
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch import nn

from gradsync import runtime, trace
from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.optstate import StateLayout, cut
from gradsync.strategies.slicing import SlicePlan, flat_view

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
               torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
               torch.optim.Rprop)
"""Optimizers whose update of a slice equals their update of the whole tensor, element by element."""


def check_elementwise_flag(elementwise: bool | None) -> None:
    if elementwise is not None and not isinstance(elementwise, bool):
        raise ConfigError(f"elementwise_optimizer must be True, False or None (decide from the optimizer's "
                          f"class), got {elementwise!r}")


def check_sliceable(name: str, ctx, elementwise: bool | None) -> None:
    """One dtype, contiguous parameters and an elementwise optimizer, or a clear error."""
    for p, n in zip(ctx.params, ctx.names):
        if p.dtype != ctx.params[0].dtype:
            raise ConfigError(f"{name} sends every parameter in one message format and needs one dtype; "
                              f"parameter {n!r} is {p.dtype}, {ctx.names[0]!r} is {ctx.params[0].dtype}")
        if not p.is_contiguous():
            raise ConfigError(f"{name} slices parameters in memory order; parameter {n!r} is not "
                              "contiguous (make it so with `param.data = param.data.contiguous()`)")
    cls = type(ctx.optimizer)
    if elementwise is False or (elementwise is None and not issubclass(cls, ELEMENTWISE)):
        raise ConfigError(f"{name} updates each slice of a parameter on its own, which equals a whole-tensor "
                          f"update only for elementwise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...); "
                          f"{cls.__name__} is not known to be one. If it is, pass elementwise_optimizer=True")


class ForwardOrder:
    """The order of the first forward pass, learned from the hook points and agreed across ranks."""

    def __init__(self, num_params: int):
        self.n = num_params
        self.announced: dict[int, None] = {}
        self.got_grad: set[int] = set()

    def eager(self) -> list[int]:
        """Parameters that got a gradient although no module owning them was called (a parent used
        them directly): needed from the start of every forward."""
        return [i for i in sorted(self.got_grad) if i not in self.announced]

    def agree(self, transport, world: bool) -> list[int]:
        """Eager parameters, then forward order, then the never-used ones; rank 0's version wins."""
        eager = self.eager()
        seen = set(eager) | set(self.announced)
        order = eager + list(self.announced) + [i for i in range(self.n) if i not in seen]
        if transport.topology.world_size > 1:
            agreed = torch.tensor(order, dtype=torch.int64, device=transport.device)
            transport.broadcast(agreed, src=0, world=world, what="broadcast of the forward order")
            order = agreed.tolist()
        return order


class Arrivals:
    """``arrived[k]``: how many steps of slice ``k`` are in this worker's parameters."""

    def __init__(self, num_slices: int, names: list[str]):
        self.arrived = [0] * num_slices
        self.names = names
        self.error: BaseException | None = None
        self.cv = threading.Condition()
        self.last = time.monotonic()  # the latest arrival: a waiting thread's progress

    def mark(self, k: int, step: int) -> None:
        with self.cv:
            self.arrived[k] = step + 1
            self.last = time.monotonic()
            self.cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.cv:
            self.error = self.error or exc
            self.cv.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def wait(self, slices, steps: int, indices=None) -> None:
        """Block until every slice in ``slices`` holds ``steps`` updates (or a thread failed).

        The wait's progress is an arrival, not other traffic (keep-alives): with nothing arriving
        for the timeout it raises, naming the ranks that hold it back (``runtime.check_progress``)."""
        arrived = self.arrived
        if all(arrived[k] >= steps for k in slices):
            return
        tracer = trace.current()
        what = "wait for " + ("parameters of " + ", ".join(repr(self.names[i]) for i in indices[:2]) if indices
                              else "every parameter")
        began = time.monotonic()
        with tracer.waiting(what) if tracer is not None else contextlib.nullcontext(), self.cv:
            runtime.wait_until(self.cv, lambda: self.check() or all(arrived[k] >= steps for k in slices), what,
                               lambda: max(began, self.last))
        self.check()


class Gradients:
    """One step's gradients against a slice plan: which parameters have theirs, and which slices
    a new gradient completes (every segment's gradient in: the slice can leave). ``sent`` names
    what the strategy does with a complete slice, for the error on a second gradient."""

    def __init__(self, plan: SlicePlan, names: list[str], sent: str):
        self.plan, self.names, self.sent = plan, names, sent
        self.open()

    def open(self) -> None:
        """A new step: no gradient yet."""
        self.ready = [False] * len(self.names)
        self.pending = [len(sl.segments) for sl in self.plan.slices]

    def arrived(self, index: int) -> list[int]:
        """Parameter ``index`` has its gradient: the slices that completes, in plan order."""
        if self.ready[index]:
            raise GradsyncError(
                f"parameter {self.names[index]!r} received a second gradient after it was {self.sent}. "
                "For gradient accumulation, run all but the last backward inside `with optimizer.no_sync():`")
        self.ready[index] = True
        complete = []
        for k in self.plan.of_param[index]:
            self.pending[k] -= 1
            if self.pending[k] == 0:
                complete.append(k)
        return complete


class SliceOptimizers:
    """Per slice, the user's optimizer over 1-D views of the slice's parameter memory."""

    def __init__(self, plan: SlicePlan, slices, params: list[nn.Parameter], optimizer, optimizer_class):
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.plan, self.params = plan, params
        self.of: dict[int, tuple[list[nn.Parameter | None], torch.optim.Optimizer | None, list[int]]] = {}
        for k in slices:
            views, groups = [], {}
            for seg in plan.slices[k].segments:
                g = group_of.get(id(params[seg.param]))
                view = None if g is None else nn.Parameter(flat_view(params[seg.param], seg))
                views.append(view)
                if view is not None:
                    groups.setdefault(g, []).append(view)
            made = None
            if groups:
                made = optimizer_class([{**hyper(optimizer.param_groups[g]), "params": ps} for g, ps in groups.items()])
            self.of[k] = (views, made, list(groups))
        if optimizer.state:  # state loaded into the user's optimizer before the plan existed
            self.load(StateLayout(optimizer_class, optimizer, params), optimizer.state)
            optimizer.state.clear()

    def pieces(self):
        """This rank's optimizer state, one :data:`~gradsync.strategies.optstate.Piece` per segment."""
        for k, (views, opt, _) in self.of.items():
            for seg, view in zip(self.plan.slices[k].segments, views):
                if view is not None and view in opt.state:
                    yield seg.param, seg.start, seg.length, opt.state[view]

    def load(self, layout: StateLayout, state: dict) -> None:
        """Give each slice's optimizer its part of ``state`` (whole tensors, keyed by parameter)."""
        for k, (views, opt, _) in self.of.items():
            for seg, view in zip(self.plan.slices[k].segments, views):
                whole = state.get(self.params[seg.param]) if view is not None else None
                if whole:
                    opt.state[view] = cut(layout, whole, seg.param, seg.start, seg.length)

    def update(self, k: int, mean: torch.Tensor, used: list[float], hyperparameters: list[dict] | None) -> None:
        """Apply one step to slice ``k`` with gradient ``mean`` (its values in slice layout); a
        segment that no worker used gets ``grad = None`` and is skipped, as in DDP."""
        views, opt, groups = self.of[k]
        if opt is None:
            return
        mean = mean.to(self.params[0].device)  # slices travel in host memory over Gloo
        for seg, view, count in zip(self.plan.slices[k].segments, views, used):
            if view is not None:
                view.grad = mean[seg.offset:seg.offset + seg.length] if count else None
        if hyperparameters is not None:
            for group, g in zip(opt.param_groups, groups):
                group.update(hyperparameters[g])
        opt.step()
        for view in views:
            if view is not None:
                view.grad = None


def hyper(group: dict) -> dict:
    """An optimizer param group without its parameters: the hyperparameters."""
    return {k: v for k, v in group.items() if k != "params"}


def out_of_step(stopped: str, their_steps: int, me: str, my_steps: int) -> GradsyncError:
    """The error for a worker that trains past the last step of one that already stopped: what it
    waits for would never come, so it raises instead of hanging."""
    return GradsyncError(f"workers are out of step: {stopped} stopped after {their_steps} steps while {me} has taken "
                         f"{my_steps}; every worker must run the same number of optimizer steps before "
                         "gradsync.shutdown()")
