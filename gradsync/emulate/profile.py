"""Compute profiles: how long each layer's forward and backward takes on some device.

A profile is what ``--compute emulated[:PROFILE]`` replays: the model's layers in forward order,
each with the milliseconds its forward and its backward take at one batch size on one device.
A *layer* is a module that owns parameters directly (``module.parameters(recurse=False)``), named
as in ``model.named_modules()``; the time of parameter-free work between two layers (activations,
pooling, residual adds) is counted in the layer before it, so the layers' times add up to the
whole step. The emulator produces each layer's gradients at the end of its backward time, in
reverse forward order.

Three sources (see docs/profiles.md): :func:`~gradsync.emulate.derive.measure` times the real
model on this machine, :func:`~gradsync.emulate.derive.from_flops` derives times from per-layer FLOPs at a given rate, and :data:`SHIPPED` names
the profiles that come with gradsync (FLOP splits scaled to published V100 throughputs).
:func:`gradsync.emulate.derive.resolve` turns the ``PROFILE`` of ``--compute emulated[:PROFILE]``
into a profile.

File format (JSON)::

    {"model": "resnet50", "batch_size": 32, "dtype": "float32",
     "device": "what the times stand for (e.g. 'NVIDIA V100-class, fp32')",
     "source": "how the times were obtained",
     "layers": [{"name": "conv1", "forward_ms": 1.1, "backward_ms": 2.3}, ...],
     "throughput": 298.51}
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import asdict, dataclass, field

from gradsync.errors import ConfigError

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")
SHIPPED = {
    "resnet50": "resnet50-b32-v100.json",
    "vgg19": "vgg19-b32-v100.json",
    "inception_v3": "inception_v3-b32-v100.json",
    "bert-base": "bert-base-b32-v100.json",
    "transformer-nmt": "transformer-nmt-b32-v100.json",
    "lstm-lm": "lstm-lm-b32-v100.json",
    "sockeye-rnn": "sockeye-rnn-b32-v100.json",
}
"""The default profile of each full-size model (``--compute emulated`` with no PROFILE)."""


@dataclass
class Layer:
    name: str
    """Module name as in ``model.named_modules()`` ('' for the root module)."""
    forward_ms: float
    backward_ms: float


@dataclass
class Profile:
    model: str
    """Model name as given to :func:`gradsync.models.get_model` (``resnet50``, ``bert-base:tiny``)."""
    batch_size: int
    device: str
    """What the times stand for, e.g. ``'NVIDIA V100-class, fp32'`` or ``'this CPU, 1 thread'``."""
    source: str
    """How the times were obtained (measured with which command, or derived from FLOPs at what rate)."""
    layers: list[Layer] = field(default_factory=list)
    dtype: str = "float32"
    on_host: bool = False
    """The times were measured on the host CPU. The emulator then keeps a core busy for each layer
    (computing, not sleeping) and runs forward synchronously, as the CPU did, so communication
    competes with computation for the cores as it did in the measurement."""
    throughput: float | None = None
    """Samples/s the times were scaled to match, so that ``step_ms == 1000 * batch_size / throughput``
    (for shipped profiles a published measurement, or an estimate from one: the source says which);
    None when the times were not scaled to a throughput."""

    @property
    def forward_ms(self) -> float:
        return sum(layer.forward_ms for layer in self.layers)

    @property
    def backward_ms(self) -> float:
        return sum(layer.backward_ms for layer in self.layers)

    @property
    def step_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    def scaled(self, factor: float, note: str = "") -> "Profile":
        """A copy with every time multiplied by ``factor`` and ``note`` appended to the source."""
        layers = [Layer(x.name, x.forward_ms * factor, x.backward_ms * factor) for x in self.layers]
        source = f"{self.source}; {note}" if note else self.source
        return dataclasses.replace(self, layers=layers, source=source)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                raw = json.load(f)
            layers = [Layer(**layer) for layer in raw.pop("layers")]
            return cls(**raw, layers=layers)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"cannot read compute profile {path!r}: {exc}") from exc


# -- layers and where time goes -----------------------------------------------------------------

def layer_modules(model) -> dict:
    """The model's layers, ``{name: module}``, in ``named_modules()`` order."""
    return {name: m for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None}


_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([tgp]flops)?\s*$", re.IGNORECASE)
_UNIT = {"gflops": 1e-3, "tflops": 1.0, "pflops": 1e3}


def parse_rate(text: str) -> float:
    """``'15tflops'``, ``'15'`` (TFLOPS), ``'900gflops'`` or ``'1.2pflops'`` -> TFLOPS."""
    match = _RATE.match(text or "")
    if not match or float(match.group(1)) * 10 ** int(match.group(2) or 0) <= 0:
        raise ConfigError(f"bad FLOP rate {text!r}: expected a positive number with an optional unit, "
                          "e.g. 15tflops, 15 (TFLOPS) or 900gflops")
    value = float(match.group(1)) * 10 ** int(match.group(2) or 0)
    return value * _UNIT[(match.group(3) or "tflops").lower()]


def check_covers(profile: Profile, model) -> None:
    """Raise ConfigError unless ``profile`` lists every layer of ``model`` exactly once, and no other."""
    names = [layer.name for layer in profile.layers]
    wanted = list(layer_modules(model))
    problems = []
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        problems.append(f"lists layer {duplicate!r} twice")
    missing = [n for n in wanted if n not in set(names)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        problems.append(f"has no layer {missing[0]!r}{more}, a module of the model that owns parameters")
    extra = [n for n in names if n not in set(wanted)]
    if extra:
        problems.append(f"lists {extra[0]!r}, which is not a parameter-owning module of the model")
    if problems:
        raise ConfigError(f"compute profile for {profile.model!r} ({profile.source[:60]}...) does not fit the model: "
                          + "; ".join(problems) + f". Re-measure it with `gradsync profile --model {profile.model}`")
