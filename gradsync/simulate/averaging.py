"""The model-averaging and asynchronous strategies' schedules: ``sma``, ``pair-averaging``, ``ps-async``.

- ``sma`` (:mod:`gradsync.strategies.sma`): at the start of the step the parameters are copied
  into one buffer and its all-reduce launched; it runs behind forward and backward. ``step()``
  waits for it, mixes the average in (a pass over the parameters) and runs the local optimizer.
- ``pair-averaging`` (:mod:`gradsync.strategies.pair_averaging`): ``step()`` averages with the
  model of one peer (in turn, or at random), runs the local optimizer and refreshes the snapshot it
  serves (double-buffered: no wait for an answer being sent); the pull (a request, then the model
  back) is sent at the end of the step and received while the next step computes
  (``overlap=False``: sent at the step and waited for). A worker answers pulls one after another.
  Answers travel on channels of their own, one per direction, so neither a request nor a
  receive's notice waits behind a model, and two workers pulling from each other move both
  models at the link's rate. With no barrier the workers drift apart, so every worker is simulated
  at its own pace, each picking its peers as the strategy does.
- ``ps-async`` (:mod:`gradsync.strategies.ps`, ``mode="async"``, dedicated servers): a server
  serves one worker at a time (that worker's pushes in, one optimizer step over its share, the
  parameters back). In steady state the ``N`` workers' requests spread over the step, so the
  representative worker's own service is followed on the server by ``N-1`` others': the step is
  ``max(the worker alone, N services)``.
"""
from __future__ import annotations

from typing import Callable

