"""What the compressors cost on this rank: encodes and decodes, counted and traced where they ran.

Each is ``[calls, raw bytes, seconds]`` since the strategy was attached (``gradsync bench`` records
them per step as ``codec_work``; the simulator's validation replays them), and each is a span in
the trace (``encode`` or ``decode``, category ``comm``) with the raw bytes it took or made. The
training thread (summed buckets) and the communication thread count into the same totals.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

from gradsync import trace
from gradsync.compress import Compressor
from gradsync.compress.base import Payload


class CodecWork:
    """Timed ``compress``/``decompress`` calls and their running totals."""

    def __init__(self):
        self._work = {"encode": [0, 0, 0.0], "decode": [0, 0, 0.0]}
        self._lock = threading.Lock()

    def compress(self, codec: Compressor, tensor: torch.Tensor) -> tuple[Payload, Any]:
        """``codec.compress(tensor)``, counted as an ``encode`` of the tensor's bytes."""
        start = time.perf_counter()
        out = codec.compress(tensor)
        self._count("encode", start, tensor.numel() * tensor.element_size())
        return out

    def decompress(self, codec: Compressor, payload: Payload, ctx: Any) -> torch.Tensor:
        """``codec.decompress(payload, ctx)``, counted as a ``decode`` of the bytes it made."""
        start = time.perf_counter()
        out = codec.decompress(payload, ctx)
        self._count("decode", start, out.numel() * out.element_size())
        return out

    def _count(self, kind: str, start: float, nbytes: int) -> None:
        end = time.perf_counter()
        with self._lock:
            work = self._work[kind]
            work[0] += 1
            work[1] += nbytes
            work[2] += end - start
        tracer = trace.current()
        if tracer is not None:
            tracer.span(kind, "comm", start, end, bytes=nbytes)

    def totals(self) -> dict[str, list]:
        with self._lock:
            return {kind: list(work) for kind, work in self._work.items()}
