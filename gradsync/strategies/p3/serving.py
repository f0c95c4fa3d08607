"""The server half of the sliced parameter servers, and the threads that receive every stream.

A slice's owner (a dedicated server, or a co-located worker) adds up every pusher's push of it
(:meth:`SliceServing._accept`): each worker's, or on hosts of several workers each host leader's
sum, which counts as its host's workers. Once every worker is counted it divides the sum by the
number of workers, updates the slice with the user's optimizer (one instance per slice, same
class and hyperparameters; exact for elementwise optimizers) and answers each pusher with the new
values (:meth:`_answer`), by the same priority the pushes were sent with; the slices one push
completes share answers as they shared the push. The pull rides on the push. A leader forwards
each answer message to its host's other workers as it arrives (:meth:`_deliver`).

One receiving thread per peer (:meth:`_receive`) keeps :data:`~gradsync.strategies.p3.wire.POSTED`
receives posted and handles, in order, the peer's pushes (this rank serves, or, from a worker of
its host, this leader adds them up), answers (this rank trains, :meth:`_deliver`), keep-alives,
and finally its stop messages. A dedicated server's whole loop is these threads (:meth:`serve`).
"""
from __future__ import annotations

import math
import sys
import time
from collections import deque

import torch

from gradsync import trace
from gradsync.strategies.p3 import wire as protocol
from gradsync.strategies.p3.wire import ANSWER, CODED, CODED_ANSWER, KEEPALIVE, PUSH, STOP, TAG
from gradsync.strategies.slicing import flat_view
from gradsync.transport import check_peer


