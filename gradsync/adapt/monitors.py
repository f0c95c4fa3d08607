"""Monitors: what an adaptation policy watches while training runs (KungFu, Mai et al., OSDI 2020).

A monitor sees training through three hook points that :func:`gradsync.distribute` calls for
every strategy, so it works with any strategy without knowing which one runs:

- ``on_local_grad(i, grad)``: parameter ``i``'s gradient on this worker, before synchronization
  (after gradient accumulation, from the same backward hook the strategies use);
- ``on_synced()``: just before the optimizer update, where ``p.grad`` holds the mean over workers
  (strategies with ``mean_grads_at_apply``; the others are refused at :func:`monitor`);
- ``after_step()``: ``optimizer.step()`` returned.

Every value is the same on every worker: what a monitor reduces, it reduces over all of them.
Built-ins:

- :class:`NoiseScale`: the gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` of McCandlish et al.
  ("An Empirical Model of Large-Batch Training", 2018, appendix A.1), from each worker's local
  gradient norm (batch ``b``) and the synchronized gradient's norm (batch ``N b``), smoothed by
  separate EMAs of numerator and denominator as KungFu does. Cost: one pass over the local
  gradients, a pass over ``1/N`` of the synchronized ones (each worker squares its share) and one
  all-reduce of two scalars.
- :class:`GradientVariance`: the variance over workers of each gradient coordinate, summed and as
  a norm. Exact: an extra all-reduce of the squared gradients (KungFu's
  ``MonitorGradientVarianceOptimizer``; one more model-sized all-reduce per step). Sampled: the
  same over a fixed random subset of coordinates (the same on every worker), scaled up.
- :class:`Throughput`: samples per second and this worker's achieved send rate.

``links(...)`` measures the rate of every link from this worker by timing point-to-point probes.

Why one file of this size: the monitors' hook protocol and the three monitors built on it; each
monitor is short and the protocol is read through them.
"""
from __future__ import annotations

import math
import time
import torch

from gradsync import runtime
from gradsync.errors import ConfigError


