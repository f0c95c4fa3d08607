"""What one benchmark (or parity test) trains, and the single-process reference it must match.

A :class:`Workload` fixes the model, per-worker batch size, optimizer and seed. Worker ``w`` at
step ``t`` trains on the batch seeded ``batch_seed(seed, t, w, num_workers)``: the same on every
machine, different for every (step, worker). The reference trains one model in one process: each
step it runs every worker's batch separately (so BatchNorm sees per-worker statistics, as on
real workers), averages the gradients with the data-parallel rule (a worker that did not use a
parameter contributes zero; a parameter nobody used keeps ``grad=None``) and steps once.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from gradsync.errors import ConfigError
from gradsync.models import ModelSpec, get_model

# name -> (constructor, atol, rtol): the tolerance of the parity check for that optimizer.
# A ring all-reduce or a server sums the workers' gradients in another order than the reference,
# so each step differs by a few ulps (relative 2^-24 per addition). SGD with momentum carries
# those differences forward almost unchanged: measured below 1e-6 after 30 steps of the tiny
# models, so 1e-5 + 1e-4 |p| leaves a margin of ten. Adam divides by the
# root of the squared gradient, so a relative rounding error in a small gradient becomes the same
# relative error in an lr-sized update: measured up to 4e-5 after 4 steps, identical for PyTorch
# DDP, hence 1e-4. Any real error (a gradient missed, doubled or not averaged) moves parameters by
# about lr = 1e-2 per step, a hundred times more than either tolerance.
# fp32 parity tests use well-conditioned models (the toy); the bench replays in float64 because
# its models can be chaotic (see docs/methods.md, "Correctness").
OPTIMIZERS = {
    "sgd": (lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4), 1e-5, 1e-4),
    "adam": (lambda params, lr: torch.optim.Adam(params, lr=lr), 1e-4, 1e-4),
    # Per-row state that rows without gradient keep as they are (hybrid's servers update only the
    # rows pushed); it divides by a root of squared gradients, as Adam does: Adam's tolerance.
    "adagrad": (lambda params, lr: torch.optim.Adagrad(params, lr=lr), 1e-4, 1e-4),
}


@dataclass(frozen=True)
class Workload:
    model: str = "toy"
    """Model name, optionally with a size (``resnet50:tiny``)."""
    batch_size: int = 8
    """Samples per worker per step."""
    optimizer: str = "sgd"
    """``sgd`` (momentum 0.9, weight decay 1e-4), ``adam`` or ``adagrad``."""
    lr: float = 0.01
    seed: int = 0
    dtype: str = "float32"
    """``float32`` for timing; ``float64`` for the bench's correctness replay (see ``tolerance``)."""
    compute: str = "real"
    """``real`` (run the model) or ``emulated[:PROFILE]`` (layers take profiled time; :mod:`gradsync.emulate`)."""
    dilation: float = 1.0
    """Emulated compute only: every profiled time is multiplied by this factor."""
    device: str = "cpu"
    """Where the model and its batches live (``cuda`` for the GPU checks of the parity tests)."""

    def spec(self) -> ModelSpec:
        return _spec(self.model, self.batch_size, self.compute, self.dilation)

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        torch.manual_seed(self.seed)
        model = self.spec().build().to(getattr(torch, self.dtype)).to(self.device)
        params = [p for p in model.parameters() if p.requires_grad]
        return model, OPTIMIZERS[self.optimizer][0](params, self.lr)

    @property
    def tolerance(self) -> tuple[float, float]:
        """(atol, rtol) of the parity check for this workload's optimizer and dtype."""
        if self.dtype == "float64":
            # Rounding noise is ~1e-16 relative; even a chaotic model (gradients of 50 at lr 1e-2)
            # cannot grow it to 1e-8 in a few steps, while any real error is ~lr = 1e-2.
            return 1e-8, 1e-6
        return OPTIMIZERS[self.optimizer][1:]

    def batch(self, spec: ModelSpec, step: int, worker: int, num_workers: int, shares: list[int] | None = None):
        """Worker ``worker``'s batch at ``step``. ``shares`` (samples per worker, summing to the global
        batch): its slice of the global batch, the workers' equal batches end to end, as a
        :class:`~gradsync.adapt.Controller` with ``set_shares`` hands them out."""
        if shares is None:
            inputs, target = spec.batch(self.batch_size, batch_seed(self.seed, step, worker, num_workers))
        else:
            inputs, target = self._share(spec, step, worker, num_workers, shares)
        if self.dtype != "float32":
            dtype = getattr(torch, self.dtype)
            inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
        if self.device != "cpu":
            inputs, target = tuple(x.to(self.device) for x in inputs), target.to(self.device)
        return inputs, target

    def _share(self, spec: ModelSpec, step: int, worker: int, num_workers: int, shares: list[int]):
        if len(shares) != num_workers or sum(shares) != self.batch_size * num_workers:
            raise ConfigError(f"shares {shares} do not split the global batch of {num_workers} x {self.batch_size}")
        parts = [spec.batch(self.batch_size, batch_seed(self.seed, step, w, num_workers)) for w in range(num_workers)]
        start = sum(shares[:worker])
        end = start + shares[worker]

        def cut(tensors):
            return torch.cat(tensors)[start:end] if tensors[0].dim() else tensors[0]  # a 0-d target: the same for all

        inputs = tuple(cut([p[0][k] for p in parts]) for k in range(len(parts[0][0])))
        return inputs, cut([p[1] for p in parts])


