"""What the job moves: samples per second and this worker's send rate (:class:`Throughput`), and
the measured rate of every link from this worker (:func:`links`)."""
from __future__ import annotations

import math
import time

import torch

from gradsync import runtime
from gradsync.adapt.monitors.base import EMA, Monitor
from gradsync.errors import ConfigError


class Throughput(Monitor):
    """Samples per second over all workers (``batch_size`` per worker per step, EMA ``alpha``), the
    step time, and this worker's achieved send rate (bytes gradsync sent during the step / its time)."""

    def __init__(self, batch_size: int, alpha: float = 0.8):
        if batch_size < 1:
            raise ConfigError(f"Throughput: batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._rate, self._step = EMA(alpha), EMA(alpha)
        self._last: tuple[float, int] | None = None
        self.readings: dict[str, float] = {}

    def after_step(self) -> None:
        now, sent = time.perf_counter(), self.transport.bytes_sent
        if self._last is not None:
            dt = now - self._last[0]
            self.readings = {
                "samples_per_s": self._rate.update(self.batch_size * self.num_workers / dt),
                "step_s": self._step.update(dt),
                # a regrouped elastic job has a new transport, counting from zero
                "egress_gbit_s": (sent - self._last[1] if sent >= self._last[1] else sent) * 8 / dt / 1e9,
            }
        self._last = (now, sent)

    def values(self) -> dict[str, float]:
        return dict(self.readings)


def links(nbytes: int = 1 << 20, repeats: int = 3) -> dict[int, float]:
    """Measured rate (Gbit/s) of the link from this worker to every other worker: collective.

    In round ``k`` every worker sends ``nbytes`` to worker ``rank + k`` while receiving from
    ``rank - k``, so each link carries one probe at a time; the best of ``repeats`` is kept (the
    least disturbed by other traffic). Servers take no part.
    """
    rt = runtime.current()
    transport, topo = rt.transport, rt.topology
    n, me = topo.num_workers, topo.rank
    out: dict[int, float] = {}
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=transport.device)
    inbox = torch.empty_like(payload)
    for k in range(1, n):
        to, frm = (me + k) % n, (me - k) % n
        best = math.inf
        for r in range(repeats):
            transport.barrier(world=False, what="link probe")
            start = time.perf_counter()
            handles = [transport.recv_async(inbox, frm, 7_000 + r, what="link probe"),
                       transport.send_async(payload, to, 7_000 + r, what="link probe")]
            for h in handles:
                h.wait()
            best = min(best, time.perf_counter() - start)
        out[to] = payload.numel() * 4 * 8 / best / 1e9
    return out
