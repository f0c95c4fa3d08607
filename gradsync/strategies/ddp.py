"""PyTorch's own DistributedDataParallel, wrapped: the reference peer in every comparison.

``distribute(model, opt, "ddp")`` builds ``DistributedDataParallel`` over the workers' process
group and routes the user's ``model(x)`` through it, so the training loop stays unchanged. The
optimizer then steps locally on DDP's averaged gradients. Defaults are DDP's own (25 MB buckets,
``find_unused_parameters=False``, buffers broadcast from rank 0 every forward), so a comparison
with ``ddp`` is a comparison with what users get from PyTorch.

Bytes on the wire are DDP's ring all-reduce of every gradient, ``2 (p-1)/p`` times their size per
worker per step (counted from the parameter sizes; DDP's own collectives are not intercepted).

``compression=NAME`` (any :mod:`gradsync.compress` spec, e.g. ``"powersgd:rank=2"``) registers
:func:`gradsync.compress.hook.comm_hook` on the DDP model, with ``error_feedback`` if asked: what a
user of vanilla DDP would do, and then the wire bytes are the hook's own count.

The reducer waits in C++, where no exception reaches it: a :class:`gradsync.watchdog.Watchdog`
watches from a forward to the optimizer step, so that a peer that stops is named within the
timeout of the fault, as gradsync's own strategies name it.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync._lazy import lazy_names
from gradsync.compress import build, hook, parse_spec
from gradsync.errors import ConfigError
from gradsync.strategies.base import Strategy, SyncContext, host_ring_bytes
from gradsync.watchdog import Watchdog


# torch 2.13 renamed broadcast_buffers and added init_sync; keep working on torch >= 2.4.
_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters
_BUFFERS_ARG = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
_NO_INIT_SYNC = {"init_sync": False} if "init_sync" in _DDP_ARGS else {}


class _Forward(nn.Module):
    """Holds the user's model so DDP sees its parameters, and calls its original forward."""

    def __init__(self, model: nn.Module, forward: Callable):
        super().__init__()
        self.model = model
        self._forward = forward

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)


_UNUSED = "Expected to have finished reduction in the prior iteration"
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def _unused_parameters(exc: BaseException, module: nn.Module, rank: str) -> ConfigError | None:
    """DDP's reducer found, at this forward, parameters that got no gradient in the last backward
    (they were not used to compute the loss): the error to raise instead, naming them, or None for
    any other error."""
    if not isinstance(exc, RuntimeError) or _UNUSED not in str(exc):
        return None
    found = _UNUSED_INDICES.search(str(exc))
    named = ""
    if found:  # the reducer's indices: the module's trainable parameters in registration order, once each
        params, seen = [], set()
        for prefix, sub in module.named_modules():
            for name, p in sub.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(f"{prefix}.{name}".removeprefix("model.").lstrip("."))
        picked = [params[int(i)] for i in found.group(1).split() if int(i) < len(params)]
        named = f" ({', '.join(repr(n) for n in picked)})" if picked else ""
    return ConfigError(
        f"{rank}, strategy ddp: some parameters{named} got no gradient in the previous step: the "
        "model's forward did not use them for the loss, and PyTorch's DDP waits for every parameter "
        "unless told otherwise. Pass find_unused_parameters=True (distribute(model, optimizer, \"ddp\", "
        "find_unused_parameters=True); it costs a walk of the autograd graph every step), or use "
        "strategy \"allreduce\", which synchronizes only the gradients a step produced")


