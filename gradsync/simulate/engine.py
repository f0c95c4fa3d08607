"""The event loop of the simulator: time, serial streams, and transfers sharing links fairly.

A :class:`Sim` keeps a clock and a heap of callbacks. Three kinds of activity run on it:

- **callbacks** at a time (:meth:`Sim.at`, :meth:`Sim.after`);
- **streams** (:class:`Stream`): work that runs one item at a time, in priority order (an
  accelerator's kernels, a communication thread);
- **transfers** (:meth:`Sim.transfer`): bytes through a set of :class:`Link` s (a host's sending
  or receiving side). Transfers in flight share each link max-min fairly (progressive filling),
  the fluid model of TCP flows: a transfer's rate is set by its most crowded link, and what a
  slowed transfer leaves unused goes to the others. Rates change only when a transfer starts or
  ends, so the loop jumps from one such event to the next.

Symmetry keeps large jobs cheap: in a synchronous job every worker does the same thing at the
same time, so a model simulates one worker and lets a transfer count as ``weight`` identical
flows on a shared link (N workers pushing to one server: weight N on the server's receiving
side, weight 1 on the representative worker's sending side).

Budgets: :attr:`Sim.max_events` bounds the work; a simulation that would pass it stops with
:class:`SimulationError` saying so, never hangs.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable

from gradsync.errors import GradsyncError


class SimulationError(GradsyncError):
    """A simulation that cannot go on: over its event budget, or a schedule that never finishes."""


@dataclass(eq=False)
class Link:
    """One direction of a network interface (or any shared pipe): ``rate`` bytes per second."""

    name: str
    rate: float
    carried: float = 0.0  # bytes moved through it so far


class _Class:
    """Transfers in flight on the same links with the same weights: they share one rate, so each
    finishes when the class's cumulative service per flow reaches its start plus its size
    (processor sharing): an event costs O(log n), not O(n)."""

    def __init__(self, uses: tuple[tuple[Link, float], ...], efficiency: float = 1.0):
        self.uses = uses  # each link's weight already divided by the efficiency (the capacity taken)
        self.efficiency = efficiency  # of the bytes that capacity moves (what the links carry)
        self.served = 0.0  # bytes one flow of this class has received since the class existed
        self.rate = 0.0
        self.heap: list = []  # (served at which it finishes, seq, done)


class Sim:
    def __init__(self, max_events: int = 5_000_000):
        self.now = 0.0
        self.max_events = max_events
        self.events = 0
        self._heap: list = []
        self._seq = itertools.count()
        self._classes: dict[tuple, _Class] = {}
        self._version = 0  # bumps whenever rates change: stale completion events are ignored
        self._last = 0.0  # when transfers' ``remaining`` were last brought up to date
        self.log: list[tuple[str, str, float, float]] | None = None  # (lane, what, start, end) if tracing

    # -- callbacks -------------------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def run(self, until: Callable[[], bool] | None = None) -> float:
        """Process events until none is left (or ``until()`` holds); the time reached."""
        while self._heap:
            if until is not None and until():
                break
            when, _, fn = heapq.heappop(self._heap)
            self._advance(when)
            self.events += 1
            if self.events > self.max_events:
                raise SimulationError(f"the simulation passed its budget of {self.max_events:,} events at "
                                      f"t={self.now:.3f} s; simulate fewer steps or workers, or raise the budget")
            fn()
        return self.now

    def record(self, lane: str, what: str, start: float, end: float) -> None:
        if self.log is not None:
            self.log.append((lane, what, start, end))

    # -- transfers -------------------------------------------------------------------------------
    def transfer(self, nbytes: float, uses: list[tuple[Link, float]], done: Callable[[], None], *,
                 latency: float = 0.0, name: str = "", lane: str | None = None, efficiency: float = 1.0) -> None:
        """Move ``nbytes`` through ``uses`` after ``latency`` seconds; then call ``done``. With an
        ``efficiency`` below 1 the transfer takes ``1/efficiency`` times its bytes' share of each
        link's capacity (flows that share a port less well than fair shares), while the links
        carry only its bytes."""
        if nbytes < 0:
            raise SimulationError(f"transfer {name!r} of {nbytes} bytes: sizes must be >= 0")
        if not 0 < efficiency <= 1:
            raise SimulationError(f"transfer {name!r}: efficiency must be in (0, 1], got {efficiency}")

        def start() -> None:
            began = self.now
            finish = done
            if lane is not None:
                def finish() -> None:
                    self.record(lane, name, began, self.now)
                    done()
            if nbytes == 0 or all(link.rate == float("inf") for link, _ in uses):
                finish()  # nothing to move, or links without a limit
                return
            key = (tuple((link, float(w) / efficiency) for link, w in uses if link.rate != float("inf")), efficiency)
            cls = self._classes.get(key)
            if cls is None:
                cls = self._classes[key] = _Class(*key)
            self._advance(self.now)
            heapq.heappush(cls.heap, (cls.served + nbytes, next(self._seq), finish))
            self._reshare()

        if latency > 0:
            self.after(latency, start)
        else:
            start()

    def _advance(self, when: float) -> None:
        dt = when - self._last
        if dt > 0:
            for cls in self._classes.values():
                moved = cls.rate * dt
                cls.served += moved
                for link, weight in cls.uses:
                    link.carried += moved * weight * cls.efficiency * len(cls.heap)
        self.now = max(self.now, when)
        self._last = self.now

    def _reshare(self) -> None:
        """Max-min fair rates by progressive filling over the classes, then the next completion."""
        self._version += 1
        for key in [k for k, c in self._classes.items() if not c.heap]:
            del self._classes[key]
        if not self._classes:
            return
        left: dict[Link, float] = {}
        load: dict[Link, float] = {}
        for cls in self._classes.values():
            for link, weight in cls.uses:
                left.setdefault(link, link.rate)
                load[link] = load.get(link, 0.0) + weight * len(cls.heap)
        unfixed = list(self._classes.values())
        while unfixed:
            ratios = {lk: left[lk] / load[lk] for lk in load if load[lk] > 1e-12}
            lowest = min(ratios.values())
            share = max(lowest, 0.0)
            # every link at the lowest fair share is a bottleneck now (ties are common: symmetric
            # workers' links), so all of them are filled in one pass
            tight = {lk for lk, r in ratios.items() if r <= lowest * (1 + 1e-12)}
            still = []
            for cls in unfixed:
                if any(lk in tight for lk, _ in cls.uses):
                    cls.rate = share
                    for lk, weight in cls.uses:
                        left[lk] -= share * weight * len(cls.heap)
                        load[lk] -= weight * len(cls.heap)
                else:
                    still.append(cls)
            unfixed = still
        soonest = min((c.heap[0][0] - c.served) / c.rate if c.rate > 0 else float("inf")
                      for c in self._classes.values())
        if soonest == float("inf"):
            raise SimulationError("transfers are in flight on links of rate 0: they would never finish")
        version = self._version
        self.after(max(soonest, 0.0), lambda: self._complete(version))

    def _complete(self, version: int) -> None:
        if version != self._version:
            return  # rates changed since this was scheduled
        finished = []
        for cls in self._classes.values():
            while cls.heap and self._done(cls, cls.heap[0][0] - cls.served):
                finished.append(heapq.heappop(cls.heap)[2])
        self._reshare()
        for done in finished:
            done()

    def _done(self, cls: _Class, remaining: float) -> bool:
        """Within rounding of its end: a millionth of its bytes left, or a rest so small at its rate
        that the clock cannot count its time (a fast link late in a long run)."""
        return remaining <= 1e-6 * max(1.0, cls.heap[0][0]) or (cls.rate > 0 and self.now + remaining / cls.rate <= self.now)


class Stream:
    """Work that runs one item at a time, lowest ``priority`` first (ties: submission order)."""

    def __init__(self, sim: Sim, name: str):
        self.sim, self.name = sim, name
        self._queue: list = []
        self._seq = itertools.count()
        self.busy = False
        self.busy_s = 0.0

    def run(self, duration: float, done: Callable[[], None] = lambda: None, *, priority: float = 0.0,
            what: str = "") -> None:
        """Queue ``duration`` seconds of work; ``done`` when it finishes."""
        self.submit(lambda finish: self.sim.after(duration, finish), done, priority=priority, what=what)

    def submit(self, start: Callable[[Callable[[], None]], None], done: Callable[[], None] = lambda: None, *,
               priority: float = 0.0, what: str = "") -> None:
        """Queue an item that ``start(finish)`` begins and that ends when it calls ``finish``."""
        heapq.heappush(self._queue, (priority, next(self._seq), start, done, what))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self._queue:
            self.busy = False
            return
        self.busy = True
        _, _, start, done, what = heapq.heappop(self._queue)
        began = self.sim.now

        def finish() -> None:
            self.busy_s += self.sim.now - began
            self.sim.record(self.name, what, began, self.sim.now)
            done()
            self._next()

        start(finish)


class Barrier:
    """Calls ``done`` once ``count`` arrivals have been counted."""

    def __init__(self, count: int, done: Callable[[], None]):
        self.count, self.done = count, done
        if count <= 0:
            done()

    def arrive(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.done()
