"""Selective compression: a cost model that decides, per bucket, whether to compress and into how many
partitions (HiPress's SeCoPa, Bai et al. SOSP 2021, section 5).

Every cost is linear, ``a + b * bytes``, measured on this job at attach time rather than fitted
offline as SeCoPa was:

- the link: one all-reduce of 1 element and one of ``LINK_PROBE_BYTES`` among the workers; a ring
  all-reduce of ``s`` bytes takes ``2 (N-1) (latency + s / N / rate)`` (Patarasuk & Yuan), which gives
  the per-message latency and the rate this job really gets (emulated links, loopback, CPU contention);
- the compressor: encode and decode of two sizes of a random gradient, each warmed by one untimed
  call (a first decode touches fresh pages for its output, which a training run pays once), median
  of ``REPEATS``, and the wire size (the compression ratio) it produced.

Every rank takes the largest (slowest) figure over workers, so all ranks make the same decisions.
The strategies' costs, for a bucket of ``s`` bytes, ``N`` workers, ratio ``r`` and ``K`` partitions
(SeCoPa's formulas, with the encode and decode counts of gradsync's implementations):

- ring, plain:           ``2 (N-1) (L + s/N/R)``
- ring, summable codec:  the same with ``r s``, plus one encode and two decodes of ``s``
- ring, merging codec:   ``2 (N-1) (2L + r s/N/R) + N enc(s/N) + (2N-1) dec(s/N)``
- ps, K partitions:      ``(N+K-2) (L + r s/K/R) + min(K+1, N) enc(s/K) + min(N-1+K, 2(N-1)) dec(s/K)``
  (plain: ``r = 1`` and no codec terms): an aggregator sends ``K-1`` pushes and ``N-1`` results
  of one partition each, and receives as many

A bucket is compressed when its compressed cost (best ``K`` for ``ps``) is lower than its plain cost.
The decisions are reported by :meth:`Decision.row` (``describe()`` and ``gradsync bench`` show them).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from gradsync.compress import Compressor, compress_checked
from gradsync.compress.base import to_bytes

LINK_PROBE_BYTES = 4 << 20
CODEC_PROBE_NUMEL = (1 << 14, 1 << 19)
REPEATS = 3


@dataclass(frozen=True)
class Linear:
    """``a + b * x`` seconds for ``x`` bytes."""

    a: float
    b: float

    def __call__(self, nbytes: float) -> float:
        return self.a + self.b * nbytes

    @classmethod
    def through(cls, x0: float, t0: float, x1: float, t1: float) -> "Linear":
        b = max(0.0, (t1 - t0) / (x1 - x0))
        return cls(max(0.0, t0 - b * x0), b)


@dataclass(frozen=True)
class Costs:
    latency: float
    """Seconds per message."""
    seconds_per_byte: float
    """On the link (``1 / rate``)."""
    encode: Linear
    decode: Linear
    ratio: float
    """Wire bytes over raw bytes."""

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.latency, self.seconds_per_byte, self.encode.a, self.encode.b,
                             self.decode.a, self.decode.b, self.ratio], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Costs":
        v = t.tolist()
        return cls(v[0], v[1], Linear(v[2], v[3]), Linear(v[4], v[5]), v[6])


@dataclass(frozen=True)
class Decision:
    bucket: int
    nbytes: int
    compress: bool
    parts: int
    plain_s: float
    compressed_s: float

    def row(self) -> str:
        choice = f"compress, {self.parts} part(s)" if self.compress else f"plain, {self.parts} part(s)"
        return (f"bucket {self.bucket:3d} {self.nbytes / 2**20:8.2f} MB  {choice:<22} predicted "
                f"{self.plain_s * 1e3:8.2f} ms plain, {self.compressed_s * 1e3:8.2f} ms compressed")


def _median_time(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # warm: fresh output pages, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_codec(make: Callable[[], Compressor], dtype: torch.dtype,
                  sizes: tuple[int, int] = CODEC_PROBE_NUMEL, repeats: int = REPEATS) -> tuple[Linear, Linear, float]:
    """Encode and decode cost lines of a fresh compressor from ``make()`` through gradients of
    ``sizes`` elements (each a warm call's median of ``repeats``), and its wire ratio."""
    generator = torch.Generator().manual_seed(0)
    points = []
    for numel in sizes:
        grad = torch.randn(numel, generator=generator).to(dtype)
        codec = make()
        payload, ctx = compress_checked(codec, grad, "cost-model probe")
        enc = _median_time(lambda: codec.compress(grad), repeats)
        dec = _median_time(lambda: codec.decompress(payload, ctx), repeats)
        ratio = to_bytes(payload).numel() / (numel * grad.element_size())
        points.append((numel * grad.element_size(), enc, dec, ratio))
    (x0, e0, d0, _), (x1, e1, d1, ratio) = points
    return Linear.through(x0, e0, x1, e1), Linear.through(x0, d0, x1, d1), ratio


def measure_link(allreduce: Callable[[torch.Tensor], None], workers: int) -> tuple[float, float]:
    """``(latency, seconds per byte)`` from timed all-reduces among ``workers`` ranks (see module doc)."""
    if workers < 2:
        return 0.0, 0.0
    small = torch.zeros(1)
    big = torch.zeros(LINK_PROBE_BYTES // 4)
    t_small = _median_time(lambda: allreduce(small))  # its first, untimed call brings the connections up
    t_big = _median_time(lambda: allreduce(big))
    hops = 2 * (workers - 1)
    latency = t_small / hops
    per_byte = max(0.0, (t_big - t_small) * workers / (hops * LINK_PROBE_BYTES))
    return latency, per_byte


def ring_cost(c: Costs, nbytes: int, n: int, *, compressed: bool, summable: bool) -> float:
    hops = 2 * (n - 1)
    if not compressed:
        return hops * (c.latency + nbytes / n * c.seconds_per_byte)
    if summable:
        return hops * (c.latency + c.ratio * nbytes / n * c.seconds_per_byte) + c.encode(nbytes) + 2 * c.decode(nbytes)
    chunk = nbytes / n
    return (hops * (2 * c.latency + c.ratio * chunk * c.seconds_per_byte)
            + n * c.encode(chunk) + (2 * n - 1) * c.decode(chunk))


def ps_cost(c: Costs, nbytes: int, n: int, k: int, *, compressed: bool) -> float:
    part = nbytes / k
    ratio = c.ratio if compressed else 1.0
    wire = (n + k - 2) * (c.latency + ratio * part * c.seconds_per_byte)
    if not compressed:
        return wire
    return wire + min(k + 1, n) * c.encode(part) + min(n - 1 + k, 2 * (n - 1)) * c.decode(part)


def decide_ring(c: Costs, bucket: int, nbytes: int, n: int, summable: bool) -> Decision:
    plain = ring_cost(c, nbytes, n, compressed=False, summable=summable)
    packed = ring_cost(c, nbytes, n, compressed=True, summable=summable)
    return Decision(bucket, nbytes, packed < plain, n, plain, packed)


def decide_ps(c: Costs, bucket: int, nbytes: int, n: int) -> Decision:
    plain_k = min(range(1, n + 1), key=lambda k: ps_cost(c, nbytes, n, k, compressed=False))
    packed_k = min(range(1, n + 1), key=lambda k: ps_cost(c, nbytes, n, k, compressed=True))
    plain = ps_cost(c, nbytes, n, plain_k, compressed=False)
    packed = ps_cost(c, nbytes, n, packed_k, compressed=True)
    return Decision(bucket, nbytes, packed < plain, packed_k if packed < plain else plain_k, plain, packed)
