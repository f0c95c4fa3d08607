"""Training that communicates every ``H`` steps: ``diloco`` (Douillard et al., arXiv 2311.08105;
streamed in fragments as in Streaming DiLoCo, arXiv 2501.18512) and ``local-sgd`` (Stich, ICLR
2019; Lin et al., ICLR 2020).

``diloco`` (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105): each worker runs ``H`` steps of the user's own optimizer (the *inner* optimizer)
on its own data, with no communication. Then the *outer gradient* of each parameter, the change
since the last synchronization ``delta_w = theta - theta_w``, is averaged over workers, and an
*outer* optimizer (SGD with Nesterov momentum, ``outer_lr`` 0.7 and momentum 0.9 as in the paper)
steps the shared parameters ``theta`` with it; every worker continues from the new ``theta``.

``local-sgd`` (Stich, ICLR 2019; Lin et al., ICLR 2020) is the same with outer SGD at learning
rate 1 and no momentum: every ``H`` steps the workers' parameters are replaced by their mean.

The streaming form (Douillard et al., "Streaming DiLoCo", arXiv 2501.18512), ``fragments=F``:
the parameters are cut into ``F`` fragments of about equal size, in model order, and fragment ``f``
synchronizes at the steps ``t`` with ``t = f H / F (mod H)``, so the network carries one fragment
at a time instead of the whole model every ``H`` steps. ``delay=tau`` sends a fragment's outer
gradient in the background while ``tau`` more inner steps run, and merges the result when it
lands: ``theta_w = mix theta_w + (1 - mix) theta`` (``mix`` 0.5 by default with a delay, the
paper's choice; without one the worker takes ``theta``). Both work with one fragment too.

How the outer gradient travels: it is a gradient, so a gradient strategy carries it. Each fragment
holds a copy of its parameters (``theta``) as the parameters of an ``allreduce`` strategy, or of
``casync-ring`` where ``compression`` names a codec whose payloads do not sum (``int4``,
``int8``, ``onebit``, ...; summable ones such as ``bf16`` are all-reduced as they are). The
strategy's buckets, two-level hosts and fault handling apply unchanged, the outer optimizer is
what its ``step`` applies, and compression keeps error feedback per site (``error_feedback``,
on by default) so what a 4-bit quantizer drops is sent at the next synchronization.

Exactness: with ``H=1`` and the update of the user's optimizer linear in the gradient (SGD,
with or without momentum and weight decay), averaging the workers' parameters after each step
equals stepping once with the averaged gradient, so ``local-sgd`` with ``H=1``, and ``diloco``
with ``H=1, outer_lr=1, outer_momentum=0``, equal the single-process reference wherever every
worker computes a gradient for every parameter (the tests check both). Otherwise, and for any
``H > 1``, workers train apart between synchronizations and the strategy is not exact; the bench
reports its loss next to the reference.

Between synchronizations each worker holds its own parameters: checkpoints and ``flush()`` see
worker 0's, evaluation on another worker sees its own. ``close()`` (shutdown, a strategy switch)
gives every worker the mean of the workers' parameters. BatchNorm statistics (floating buffers)
are averaged with the first fragment. The outer optimizer's momentum is the strategy's: a
checkpoint or an elastic resize restarts it (and ``theta``) from the parameters then.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from gradsync.compress import PowerSGD, build, parse_spec
from gradsync.compress.base import all_finite
from gradsync.errors import ConfigError
from gradsync.strategies.base import Strategy, SyncContext
from gradsync.strategies.casync_ring import compressed_allreduce
from gradsync.strategies.overlap import ELEMENTWISE


class DiLoCo(Strategy):
    name = "diloco"
    summary = "DiLoCo: H local steps, then an outer Nesterov step on the mean parameter change (streamed with fragments)"
    grad_edits = "local"  # the inner optimizer steps with this worker's own gradient
    exact = False
    synchronous = False  # workers meet every H steps, not every step

    def __init__(self, H: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 fragments: int = 1, delay: int = 0, mix: float | None = None, compression: str | None = None,
                 error_feedback: bool = True,
                 outer_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None):
        if not isinstance(H, int) or isinstance(H, bool) or H < 1:
            raise ConfigError(f"{self.name}: H (inner steps between synchronizations) must be an integer >= 1, got {H!r}")
        if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
            raise ConfigError(f"{self.name}: fragments must be an integer >= 1, got {fragments!r}")
        if not isinstance(delay, int) or isinstance(delay, bool) or not 0 <= delay < H:
            raise ConfigError(f"{self.name}: delay (inner steps a fragment's synchronization overlaps) must be an "
                              f"integer in [0, H) = [0, {H}), so that it lands before it is sent again; got {delay!r}")
        if mix is not None and not 0.0 <= mix <= 1.0:
            raise ConfigError(f"{self.name}: mix must be in [0, 1] (the share of the worker's own parameters kept "
                              f"when a delayed fragment lands), got {mix!r}")
        if not outer_lr > 0:
            raise ConfigError(f"{self.name}: outer_lr must be > 0, got {outer_lr!r}")
        if not 0.0 <= outer_momentum < 1.0:
            raise ConfigError(f"{self.name}: outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise ConfigError(f"{self.name}: outer_optimizer must be a callable that takes a list of parameters and "
                              f"returns a torch.optim.Optimizer, got {outer_optimizer!r}")
        self.H, self.fragments, self.delay = H, fragments, delay
        self.period = H
        self.mix = (0.5 if delay else 0.0) if mix is None else float(mix)
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.outer_optimizer = outer_optimizer
        self.compression, self.error_feedback = compression, error_feedback
        self.summable = True
        if compression is not None:
            codec, options = parse_spec(compression)
            self.codec_name, self.codec_options = codec, options  # as the compressed strategies name theirs
            probe = build(codec, **options)  # a bad name or option fails here, not at the first synchronization
            self.summable = probe.summable and not isinstance(probe, PowerSGD)
            self.exact = False

    # -- setup ---------------------------------------------------------------------------------------
    def _outer_strategy(self) -> Strategy:
        """The gradient strategy that averages one fragment's outer gradient."""
        options = {"rebuild_buckets": False} if self.summable else {}  # the order is always backward's
        return compressed_allreduce(self.compression, self.error_feedback, broadcast_buffers=False, **options)

    def _make_outer_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.outer_optimizer is None:
            return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum,
                                   nesterov=self.nesterov and self.outer_momentum > 0)
        made = self.outer_optimizer(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise ConfigError(f"{self.name}: outer_optimizer returned {type(made).__name__}, not a torch.optim.Optimizer")
        if self.fragments > 1 and not isinstance(made, ELEMENTWISE):
            raise ConfigError(f"{self.name}: with fragments={self.fragments} each fragment has its own outer optimizer, "
                              f"which equals one over the whole model only for elementwise optimizers (SGD, Adam, "
                              f"...); {type(made).__name__} is not known to be one. Use fragments=1")
        return made

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        n = len(ctx.params)
        if self.fragments > n:
            raise ConfigError(f"{self.name}: fragments={self.fragments} exceeds the model's {n} trainable parameters; "
                              f"a fragment holds whole parameters, so use fragments <= {n}")
        self.parts = []
        for f, indices in enumerate(split([p.numel() for p in ctx.params], self.fragments)):
            params = [ctx.params[i] for i in indices]
            theta = [nn.Parameter(p.detach().clone()) for p in params]
            outer_opt = self._make_outer_optimizer(theta)
            outer = self._outer_strategy()
            outer.attach(SyncContext(model=nn.ParameterList(theta), optimizer=outer_opt, params=theta,
                                     names=[f"{ctx.names[i]} (outer gradient)" for i in indices],
                                     transport=ctx.transport, topology=ctx.topology, stats=ctx.stats,
                                     two_level=ctx.two_level))
            self.parts.append(_Fragment(params, theta, outer_opt, outer, offset=f * self.H // self.fragments))
        self.buffers = [b for b in ctx.model.buffers() if b.is_floating_point()]
        self.t = 0
        self.syncs = 0
        self.closed = False

    # -- hook points ---------------------------------------------------------------------------------
    def step(self, apply: Callable[[], Any]) -> Any:
        result = apply()
        self.t += 1
        for part in self.parts:
            if part.launched is not None and self.t - part.launched >= self.delay:
                self._land(part)
        for part in self.parts:
            if self.t >= part.offset and (self.t - part.offset) % self.H == 0 and self.t > 0:
                self._launch(part)
                if not self.delay:
                    self._land(part)
        return result

    def _launch(self, part: "_Fragment") -> None:
        """Send the fragment's outer gradient ``theta - theta_w`` through its gradient strategy."""
        with torch.no_grad():
            for shared, mine in zip(part.theta, part.params):
                shared.grad = shared.detach() - mine.detach()
        for i in reversed(range(len(part.theta))):  # as backward would: the strategy's bucket order
            part.outer.on_grad_ready(i)
        part.launched = self.t

    def _land(self, part: "_Fragment") -> None:
        """Wait for the mean outer gradient, step ``theta`` with the outer optimizer, continue from it.
        A fault every worker agreed on (a non-finite outer gradient through a codec) raises here,
        on every worker, with nothing applied; the fragment is then no longer in flight."""
        part.launched = None
        try:
            part.outer.after_backward()
            part.outer.step(part.optimizer.step)
        finally:
            for shared in part.theta:
                shared.grad = None
        with torch.no_grad():
            for shared, mine in zip(part.theta, part.params):
                if self.mix:
                    mine.mul_(self.mix).add_(shared, alpha=1.0 - self.mix)
                else:
                    mine.copy_(shared)
        if part is self.parts[0] and self.buffers:
            self._average(self.buffers, "buffers")
        self.syncs += 1

    def close(self) -> None:
        """Land the fragments in flight, then give every worker the mean of the workers' parameters,
        so that the model after training (or under the strategy switched to) is one model (unless
        some worker's are NaN/Inf: then each keeps its own rather than all getting NaN)."""
        if getattr(self, "closed", True):
            return
        self.closed = True
        for part in self.parts:
            if part.launched is not None:  # every worker has the same ones in flight: land them
                self._land(part)
            part.outer.close()
        if self.ctx.topology.num_workers > 1 and self.t > 0:
            self._average(self.ctx.params, "parameters")

    def _average(self, tensors: list[torch.Tensor], what: str) -> None:
        wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        flat = torch.cat([t.detach().reshape(-1).to(wide) for t in tensors])
        self.ctx.transport.allreduce(flat, what=f"{self.name} average of the {what}")
        if not all_finite(flat):  # some worker's are NaN/Inf: the same sum everywhere, so all keep their own
            return
        flat /= self.ctx.topology.num_workers
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def abandon(self) -> None:
        self.closed = True
        for part in getattr(self, "parts", ()):
            part.outer.abandon()

    # -- reports -------------------------------------------------------------------------------------
    def describe(self) -> str:
        outer = f"outer_lr={self.outer_lr:g}, outer_momentum={self.outer_momentum:g}" + (
            ", nesterov" if self.nesterov and self.outer_momentum else "")
        if self.outer_optimizer is not None:
            outer = "outer_optimizer=" + getattr(self.outer_optimizer, "__name__", "custom")
        return f"{self.name}(H={self.H}, {outer}{self._stream()})"

    def _stream(self) -> str:
        parts = "" if self.fragments == 1 else f", fragments={self.fragments}"
        parts += "" if not self.delay else f", delay={self.delay}, mix={self.mix:g}"
        if self.compression is not None:
            parts += f", compression={self.compression}" + (" with error feedback" if self.error_feedback else "")
        return parts

    def host_work(self) -> dict[str, list]:
        total: dict[str, list] = {}
        for part in getattr(self, "parts", ()):
            for kind, (calls, nbytes, seconds) in part.outer.host_work().items():
                was = total.setdefault(kind, [0, 0, 0.0])
                was[0], was[1], was[2] = was[0] + calls, was[1] + nbytes, was[2] + seconds
        return total

    def min_bytes_per_host(self, model_bytes: int) -> float:
        # Each fragment's outer gradient crosses once every H steps, at its strategy's bound.
        total = sum(p.numel() * p.element_size() for p in self.ctx.params) or 1
        return sum(part.outer.min_bytes_per_host(model_bytes * part.nbytes / total) for part in self.parts) / self.H


class LocalSGD(DiLoCo):
    name = "local-sgd"
    summary = "local SGD: H local steps, then the workers' parameters replaced by their mean (Stich; Lin et al.)"

    def __init__(self, H: int = 10, fragments: int = 1, delay: int = 0, mix: float | None = None,
                 compression: str | None = None, error_feedback: bool = True):
        super().__init__(H=H, outer_lr=1.0, outer_momentum=0.0, nesterov=False, fragments=fragments, delay=delay,
                         mix=mix, compression=compression, error_feedback=error_feedback)

    def describe(self) -> str:
        return f"{self.name}(H={self.H}{self._stream()})"


class _Fragment:
    """One fragment: the worker's parameters, the shared copy ``theta`` (the outer strategy's
    parameters), its outer optimizer and strategy, its step offset and the step it was sent at."""

    def __init__(self, params, theta, optimizer, outer, offset: int):
        self.params, self.theta, self.optimizer, self.outer, self.offset = params, theta, optimizer, outer, offset
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.launched: int | None = None


def split(sizes: list[int], fragments: int) -> list[list[int]]:
    """``fragments`` runs of consecutive parameter indices of about equal total size (each
    non-empty), for parameters of ``sizes`` elements in model order."""
    total = sum(sizes)
    runs: list[list[int]] = [[] for _ in range(fragments)]
    seen = 0
    for i, size in enumerate(sizes):
        left = len(sizes) - i  # parameters still to place, this one included
        f = min(fragments - 1, seen * fragments // max(total, 1))
        f = max(f, fragments - left)  # every later fragment must still get one
        while f > 0 and not runs[f - 1]:
            f -= 1  # never skip a fragment
        runs[f].append(i)
        seen += size
    return runs
