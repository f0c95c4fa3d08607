"""The compressor contract (after GRACE, Xu et al. ICDCS 2021, and Horovod's two-method compressor).

A compressor turns one gradient into a *payload*, a list of tensors that are the only thing that crosses
the wire, plus a *context* that stays on the sending rank::

    payload, ctx = compressor.compress(grad)        # any float dtype, any shape, contiguous or not
    approx = compressor.decompress(payload, ctx)    # grad's shape and dtype

``decompress`` also works on a payload that came from another rank, given a context from a tensor of
the same shape and dtype (a receiver builds one with :meth:`Compressor.context_for`).

Declared properties, which synchronization strategies read instead of branching on names:

- ``summable``: :meth:`Compressor.reduce` sums a gradient over ranks with all-reduces of compressed
  tensors. By default it compresses, all-reduces each payload tensor and decompresses once, which is
  right when the element-wise sum of payloads decompresses to the sum of what each would (casts,
  random-k at shared indices); PowerSGD overrides it with its two rounds. Other compressors need
  decode, merge, re-encode (a parameter server or a ring that merges), or an all-gather.
- ``lossless``: ``decompress(compress(x)) == x`` exactly.

Compressors are stateful per gradient (a residual, a momentum, a warm-start matrix, a step count), so
a strategy builds one instance per gradient with :func:`gradsync.compress.build`; every rank must call
``compress`` on its instance the same number of times (random-k and PowerSGD derive shared random
numbers from that count).

Faults: a NaN or Inf in a gradient cannot be compressed meaningfully (a scale becomes NaN and spreads
over every element). :func:`compress_checked` raises :class:`NonFiniteGradientError` naming the
parameter and rank before anything is sent, and turns a compressor's own :class:`CompressionError`
(fp16 overflow) into one that names them too.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from gradsync.errors import GradsyncError

Payload = list[torch.Tensor]


class CompressionError(GradsyncError):
    """A gradient could not be compressed faithfully (for example, out of the target format's range)."""


class NonFiniteGradientError(CompressionError):
    """A gradient holds NaN or Inf."""


@dataclass
class Context:
    """What the receiving side needs to rebuild a tensor: its shape and dtype."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.shape.numel()


class Compressor:
    """Base class. Subclasses are dataclasses whose fields are their options (documented per field)."""

    name: ClassVar[str] = "compressor"
    summable: ClassVar[bool] = False
    lossless: ClassVar[bool] = False
    shared_seed: ClassVar[bool] = False
    """Whether every rank must seed this gradient's instance alike (see :func:`gradsync.compress.build`)."""

    def __init_subclass__(cls, **kwargs):
        """Every compressor's ``compress`` refuses a tensor that is not floating point (an integer
        "gradient" would be cast, truncated or bit-packed into nonsense), naming its dtype."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("compress")
        if own is None or getattr(own, "_checks_dtype", False):
            return

        @functools.wraps(own)
        def compress(self, tensor: torch.Tensor) -> tuple[Payload, Any]:
            if not tensor.is_floating_point():
                raise CompressionError(f"{self.name} compresses floating-point gradients; got a {tensor.dtype} tensor "
                                       f"of shape {list(tensor.shape)}")
            return own(self, tensor)

        compress._checks_dtype = True
        cls.compress = compress

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Any]:
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    def context_for(self, tensor: torch.Tensor) -> Any:
        """The context a receiver uses to decompress another rank's payload for a tensor like this one."""
        return Context(tensor.shape, tensor.dtype)

    def reduce(self, tensor: torch.Tensor, allreduce: Callable[[torch.Tensor], None]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum ``tensor`` over ranks through compressed payloads (``summable`` compressors only).

        ``allreduce(t)`` sums ``t`` in place over ranks. Returns ``(total, mine)``: the decompressed
        sum, and this rank's own contribution as the sum saw it (what error feedback subtracts).
        PowerSGD overrides this with its two rounds.
        """
        if not self.summable:
            raise CompressionError(f"{self.name} payloads cannot be summed; use decode-merge-encode or all-gather")
        payload, ctx = self.compress(tensor)
        mine = self.decompress([p.clone() for p in payload], ctx)
        for part in payload:
            allreduce(part)
        total = self.decompress(payload, ctx)
        if not all_finite(total):
            raise CompressionError(f"the sum over ranks overflowed {self.name}'s range; divide by the number "
                                   "of ranks before summing, or use bf16")
        return total, mine

    def describe(self) -> str:
        shown = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        opts = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in shown if f.init and f.repr)
        return f"{self.name}({opts})" if opts else self.name


def wire_bytes(payload: Payload) -> int:
    """Bytes a payload puts on the wire."""
    return sum(t.numel() * t.element_size() for t in payload)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D float32 view or copy of ``tensor`` (compressors compute in float32)."""
    return tensor.reshape(-1).float()


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, at the speed of a sum (a CPU reduces far faster than it
    materializes ``isfinite(t)``).

    Any NaN or Inf makes the sum NaN or Inf; a finite sum therefore proves all elements finite, and
    only a sum that overflowed needs the element-wise check.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    wide = torch.float32 if tensor.element_size() < 4 else tensor.dtype
    return bool(torch.isfinite(tensor.sum(dtype=wide))) or bool(torch.isfinite(tensor).all())


def check_finite(tensor: torch.Tensor, name: str, rank: int | None = None) -> None:
    if not all_finite(tensor):
        bad = int((~torch.isfinite(tensor)).sum())
        where = "" if rank is None else f" on rank {rank}"
        raise NonFiniteGradientError(
            f"gradient of {name!r}{where} has {bad} NaN/Inf element(s) of {tensor.numel()}; nothing was sent. "
            "Lower the learning rate, clip gradients, or skip the step (with AMP, unscale and check "
            "before synchronizing).")


def compress_checked(compressor: Compressor, tensor: torch.Tensor, name: str,
                     rank: int | None = None) -> tuple[Payload, Any]:
    """``compressor.compress(tensor)`` after a finiteness check; errors name ``name`` and ``rank``."""
    check_finite(tensor, name, rank)
    try:
        return compressor.compress(tensor)
    except CompressionError as exc:
        where = "" if rank is None else f" on rank {rank}"
        raise type(exc)(f"compressing {name!r}{where} with {compressor.name}: {exc}") from None


# -- a payload as one self-describing byte message (what strategies send point to point) ----------------
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.float64]


def to_bytes(payload: Payload) -> torch.Tensor:
    """``payload`` as one ``uint8`` tensor: ``int64`` part count, then ``(numel, dtype code)`` per part,
    then each part's bytes. Never empty, so it can always be sent."""
    header = [len(payload)]
    for part in payload:
        header += [part.numel(), _DTYPES.index(part.dtype)]
    device = payload[0].device if payload else None
    parts = [torch.tensor(header, dtype=torch.int64, device=device).view(torch.uint8)]
    parts += [p.reshape(-1).contiguous().view(torch.uint8) for p in payload]
    return torch.cat(parts)


MAX_PARTS = 64
"""The most parts a payload has (the codecs send 1 to 4)."""


def message_problem(message: torch.Tensor) -> str | None:
    """What is wrong with a received :func:`to_bytes` message (its layout: part count, dtype codes,
    lengths adding up to its size), or None. Checked before any part is read."""
    size = message.numel()
    if size < 8:
        return f"a {size}-byte payload (the part count alone takes 8)"
    count = int(message[:8].view(torch.int64))
    if not 0 <= count <= MAX_PARTS or size < 8 * (1 + 2 * count):
        return f"a payload of {count} parts in {size} bytes (at most {MAX_PARTS} parts, 16 header bytes each)"
    header = message[8: 8 * (1 + 2 * count)].view(torch.int64).tolist()
    total = 8 * (1 + 2 * count)
    for i in range(count):
        numel, code = header[2 * i], header[2 * i + 1]
        if not 0 <= code < len(_DTYPES) or numel < 0:
            return f"payload part {i} of {numel} elements of dtype code {code}"
        total += numel * _DTYPES[code].itemsize
    if total != size:
        return f"a payload whose parts add up to {total} bytes in a {size}-byte message"
    return None


def from_bytes(message: torch.Tensor, like: Payload | None = None) -> Payload:
    """The payload in a :func:`to_bytes` message: flat parts, or shaped like ``like``'s where sizes match.
    A message whose layout is wrong is a ``ValueError`` (:func:`message_problem`)."""
    problem = message_problem(message)
    if problem is not None:
        raise ValueError(f"malformed compressed message: {problem}")
    count = int(message[:8].view(torch.int64))
    header = message[8: 8 * (1 + 2 * count)].view(torch.int64).tolist()
    out, offset = [], 8 * (1 + 2 * count)
    for i in range(count):
        numel, dtype = header[2 * i], _DTYPES[header[2 * i + 1]]
        nbytes = numel * dtype.itemsize
        part = message[offset: offset + nbytes].clone().view(dtype)
        ref = like[i] if like is not None and i < len(like) else None
        out.append(part.view(ref.shape) if ref is not None and ref.numel() == numel else part)
        offset += nbytes
    return out
