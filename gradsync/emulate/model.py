"""The emulated model: real-size parameters and gradients, layers that take the profiled time.

``emulated_spec(model, batch_size, profile_text, dilation)`` returns a
:class:`~gradsync.models.ModelSpec` like any other, so ``distribute``, every strategy, the bench and
its single-process reference run it unchanged. What happens inside:

- The model has the real model's parameters (same names, shapes, ``requires_grad``), as real CPU
  tensors, grouped into the profile's layers (modules that own parameters). The real model is only
  built on the ``meta`` device to learn them, so a full VGG-19 costs its parameters, nothing more.
- Forward calls each layer module in the profile's order (so module hooks fire as on the real
  model) through one autograd function per layer. Backward runs the layers in reverse and each
  returns its parameters' gradients when the emulated accelerator finishes that layer, so
  gradient-ready hooks (and with them every strategy's communication) fire at the times a GPU
  would fire them.
- Time is an :class:`AcceleratorClock`: kernels run back to back on the accelerator while the CPU
  sleeps. Forward only books time (a GPU runs ahead of the host), except that a layer cannot start
  before the host reaches it, so a strategy blocking in a forward hook delays the accelerator as
  it would on a GPU. Backward sleeps until each layer's end. ``dilation`` multiplies every time,
  and so does this rank's straggler factor (``--slow RANK:FACTOR``, :mod:`gradsync.emulate.slow`).
  A batch of another size than the profile's scales every layer's time linearly (a worker given a
  smaller share of the global batch computes for less time, as under ``BalanceBatches``).
- Gradients are deterministic functions of the batch (one number per sample, drawn from the batch
  seed) and the parameter: a fixed pseudo-random pattern, shifted and scaled by the batch. So the
  data-parallel reference is well defined, and workers with different batches send different,
  non-parallel gradients. Making one costs one pass over the parameter's memory.
- Embedding tables (the model spec's ``lookups`` names them and says which ids each reads) are
  :class:`EmulatedEmbedding` modules fed the real batch's ids: their gradient has values only on
  the rows read (dense with zeros elsewhere, or sparse with ``sparse=True``), as the real table's.

Limits: the host-side work of the strategies (copies into buckets, the optimizer's update) runs
on the CPU for real, where a GPU would do it in microseconds; ``--dilation`` shrinks its share.
"""
from __future__ import annotations

import functools
import time

import torch
from torch import nn

from gradsync import trace
from gradsync.emulate.derive import resolve
from gradsync.emulate.profile import Profile, check_covers, layer_modules
from gradsync.emulate.slow import rank_factor

_POOL = 1 << 20  # elements of the gradient pattern; a gradient is a window of it, tiled


class AcceleratorClock:
    """When the emulated accelerator is free; forward books, backward sleeps (see module docstring).

    ``busy``: the device is the host CPU (a profile measured here): every layer keeps this core
    computing for its time, forward included, instead of sleeping.
    """

    def __init__(self, dilation: float = 1.0, busy: bool = False):
        self.dilation = dilation
        self.scale = 1.0
        """This pass's batch over the profile's: every layer's time is multiplied by it."""
        self.busy = busy
        self.free = 0.0
        self.in_backward = False

    def forward(self, ms: float) -> tuple[float, float]:
        start = max(self.free, time.perf_counter())
        self.free = start + ms * self.scale * self.dilation / 1e3
        self.in_backward = False
        if self.busy:
            self.sleep_until(self.free)
        return start, self.free

    def backward(self, ms: float) -> tuple[float, float]:
        # The first backward layer waits for the host to call backward(); the rest follow at once.
        start = self.free if self.in_backward else max(self.free, time.perf_counter())
        self.in_backward = True
        self.free = start + ms * self.scale * self.dilation / 1e3
        return start, self.free

    def sleep_until(self, deadline: float) -> None:
        if self.busy:
            _burn_until(deadline)
            return
        delay = deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


_BURN = None


def _burn_until(deadline: float) -> None:
    """Keep this core computing until ``deadline``, in small matrix products (each releases the GIL,
    so communication threads run between them as they would beside real layers)."""
    global _BURN
    if _BURN is None:
        _BURN = torch.rand(48, 48)
    while time.perf_counter() < deadline:
        torch.mm(_BURN, _BURN)


