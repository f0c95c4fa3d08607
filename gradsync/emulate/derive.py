"""Where compute profiles come from: measuring the real model, deriving times from FLOPs, or a file
(shipped or the user's); :func:`resolve` picks the one ``--compute emulated[:PROFILE]`` names.

Both attribute time (or FLOPs) to the layers of :mod:`gradsync.emulate.profile` the same way: each
call of a layer starts a segment that belongs to it until the next layer call, so parameter-free
work counts toward the layer before it and the layers add up to the whole step.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import platform
import statistics
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager

from gradsync.emulate.profile import PROFILE_DIR, SHIPPED, Layer, Profile, layer_modules, parse_rate
from gradsync.errors import ConfigError


class _Split:
    """Splits a running counter (a clock, a FLOP count) among layers as the forward pass calls them.

    Each call of a layer ends the current segment and starts one that belongs to that layer, so
    parameter-free work counts toward the layer called before it; with no module called twice this
    is exactly "from layer i's pre-hook to layer i+1's". What runs before the first layer call is
    kept under the key None.
    """

    def __init__(self, read):
        self.read, self.owner, self.start = read, None, read()
        self.totals: dict = defaultdict(float)
        self.order: list[str] = []

    def enter(self, name) -> None:
        now = self.read()
        self.totals[self.owner] += now - self.start
        self.owner, self.start = name, now
        if name is not None and name not in self.order:
            self.order.append(name)


@contextmanager
def _on_layer_calls(model, callback):
    """Call ``callback(name)`` from a forward pre-hook whenever a layer of ``model`` is called."""
    handles = [m.register_forward_pre_hook(lambda _m, _args, n=name: callback(n))
               for name, m in layer_modules(model).items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _complete(model, order: list[str]) -> list[str]:
    # A parameter-owning module the forward pass never called (an unused head) still needs its
    # parameters emulated: it goes at the end, with 0 ms.
    return order + [name for name in layer_modules(model) if name not in order]


def layer_order(model, inputs) -> list[str]:
    """Layer names in order of first call during ``model(*inputs)``, then the never-called ones.

    Runs one forward pass under ``torch.no_grad()`` in the model's current mode (BatchNorm running
    statistics update as in any training-mode forward).
    """
    import torch

    split = _Split(lambda: 0.0)
    with _on_layer_calls(model, split.enter), torch.no_grad():
        model(*inputs)
    return _complete(model, split.order)


# -- measuring ----------------------------------------------------------------------------------

def _spec(model_name: str):
    from gradsync.models import get_model

    try:
        return get_model(model_name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _clock(device: str):
    import torch

    if not device.startswith("cuda"):
        return time.perf_counter

    def read() -> float:
        # Synchronizing at every layer boundary stops the CPU from queueing kernels ahead, so each
        # layer pays its launch latency in full (tens of microseconds): small layers read slower
        # than in a free-running step. It is the price of knowing where each layer ends.
        torch.cuda.synchronize()
        return time.perf_counter()

    return read


def _backward_split(owners: dict, ready: dict, start: float, end: float) -> dict:
    """Backward ms per layer: from the previous gradient-ready event to this layer's last one.

    ``owners`` maps layer name to the ids of its parameters, ``ready`` parameter id to the time
    its gradient was accumulated. Layers without gradients (frozen, unused) get 0.
    """
    done = {name: max(ready[p] for p in ids if p in ready) for name, ids in owners.items()
            if any(p in ready for p in ids)}
    out, previous = dict.fromkeys(owners, 0.0), start
    for name in sorted(done, key=done.get):
        out[name], previous = (done[name] - previous) * 1e3, done[name]
    # Autograd's work after the last gradient (freeing the graph) goes to the last layer to finish,
    # so the layers add up to the whole backward pass.
    last = max(done, key=done.get) if done else next(iter(owners))
    out[last] += (end - previous) * 1e3
    return out


def _timed_step(model, spec, inputs, target, owners, ready, read) -> tuple[dict, dict]:
    """One training step without the optimizer: (forward ms per layer, backward ms per layer)."""
    split = _Split(read)
    with _on_layer_calls(model, split.enter):
        loss = spec.loss(model(*inputs), target)
    split.enter(None)
    forward = {name: split.totals.get(name, 0.0) * 1e3 for name in owners}
    first = split.order[0] if split.order else next(iter(owners))
    forward[first] += split.totals.get(None, 0.0) * 1e3  # the call into the root module itself
    ready.clear()
    start = read()
    loss.backward()
    return forward, _backward_split(owners, ready, start, read())


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.processor() or "unknown CPU"
    except OSError:
        return platform.processor() or "unknown CPU"


def measure(model_name: str, batch_size: int, *, device: str = "cpu", steps: int = 10, warmup: int = 3,
            threads: int | None = None) -> Profile:
    """Time each layer of the real model over ``warmup + steps`` SGD steps; keep the per-layer median.

    Forward time is split at layer calls (see :class:`_Split`); the last layer's runs to the end
    of the loss. A layer's backward time ends when the last of its parameters' gradients is
    accumulated (``register_post_accumulate_grad_hook``) and starts at the previous such event
    (the first at the start of ``backward()``). The optimizer step is not timed. ``threads`` sets
    ``torch.set_num_threads`` for the measurement (restored afterwards).
    """
    import torch

    if batch_size < 1 or steps < 1 or warmup < 0 or (threads is not None and threads < 1):
        raise ConfigError("measure needs batch_size >= 1, steps >= 1, warmup >= 0 and threads >= 1")
    spec, saved_threads = _spec(model_name), torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = spec.build().to(device).train()
        inputs, target = spec.batch(batch_size, seed=0)
        inputs, target = tuple(x.to(device) for x in inputs), target.to(device)
        order = layer_order(model, inputs)
        times = _measure_steps(model, spec, inputs, target, order, _clock(device), steps, warmup)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(saved_threads)
    median = {key: {name: statistics.median(s[key][name] for s in times) for name in order} for key in (0, 1)}
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else \
        f"this CPU ({_cpu_name()}), {used} thread{'s' if used > 1 else ''}"
    command = f"gradsync profile --model {model_name} --batch-size {batch_size} --device {device} " \
              f"--steps {steps} --warmup {warmup}" + (f" --threads {threads}" if threads else "")
    return Profile(model_name, batch_size, where, f"measured: {command} ({datetime.date.today()}); "
                   f"median per layer over {steps} steps after {warmup} warm-up steps",
                   [Layer(n, median[0][n], median[1][n]) for n in order], on_host=not device.startswith("cuda"))


def _measure_steps(model, spec, inputs, target, order, read, steps, warmup) -> list[tuple[dict, dict]]:
    import torch

    modules = layer_modules(model)
    owners = {name: [id(p) for p in modules[name].parameters(recurse=False) if p.requires_grad] for name in order}
    ready: dict = {}
    params = {id(p): p for p in model.parameters() if p.requires_grad}  # a tied parameter once
    handles = [p.register_post_accumulate_grad_hook(lambda _p, key=key: ready.__setitem__(key, read()))
               for key, p in params.items()]
    optimizer = torch.optim.SGD(params.values(), lr=1e-3)
    try:
        results = []
        for step in range(warmup + steps):
            times = _timed_step(model, spec, inputs, target, owners, ready, read)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= warmup:
                results.append(times)
        return results
    finally:
        for handle in handles:
            handle.remove()


# -- deriving from FLOPs ------------------------------------------------------------------------

def layer_flops(model, inputs, loss=None) -> tuple[list[str], dict]:
    """``(layer order, forward FLOPs per layer)`` of ``model(*inputs)`` and then ``loss(output)``.

    FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` (matrix products,
    convolutions, attention; elementwise and normalisation ops count 0) and split at layer calls
    like forward times. FLOPs before the first layer call are spread over the layers in
    proportion to their own.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    split = _Split(counter.get_total_flops)
    with _on_layer_calls(model, split.enter), counter, torch.no_grad():
        output = model(*inputs)
        if loss is not None:
            loss(output)
    split.enter(None)
    order = _complete(model, split.order)
    flops = {name: float(split.totals.get(name, 0)) for name in order}
    owned, loose = sum(flops.values()), float(split.totals.get(None, 0))
    if loose and owned:
        flops = {name: value * (1 + loose / owned) for name, value in flops.items()}
    return order, flops


def _model_flops(spec, batch_size: int) -> tuple[list[str], dict, str]:
    try:
        # On the meta device tensors have shapes but no data: full-size VGG-19 or the 800M-parameter
        # LSTM cost nothing to "run".
        model = spec.build_meta()
        inputs, target = spec.batch(batch_size, seed=0)
        order, flops = layer_flops(model.train(), tuple(x.to("meta") for x in inputs),
                                   lambda out: spec.loss(out, target.to("meta")))
        return order, flops, "on the meta device"
    except (RuntimeError, NotImplementedError):
        # Data-dependent control flow (toy's ``int(tokens[0, 0])``) needs real values: count one
        # sample on the CPU and scale linearly with the batch. Eval mode, because training-mode
        # BatchNorm rejects a batch of one; FLOPs differ only in training-only branches.
        model = spec.build().eval()
        inputs, target = spec.batch(1, seed=0)
        with warnings.catch_warnings():  # counting only: which CPU kernel runs an LSTM does not matter
            warnings.filterwarnings("ignore", message="LSTM with projections is not supported with oneDNN")
            order, flops = layer_flops(model, inputs, lambda out: spec.loss(out, target))
        return order, {k: v * batch_size for k, v in flops.items()}, "on the CPU at batch 1, scaled linearly"


@functools.lru_cache(maxsize=16)
def _counted(model_name: str, batch_size: int) -> tuple[tuple[str, ...], tuple[tuple[str, float], ...], str]:
    """:func:`_model_flops` of a model, counted once per process: counting builds the model, which
    for a model that does not run on the meta device means its full-size parameters on the CPU
    (``lstm-lm:cpu``: half a second each time), and ``gradsync simulate --validate`` asks for the
    same models again and again."""
    order, flops, how = _model_flops(_spec(model_name), batch_size)
    return tuple(order), tuple(flops.items()), how


def from_flops(model_name: str, batch_size: int, tflops: float, *, device: str | None = None) -> Profile:
    """Per-layer times of ``model_name`` at ``batch_size`` on a device that sustains ``tflops``.

    Forward time is the layer's forward FLOPs (:func:`layer_flops`) over the rate; backward is
    twice that, because each layer computes two products of the forward's size: the gradient of
    its input (to pass on) and of its weight. Layers without matrix work (BatchNorm, LayerNorm,
    embeddings) get 0 ms: their memory-bound cost is left out rather than guessed.
    """
    if not tflops > 0:
        raise ConfigError(f"the FLOP rate must be positive, got {tflops} TFLOPS")
    order, counted, how = _counted(model_name, batch_size)
    flops = dict(counted)
    per_ms = tflops * 1e12 / 1e3
    layers = [Layer(name, flops[name] / per_ms, 2 * flops[name] / per_ms) for name in order]
    total = 3 * sum(flops.values()) / 1e9
    source = (f"derived: gradsync profile --model {model_name} --batch-size {batch_size} --flops {tflops:g}tflops "
              f"({datetime.date.today()}); forward FLOPs per layer from FlopCounterMode {how}, backward = 2x "
              f"forward, {total:.4g} GFLOP per step at {tflops:g} TFLOPS")
    return Profile(model_name, batch_size, device or f"a device sustaining {tflops:g} TFLOPS, fp32", source, layers)


# -- choosing one -------------------------------------------------------------------------------

def _help(model_name: str, batch_size: int) -> str:
    shipped = ", ".join(f"{v.removesuffix('.json')} ({k})" for k, v in SHIPPED.items())
    base = model_name.partition(":")[0]
    return (f"shipped profiles (full-size models): {shipped}. For other models, measure one with "
            f"`gradsync profile --model {model_name} --batch-size {batch_size} --out {base}.json` and pass "
            f"emulated:{base}.json, or derive one from FLOPs with emulated:flops:RATE (e.g. flops:15tflops)")


def _load(model_name: str, batch_size: int, text: str | None) -> Profile:
    base, _, size = model_name.partition(":")
    if not text:
        if size not in ("", "full") or base not in SHIPPED:
            raise ConfigError(f"no shipped compute profile for {model_name!r}; {_help(model_name, batch_size)}")
        return Profile.load(os.path.join(PROFILE_DIR, SHIPPED[base]))
    if text.endswith(".json") and os.path.isfile(text):
        return Profile.load(text)
    name = text if text.endswith(".json") else text + ".json"
    if os.path.basename(name) == name and os.path.isfile(os.path.join(PROFILE_DIR, name)):
        return Profile.load(os.path.join(PROFILE_DIR, name))
    raise ConfigError(f"unknown compute profile {text!r}: not flops:RATE, an existing .json file or a "
                      f"shipped profile; {_help(model_name, batch_size)}")


def resolve(model_name: str, batch_size: int, text: str | None) -> Profile:
    """The profile that ``--compute emulated[:TEXT]`` means for ``model_name`` at ``batch_size``.

    ``TEXT`` empty: the shipped default for the model (full size only); ``flops:RATE``: derived by
    :func:`from_flops`; a path to a ``.json`` file, or a shipped profile's file name (``.json``
    optional). A loaded profile must be for the same model (base name); if it was made at another
    batch size its times are scaled linearly to ``batch_size`` and the source says so.
    """
    if text and text.startswith("flops:"):
        return from_flops(model_name, batch_size, parse_rate(text[len("flops:"):]))
    profile = _load(model_name, batch_size, text)
    if profile.model.partition(":")[0] != model_name.partition(":")[0]:
        raise ConfigError(f"compute profile {text or SHIPPED.get(model_name)!r} is for model {profile.model!r}, "
                          f"not {model_name!r}; {_help(model_name, batch_size)}")
    if profile.batch_size != batch_size:
        note = f"times scaled linearly from batch {profile.batch_size} to {batch_size}"
        profile = dataclasses.replace(profile.scaled(batch_size / profile.batch_size, note), batch_size=batch_size)
    return profile