class SliceServing:
    """Mixed into :class:`~gradsync.strategies.p3.base.SlicedServer`: aggregate, update, answer, receive."""

    def _accept(self, src: int, slices: list[int], step: int, buf: torch.Tensor) -> None:
        """Pusher ``src``'s push of ``slices`` (message ``buf``): add each to its sum; update and
        answer those that every worker has now pushed (a leader's push counts its host's workers)."""
        wire, done, weight = self.wire, [], self.weight[src]
        with self.lock:
            for i, k in enumerate(slices):
                payload, used = wire.payload(buf, i), wire.used(buf, i)
                acc = self.accum.get((k, step))
                if acc is None:
                    self.accum[(k, step)] = acc = [payload.clone(), used.clone(), weight]
                else:
                    acc[0].add_(payload)
                    acc[1].add_(used)
                    acc[2] += weight
                if acc[2] == len(self.workers):
                    del self.accum[(k, step)]
                    before = None if self.coder is None else self._values(k)
                    self.updaters.update(k, acc[0].div_(len(self.workers)), acc[1].tolist(), self.hyper.get(step))
                    if before is not None:
                        self._encode_change(k, before)
                    done.append(k)
            if done:
                self._answer(done, step)

    def _values(self, k: int) -> torch.Tensor:
        """Slice ``k``'s parameter values, in slice layout (a tail past its segments is zero)."""
        out = torch.zeros(self.plan.slice_numel, dtype=self.wire.dtype)
        for seg in self.plan.slices[k].segments:
            out[seg.offset:seg.offset + seg.length].copy_(flat_view(self.ctx.params[seg.param], seg))
        return out

    def _encode_change(self, k: int, before: torch.Tensor) -> None:
        """Compressed answers: encode slice ``k``'s change by its update (with a residual of its own)
        into its answer slot, and set the slice to ``before`` plus the decoded change, which is what
        every worker computes from the answer: one model everywhere."""
        first = self.ctx.names[self.plan.slices[k].segments[0].param]
        what = f"the update of slice {k} ({first!r}..)"
        slot = self.answer_slots.get(k)
        if slot is None:
            slot = self.answer_slots[k] = torch.zeros(self.wire.slot, dtype=torch.uint8)
        self.answer_coder.encode(k, self._values(k).sub_(before), slot, what=what)
        change = torch.empty_like(before)
        self.answer_coder.decode(k, slot, change, self.me, what)
        self._add_change(k, before.add_(change), assign=True)

    def _add_change(self, k: int, values: torch.Tensor, assign: bool = False) -> None:
        """Slice ``k``'s parameters plus ``values`` (or set to them, ``assign``)."""
        with torch.no_grad():
            for seg in self.plan.slices[k].segments:
                view, part = flat_view(self.ctx.params[seg.param], seg), values[seg.offset:seg.offset + seg.length]
                view.copy_(part) if assign else view.add_(part.to(view.device))

    def _answer(self, slices: list[int], step: int) -> None:
        """Send the updated ``slices`` to every pusher (and a leader's to its host's workers),
        grouped and by priority as the pushes were; compressed, their encoded changes."""
        params, wire = self.ctx.params, self.wire
        for _, group in self._groups(slices):
            answer = wire.new(ANSWER if self.coder is None else CODED_ANSWER, group, step)
            for i, k in enumerate(group):
                if self.coder is not None:
                    wire.coded(answer, i).copy_(self.answer_slots[k])
                    continue
                payload = wire.payload(answer, i)
                for seg in self.plan.slices[k].segments:
                    payload[seg.offset:seg.offset + seg.length].copy_(flat_view(params[seg.param], seg))
            for w in self.pushers:
                if w != self.me:
                    self.sender.put(self._send_priority(group[0], step), answer, w, TAG,
                                    what=f"pull of slices {group} to rank {w}")
            self._forward(group, step, answer)
        if self.me in self.workers:
            for k in slices:
                self.arrivals.mark(k, step)

    def _forward(self, slices: list[int], step: int, answer: torch.Tensor) -> None:
        """A leader: the answer message ``answer`` on to its host's other workers (intra-host)."""
        for w in self.followers:
            self.inside.put(self._send_priority(slices[0], step), answer, w, TAG,
                            what=f"pull of slices {slices} to rank {w} (host)")

    def _deliver(self, slices: list[int], step: int, buf: torch.Tensor, peer: int, coded: bool = False) -> None:
        """An answer from ``peer``: forwarded to the host's workers (a leader; ``buf`` is received
        into again, so they get a copy), then into the parameters (``coded``: added, decoded)."""
        params, wire = self.ctx.params, self.wire
        if self.followers:
            kind = CODED_ANSWER if coded else ANSWER
            self._forward(slices, step, buf[:wire.length(len(slices), kind)].clone())
        with torch.no_grad():
            for i, k in enumerate(slices):
                if coded:
                    change = torch.empty(self.plan.slice_numel, dtype=wire.dtype)
                    first = self.ctx.names[self.plan.slices[k].segments[0].param]
                    self.answer_coder.decode(k, wire.coded(buf, i), change, peer, f"the update of slice {k} ({first!r}..)")
                    self._add_change(k, change)
                    continue
                payload = wire.payload(buf, i)
                for seg in self.plan.slices[k].segments:
                    flat_view(params[seg.param], seg).copy_(payload[seg.offset:seg.offset + seg.length])
        for k in slices:
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
                kind, count, step, slices = wire.header(buf)
                self._check_message(peer, kind, count, step, slices)
                if kind == STOP:
                    if peer in self.workers:
                        self.stopped[peer] = step
                        if self.steps > step:  # our pushes to it will never be answered
                            self.arrivals.fail(self._out_of_step(peer, step))
                    for _, rest in posted:  # the peer's other stop messages
                        rest.wait(background=True)
                    return
                for k in slices:
                    since = self._trace_arrival(kind, k, peer, since)
                if kind == PUSH and peer in self.followers:
                    self._add_host(slices, step, buf)
                elif kind == PUSH:
                    self._accept(peer, slices, step, buf)
                elif kind == CODED:
                    self._accept(peer, slices, step, self._decode(peer, slices, step, buf))
                elif kind in (ANSWER, CODED_ANSWER):
                    self._deliver(slices, step, buf, peer, coded=kind == CODED_ANSWER)
                posted.append((buf, t.recv_async(buf, peer, TAG, what=f"message from rank {peer}", traced=False)))
        except BaseException as exc:  # raised in the training thread by _check()
            self.arrivals.fail(exc)

    def _decode(self, peer: int, slices: list[int], step: int, buf: torch.Tensor) -> torch.Tensor:
        """A :data:`~gradsync.strategies.p3.wire.CODED` push from ``peer`` as the plain push it encodes."""
        wire, names = self.wire, self.ctx.names
        plain = wire.new(PUSH, slices, step)
        for i, k in enumerate(slices):
            first = names[self.plan.slices[k].segments[0].param]
            self.coder.decode(k, wire.coded(buf, i), wire.payload(plain, i), peer, f"slice {k} ({first!r}..)")
            wire.used(plain, i).copy_(wire.coded_used(buf, i))
        return plain

    def _check_message(self, peer: int, kind: int, count: int, step: int, slices: list[int]) -> None:
        """A push or an answer carries 1 to ``wire.group`` slices, each checked; a stop or keep-alive none.
        Encoded pushes come only where this job compresses, and never from a worker of this host."""
        if kind == CODED:
            check_peer(self.coder is not None and peer not in self.followers, peer, "a P3 message",
                       "an encoded push (this job's pushes are not compressed, or the peer is on this host)")
        if kind == CODED_ANSWER:
            check_peer(self.coder is not None, peer, "a P3 message", "an encoded answer (this job does not compress)")
        if kind in (PUSH, ANSWER, CODED, CODED_ANSWER):
            check_peer(1 <= count <= self.wire.group, peer, "a P3 message",
                       f"kind {kind} with {count} slices (at most {self.wire.group})")
        for k in slices or [0]:
            self._check_header(peer, kind, k, step)

    def _check_header(self, peer: int, kind: int, k: int, step: int) -> None:
        """A message from ``peer`` must push a slice this rank owns, answer with one ``peer`` owns, or
        stop; inside a host, a worker pushes any slice to its leader, which answers with any slice."""
        slices = self.plan.slices
        owner = {PUSH: self.me, CODED: self.me, ANSWER: peer, CODED_ANSWER: peer}.get(kind)
        relayed = peer in self.followers if kind == PUSH else kind in (ANSWER, CODED_ANSWER) and peer == self.relay
        ok = kind in (STOP, KEEPALIVE) or (owner is not None and 0 <= k < len(slices)
                                           and (relayed or slices[k].owner == owner))
        check_peer(ok and step >= 0, peer, "a P3 message", f"kind {kind}, slice {k}, step {step}")

    def _trace_arrival(self, kind: int, k: int, peer: int, since: float) -> float:
        """A span per received slice, from the previous arrival on this stream to this one."""
        now = time.perf_counter()
        tracer = trace.current()
        if tracer is not None:
            first = self.ctx.names[self.plan.slices[k].segments[0].param]
            what = "pull" if kind in (ANSWER, CODED_ANSWER) else "push"
            tracer.span(f"{what} slice {k} ({first}) from rank {peer}", "comm", since, now,
                        bytes=self.wire.coded_block if kind in (CODED, CODED_ANSWER) else self.wire.block, op=f"{what} received", priority=self.prio[k])
        return now

    def _keepalive(self, sender, peers: list[int]) -> None:
        # After the stop messages a peer has no receive left. Runs on the sending thread, so stop
        # messages put meanwhile are still queued, and a keep-alive's priority sends it before them.
        if not self.stopping:
            for peer in peers:
                sender.put((math.inf, sys.float_info.max), self.wire.new(KEEPALIVE, [], self.steps), peer, TAG,
                           what=f"keep-alive to rank {peer}")

    def _stop_peers(self) -> None:
        self.stopping = True
        for peer in self.peers:
            for _ in range(protocol.POSTED):
                self._sender_to(peer).put((math.inf, math.inf), self.wire.new(STOP, [], self.steps), peer, TAG,
                                          what=f"stop to rank {peer}")

    def abandon(self) -> None:
        """A peer failed (an elastic job regroups): the senders stop at once, and every peer gets
        this rank's stop messages straight from the transport, which ends the receiving thread that
        the peer keeps for this rank (the surviving peers do the same for this rank's threads; a
        Gloo receive cannot be cancelled). A send to the dead peer fails, which ends nothing else."""
        self.closed = self.stopping = True
        if self.plan is None:  # no step was taken: nothing started
            return
        self.sender.abandon()
        if self.inside is not None:
            self.inside.abandon()
        self.ctx.transport.send_despite_failure([(self.wire.new(STOP, [], self.steps), peer, TAG)
                                                 for peer in self.peers for _ in range(protocol.POSTED)])

    def _close_senders(self) -> None:
        self.sender.close()
        if self.inside is not None:
            self.inside.close()

    def serve(self) -> None:
        """A dedicated server: slices are served on the receiving threads until every pusher stops."""
        self._make_plan()
        for thread in self.threads:
            thread.join()
        self._check()
        self._stop_peers()
        self._close_senders()
