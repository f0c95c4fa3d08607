"""The built-in adaptation policies (KungFu's): :class:`AdaptiveBatchSize` grows the global batch
with the gradient noise scale, :class:`StrategySwitch` keeps the fastest synchronization strategy
for the current network, :class:`BalanceBatches` gives each worker a share of the global batch in
proportion to its speed, :class:`ScheduledResize` changes the number of workers at given steps."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from gradsync import flight, runtime
from gradsync.adapt.monitors import NoiseScale
from gradsync.adapt.policy import Controller, Policy
from gradsync.errors import ConfigError


class AdaptiveBatchSize(Policy):
    """Grow the batch as the gradient noise scale grows (McCandlish et al. 2018; KungFu Fig. 4).

    Every ``every`` steps, when the measured noise scale ``B_simple`` exceeds ``threshold`` times the
    global batch, the per-worker batch doubles (up to ``max_batch_size``): the batch then tracks the
    noise scale from below, where a bigger batch still buys almost proportionally fewer steps. The
    learning rate follows the batch by ``lr_scaling``: ``"linear"`` (Goyal et al. 2017: lr x 2 when
    the batch doubles), ``"sqrt"`` (x sqrt(2), for Adam-like optimizers), or ``None``.
    ``history`` lists ``(step, noise_scale, new_batch_size)`` of every change.
    """

    def __init__(self, noise_scale: NoiseScale, max_batch_size: int, *, every: int = 10, threshold: float = 2.0,
                 lr_scaling: str | None = "linear"):
        if lr_scaling not in ("linear", "sqrt", None):
            raise ConfigError(f"lr_scaling must be 'linear', 'sqrt' or None, got {lr_scaling!r}")
        if every < 1 or threshold <= 0:
            raise ConfigError("AdaptiveBatchSize: every must be >= 1 and threshold > 0")
        self.noise_scale, self.max_batch_size = noise_scale, max_batch_size
        self.every, self.threshold, self.lr_scaling = every, threshold, lr_scaling
        self.history: list[tuple[int, float, int]] = []

    def after_step(self, ctl: Controller) -> None:
        if ctl.step % self.every:
            return
        gns = self.noise_scale.value
        if not math.isfinite(gns) or gns <= self.threshold * ctl.global_batch_size:
            return
        new = min(self.max_batch_size, ctl.batch_size * 2)
        if new == ctl.batch_size:
            return
        factor = new / ctl.batch_size
        ctl.set_batch_size(new)
        if self.lr_scaling == "linear":
            ctl.scale_lr(factor)
        elif self.lr_scaling == "sqrt":
            ctl.scale_lr(math.sqrt(factor))
        self.history.append((ctl.step, gns, new))

    def state(self) -> dict:
        return {"history": self.history}

    def load_state(self, state: dict) -> None:
        self.history = [tuple(h) for h in state["history"]]


class StrategySwitch(Policy):
    """Use whichever candidate strategy is fastest now, and look again when things change.

    Probing: each candidate runs ``probe_steps`` steps (the first one after a switch is not counted);
    its time is the median step time, the slowest worker's (one all-reduce, so every worker decides
    alike). Then the fastest runs. Every ``check_every`` steps the current strategy's median over
    the last ``probe_steps`` steps is compared with its time when chosen: ``tolerance`` slower (the
    network got slower, another job shares it; KungFu votes at 0.8x) and the candidates are probed
    again. Parameters and optimizer state carry over every switch (``optimizer.switch_strategy``).

    ``candidates``: names, or ``(name, options)`` pairs. ``history``: ``(step, event, detail)``.
    """

    def __init__(self, candidates: list, *, probe_steps: int = 5, check_every: int = 50, tolerance: float = 0.2):
        if len(candidates) < 2:
            raise ConfigError("StrategySwitch needs at least two candidate strategies")
        if probe_steps < 2:
            raise ConfigError("StrategySwitch: probe_steps must be >= 2 (the first step after a switch is dropped)")
        self.candidates = [(c, {}) if isinstance(c, str) else (c[0], dict(c[1])) for c in candidates]
        self.probe_steps, self.check_every, self.tolerance = probe_steps, check_every, tolerance
        self.history: list[tuple[int, str, Any]] = []
        self.times: list[float] = []
        self.probing: int | None = 0  # index of the candidate being probed; None once one is chosen
        self.measured: dict[int, float] = {}
        self.chosen_time = math.inf
        self.current: int | None = None
        self._last = None

    def state(self) -> dict:
        return {"history": self.history, "times": self.times, "probing": self.probing,
                "measured": list(self.measured.items()), "chosen_time": self.chosen_time, "current": self.current}

    def load_state(self, state: dict) -> None:
        self.history = [tuple(h) for h in state["history"]]
        self.times, self.probing, self.current = state["times"], state["probing"], state["current"]
        self.measured = {int(k): v for k, v in state["measured"]}
        self.chosen_time = state["chosen_time"]
        self._last = None

    def label(self, k: int) -> str:
        name, options = self.candidates[k]
        return name if not options else f"{name}({', '.join(f'{a}={b}' for a, b in options.items())})"

    def _switch(self, ctl: Controller, k: int) -> None:
        if self.current != k:
            ctl.switch_strategy(self.candidates[k][0], **self.candidates[k][1])
            self.current = k
        self.times, self._last = [], None

    def before_train(self, ctl: Controller) -> None:
        self._switch(ctl, 0)
        self.history.append((ctl.step, "probe", self.label(0)))

    def _median_slowest(self) -> float:
        t = torch.tensor([statistics.median(self.times[1:])], dtype=torch.float64)
        runtime.current().transport.allreduce(t, op="max", what="StrategySwitch step times")
        return float(t)

    def after_step(self, ctl: Controller) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now
        if self.probing is not None:
            if len(self.times) < self.probe_steps:
                return
            self.measured[self.probing] = self._median_slowest()
            self.history.append((ctl.step, "measured", (self.label(self.probing), self.measured[self.probing])))
            if self.probing + 1 < len(self.candidates):
                self.probing += 1
                self._switch(ctl, self.probing)
                return
            best = min(self.measured, key=self.measured.get)
            self.probing, self.chosen_time = None, self.measured[best]
            self._switch(ctl, best)
            self.history.append((ctl.step, "chose", self.label(best)))
            return
        if ctl.step % self.check_every or len(self.times) < self.probe_steps:
            return
        self.times = self.times[-self.probe_steps:]
        recent = self._median_slowest()
        if recent > (1 + self.tolerance) * self.chosen_time:
            self.history.append((ctl.step, "slower", (self.label(self.current), recent)))
            self.probing, self.measured = 0, {}
            self._switch(ctl, 0)


class ScheduledResize(Policy):
    """Resize the job at given steps: ``ScheduledResize({100: 4, 300: 2})`` (needs ``gradsync run --elastic``)."""

    def __init__(self, schedule: dict[int, int]):
        for step, size in schedule.items():
            if step < 0 or size < 1:
                raise ConfigError(f"ScheduledResize: step {step} -> {size} workers is not a valid entry")
        self.schedule = dict(schedule)

    def after_step(self, ctl: Controller) -> None:
        size = self.schedule.get(ctl.step)
        if size is not None and size != ctl.num_workers:
            ctl.resize(size)


class StopFile(Policy):
    """End training after the first step at which any worker sees ``path`` (a scheduler's preemption
    notice on shared storage, an operator's ``touch``): the workers agree in one all-reduce of one
    flag a step, so all stop after the same step, where ``ctl.run`` returns and the script saves
    what it saves. The file is left where it is."""

    def __init__(self, path: str):
        if not path:
            raise ConfigError("StopFile needs the path of the file to watch for")
        self.path = path

    def after_step(self, ctl: Controller) -> None:
        import os

        seen = torch.tensor([float(os.path.exists(self.path))])
        if ctl.num_workers > 1:
            runtime.current().transport.allreduce(seen, op="max", what=f"StopFile({self.path})")
        if seen.item() > 0:
            ctl.stop()


def balanced_shares(seconds_per_sample: list[float], global_batch: int, min_share: int = 1) -> list[int]:
    """Integer shares of ``global_batch``, one per worker, in proportion to each worker's speed
    (1 / its seconds per sample), each at least ``min_share``: workers whose proportional share
    falls below it get ``min_share`` and the rest is split among the others (water-filling), then
    rounded by largest remainders (ties to the lower rank). Pure: every worker computes the same
    shares from the same readings."""
    n = len(seconds_per_sample)
    if n * min_share > global_batch:
        raise ConfigError(f"BalanceBatches: {n} workers at min_share {min_share} need a global batch of at least "
                          f"{n * min_share}, got {global_batch}")
    if not all(math.isfinite(s) and s > 0 for s in seconds_per_sample):
        raise ConfigError(f"seconds per sample must be finite and > 0, got {seconds_per_sample}")
    speed = [1.0 / s for s in seconds_per_sample]
    floor: set[int] = set()
    while True:
        free = [r for r in range(n) if r not in floor]
        left, total = global_batch - min_share * len(floor), sum(speed[r] for r in free)
        quota = [min_share if r in floor else left * speed[r] / total for r in range(n)]
        low = {r for r in free if quota[r] < min_share}
        if not low:
            break
        floor |= low
    sizes = [math.floor(q) for q in quota]
    by_remainder = sorted(range(n), key=lambda r: (sizes[r] - quota[r], r))
    for r in by_remainder[:global_batch - sum(sizes)]:
        sizes[r] += 1
    return sizes


class BalanceBatches(Policy):
    """Give each worker a share of the global batch in proportion to its speed, so that a slower
    GPU or a busier host no longer makes every synchronous step wait for it (KungFu adapts to
    stragglers the same way; here the global batch, and so the update, stays exactly the same).

    Each step a worker times its own work: the step's wall time (from ``before_step`` to
    ``after_step``) less the time its training thread waited in gradsync's operations (the flight
    record's ``waited_s``), divided by its samples. Every ``every`` steps after ``warmup``, the
    workers all-reduce the median of their readings (one collective: every worker then holds the
    same numbers and decides alike) and :func:`balanced_shares` splits the global batch in proportion
    to speed, each share at least ``min_share``. The new shares are taken (``ctl.set_shares``) when
    they would shorten the slowest worker's predicted time by more than ``tolerance``. Repeating this
    converges to equal step times even where part of a step does not grow with the batch: a worker
    whose fixed cost inflates its time per sample gets less until every worker's time is the same.

    The Controller weights each worker's gradient by ``num_workers * b_r / B``, so every update is the
    one a single process makes on the whole global batch. It needs a strategy that averages over
    workers and whose waits gradsync times (``Strategy.mean_over_workers`` and ``waits_recorded``:
    allreduce, allreduce-priority, ps, ps-sliced, p3, casync-*, compressed-allgather, hybrid; not ddp,
    whose reducer waits inside PyTorch, nor the model-averaging strategies). ``history`` lists
    ``(step, shares)`` of every change. When the number of workers changes, shares are equal again
    and the policy measures afresh.
    """

    def __init__(self, *, every: int = 20, warmup: int = 5, min_share: int = 1, tolerance: float = 0.05):
        if every < 1 or warmup < 0:
            raise ConfigError(f"BalanceBatches: every must be >= 1 and warmup >= 0, got {every} and {warmup}")
        if isinstance(min_share, bool) or not isinstance(min_share, int) or min_share < 1:
            raise ConfigError(f"BalanceBatches: min_share must be an integer >= 1 (a worker without samples has no "
                              f"speed to measure), got {min_share!r}")
        if not 0 <= tolerance < 1:
            raise ConfigError(f"BalanceBatches: tolerance must be in [0, 1), got {tolerance}")
        self.every, self.warmup, self.min_share, self.tolerance = every, warmup, min_share, tolerance
        self.history: list[tuple[int, list[int]]] = []
        self.readings: list[float] = []  # this worker's seconds per sample since the last decision
        self._began: tuple[float, float] | None = None
        self._workers = 0

    def state(self) -> dict:
        return {"history": self.history}

    def load_state(self, state: dict) -> None:
        self.history = [(step, list(shares)) for step, shares in state["history"]]
        self.readings, self._began = [], None

    def before_step(self, ctl: Controller) -> None:
        strategy = ctl.optimizer.strategy
        if not (strategy.mean_over_workers and strategy.waits_recorded):
            raise ConfigError(f"BalanceBatches needs a strategy that averages gradients over workers and whose waits "
                              f"gradsync times (allreduce, ps, p3, casync-*, ...); {strategy.name!r} is not one")
        recorder = flight.current()
        self._began = (time.perf_counter(), recorder.waited_s if recorder is not None else 0.0)

    def after_step(self, ctl: Controller) -> None:
        if ctl.num_workers != self._workers:  # first step, or a regroup: the old readings are of another job
            self._workers, self.readings = ctl.num_workers, []
        samples = ctl.step_sizes[ctl.rank] if ctl.step_sizes else 0
        if self._began is not None and ctl.step > self.warmup and samples:
            recorder = flight.current()
            waited = (recorder.waited_s if recorder is not None else 0.0) - self._began[1]
            self.readings.append((time.perf_counter() - self._began[0] - waited) / samples)
        self._began = None
        if ctl.num_workers > 1 and ctl.step > self.warmup and ctl.step % self.every == 0:
            self._decide(ctl)

    def gather(self, ctl: Controller, mine: float) -> list[float]:
        """Every worker's reading, by rank (one all-reduce of ``num_workers`` numbers)."""
        t = torch.zeros(ctl.num_workers, dtype=torch.float64)
        t[ctl.rank] = mine
        runtime.current().transport.allreduce(t, what="BalanceBatches seconds per sample")
        return t.tolist()

    def _decide(self, ctl: Controller) -> None:
        seconds = self.gather(ctl, statistics.median(self.readings) if self.readings else math.nan)
        self.readings = []
        if not all(math.isfinite(s) and s > 0 for s in seconds):
            return  # a worker has no reading yet (it joined, or had no samples): next time
        now = ctl.shares or [ctl.batch_size] * ctl.num_workers
        new = balanced_shares(seconds, ctl.global_batch_size, self.min_share)

        def slowest(sizes: list[int]) -> float:
            return max(s * b for s, b in zip(seconds, sizes))
        if new != now and slowest(new) < (1 - self.tolerance) * slowest(now):
            ctl.set_shares(new)
            self.history.append((ctl.step, new))
