"""The server half of the sliced parameter servers, and the threads that receive every stream.

A slice's owner (a dedicated server, or a co-located worker) adds up every worker's push of it
(:meth:`SliceServing._accept`); once all are in it averages them, updates the slice with the
user's optimizer (one instance per slice, same class and hyperparameters; exact for elementwise
optimizers) and answers each worker with the new values (:meth:`_update`), by the same priority
the pushes were sent with. The pull rides on the push.

One receiving thread per peer (:meth:`_receive`) keeps :data:`~gradsync.strategies.p3.wire.POSTED`
receives posted and handles, in order, the peer's pushes (this rank serves), answers (this rank
trains, :meth:`_deliver`), keep-alives, and finally its stop messages. A dedicated server's whole
loop is these threads (:meth:`serve`).
"""
from __future__ import annotations

import math
import sys
import time
from collections import deque

import torch

from gradsync import trace
from gradsync.strategies.p3 import wire as protocol
from gradsync.strategies.p3.wire import ANSWER, KEEPALIVE, PUSH, STOP, TAG
from gradsync.strategies.slicing import flat_view
from gradsync.transport import check_peer


class SliceServing:
    """Mixed into :class:`~gradsync.strategies.p3.base.SlicedServer`: aggregate, update, answer, receive."""

    def _accept(self, src: int, k: int, step: int, payload: torch.Tensor, used: torch.Tensor) -> None:
        with self.lock:
            acc = self.accum.get((k, step))
            if acc is None:
                self.accum[(k, step)] = acc = [payload.clone(), used.clone(), 1]
            else:
                acc[0].add_(payload)
                acc[1].add_(used)
                acc[2] += 1
            if acc[2] == len(self.workers):
                del self.accum[(k, step)]
                self._update(k, step, acc[0], acc[1].tolist())

    def _update(self, k: int, step: int, total: torch.Tensor, used: list[float]) -> None:
        sl = self.plan.slices[k]
        self.updaters.update(k, total.div_(len(self.workers)), used, self.hyper.get(step))
        answer = self.wire.new(ANSWER, k, step)
        payload, params = self.wire.payload(answer), self.ctx.params
        for seg in sl.segments:
            payload[seg.offset:seg.offset + seg.length].copy_(flat_view(params[seg.param], seg))
        for w in self.workers:
            if w != self.me:
                self.sender.put(self._send_priority(k, step), answer, w, TAG, what=f"pull of slice {k} to rank {w}")
        if self.me in self.workers:
            self.arrivals.mark(k, step)

    def _deliver(self, k: int, step: int, payload: torch.Tensor) -> None:
        params = self.ctx.params
        with torch.no_grad():
            for seg in self.plan.slices[k].segments:
                flat_view(params[seg.param], seg).copy_(payload[seg.offset:seg.offset + seg.length])
        self.arrivals.mark(k, step)

    # -- communication threads -----------------------------------------------------------------------
    def _receive(self, peer: int) -> None:
        """Messages from ``peer``, in order: pushes (we serve), answers (we train), then its stops."""
        t, wire = self.ctx.transport, self.wire
        try:
            posted = deque()
            for _ in range(protocol.POSTED):
                buf = torch.empty(wire.nbytes, dtype=torch.uint8)
                posted.append((buf, t.recv_async(buf, peer, TAG, what=f"message from rank {peer}", traced=False)))
            since = time.perf_counter()
            while True:
                buf, handle = posted.popleft()
                handle.wait(background=True)
                kind, k, step = wire.header(buf)
                self._check_header(peer, kind, k, step)
                if kind == STOP:
                    if peer in self.workers:
                        self.stopped[peer] = step
                        if self.steps > step:  # our pushes to it will never be answered
                            self.arrivals.fail(self._out_of_step(peer, step))
                    for _, rest in posted:  # the peer's other stop messages
                        rest.wait(background=True)
                    return
                if kind == PUSH:
                    since = self._trace_arrival(kind, k, peer, since)
                    self._accept(peer, k, step, wire.payload(buf), wire.used(buf))
                elif kind == ANSWER:
                    since = self._trace_arrival(kind, k, peer, since)
                    self._deliver(k, step, wire.payload(buf))
                posted.append((buf, t.recv_async(buf, peer, TAG, what=f"message from rank {peer}", traced=False)))
        except BaseException as exc:  # raised in the training thread by _check()
            self.arrivals.fail(exc)

    def _check_header(self, peer: int, kind: int, k: int, step: int) -> None:
        """A message from ``peer`` must push a slice this rank owns, answer with one ``peer`` owns, or stop."""
        slices = self.plan.slices
        owner = {PUSH: self.me, ANSWER: peer}.get(kind)
        ok = kind in (STOP, KEEPALIVE) or (owner is not None and 0 <= k < len(slices) and slices[k].owner == owner)
        check_peer(ok and step >= 0, peer, "a P3 message", f"kind {kind}, slice {k}, step {step}")

    def _trace_arrival(self, kind: int, k: int, peer: int, since: float) -> float:
        """A span per received slice, from the previous arrival on this stream to this one."""
        now = time.perf_counter()
        tracer = trace.current()
        if tracer is not None:
            first = self.ctx.names[self.plan.slices[k].segments[0].param]
            what = "push" if kind == PUSH else "pull"
            tracer.span(f"{what} slice {k} ({first}) from rank {peer}", "comm", since, now,
                        bytes=self.wire.nbytes, op=f"{what} received", priority=self.prio[k])
        return now

    def _keepalive(self) -> None:
        # After the stop messages a peer has no receive left. Runs on the sending thread, so stop
        # messages put meanwhile are still queued, and a keep-alive's priority sends it before them.
        if not self.stopping:
            for peer in self.peers:
                self.sender.put((math.inf, sys.float_info.max), self.wire.new(KEEPALIVE, 0, self.steps), peer, TAG,
                                what=f"keep-alive to rank {peer}")

    def _stop_peers(self) -> None:
        self.stopping = True
        for peer in self.peers:
            for _ in range(protocol.POSTED):
                self.sender.put((math.inf, math.inf), self.wire.new(STOP, 0, self.steps), peer, TAG,
                                what=f"stop to rank {peer}")

    def serve(self) -> None:
        """A dedicated server: slices are served on the receiving threads until every worker stops."""
        self._make_plan()
        for thread in self.threads:
            thread.join()
        self._check()
        self._stop_peers()
        self.sender.close()
