"""The model-averaging and asynchronous strategies' schedules: ``sma``, ``pair-averaging``, ``ps-async``.

- ``sma`` (:mod:`gradsync.strategies.sma`): at the start of the step the parameters are copied
  into one buffer and its all-reduce launched; it runs behind forward and backward. ``step()``
  waits for it, mixes the average in (a pass over the parameters) and runs the local optimizer.
- ``pair-averaging`` (:mod:`gradsync.strategies.pair_averaging`): ``step()`` asks one random peer
  for its model (a request, then the model back) and averages with it, runs the local optimizer
  and refreshes the snapshot it serves. A worker answers pulls one after another, holding its
  snapshot, so the step is set by the most-asked worker: the simulator draws every worker's
  peers from the strategy's own generators and sends that many models through one link.
- ``ps-async`` (:mod:`gradsync.strategies.ps`, ``mode="async"``, dedicated servers): a server
  serves one worker at a time (that worker's pushes in, one optimizer step over its share, the
  parameters back). In steady state the ``N`` workers' requests spread over the step, so the
  representative worker's own service is followed on the server by ``N-1`` others': the step is
  ``max(the worker alone, N services)``.
"""
from __future__ import annotations

from typing import Callable

from gradsync.errors import ConfigError
from gradsync.simulate.engine import Barrier
from gradsync.simulate.worker import StrategyModel, Worker


class SMA(StrategyModel):
    def bind(self, worker: Worker) -> None:
        super().bind(worker)
        self.collectives = worker.thread("collectives")
        self.averaged = False
        self.waiting: Callable[[], None] | None = None

    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        wk = self.wk
        self.averaged = False
        # The copy into the buffer is on the training thread, before the forward starts.
        wk.host.run(wk.copy_s(wk.w.nbytes), lambda: (self.collectives.submit(
            lambda finish: wk.ring(wk.w.nbytes, finish, "parameter average"), self._averaged,
            what="sma all-reduce"), go()), what="copy parameters")

    def _averaged(self) -> None:
        self.averaged = True
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            waiting()

    def step(self, step: int, go: Callable[[], None]) -> None:
        wk = self.wk

        def mix() -> None:
            wk.host.run(wk.update_s(wk.w.nbytes), lambda: self.local_update(go), what="mix average")

        if self.averaged:
            mix()
        else:
            self.waiting = mix


class PairAveraging(StrategyModel):
    def bind(self, worker: Worker) -> None:
        import random

        super().bind(worker)
        # The peers every worker picks, from the strategy's own generators (seed and rank as
        # PairAveraging.attach makes them), so the simulated step sees the same load.
        n, seed = worker.np, self.strategy.seed
        self.rngs = [random.Random(seed * 7919 + r) for r in range(n)]
        self.peers = [[p for p in range(n) if p != r] for r in range(n)]

    def _busiest(self) -> int:
        """This step's largest number of pulls one worker answers (one model after another, with
        its snapshot's lock held: its own step and its requesters wait for all of them)."""
        load = [0] * self.wk.np
        for rng, peers in zip(self.rngs, self.peers):
            load[rng.choice(peers)] += 1
        return max(load)

    def step(self, step: int, go: Callable[[], None]) -> None:
        wk = self.wk
        if wk.np == 1:
            self.local_update(go)
            return
        nbytes, busiest = wk.w.nbytes, self._busiest()
        # Two workers pull from each other at once: both directions between one pair of hosts.
        uses = [(wk.tx, busiest), (wk.rx, 1)] + ([(wk.duplex, 2)] if wk.np == 2 else [])

        def averaged() -> None:
            wk.host.run(wk.update_s(nbytes), lambda: self.local_update(
                lambda: wk.host.run(wk.copy_s(nbytes), go, what="snapshot")), what="average with peer")

        # the request (one latency), then the model back from a peer answering ``busiest`` pulls
        wk.sim.after(wk.net.latency_s, lambda: wk.message(nbytes, uses, averaged, "peer model"))


class AsyncServers(StrategyModel):
    def __init__(self, strategy, servers: int):
        super().__init__(strategy)
        if servers < 1:
            raise ConfigError("ps-async needs dedicated servers (--servers S)")
        self.servers = servers

    def bind(self, worker: Worker) -> None:
        from gradsync.strategies.ps import partition

        super().bind(worker)
        owner = partition([p.numel for p in worker.params], list(range(self.servers)))
        self.owned = [0.0] * self.servers
        for i, p in enumerate(worker.params):
            self.owned[owner[i]] += p.nbytes
        self.queues = [worker.thread(f"server {s}") for s in range(self.servers)]

    def _service(self, s: int, finish: Callable[[], None]) -> None:
        """Server ``s`` serves this worker: its pushes in, an optimizer step, its parameters back."""
        wk, nbytes = self.wk, self.owned[s]
        tx, rx = wk.servers[s]
        wk.message(nbytes, [(wk.tx, 1), (rx, 1)], lambda: wk.host.run(
            wk.copy_s(nbytes) + wk.update_s(nbytes), lambda: wk.message(nbytes, [(tx, 1), (wk.rx, 1)], finish,
                                                                         f"pull {s}"), what=f"server {s} update"),
            f"push {s}")

    def _others(self, s: int) -> float:
        """The ``N-1`` other workers' services on server ``s``, alone on its links."""
        wk, nbytes = self.wk, self.owned[s]
        rate = float("inf") if wk.net.rate_bps is None else wk.net.rate_bps / 8
        one = 4 * wk.net.latency_s + 2 * nbytes / rate + wk.copy_s(nbytes) + wk.update_s(nbytes)
        return (wk.np - 1) * one

    def step(self, step: int, go: Callable[[], None]) -> None:
        served = Barrier(self.servers, lambda: self.local_update_skipped(go))
        for s, queue in enumerate(self.queues):
            queue.submit(lambda finish, s=s: self._service(s, finish), served.arrive, what="this worker")
            queue.run(self._others(s), what="other workers")

    def local_update_skipped(self, go: Callable[[], None]) -> None:
        go()  # the update ran on the servers
