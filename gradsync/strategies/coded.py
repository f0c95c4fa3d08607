"""Compressed pushes and answers for the parameter servers (``ps``, ``p3``, ``ps-sliced`` with
``compression=``; ``ps-async`` compresses its pushes only).

A parameter server's push is a fixed block of gradient per key (a fused group of tensors for
``ps``, a slice for ``p3``), so its encoded form gets a fixed *slot* on the wire: an ``int64``
length, then the payload as one :func:`~gradsync.compress.base.to_bytes` message, padded to the
slot. The slot is the payload of a fresh compressor on a block of ones, rounded up to 8 bytes: the
largest any codec here sends (sparsifiers keep their full ``k`` on ties, DGC its widest warm-up
density); a payload that outgrows it raises :class:`~gradsync.compress.CompressionError` naming
the codec.

The pusher keeps one compressor per key (with ``error_feedback=True``, one residual per key: what
that slice or group lost is added to its next push). A server decodes each push with a decoder of
its own per key and adds the decoded blocks as it adds exact ones. Its answer is the key's
*change* by the update, encoded by a compressor of the server's with a residual per key (always:
a change that is dropped without one never arrives); the server sets the key to its value before
the update plus the decoded change, which is exactly what every worker computes from the answer,
so every rank holds one model (the double compression of BytePS's and HiPress's servers, on the
parameters' change since the update happens on the server). Only what crosses the network is
encoded: a co-located server keeps its own push exact, and on hosts of several workers the host's
pushes are summed exactly inside the host and the leader encodes the host's sum.

Codecs whose receiver needs the sender's random state (``randomk``, ``powersgd``: shared seeds a
server that never compresses cannot follow) are refused. A block that holds NaN or Inf is not
encoded: its slot says so, and the server adds a block of NaN, so the update goes non-finite as it
would without compression (and as DDP's does).
"""
from __future__ import annotations

import warnings

import torch

from gradsync.compress import CompressionError, Compressor, build, parse_spec
from gradsync.compress.base import all_finite, from_bytes, to_bytes
from gradsync.errors import ConfigError
from gradsync.transport import check_peer

NOT_FINITE = -1
"""The length a slot carries for a block that held NaN or Inf (nothing encoded)."""


class CodedBlocks:
    """Encode and decode fixed blocks (a push's gradients, an answer's change) with one codec: a
    compressor per key where blocks are encoded, a decoder per key where they arrive."""

    def __init__(self, compression: str, error_feedback: bool, strategy: str):
        name, self.options = parse_spec(compression)
        probe = build(name, **self.options)  # a bad name or option fails here
        if probe.shared_seed:
            raise ConfigError(f"{strategy} cannot use compression={compression!r}: {name} draws random numbers "
                              "every rank must share, and a server decodes without compressing; use a codec "
                              "without a shared seed (topk, dgc, onebit, int8, int4, fp16, ...)")
        self.name, self.error_feedback, self.lossless = name, error_feedback, probe.lossless
        self.rank = 0
        self.encoders: dict[object, Compressor] = {}
        self.decoders: dict[object, Compressor] = {}
        self.slots: dict[int, int] = {}

    def reset(self, rank: int) -> None:
        """A new job (an attach): no compressor, and so no residual, carried over from the last one."""
        self.rank = rank
        self.encoders.clear()
        self.decoders.clear()

    def slot(self, numel: int) -> int:
        """The bytes one encoded block of ``numel`` elements takes on the wire (length word included)."""
        size = self.slots.get(numel)
        if size is None:
            payload, _ = build(self.name, **self.options).compress(torch.ones(numel))
            size = self.slots[numel] = 8 * (1 + (to_bytes(payload).numel() + 7) // 8)  # 8-byte aligned
        return size

    def encode(self, key: object, block: torch.Tensor, out: torch.Tensor, what: str) -> None:
        """``block`` (1-D, float) encoded into ``out`` (``uint8``, :meth:`slot` bytes) by key ``key``'s
        compressor; ``what`` names the block in errors and warnings."""
        length = out[:8].view(torch.int64)
        if not all_finite(block):
            length.fill_(NOT_FINITE)
            return
        codec = self.encoders.get(key)
        if codec is None:
            codec = self.encoders[key] = build(self.name, key=str(key), worker=self.rank,
                                               error_feedback=self.error_feedback, **self.options)
        try:
            payload, _ = codec.compress(block)
        except CompressionError as exc:
            warnings.warn(f"rank {self.rank} could not compress {what} with {self.name} ({exc}); it is pushed "
                          "as NaN, so this update goes non-finite", RuntimeWarning, stacklevel=2)
            length.fill_(NOT_FINITE)
            return
        data = to_bytes(payload)
        if 8 + data.numel() > out.numel():
            raise CompressionError(f"{self.name} encoded {what} into {data.numel()} bytes, more than the "
                                   f"{out.numel() - 8} its slot holds; this codec's payloads grow past a block of "
                                   "ones' (use a codec of fixed size)")
        length.fill_(data.numel())
        out[8:8 + data.numel()].copy_(data)

    def decode(self, key: object, slot: torch.Tensor, into: torch.Tensor, peer: int, what: str) -> None:
        """Write the block that ``slot`` (received from ``peer``) encodes into ``into`` (1-D)."""
        length = int(slot[:8].view(torch.int64))
        if length == NOT_FINITE:
            into.fill_(float("nan"))
            return
        check_peer(0 < length <= slot.numel() - 8, peer, f"a compressed push of {what}",
                   f"a length of {length} bytes (the slot holds {slot.numel() - 8})")
        try:
            payload = from_bytes(slot[8:8 + length])
        except ValueError as exc:
            check_peer(False, peer, f"a compressed push of {what}", str(exc))
        codec = self.decoders.get(key)
        if codec is None:
            codec = self.decoders[key] = build(self.name, key=str(key), **self.options)
        check_peer(sum(p.numel() for p in payload) <= 2 * into.numel() + 4096, peer,
                   f"a compressed push of {what}", f"a payload of {sum(p.numel() for p in payload)} elements")
        try:
            into.copy_(codec.decompress(payload, codec.context_for(into)).reshape(-1))
        except (RuntimeError, IndexError) as exc:
            check_peer(False, peer, f"a compressed push of {what}", f"a payload {self.name} cannot decode ({exc})")

    def describe(self) -> str:
        return f"{self.name}{' with error feedback' if self.error_feedback else ''}"