from gradsync.errors import ConfigError
from gradsync.simulate.engine import Barrier, Link, Stream
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
    """Every worker simulated, each at its own pace (there is no barrier to keep them in step).

    A worker's step: its forward and backward, the wait for the model it asked for at the end of
    its previous step, the average (one ``lerp_`` pass over the parameters: a copy's time), the
    local optimizer, the snapshot
    it serves refreshed (a copy; double-buffered, so it never waits for an answer), and a pull
    request to the next peer (in turn, or from the strategy's own generator: its seed and rank),
    answered while its next step computes (``overlap=False``: the request and the peer's model
    before the average). Each worker's server thread answers requests one at a time, in arrival
    order, each with the whole model through its link, at the link's rate (the requester's receive
    was posted first, and its notice goes on a channel that carries no model its way); requests,
    on the default pairs, arrive after the wire's latency. The step time is ``gradsync bench``'s:
    per step, the slowest worker's."""

    def bind(self, worker: Worker) -> None:
        import random

        super().bind(worker)
        n, seed, sim = worker.np, self.strategy.seed, worker.sim
        from gradsync.strategies.pair_averaging import in_turn

        self.rngs = [random.Random(seed * 7919 + r) for r in range(n)]
        self.peers = [[p for p in range(n) if p != r] for r in range(n)]
        self.turns = [in_turn(r, self.peers[r], n) for r in range(n)]
        self.turn = [0] * n
        rate = worker.tx.rate
        self.tx = [worker.tx] + [Link(f"worker {r} tx", rate) for r in range(1, n)]
        self.rx = [worker.rx] + [Link(f"worker {r} rx", rate) for r in range(1, n)]
        self.hosts = [worker.host] + [Stream(sim, f"rank {r} host") for r in range(1, n)]
        self.servers = [Stream(sim, f"rank {r} server thread") for r in range(n)]
        self.starts: list[list[float]] = [[] for _ in range(n)]  # of the other workers' steps, after their batches
        self.ends: list[list[float]] = [[] for _ in range(n)]
        self.pulled: list[dict | None] = [None] * n  # overlapped: each worker's pull on its way
        for r in range(1, n):
            self._others_step(r)

    def _others_step(self, r: int) -> None:
        """Worker ``r`` (not the one the driver runs): its batch (Host.batch_s), compute, then its
        step, then again."""
        if len(self.ends[r]) == self.wk.steps:
            return

        def step() -> None:
            self.starts[r].append(self.wk.sim.now)
            self.wk.sim.after(self.wk.w.compute_s, lambda: self._pull(r, lambda: (
                self.ends[r].append(self.wk.sim.now), self._others_step(r))))

        if self.wk.host_rates.batch_s > 0:
            self.hosts[r].run(self.wk.host_rates.batch_s, step, what="batch")
        else:
            step()

    def _pull(self, r: int, done: Callable[[], None]) -> None:
        # on hosts of several ranks, the host's ranks average inside it first (an all-reduce over
        # its intra-host link), and the host is one peer of the pairs
        inside = self.wk.inside_allreduce_s(self.wk.w.nbytes)
        if inside > 0:
            self.wk.sim.after(inside, lambda: self._pull_peer(r, done))
        else:
            self._pull_peer(r, done)

    def _pull_peer(self, r: int, done: Callable[[], None]) -> None:
        wk, nbytes = self.wk, self.wk.w.nbytes
        if wk.np == 1:
            self.hosts[r].run(wk.update_s(nbytes), done, what="optimizer")
            return
        if not self.strategy.overlap:  # the pull at the step, waited for
            self._request(r, lambda: self._finish(r, True, done))
            return

        def go(had: bool) -> None:  # then the next pull, answered while the next step computes
            self._finish(r, had, lambda: (self._request(r, lambda: self._arrived(r)), done()))

        pulled = self.pulled[r]
        if pulled is None:
            go(False)
        elif pulled["arrived"]:
            self.pulled[r] = None
            go(True)
        else:
            pulled["waiter"] = lambda: (self.pulled.__setitem__(r, None), go(True))

    def _arrived(self, r: int) -> None:
        pulled = self.pulled[r]
        pulled["arrived"] = True
        if pulled["waiter"] is not None:
            pulled["waiter"]()

    def _finish(self, r: int, averaged: bool, done: Callable[[], None]) -> None:
        """The average (when a model came), the local optimizer, then the snapshot's refresh."""
        wk, nbytes = self.wk, self.wk.w.nbytes
        average = wk.copy_s(nbytes) if averaged else 0.0  # one lerp_ pass: as long as a copy
        self.hosts[r].run(average + wk.update_s(nbytes), lambda: self.hosts[r].run(
            wk.copy_s(nbytes), done, what="snapshot"), what="average and optimizer")

    def _request(self, r: int, arrived: Callable[[], None]) -> None:
        """Worker ``r`` asks the peer its generator picks for its model; ``arrived`` once it is in."""
        wk, nbytes = self.wk, self.wk.w.nbytes
        if self.strategy.choice == "rotate":
            turns = self.turns[r]
            peer, self.turn[r] = turns[self.turn[r] % len(turns)], self.turn[r] + 1
        else:
            peer = self.rngs[r].choice(self.peers[r])
        if self.strategy.overlap:
            self.pulled[r] = {"arrived": False, "waiter": None}

        def answer(finish: Callable[[], None]) -> None:  # on the peer's server thread, woken by the request
            # The requester's receive was posted before its request, and its notice travels on a
            # channel that carries no model that way: the model moves at once, at the link's rate.
            wk.sim.after(wk.wake_s(), lambda: wk.message(nbytes, [(self.tx[peer], 1), (self.rx[r], 1)], finish,
                                                         f"model {peer} -> {r}"))

        # The request goes on the default pairs, which carry no models: it arrives after the wire's latency.
        wk.sim.after(wk.net.latency_s, lambda: self.servers[peer].submit(answer, arrived, what=f"pull from {r}"))

    def step(self, step: int, go: Callable[[], None]) -> None:
        self._pull(0, go)

    def step_times(self, ends: list[float]) -> list[float]:
        """Each step's slowest worker's time, every worker's from its own start after its batch."""
        every = [(self.wk.step_starts, ends)] + list(zip(self.starts[1:], self.ends[1:]))
        return [max(e[i] - s[i] for s, e in every) for i in range(len(ends))]


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
