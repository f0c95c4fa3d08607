"""Gradient compressors (``gradsync.compress``): one small class each, behind one contract.

See :mod:`gradsync.compress.base` for the contract (``compress`` / ``decompress``, ``summable``,
``lossless``) and :mod:`gradsync.compress.hook` for using any of them as a PyTorch DDP communication
hook. :data:`COMPRESSORS` maps a public name to a class; :func:`build` makes the per-gradient
instance a strategy uses; :func:`register` adds one in one line.

=============  =================================  ===========================  =========
name           method                             wire (float32 = 32 bits)     summable
=============  =================================  ===========================  =========
none           the gradient                       32 bits                      yes
fp16, bf16     half-precision cast                16 bits                      yes
onebit         sign + two means                   1 bit                        no
signsgd        sign                               1 bit                        no
scaled-sign    sign x mean magnitude              1 bit                        no
efsignsgd      sign x mean magnitude, with EF     1 bit                        no
tbq            +-tau / 0 with residual            2 bits                       no
terngrad       stochastic ternary                 2 bits                       no
qsgd           stochastic, ``levels`` levels      2-8 bits + a norm per 128    no
int8, int4     nearest of 255 / 15 levels         8 / 4 bits + a scale per 128 no
topk           largest ``ratio``                  64 bits x ratio              no
randomk        shared random ``ratio``            32 bits x ratio              yes
dgc            sampled top-k, momentum            64 bits x ratio              no
graddrop       sampled top-k with residual        64 bits x (1 - drop_ratio)   no
powersgd       rank-r ``P Q^T``                   32 (n + m) r per matrix      yes (2 rounds)
=============  =================================  ===========================  =========
"""
from __future__ import annotations

import zlib
from functools import partial
from typing import Any, Callable

from gradsync.compress.base import (CompressionError, Compressor, Context, NonFiniteGradientError, Payload,
                                    check_finite, compress_checked, wire_bytes)
from gradsync.compress.cast import BF16, FP16, Identity
from gradsync.compress.feedback import ErrorFeedback
from gradsync.compress.powersgd import PowerSGD
from gradsync.compress.quantize import QSGD, TBQ, Int4, Int8, TernGrad
from gradsync.compress.sign import OneBit, ScaledSign, SignSGD
from gradsync.compress.sparsify import DGC, GradDrop, RandomK, TopK
from gradsync.errors import ConfigError, options_error


def _with_feedback(cls: Callable[..., Compressor], **options: Any) -> Compressor:
    return ErrorFeedback(cls(**options))


COMPRESSORS: dict[str, Callable[..., Compressor]] = {
    "none": Identity,
    "fp16": FP16,
    "bf16": BF16,
    "onebit": OneBit,
    "signsgd": SignSGD,
    "scaled-sign": ScaledSign,
    "efsignsgd": partial(_with_feedback, ScaledSign),
    "tbq": TBQ,
    "terngrad": TernGrad,
    "qsgd": QSGD,
    "int8": Int8,
    "int4": Int4,
    "topk": TopK,
    "randomk": RandomK,
    "dgc": DGC,
    "graddrop": GradDrop,
    "powersgd": PowerSGD,
}


def register(name: str, constructor: Callable[..., Compressor]) -> None:
    """Make ``constructor`` available as ``compression=name`` everywhere."""
    COMPRESSORS[name] = constructor


def compressor_names() -> list[str]:
    return sorted(COMPRESSORS)


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"topk:ratio=0.01,seed=3"`` -> ``("topk", {"ratio": 0.01, "seed": 3})`` (numbers, true/false, none)."""
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"compressor option {item!r} in {spec!r} is not KEY=VALUE")
        low = raw.strip().lower()
        if low in ("true", "false", "none"):
            options[key.strip()] = {"true": True, "false": False, "none": None}[low]
            continue
        try:
            options[key.strip()] = int(raw)
        except ValueError:
            try:
                options[key.strip()] = float(raw)
            except ValueError:
                options[key.strip()] = raw.strip()
    return name.strip(), options


def _accepts_seed(constructor: Callable[..., Compressor]) -> bool:
    target = constructor.args[0] if isinstance(constructor, partial) else constructor
    return "seed" in getattr(target, "__dataclass_fields__", {})


def build(name: str, *, key: str = "", worker: int = 0, error_feedback: bool = False, **options: Any) -> Compressor:
    """A compressor instance for one gradient.

    ``key`` names the gradient (its parameter name) and ``worker`` is the caller's rank: compressors with a ``seed``
    get one derived from them unless ``seed`` is given, equal on every rank where the algorithm needs
    shared random numbers (random-k's indices, PowerSGD's first ``Q``) and different per rank otherwise
    (independent stochastic rounding). ``error_feedback=True`` wraps it in :class:`ErrorFeedback`.
    """
    if name not in COMPRESSORS:
        raise ConfigError(f"unknown compressor {name!r}; valid compressors: {', '.join(compressor_names())}")
    constructor = COMPRESSORS[name]
    if "seed" not in options and _accepts_seed(constructor):
        options["seed"] = zlib.crc32(key.encode())
    try:
        compressor = constructor(**options)
    except TypeError as exc:
        raise options_error("compressor", name, constructor, options, exc) from None
    if not compressor.shared_seed and hasattr(compressor, "seed"):
        compressor.seed += 7919 * worker
    return ErrorFeedback(compressor) if error_feedback else compressor


__all__ = ["BF16", "COMPRESSORS", "CompressionError", "Compressor", "Context", "DGC", "ErrorFeedback", "FP16",
           "GradDrop", "Identity", "Int4", "Int8", "NonFiniteGradientError", "OneBit", "Payload", "PowerSGD", "QSGD", "RandomK",
           "ScaledSign", "SignSGD", "TBQ", "TernGrad", "TopK", "build", "check_finite", "compress_checked",
           "compressor_names", "parse_spec", "register", "wire_bytes"]
