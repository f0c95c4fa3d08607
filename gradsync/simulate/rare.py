"""The schedules of the strategies that communicate every ``H`` steps: ``local-sgd`` and ``diloco``
(:mod:`gradsync.strategies.diloco`).

A step is the worker's forward, backward and its own optimizer, with nothing on the wire. After
the optimizer, as the strategy does in ``step()``:

1. every fragment whose outer gradient was sent ``delay`` steps ago lands: the training thread
   waits for its exchange, then steps the shared copy with the outer optimizer and merges it into
   the parameters (the optimizer's pass, then one copy, or two passes where it mixes);
2. every fragment whose turn it is (``t = f H / F mod H``) is sent: the outer gradient and its
   packing into the carrier's bucket are two passes over its bytes on the training thread, then its
   exchange runs on its own stream, as the
   fragment's gradient strategy runs it: a ring all-reduce of the fragment (``allreduce``; a
   summable codec's payload: the ratio of it, plus its encode and decode), or casync-ring's
   decode-merge-encode hops with the codec's measured costs (:mod:`gradsync.simulate.compressed`).
   Without a delay the fragment lands at once.

Most steps therefore take the compute alone, and one in every ``H / F`` carries a fragment's
exchange (or, with a delay, hides it behind the next steps' compute). The step time is the mean
over whole periods of ``H`` steps (:attr:`RareSync.period`), not the median, which would report a
step without communication.
"""
from __future__ import annotations

from typing import Callable

from gradsync.simulate.worker import StrategyModel, Worker
from gradsync.strategies.diloco import split


class RareSync(StrategyModel):
    """``local-sgd`` and ``diloco``: fragments sent every ``H`` steps, landed ``delay`` steps later."""

    def __init__(self, strategy):
        super().__init__(strategy)
        self.period = strategy.H

    def bind(self, worker: Worker) -> None:
        super().bind(worker)
        s = self.strategy
        runs = split([p.numel for p in worker.params], s.fragments)  # the strategy's fragments
        self.fragments = [sum(worker.params[i].nbytes for i in run) for run in runs]
        self.offsets = [f * s.H // s.fragments for f in range(s.fragments)]
        self.t = 0
        self.sent: dict[int, int] = {}  # fragment -> the step it was sent at
        self.done: dict[int, bool] = {}
        self.waiting: dict[int, Callable[[], None]] = {}
        self.streams = [worker.thread(f"fragment {f}") for f in range(s.fragments)]
        self.carrier = None
        if s.compression is not None:
            self.carrier = self._carrier(worker)

    def _carrier(self, worker: Worker):
        """The fragment's gradient strategy with a codec, as the simulator models it (its costs and,
        for codecs that do not sum, its ring of hops)."""
        from gradsync.simulate import compressed

        outer = self.strategy._outer_strategy()
        if self.strategy.summable:  # allreduce with a summable codec: its payload all-reduced
            from gradsync.compress import parse_spec

            name, options = parse_spec(self.strategy.compression)
            host = worker.host_rates
            return compressed.codec_cost(name, options, host.codec_speed, host.decode_speed, host.codecs)
        model = compressed.CaSyncRing(outer)
        model.bind(worker)
        return model

    def describe(self) -> str:
        s = self.strategy
        return f"every {s.H} steps, {s.fragments} fragment(s), delay {s.delay}"

    def step(self, step: int, go: Callable[[], None]) -> None:
        self.local_update(lambda: self._after_update(go))

    def _after_update(self, go: Callable[[], None]) -> None:
        self.t += 1
        landing = [f for f, at in self.sent.items() if self.t - at >= self.strategy.delay]
        sending = [f for f, offset in enumerate(self.offsets)
                   if self.t >= offset and (self.t - offset) % self.strategy.H == 0]
        self._in_turn(landing, self._land, lambda: self._in_turn(sending, self._send, go))

    def _in_turn(self, fragments: list[int], act: Callable[[int, Callable[[], None]], None],
                 go: Callable[[], None]) -> None:
        """``act(f, then)`` for each fragment in order, each after the one before; then ``go``."""
        if not fragments:
            go()
        else:
            act(fragments[0], lambda: self._in_turn(fragments[1:], act, go))

    def _send(self, f: int, then: Callable[[], None]) -> None:
        wk = self.wk
        self.sent[f], self.done[f] = self.t, False
        after = then if self.strategy.delay else (lambda: self._land(f, then))  # no delay: it lands at once
        # the outer gradient (theta - theta_w into .grad) and its packing into the carrier's buckets
        wk.host.run(2 * wk.copy_s(self.fragments[f]), lambda: (self.streams[f].submit(
            lambda finish: self._exchange(f, finish), lambda: self._arrived(f), what=f"outer gradient {f}"), after()),
            what=f"outer gradient {f}")

    def _exchange(self, f: int, finish: Callable[[], None]) -> None:
        wk, nbytes = self.wk, self.fragments[f]
        if self.carrier is None:
            wk.ring(nbytes, finish, f"fragment {f}")
        elif hasattr(self.carrier, "exchange"):  # casync-ring's hops
            self.carrier.exchange(0, nbytes, finish)
        else:  # a summable codec: encoded, its payload all-reduced, decoded
            codec = self.carrier
            wk.sim.after(codec.encode(nbytes), lambda: wk.ring(codec.ratio * nbytes, lambda: wk.sim.after(
                codec.decode(nbytes), finish), f"fragment {f}"))

    def _arrived(self, f: int) -> None:
        self.done[f] = True
        waiting = self.waiting.pop(f, None)
        if waiting is not None:
            waiting()

    def _land(self, f: int, then: Callable[[], None]) -> None:
        wk = self.wk

        def merge() -> None:
            del self.sent[f]
            nbytes = self.fragments[f]
            passes = 2 if self.strategy.mix else 1  # theta copied in; or mixed in: a scaling and an add
            wk.host.run(wk.update_s(nbytes) + passes * wk.copy_s(nbytes), then, what=f"outer step {f}")

        if self.done[f]:
            merge()
        else:
            self.waiting[f] = merge