@functools.lru_cache(maxsize=4)
def _pattern(dtype: torch.dtype) -> torch.Tensor:
    """Two copies of one fixed pseudo-random vector, so any window of ``_POOL`` elements is a view."""
    base = torch.randn(_POOL, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    return torch.cat([base, base]).to(dtype)


def synthetic_grad(param: torch.Tensor, value: float, salt: int) -> torch.Tensor:
    """The gradient of ``param`` for a batch summarised by ``value`` (one float in [0, 1))."""
    pattern = _pattern(param.dtype)
    out = torch.empty(param.numel(), dtype=param.dtype)
    offset = (int(value * _POOL) + salt * 7919) % _POOL
    for start in range(0, param.numel(), _POOL):
        n = min(_POOL, param.numel() - start)
        torch.mul(pattern[offset:offset + n], 0.5 + value, out=out[start:start + n])
    return out.view_as(param)


class _LayerFunction(torch.autograd.Function):
    """One layer: forward books its time, backward sleeps to its end and returns the gradients."""

    @staticmethod
    def forward(ctx, token, batch_value, layer, *params):
        ctx.layer, ctx.value = layer, float(batch_value)
        ctx.wants = [p.requires_grad for p in params]
        start, end = layer.clock.forward(layer.forward_ms)
        layer.record("forward", start, end)
        return token.clone()

    @staticmethod
    def backward(ctx, grad_token):
        layer = ctx.layer
        start, end = layer.clock.backward(layer.backward_ms)
        grads = [synthetic_grad(p, ctx.value, layer.salt + k) if want else None
                 for k, (p, want) in enumerate(zip(layer.own_params, ctx.wants))]
        layer.clock.sleep_until(end)  # the gradients were made while the accelerator "ran"
        layer.record("backward", start, end)
        return (grad_token, None, None, *grads)


class EmulatedLayer(nn.Module):
    """Holds one profiled layer's parameters; calling it runs the layer on the emulated clock."""

    def __init__(self, name: str, forward_ms: float, backward_ms: float, clock: AcceleratorClock, salt: int):
        super().__init__()
        self.layer_name, self.forward_ms, self.backward_ms = name, forward_ms, backward_ms
        self.clock, self.salt = clock, salt

    @property
    def own_params(self) -> list[nn.Parameter]:
        return list(self.parameters(recurse=False))

    def record(self, phase: str, start: float, end: float) -> None:
        tracer = trace.current()
        if tracer is not None:
            tracer.span(f"{phase} {self.layer_name or '(root)'}", "compute", start, end)

    def forward(self, token: torch.Tensor, batch_value: torch.Tensor) -> torch.Tensor:
        return _LayerFunction.apply(token, batch_value, self, *self.own_params)


class _EmbeddingFunction(torch.autograd.Function):
    """An embedding table: forward books its time; backward returns a gradient on the rows read."""

    @staticmethod
    def forward(ctx, token, batch_value, layer, ids, weight):
        ctx.layer, ctx.value = layer, float(batch_value)
        ctx.save_for_backward(ids)
        start, end = layer.clock.forward(layer.forward_ms)
        layer.record("forward", start, end)
        return token.clone()

    @staticmethod
    def backward(ctx, grad_token):
        layer, (ids,) = ctx.layer, ctx.saved_tensors
        start, end = layer.clock.backward(layer.backward_ms)
        weight = layer.weight
        values = synthetic_grad(torch.empty(ids.numel(), weight.shape[1], dtype=weight.dtype), ctx.value, layer.salt)
        if layer.sparse:  # as nn.Embedding(sparse=True): uncoalesced, one row per id read
            grad = torch.sparse_coo_tensor(ids.view(1, -1), values, weight.shape, check_invariants=False)
        else:
            grad = torch.zeros_like(weight).index_add_(0, ids, values)
        layer.clock.sleep_until(end)
        layer.record("backward", start, end)
        return grad_token, None, None, None, grad


class EmulatedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` (so strategies that look for tables find it) whose forward is
    ``(ids, token, batch_value)``: it checks ``ids`` as the real lookup would, books the profiled
    time, and its gradient touches exactly the rows ``ids`` names (sparse if ``sparse``)."""

    def __init__(self, name: str, real: nn.Embedding, forward_ms: float, backward_ms: float,
                 clock: AcceleratorClock, salt: int):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = real.num_embeddings, real.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, real.sparse
        self.weight = nn.Parameter(_initial(real.weight), requires_grad=real.weight.requires_grad)
        self.layer_name, self.forward_ms, self.backward_ms = name, forward_ms, backward_ms
        self.clock, self.salt = clock, salt

    record = EmulatedLayer.record

    def forward(self, ids: torch.Tensor, token: torch.Tensor, batch_value: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"index out of range in self: {self.layer_name} has {self.num_embeddings} rows, "
                             f"ids span {int(ids.min())}..{int(ids.max())}")
        return _EmbeddingFunction.apply(token, batch_value, self, ids, self.weight)


class EmulatedModel(nn.Module):
    """The real model's parameters, in the profile's layers. ``forward(x)`` takes one float per sample;
    a model with embedding tables (``lookups``: table name -> the ids it reads, from the inputs)
    takes the real model's inputs, and its tables are :class:`EmulatedEmbedding` s.

    Every layer takes its profiled time times ``dilation`` times ``slowdown``: how many times as long
    this rank computes (a straggler); None reads it from ``GRADSYNC_SLOW`` at this process's ``RANK``
    (:func:`gradsync.emulate.slow.rank_factor`: 1 unless the launcher's ``--slow`` names the rank)."""

    def __init__(self, real: nn.Module, profile: Profile, dilation: float = 1.0, lookups: dict | None = None,
                 slowdown: float | None = None):
        super().__init__()
        self.slowdown = rank_factor() if slowdown is None else slowdown
        self.clock = AcceleratorClock(dilation * self.slowdown, busy=profile.on_host)
        self.batch_size = profile.batch_size
        self.lookups = dict(lookups or {})
        check_covers(profile, real)
        owned = layer_modules(real)
        self.order: list[EmulatedLayer] = []
        seen: set[int] = set()
        for salt, layer in enumerate(profile.layers):
            if layer.name in self.lookups:
                table = owned[layer.name]
                seen.add(id(table.weight))
                self.order.append(self._place(layer.name, EmulatedEmbedding(
                    layer.name, table, layer.forward_ms, layer.backward_ms, self.clock, salt)))
                continue
            module = self if layer.name == "" else self._make_path(layer.name, layer, salt)
            for pname, p in owned[layer.name].named_parameters(recurse=False):
                if id(p) not in seen:  # a tied parameter lives in the first layer that owns it
                    seen.add(id(p))
                    module.register_parameter(pname, nn.Parameter(_initial(p), requires_grad=p.requires_grad))
            if module is not self:
                self.order.append(module)
        root = next((lay for lay in profile.layers if lay.name == ""), None)
        if root is not None:  # parameters owned by the model itself: their layer runs first
            self.order.insert(0, _RootLayer(self, root.forward_ms, root.backward_ms, profile.layers.index(root)))

    def _make_path(self, name: str, layer, salt: int) -> EmulatedLayer:
        return self._place(name, EmulatedLayer(name, layer.forward_ms, layer.backward_ms, self.clock, salt))

    def _place(self, name: str, module: nn.Module) -> nn.Module:
        parent: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        existing = getattr(parent, leaf, None)
        if existing is not None:  # a placeholder made for a deeper layer's path: keep its children
            for child_name, child in existing.named_children():
                module.add_module(child_name, child)
            delattr(parent, leaf)
        parent.add_module(leaf, module)
        return module

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.lookups:  # the real inputs: one number per batch from all of them, tables read their ids
            value = torch.frac(sum(x.double().sum() for x in inputs) * 0.6180339887498949).reshape(())
            token = torch.zeros((), dtype=next(iter(self.parameters())).dtype)
        else:
            x, = inputs
            value = x.double().mean().reshape(())
            token = torch.zeros((), dtype=x.dtype)
        self.clock.scale = inputs[0].shape[0] / self.batch_size  # backward runs at the same batch
        for layer in self.order:
            if isinstance(layer, EmulatedEmbedding):
                token = layer(self.lookups[layer.layer_name](inputs), token, value)
            else:
                token = layer(token, value)
        return token


class _RootLayer:
    """The layer of the parameters the model owns directly (it has no module of its own to call)."""

    layer_name = ""
    record = EmulatedLayer.record

    def __init__(self, model: EmulatedModel, forward_ms: float, backward_ms: float, salt: int):
        self._model = [model]  # a list, so nn.Module does not adopt the model as its own child
        self.forward_ms, self.backward_ms, self.clock, self.salt = forward_ms, backward_ms, model.clock, salt

    @property
    def own_params(self) -> list[nn.Parameter]:
        return list(self._model[0].parameters(recurse=False))

    def __call__(self, token: torch.Tensor, batch_value: torch.Tensor) -> torch.Tensor:
        return _LayerFunction.apply(token, batch_value, self, *self.own_params)


def _initial(meta_param: torch.Tensor) -> torch.Tensor:
    """Small deterministic values of the right shape (the values do not change the timing)."""
    return synthetic_grad(torch.empty(meta_param.shape, dtype=meta_param.dtype), 0.25, meta_param.numel()) * 0.01


def emulated_spec(model: str, batch_size: int, profile_text: str | None = None, dilation: float = 1.0):
    """A :class:`~gradsync.models.ModelSpec` for ``model`` on emulated compute (see the module docstring).

    A batch is one float in [0, 1) per sample, from the batch seed, or for a model with embedding
    tables the real model's batch; the loss is the model's output.
    """
    from gradsync.models import ModelSpec, get_model

    real_spec = get_model(model)
    profile = resolve(model, batch_size, profile_text)

    def build() -> nn.Module:
        real = real_spec.build_meta()
        return EmulatedModel(real, profile, dilation, real_spec.lookups)

    def make_batch(n: int, generator: torch.Generator):
        if real_spec.lookups:  # the tables read the rows a real batch would
            return real_spec.make_batch(n, generator)[0], torch.zeros(())
        return (torch.rand(n, generator=generator),), torch.zeros(())

    return ModelSpec(name=real_spec.name, size=real_spec.size, build=build, make_batch=make_batch,
                     loss=lambda output, target: output + target,
                     description=f"{real_spec.description} on emulated compute: {profile.device}",
                     options={**real_spec.options, "profile": profile, "dilation": dilation})