class Monitor:
    """Base class: no-op hooks. ``values()`` returns this monitor's latest readings by name."""

    needs_mean_grads = False
    """Reads ``p.grad`` in :meth:`on_synced` (only strategies with ``mean_grads_at_apply``)."""

    def attach(self, params: list[torch.nn.Parameter], names: list[str], every: int) -> None:
        self.params, self.names, self.every = params, names, every
        self.transport = runtime.current().transport
        self.num_workers = runtime.current().topology.num_workers
        self.step = 0  # optimizer steps seen

    @property
    def active(self) -> bool:
        """Whether this step is monitored (every ``every`` steps; the same on every worker)."""
        return self.step % self.every == 0

    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        pass

    def on_synced(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def values(self) -> dict[str, float]:
        return {}

    def state(self) -> dict:
        """What a worker joining an elastic job needs to report as the others do (JSON values)."""
        return {}

    def load_state(self, state: dict) -> None:
        pass


class EMA:
    """``value = alpha * value + (1 - alpha) * x``; the first sample is taken as is (KungFu's ``ema.hpp``)."""

    def __init__(self, alpha: float):
        if not 0.0 <= alpha < 1.0:
            raise ConfigError(f"an EMA's alpha must be in [0, 1), got {alpha}")
        self.alpha, self.value = alpha, None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.alpha * self.value + (1 - self.alpha) * x
        return self.value


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a tensor's elements, as a float64 scalar (one pass, no temporary)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        flat = t.view(-1)
        return torch.dot(flat, flat).double()
    return torch.linalg.vector_norm(t, dtype=torch.float32).double().square()


class NoiseScale(Monitor):
    """The gradient noise scale ``B_simple``: the batch size beyond which a larger batch stops paying.

    With ``b`` samples per worker, ``B = N b`` in all, ``|G_b|^2`` the mean over workers of their local
    gradients' squared norms and ``|G_B|^2`` the synchronized gradient's, the unbiased estimates are
    ``|G|^2 = (B |G_B|^2 - b |G_b|^2) / (B - b)`` and ``tr(Sigma) = (|G_b|^2 - |G_B|^2) / (1/b - 1/B)``;
    each goes through its own EMA (``alpha``; reported as ``grad_sq_norm`` and ``grad_trace_cov``) and
    ``noise_scale`` is their ratio. Needs two or more workers
    (with one, ``b == B`` and nothing can be told apart): ``noise_scale`` is then ``nan``.

    ``batch_size``: samples per worker per step; keep it current when it changes
    (:class:`gradsync.adapt.AdaptiveBatchSize` does).
    """

    needs_mean_grads = True

    def __init__(self, batch_size: int, alpha: float = 0.9):
        if batch_size < 1:
            raise ConfigError(f"NoiseScale: batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.alpha = alpha
        self._s, self._g = EMA(alpha), EMA(alpha)
        self._local: list[torch.Tensor] = []
        self.readings: dict[str, float] = {}

    def attach(self, params, names, every) -> None:
        super().attach(params, names, every)
        self._local = []  # readings of a step that failed midway (elastic recovery) must not count
        # The synchronized gradient is the same on every worker: each squares its share of the
        # parameters (balanced by size) and the all-reduce adds the shares up.
        load = [0] * self.num_workers
        self.share = [False] * len(params)
        me = runtime.current().topology.rank
        for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
            w = load.index(min(load))
            load[w] += params[i].numel()
            self.share[i] = w == me

    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        if self.active:
            self._local.append(_sq(grad))

    def on_synced(self) -> None:
        if not self.active:
            return
        device = self.transport.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        local = torch.stack(self._local).sum().to(device) if self._local else zero
        self._local = []
        mine = [_sq(p.grad) for p, own in zip(self.params, self.share) if own and p.grad is not None]
        big = torch.stack(mine).sum().to(device) if mine else zero
        t = torch.stack([local, big])
        self.transport.allreduce(t, what="noise scale norms")
        small_sq, big_sq = float(t[0]) / self.num_workers, float(t[1])
        b, B = self.batch_size, self.batch_size * self.num_workers
        if B == b:
            self.readings = {"noise_scale": math.nan, "grad_sq_norm": big_sq}
            return
        g2 = (B * big_sq - b * small_sq) / (B - b)
        trace = (small_sq - big_sq) / (1 / b - 1 / B)
        s, g = self._s.update(trace), self._g.update(g2)
        self.readings = {"noise_scale": s / g if g else math.inf, "grad_sq_norm": g, "grad_trace_cov": s}

    @property
    def value(self) -> float:
        return self.readings.get("noise_scale", math.nan)

    def state(self) -> dict:
        return {"s": self._s.value, "g": self._g.value, "readings": self.readings}

    def load_state(self, state: dict) -> None:
        self._s.value, self._g.value, self.readings = state["s"], state["g"], dict(state["readings"])

    def values(self) -> dict[str, float]:
        return dict(self.readings)


class GradientVariance(Monitor):
    """Variance over workers of every gradient coordinate, ``Var_k = E_w[g_k^2] - (E_w[g_k])^2``.

    Reports ``grad_variance`` (the sum over coordinates) and ``grad_variance_norm`` (the L2 norm of
    the variance vector). ``sample=None``: exact, one extra all-reduce of the squared gradients per
    monitored step (KungFu's variance monitor). ``sample=k`` (an int) or a fraction in (0, 1]: the same
    over ``k`` coordinates drawn once with ``seed`` (so the same on every worker), scaled to the
    whole model; one all-reduce of ``2k`` numbers. ``sample=1.0`` equals the exact value.
    """

    needs_mean_grads = True

    def __init__(self, sample: int | float | None = None, seed: int = 0):
        if sample is not None and (sample <= 0 or (isinstance(sample, float) and sample > 1)):
            raise ConfigError(f"GradientVariance: sample must be a count >= 1 or a fraction in (0, 1], got {sample}")
        self.sample, self.seed = sample, seed
        self.readings: dict[str, float] = {}

    def attach(self, params, names, every) -> None:
        super().attach(params, names, every)
        sizes = [p.numel() for p in params]
        self.total = sum(sizes)
        self.offsets = [0]
        for n in sizes[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        device = params[0].device if params else torch.device("cpu")
        if self.sample is None:
            self.picks = None
            self.count = self.total
            self.buffer = torch.zeros(self.total, dtype=torch.float32, device=device)
            return
        count = self.sample if isinstance(self.sample, int) else max(1, round(self.sample * self.total))
        count = min(count, self.total)
        gen = torch.Generator().manual_seed(self.seed)
        if count * 4 >= self.total:
            chosen = torch.randperm(self.total, generator=gen)[:count]
        else:  # without a permutation of the whole model: draw with replacement, keep distinct ones
            distinct = torch.unique(torch.randint(self.total, (count * 2,), generator=gen))
            chosen = distinct[torch.randperm(distinct.numel(), generator=gen)[:count]]
        chosen = chosen.sort().values
        self.count = chosen.numel()
        # Per parameter: the positions picked inside it, and where they go in the sample.
        self.picks, start = [], 0
        for i, (offset, n) in enumerate(zip(self.offsets, sizes)):
            end = int(torch.searchsorted(chosen, offset + n))
            if end > start:
                self.picks.append((i, (chosen[start:end] - offset).to(device), start, end))
            start = end
        self.by_param = {i: (idx, a, b) for i, idx, a, b in self.picks}
        self.buffer = torch.zeros(2 * self.count, dtype=torch.float32, device=device)

    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        if not self.active:
            return
        if self.picks is None:
            start = self.offsets[index]
            torch.mul(grad.reshape(-1), grad.reshape(-1), out=self.buffer[start:start + grad.numel()])
            return
        if index in self.by_param:
            idx, a, b = self.by_param[index]
            values = grad.reshape(-1).index_select(0, idx).float()
            self.buffer[a:b] = values
            self.buffer[self.count + a:self.count + b] = values * values

    def on_synced(self) -> None:
        if not self.active:
            return
        n = self.num_workers
        if self.picks is None:
            # Squared local gradients of the parameters this worker did not use are zero.
            for i, p in enumerate(self.params):
                if p.grad is None:
                    self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].zero_()
            self.transport.allreduce(self.buffer, what="gradient variance (squared gradients)")
            mean = torch.cat([torch.zeros(p.numel(), device=self.buffer.device) if p.grad is None
                              else p.grad.reshape(-1).float() for p in self.params])
            var = (self.buffer / n - mean * mean).clamp_min_(0)
            scale = 1.0
        else:
            self.transport.allreduce(self.buffer, what="gradient variance (sampled coordinates)")
            mean, sq = self.buffer[:self.count] / n, self.buffer[self.count:] / n
            var = (sq - mean * mean).clamp_min_(0)
            scale = self.total / self.count
        var64 = var.double()
        self.readings = {"grad_variance": float(var64.sum()) * scale,
                         "grad_variance_norm": math.sqrt(float(var64.pow(2).sum()) * scale)}
        self.buffer.zero_()

    def values(self) -> dict[str, float]:
        suffix = "" if self.picks is None else "_sampled"
        return {k + suffix: v for k, v in self.readings.items()}


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


class Monitors:
    """The monitors attached to one optimizer (what :func:`monitor` returns).

    ``values()`` (or ``monitors["noise_scale"]``) reads the latest values, the same on every worker;
    ``print_every=k`` prints them on worker 0 every ``k`` steps; ``tensorboard=DIR`` writes them as
    TensorBoard scalars ``gradsync/<name>`` from worker 0 (needs ``pip install tensorboard``).
    """

    def __init__(self, monitors: list[Monitor], print_every: int = 0, tensorboard: str | None = None):
        self.monitors = monitors
        self.print_every = print_every
        self.step = 0
        self.writer = None
        if tensorboard and self.leader:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError("tensorboard=... needs the tensorboard package: pip install tensorboard "
                                  "(or gradsync[tensorboard])") from exc
            self.writer = SummaryWriter(tensorboard)

    @property
    def leader(self) -> bool:
        """Worker 0 now (an elastic job renumbers its workers; TensorBoard stays where it was opened)."""
        return runtime.is_initialized() and runtime.current().topology.rank == 0

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self.monitors:
            out.update(m.values())
        return out

    def __getitem__(self, name: str) -> float:
        return self.values()[name]

    def __iter__(self):
        return iter(self.monitors)

    # the hook points, fanned out
    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        for m in self.monitors:
            m.on_local_grad(index, grad)

    def on_synced(self) -> None:
        for m in self.monitors:
            m.on_synced()

    def after_step(self) -> None:
        for m in self.monitors:
            m.after_step()
            m.step += 1  # what ``Monitor.active`` counts
        self.step += 1
        printing = bool(self.print_every) and self.step % self.print_every == 0 and self.leader
        if not printing and self.writer is None:
            return
        values = self.values()
        if printing:
            print(f"gradsync step {self.step}: " + "  ".join(f"{k}={v:.4g}" for k, v in values.items()), flush=True)
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(f"gradsync/{k}", v, self.step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def monitor(optimizer, *monitors: Monitor, every: int = 1, print_every: int = 0,
            tensorboard: str | None = None) -> Monitors:
    """Attach ``monitors`` to an optimizer returned by :func:`gradsync.distribute`.

    ``every``: monitor every ``every``-th step only (the other steps cost nothing). Collective in
    effect: every worker must attach the same monitors, since they reduce over all workers.
    Replaces monitors attached before. Returns the :class:`Monitors`; ``optimizer.monitors`` too.
    """
    sync = getattr(optimizer, "_gradsync", None)
    if sync is None:
        raise ConfigError("gradsync.adapt.monitor needs an optimizer returned by gradsync.distribute")
    if every < 1:
        raise ConfigError(f"every must be >= 1, got {every}")
    strategy = sync.strategy
    for m in monitors:
        if not isinstance(m, Monitor):
            raise ConfigError(f"{m!r} is not a gradsync.adapt.Monitor")
        if m.needs_mean_grads and not strategy.mean_grads_at_apply:
            raise ConfigError(
                f"{type(m).__name__} reads the synchronized gradient on every worker, which strategy "
                f"{strategy.name!r} does not produce (it updates parameters on servers or per slice); "
                "use allreduce, ddp, casync-ring, casync-ps or compressed-allgather")
        m.attach(sync.params, sync.names, every)
    group = Monitors(list(monitors), print_every, tensorboard)
    sync.set_observer(group)
    return group