@functools.lru_cache(maxsize=8)
def _spec(model: str, batch_size: int, compute: str, dilation: float) -> ModelSpec:
    kind, _, profile = compute.partition(":")
    if kind == "real":
        if profile or dilation != 1.0:
            raise ConfigError("real compute takes no profile and no dilation; use --compute emulated[:PROFILE]")
        return get_model(model)
    if kind != "emulated":
        raise ConfigError(f"unknown compute {compute!r}: expected real, emulated or emulated:PROFILE")
    from gradsync.emulate.model import emulated_spec

    return emulated_spec(model, batch_size, profile or None, dilation)


def batch_seed(seed: int, step: int, worker: int, num_workers: int) -> int:
    return seed * 1_000_003 + step * num_workers + worker


def train_step(model: nn.Module, optimizer, spec: ModelSpec, inputs, target) -> float:
    loss = spec.loss(model(*inputs), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def shares_at(history: list | None, step: int) -> list[int] | None:
    """The shares in force at ``step`` from ``BalanceBatches.history`` (``(step, shares)`` pairs, each
    taking effect at its step); None (equal shares) before the first or for no history."""
    now = None
    for since, shares in history or []:
        if since <= step:
            now = None if len(set(shares)) == 1 else list(shares)
    return now


def reference(work: Workload, num_workers: int, steps: int, *, with_optimizer: bool = False,
              shares: list | None = None):
    """Train the single-process data-parallel reference for ``steps`` steps: the model (and its
    optimizer, with ``with_optimizer``). ``shares``: the workers' shares of each global batch as a
    ``BalanceBatches.history`` (:func:`shares_at`); each worker's gradient then counts by its samples,
    the update a single process makes on the whole global batch."""
    spec = work.spec()
    model, optimizer = work.build()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        totals: list[torch.Tensor | None] = [None] * len(params)
        split = shares_at(shares, step)
        for w in range(num_workers):
            if split is not None and not split[w]:
                continue  # no samples: no gradient
            inputs, target = work.batch(spec, step, w, num_workers, split)
            weight = 1.0 if split is None else num_workers * split[w] / sum(split)
            optimizer.zero_grad()
            spec.loss(model(*inputs), target).backward()
            for k, p in enumerate(params):
                if p.grad is not None:
                    grad = p.grad if weight == 1.0 else p.grad * weight
                    totals[k] = grad.clone() if totals[k] is None else totals[k] + grad
        for p, total in zip(params, totals):
            p.grad = None if total is None else total / num_workers
        optimizer.step()
    optimizer.zero_grad()
    return (model, optimizer) if with_optimizer else model


EVAL_STEP = 1_000_000
"""Evaluation batches are the workload's batches at steps from here on: never trained on."""


@torch.no_grad()
def eval_loss(work: Workload, params: dict[str, torch.Tensor], batches: int = 4) -> float:
    """Mean loss of a model with ``params`` over ``batches`` held-out batches (model in train mode,
    as the reference trains: BatchNorm uses batch statistics). For strategies that are not exact
    (``sma``, ``pair-averaging``, lossy compression), how much worse their model is than the reference's."""
    spec = work.spec()
    model, _ = work.build()
    missing, unexpected = model.load_state_dict(params, strict=False)  # parameters only, no buffers
    # Neither buffers nor the second name of a tied parameter were saved.
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    lacking = set(missing) - aliases - {name for name, _ in model.named_buffers()}
    if unexpected or lacking:
        raise ValueError(f"eval_loss: parameters do not match the model: missing {sorted(lacking)}, "
                         f"unexpected {sorted(unexpected)}")
    losses = [float(spec.loss(model(*inputs), target))
              for inputs, target in (work.batch(spec, EVAL_STEP + k, 0, 1) for k in range(batches))]
    return sum(losses) / len(losses)


def compare(params: dict[str, torch.Tensor], ref: nn.Module, tolerance: tuple[float, float]) -> dict:
    """Max absolute and relative difference to the reference, and whether all are within tolerance."""
    atol, rtol = tolerance
    max_abs = max_rel = 0.0
    ok = True
    for name, q in ref.named_parameters():
        p, q = params[name].detach(), q.detach()
        diff = (p - q).abs()
        if not diff.numel():
            continue
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / q.abs().clamp_min(1e-12)).max()))
        ok = ok and bool((diff <= atol + rtol * q.abs()).all())
    return {"max_abs_diff": max_abs, "max_rel_diff": max_rel, "correct": ok}
