"""The schedules of the bucketed (``allreduce``, ``ddp``), parameter-server (``ps``) and sliced
(``p3``, ``ps-sliced``, ``allreduce-priority``) strategies, on the simulated worker
(:mod:`gradsync.simulate.worker`).

Where a strategy communicates, when, in what units and under what limits comes from the strategy
itself: the options of the object ``gradsync.strategies.resolve`` builds (the same defaults and
``--set`` overrides as a real run), and its own planning functions (``allreduce.plan_buckets`` for
buckets, ``slicing.SlicePlan`` for P3 slices and ByteScheduler partitions, ``ps.partition`` for
server placement), run on the model's parameter sizes.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable

from gradsync.errors import ConfigError
from gradsync.simulate.engine import Barrier, Link, Sim, Stream
from gradsync.simulate.worker import StrategyModel, Worker


# -- all-reduce of buckets (allreduce, ddp) ----------------------------------------------------------
class Buckets(StrategyModel):
    """Buckets in reverse parameter order (``plan_buckets``), each all-reduced once all its
    gradients exist, strictly in bucket order on one collective stream; the end of backward waits
    for all; then the local optimizer. ``only``: the parameters (by index) that go through buckets
    (``hybrid``'s dense ones); None: all."""

    updates_locally = True

    def __init__(self, strategy, cap_bytes: int, first_cap_bytes: int, flags: bool, copy_back: bool = False,
                 only: set[int] | None = None):
        super().__init__(strategy)
        self.cap, self.first, self.flags, self.copy_back = cap_bytes, first_cap_bytes, flags, copy_back
        self.only = only

    def bind(self, worker: Worker) -> None:
        from gradsync.strategies.allreduce import plan_buckets

        super().bind(worker)
        order = [i for i in reversed(range(len(worker.params))) if self.only is None or i in self.only]
        self.buckets = plan_buckets(worker.metas, order, self.cap, self.first)
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.bytes = [sum(worker.params[i].nbytes for i in b) + (4 * len(b) if self.flags else 0) for b in self.buckets]
        self.net = Stream(worker.sim, "collectives")
        self.index = {p.name: i for i, p in enumerate(worker.params)}

    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.launched = 0
        self.done = 0
        self.waiting: Callable[[], None] | None = None
        go()

    def on_layer_ready(self, step: int, layer: int) -> None:
        for p in self.wk.w.layers[layer].params:
            b = self.bucket_of.get(self.index[p.name])
            if b is not None:
                self.missing[b] -= 1
        self._launch()

    def _launch(self) -> None:
        while self.launched < len(self.buckets) and self.missing[self.launched] == 0:
            b = self.launched
            self.launched += 1
            copy = self.wk.copy_s(self.bytes[b])
            back = copy if self.copy_back else 0.0  # DDP copies the sum back into .grad (no bucket views)
            self.net.submit(lambda finish, b=b, copy=copy, back=back: self.wk.sim.after(
                copy, lambda: self.wk.ring(self.bytes[b], lambda: self.wk.sim.after(back, finish), f"bucket {b}")),
                self._reduced, what=f"bucket {b}")

    def _reduced(self) -> None:
        self.done += 1
        if self.done == len(self.buckets) and self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            waiting()

    def after_backward(self, step: int, go: Callable[[], None]) -> None:
        if self.done == len(self.buckets):
            go()
        else:
            self.waiting = go

    def step(self, step: int, go: Callable[[], None]) -> None:
        self.local_update(go)


# -- parameter servers (ps) ---------------------------------------------------------------------------
class ParameterServers(StrategyModel):
    """Groups of at most ``fuse_bytes`` per server, pushed as soon as complete during backward; at
    ``step()`` each server (or co-located owner) aggregates once every push is in, updates its
    share, and answers; the next forward waits for every pull. On hosts of several ranks each
    layer's gradients are summed inside the host once ready and pushed on, and the pulled
    parameters are broadcast inside the host at ``step()`` (:class:`~gradsync.simulate.hosts.StepShare`)."""

    shares_host_at_step = True

    def __init__(self, strategy, servers: int):
        super().__init__(strategy)
        self.dedicated = servers

    def bind(self, worker: Worker) -> None:
        from gradsync.strategies.allreduce import plan_buckets
        from gradsync.strategies.ps import partition

        super().bind(worker)
        n = len(worker.params)
        owners = list(range(self.dedicated or worker.np))
        owner = partition([p.numel for p in worker.params], owners)
        self.groups: list[tuple[int, list[int]]] = []
        cap = self.strategy.fuse_bytes or 1
        for s in owners:
            mine = [i for i in reversed(range(n)) if owner[i] == s]
            self.groups += [(s, g) for g in plan_buckets(worker.metas, mine, cap, cap)]
        self.group_of = {i: g for g, (_, members) in enumerate(self.groups) for i in members}
        self.index = {p.name: i for i, p in enumerate(worker.params)}
        self.owned_bytes = [0.0] * len(owners)
        for s, members in self.groups:
            self.owned_bytes[s] += sum(worker.params[i].nbytes for i in members)
        # Co-located owners are workers' hosts: each one's NIC carries what it serves, so an owner
        # of more than its share (VGG-19's fc6, a language model's tables) is the step's bottleneck.
        self.owner_links = [] if self.dedicated else [
            (Link(f"owner {s} tx", worker.tx.rate), Link(f"owner {s} rx", worker.rx.rate)) for s in owners]

    def _send(self, s: int, nbytes: float, push: bool, done: Callable[[], None], name: str) -> None:
        """A push to (or an answer from) owner ``s`` of a group of ``nbytes``."""
        wk = self.wk
        if self.dedicated:
            tx, rx = wk.servers[s]
            uses = [(wk.tx, 1), (rx, wk.np)] if push else [(tx, wk.np), (wk.rx, 1)]
            wk.message(nbytes, uses, done, name)
            return
        # Co-located: the np - 1 other workers push a group to its owner's host (and it answers
        # them); the representative worker sends (receives) the share of a group that leaves its
        # own host. Receives are posted before sends, so both directions run at full rate.
        # Every host sends to and receives from every other at once: an all-to-all (Network.mesh).
        # Flat on hosts of R ranks, the owners on the worker's own host take theirs without the NIC.
        tx, rx = self.owner_links[s]
        others = wk.np - wk.local_peers
        away = others / wk.np
        uses = [(wk.tx, away), (rx, others)] if push else [(tx, others), (wk.rx, away)]
        if push:  # what a worker sends (its answers, as an owner, are the owners' links')
            wk.local_sent += nbytes * (wk.local_peers - 1) / wk.np
        wk.message(nbytes if others > 0 else 0.0, uses, done, name, mesh=True)

    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        self.missing = [len(g) for _, g in self.groups]
        self.pushes_done = 0
        self.at_step: Callable[[], None] | None = None
        go()

    def on_layer_ready(self, step: int, layer: int) -> None:
        for p in self.wk.w.layers[layer].params:
            g = self.group_of[self.index[p.name]]
            self.missing[g] -= 1
            if self.missing[g] == 0:
                self._push(g)

    def _push(self, g: int) -> None:
        s, members = self.groups[g]
        nbytes = sum(self.wk.params[i].nbytes + 4 for i in members)
        self.wk.host.run(self.wk.copy_s(nbytes), lambda: self._send(s, nbytes, True, self._pushed, f"push {g}"),
                         what=f"pack {g}")

    def _pushed(self) -> None:
        self.pushes_done += 1
        if self.pushes_done == len(self.groups) and self.at_step is not None:
            self.at_step()

    def step(self, step: int, go: Callable[[], None]) -> None:
        def serve() -> None:
            # The busiest owner sums what it received and updates its share (owners work in
            # parallel), then answers every group.
            most = max(self.owned_bytes)
            update = self.wk.copy_s(most * (self.wk.np if self.dedicated else self.wk.np - 1)) + self.wk.update_s(most)
            pulls = Barrier(len(self.groups), go)
            self.wk.host.run(update, lambda: [self._send(
                s, sum(self.wk.params[i].nbytes for i in members), False, pulls.arrive, f"pull {g}")
                for g, (s, members) in enumerate(self.groups)], what="server update")

        if self.pushes_done == len(self.groups):
            serve()
        else:
            self.at_step = serve


# -- P3 and ByteScheduler: slices under priority and credit --------------------------------------------
class CreditSender:
    """A sender that issues the lowest priority first while the bytes in flight stay within
    ``credit`` (None: no bound); a message larger than the credit goes alone. A message's credit
    comes back ``handoff_s()`` after it is delivered (the thread that sees the send complete wakes
    the thread that sends: gradsync's :class:`~gradsync.strategies.scheduler.PrioritySender`;
    :meth:`~gradsync.simulate.worker.Worker.wake_s`)."""

    def __init__(self, sim: Sim, credit: float | None, handoff_s: Callable[[], float] = lambda: 0.0):
        self.sim, self.credit, self.handoff_s = sim, credit, handoff_s
        self.inflight = 0.0
        self.queue: list = []
        self.seq = itertools.count()

    def put(self, priority, nbytes: float, send: Callable[[Callable[[], None]], None]) -> None:
        heapq.heappush(self.queue, (priority, next(self.seq), nbytes, send))
        self._issue()

    def _issue(self) -> None:
        while self.queue:
            _, _, nbytes, send = self.queue[0]
            if self.credit is not None and self.inflight > 0 and self.inflight + nbytes > self.credit:
                return
            heapq.heappop(self.queue)
            self.inflight += nbytes
            send(lambda n=nbytes: self._done(n))

    def _done(self, nbytes: float) -> None:
        wait = 0.0 if self.credit is None else self.handoff_s()
        if wait <= 0:
            self._returned(nbytes)
        else:
            self.sim.after(wait, lambda: self._returned(nbytes))

    def _returned(self, nbytes: float) -> None:
        self.inflight -= nbytes
        self._issue()


class ReceiveWindow:
    """The receives a process keeps posted for a stream of messages, as slots.

    Gloo moves a point-to-point message's bytes only once the receiver has posted a matching
    receive (a rendezvous: the sender waits for the receiver's notice), and ``p3``'s receiving
    threads keep :data:`gradsync.strategies.p3.wire.POSTED` receives posted per peer, posting the next
    only once a message has been handled (a push aggregated and, if it was the last, its slice
    updated; an answer copied into the parameters). So at most ``slots`` messages travel into a
    process at once, and a receiving thread that falls behind stops its peers' links: a message
    takes a slot before it goes on the wire and returns it once handled. ``take(weight, go)``
    calls ``go(give_back)`` when ``weight`` slots are free (a model's message may stand for a
    share of one), in the order asked."""

    def __init__(self, slots: float):
        self.slots, self.used = slots, 0.0
        self.waiting: list[tuple[float, Callable]] = []

    def take(self, weight: float, go: Callable[[Callable[[], None]], None]) -> None:
        if not self.waiting and self.used + weight <= self.slots + 1e-9:
            self.used += weight
            go(lambda: self._give_back(weight))
        else:
            self.waiting.append((weight, go))

    def _give_back(self, weight: float) -> None:
        self.used -= weight
        while self.waiting and self.used + self.waiting[0][0] <= self.slots + 1e-9:
            weight, go = self.waiting.pop(0)
            self.used += weight
            go(lambda w=weight: self._give_back(w))


class Slices(StrategyModel):
    """``p3`` / ``ps-sliced`` (``all_reduce=False``): slices pushed under priority and credit to
    their owners, each updated once all N pushes are in and answered; the forward of a layer waits
    for its slices (overlap) or ``step()`` waits for all. A message crosses the wire only into a
    receive its receiver has posted (:class:`ReceiveWindow`). ``allreduce-priority``
    (``all_reduce=True``): partitions all-reduced in priority order under credit, each updated on
    every worker; the forward of a layer waits for its partitions."""

    def __init__(self, strategy, slice_params: int, credit: float | None, priority: bool, overlap: bool,
                 all_reduce: bool, servers: int):
        super().__init__(strategy)
        self.slice_params, self.credit, self.priority, self.overlap = slice_params, credit, priority, overlap
        self.all_reduce, self.dedicated = all_reduce, servers

    def bind(self, worker: Worker) -> None:
        from gradsync.strategies.slicing import SlicePlan

        super().bind(worker)
        n = len(worker.params)
        owners = list(range(self.dedicated or worker.np))
        self.plan = SlicePlan(worker.metas, list(range(n)), self.slice_params, owners)
        size = worker.params[0].nbytes // max(worker.params[0].numel, 1) if n else 4
        self.nbytes = [(s.numel + (len(s.segments) if self.all_reduce else self.plan.max_segments)) * size
                       + (0 if self.all_reduce else 16) for s in self.plan.slices]
        if not self.all_reduce:  # P3's wire: every message is the largest slice's size
            self.nbytes = [max(self.nbytes)] * len(self.nbytes)
        self.index = {p.name: i for i, p in enumerate(worker.params)}
        self.slices_of_layer = [self.plan.slices_of([self.index[p.name] for p in layer.params])
                                for layer in worker.w.layers]
        self.arrived_step = [-1] * len(self.plan.slices)  # the last step whose answer arrived
        self.waiters: dict[int, list] = {}
        self.sender = CreditSender(worker.sim, self.credit, worker.wake_s)
        self.interpreter = worker.cpu_stream("python threads")
        self.message_s = 0.0 if self.all_reduce else worker.host_rates.message_s
        if self.dedicated:  # one sender per server, for its answers
            # a dedicated server runs no training thread: its threads hand off without waiting
            self.server_senders = [CreditSender(worker.sim, self.credit) for _ in range(self.dedicated)]
        if not self.all_reduce:  # the receives posted for this worker's pushes, and for its answers
            from gradsync.strategies.p3.wire import POSTED

            senders = self.dedicated or max(worker.np - 1, 1)
            self.pushes_in = ReceiveWindow(POSTED * senders)  # at its owners (by symmetry: at this worker)
            # co-located, pushes and answers from a peer share its receives
            self.answers_in = ReceiveWindow(POSTED * senders) if self.dedicated else self.pushes_in
        self.pending: list[int] = []
        self.flushing: tuple | None = None  # (step, go): step() waits for every answer of that step
        self.unanswered = 0  # while flushing: the slices whose answer of that step has not arrived
        if self.credit is not None and self.credit < max(self.nbytes, default=0):
            raise ConfigError(f"credit_mb={self.credit / 2**20:g} is less than one message "
                              f"({max(self.nbytes) / 2**20:.3g} MB): nothing could be sent; raise credit_mb")

    def _prio(self, step: int, k: int):
        return (step, k if self.priority else 0.0)

    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        self.pending = [len({seg.param for seg in s.segments}) for s in self.plan.slices]
        go()

    def before_layer(self, step: int, layer: int, go: Callable[[], None]) -> None:
        if not self.overlap or step == 0:
            go()
            return
        needed = [k for k in self.slices_of_layer[layer] if self.arrived_step[k] < step - 1]
        if not needed:
            go()
            return
        count = Barrier(len(needed), go)
        for k in needed:
            self.waiters.setdefault(k, []).append(count.arrive)

    def on_layer_ready(self, step: int, layer: int) -> None:
        if step == 0:
            return  # step 0 only records the order; everything goes at step()
        for p in self.wk.w.layers[layer].params:
            for k in self.plan.of_param[self.index[p.name]]:
                self.pending[k] -= 1
                if self.pending[k] == 0:
                    self._push(step, k)

    def _push(self, step: int, k: int) -> None:
        wk, nbytes = self.wk, self.nbytes[k]
        copy = wk.copy_s(self.plan.slices[k].numel * 4)
        if self.all_reduce:
            wk.host.run(copy, lambda: self.sender.put(self._prio(step, k), nbytes, lambda release: wk.ring(
                nbytes, lambda: self._update(step, k, release), f"partition {k}")), what=f"fill {k}")
            return
        n = wk.np
        if self.dedicated:
            s = self.plan.slices[k].owner
            tx, rx = wk.servers[s]
            uses, share = [(wk.tx, 1), (rx, n)], nbytes
        else:  # the owner is a worker: 1 in N pushes stay home (flat on hosts of R ranks: R in N)
            uses, share = [(wk.tx, 1), (wk.rx, 1)], nbytes * (n - wk.local_peers) / n
            wk.local_sent += nbytes * (wk.local_peers - 1) / n
        # The credit counts whole messages (the sender's), the wire this worker's share of them.
        ends = 1.0 if self.dedicated else (n - 1) / n  # this worker's share of the sends (and receives)

        def push(release: Callable[[], None], handled: Callable[[], None]) -> None:
            wk.message(share, uses, lambda: (release(), self._handled(
                0.0 if self.dedicated else ends, lambda: self._aggregate(step, k, handled))), f"push {k}",
                mesh=not self.dedicated)  # co-located: every worker pushes to every other (Network.mesh)

        wk.host.run(copy, lambda: self.sender.put(self._prio(step, k), nbytes, lambda release: self._handled(
            ends, lambda: self.pushes_in.take(ends, lambda handled: push(release, handled)))), what=f"copy {k}")

    def _handled(self, ends: float, then: Callable[[], None]) -> None:
        """``ends`` message ends handled by the process's Python threads (none for ``allreduce-priority``)."""
        self.wk.message_ends(self.interpreter, ends, then, self.message_s)

    def _update(self, step: int, k: int, release: Callable[[], None]) -> None:
        """All-reduced partition k: divide, update, mark arrived, return the credit (ByteScheduler's
        completion thread, on every worker)."""
        self.wk.host.run(self.wk.update_s(self.plan.slices[k].numel * 4),
                         lambda: (self._arrived(step, k), release()), what=f"update {k}")

    def _aggregate(self, step: int, k: int, handled: Callable[[], None]) -> None:
        """Every worker's push of slice k is in at its owner: update it (the push is ``handled`` then:
        its receive is posted again) and answer the workers."""
        wk, nbytes, n = self.wk, self.nbytes[k], self.wk.np

        def answer() -> None:
            if self.dedicated:
                s = self.plan.slices[k].owner
                tx, rx = wk.servers[s]
                self.server_senders[s].put(self._prio(step, k), nbytes * n, lambda release: self.answers_in.take(
                    1.0, lambda handled: wk.message(nbytes, [(tx, n), (wk.rx, 1)], lambda: (release(), self._handled(
                        1.0, lambda: (handled(), self._arrived(step, k)))), f"answer {k}")))
            else:  # the owner answers N-1 workers; by symmetry this worker's NIC carries the share of
                # them on other hosts
                share, ends = nbytes * (n - wk.local_peers) / n, (n - 1) / n
                self.sender.put(self._prio(step, k), nbytes, lambda release: self._handled(
                    ends, lambda: self.answers_in.take(ends, lambda handled: wk.message(
                        share, [(wk.tx, 1), (wk.rx, 1)], lambda: (release(), self._handled(
                            ends, lambda: (handled(), self._arrived(step, k)))), f"answer {k}", mesh=True))))

        wk.host.run(wk.update_s(self.plan.slices[k].numel * 4), lambda: (handled(), answer()), what=f"update {k}")

    def _arrived(self, step: int, k: int) -> None:
        before = self.arrived_step[k]
        self.arrived_step[k] = max(before, step)
        for arrive in self.waiters.pop(k, []):
            arrive()
        if self.flushing is None:
            return
        flushed, go = self.flushing
        if before < flushed <= step:
            self.unanswered -= 1
        if self.unanswered == 0:
            self.flushing = None
            go()

    def step(self, step: int, go: Callable[[], None]) -> None:
        if step == 0:  # the plan is made now: every slice goes at once
            for k in range(len(self.plan.slices)):
                self._push(step, k)
        if self.overlap and step > 0:
            go()
            return
        self.unanswered = sum(1 for a in self.arrived_step if a < step)
        if self.unanswered == 0:
            go()
        else:
            self.flushing = (step, go)