class TorchDDP(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` with its usual options."""

    name = "ddp"
    summary = "PyTorch's DistributedDataParallel, wrapped: the reference peer"
    grad_edits = "synced"  # DDP's reducer waits for its buckets at the end of backward
    mean_grads_at_apply = True  # DDP's reducer leaves the averaged gradients in p.grad before step
    mean_over_workers = True  # gradsync's gradient hook runs before the reducer's: weights reach it
    waits_recorded = False  # the reducer waits for its buckets in C++

    def __init__(self, bucket_mb: float = 25.0, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False,
                 compression: str | None = None, error_feedback: bool = False):
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ConfigError(f"ddp bucket_mb must be a number > 0 (MB), got {bucket_mb!r}")
        self.options = dict(bucket_cap_mb=bucket_mb, find_unused_parameters=find_unused_parameters,
                            **{_BUFFERS_ARG: broadcast_buffers},
                            gradient_as_bucket_view=gradient_as_bucket_view)
        self.compression, self.error_feedback = compression, error_feedback
        self.hook_state = None
        self.watchdog: Watchdog | None = None  # made when attached: the strategy is copied before
        if compression is not None:
            name, options = parse_spec(compression)
            self.exact = build(name, **options).lossless  # a bad name or option fails here

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        p = ctx.topology.num_workers
        grad_bytes = sum(q.numel() * q.element_size() for q in ctx.params)
        self.bytes_per_step = int(2 * (p - 1) / p * grad_bytes)

    def wrap_forward(self, forward: Callable) -> Callable:
        # distribute() already broadcast rank 0's state and checked shapes: skip DDP's own init sync.
        ddp = DistributedDataParallel(_Forward(self.ctx.model, forward), **_NO_INIT_SYNC,
                                      process_group=self.ctx.transport.worker_group, **self.options)
        self.ddp = ddp
        self.watchdog = Watchdog("DDP's all-reduce (PyTorch's reducer)")
        if self.compression is not None:
            name, options = parse_spec(self.compression)
            self.hook_state, compression_hook = hook.comm_hook(
                name, self.ctx.model, error_feedback=self.error_feedback,
                process_group=self.ctx.transport.worker_group, **options)
            ddp.register_comm_hook(self.hook_state, compression_hook)

        def forward_through_ddp(*args, **kwargs):
            # A plain function, not the module: assigning a Module to model.forward would register
            # it as a submodule and leave the class's forward in place.
            self.watchdog.enter()
            try:
                out = ddp(*args, **kwargs)
            except BaseException as exc:
                self.watchdog.leave()
                unused = _unused_parameters(exc, ddp.module, self.ctx.topology.describe(self.ctx.topology.rank))
                if unused is not None:
                    raise unused from exc
                raise
            if not torch.is_grad_enabled():  # an evaluation: no backward follows
                self.watchdog.leave()
            else:
                self._wait_from_backward(out)
            return out

        return forward_through_ddp

    def _wait_from_backward(self, out) -> None:
        """Between this forward and its backward the script runs its own code (the loss, the next
        micro-batch): shown as such, so that a rank stuck there is named by its peers. The wait
        shows again when backward reaches the output (its all-reduces follow)."""
        tensors = out if isinstance(out, (list, tuple)) else list(out.values()) if isinstance(out, dict) else [out]
        first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            self.watchdog.pause()
            first.register_hook(self._backward_began)

    def _backward_began(self, grad):
        self.watchdog.record()
        return None

    def step(self, apply: Callable[[], Any]) -> Any:
        if self.hook_state is None:
            self.ctx.transport.count_external(self.bytes_per_step)
        else:
            self.ctx.transport.count_external(self.hook_state.bytes_sent)
            self.hook_state.bytes_sent = 0
        # DDP's reducer waited for every bucket at the end of backward (count_external marked that
        # progress): the training thread waits on no peer until the next forward.
        self.watchdog.leave()
        return apply()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()

    def min_bytes_per_host(self, model_bytes: int) -> float:
        return host_ring_bytes(model_bytes, self.ctx.topology)

    def describe(self) -> str:
        hooked = "" if self.compression is None else f", comm hook {self.compression}" + (
            " with error feedback" if self.error_feedback else "")
        return (f"ddp(bucket_mb={self.options['bucket_cap_mb']:g}, "
                f"find_unused_parameters={self.options['find_unused_parameters']}{hooked})")

# The old class name, kept as a deprecated alias.
lazy_names(__name__, {}, renamed={"DDP": "gradsync.strategies.TorchDDP"})
