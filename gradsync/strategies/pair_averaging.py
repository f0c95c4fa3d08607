"""Asynchronous decentralized pair averaging, ``pair-averaging`` (AD-PSGD, Lian et al., ICML 2018;
KungFu's ``PairAveragingOptimizer``).

Every step a worker averages its model with the model of one peer (``v <- (v + v_peer) / 2``) and
applies its local gradient. By default (``peers="rotate"``) it takes its peers in turn: at its t-th
step it pulls from the (t mod (n-1) + 1)-th worker after it, so where the workers step together
each answers one pull a step. ``peers="random"`` draws the peer at random, as AD-PSGD's analysis
and KungFu's optimizer do; then some workers answer two or three pulls in a step while others
answer none, and every answer shares its worker's link (measured in docs/bench-adaptive.md).
As in KungFu, the pull is overlapped with computation: a worker asks for the peer's model at the
end of its step, the model arrives while it computes the next step's gradient, and is averaged in
at that next step (``overlap=False``: the pull at the step itself, waited for, as AD-PSGD's
pseudo-code has it). There is no global barrier: a worker never waits for more than one peer, and
that peer does not stop training to answer, since every worker runs a small server thread that
answers pulls from a snapshot of its model. Workers may therefore average models from different
steps. The snapshot is double-buffered: after its step a worker copies its model into the snapshot
no answer is reading and publishes it, so a step never waits for an answer still on its way to a
peer (on a slow link one answer takes most of a step); where both are being read, the answers go on
with the published one, a step older.

Wire (no pickle): a pull is an ``int64[2] = (op, rank)`` request on tag ``TAG_REQUEST`` (op 1 = pull,
2 = this worker is leaving, 3 = a keep-alive ping, skipped: :mod:`gradsync.strategies.keepalive`),
answered by the flat model (one buffer per dtype) on tag ``TAG_REPLY``. Gloo moves a message only
once its receiver's notice that the receive is posted has arrived, and that notice travels on the
same connection as the data going its way. So the answers travel on two channels of their own
(:meth:`~gradsync.transport.Transport.channel`), one for each direction between two ranks
(lower to higher, higher to lower): a request or a receive's notice never waits behind a whole
model going the same way, where two workers pull from each other.
At ``close`` a worker tells every peer it is leaving and keeps serving until every peer has said the
same, so a peer's last pull is always answered; a peer from which nothing came for the timeout
(``GRADSYNC_TIMEOUT``) while it had not left is named in the error.

Hosts of several workers (on Gloo, ``distribute(..., hosts="auto")``): each step a host's workers
first average their models inside the host; the host's first worker then pulls the model of
another host's first worker and averages with it, and hands the result to its host's workers. A
pair exchange crosses the network once per host, not once per worker; only the hosts' first
workers serve pulls.

Not exact (see :mod:`gradsync.strategies.sma`); the bench reports its loss next to the reference.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

import torch

from gradsync import flight, runtime
from gradsync.errors import ConfigError
from gradsync.strategies.base import Strategy, SyncContext, worker_hosts
from gradsync.transport import REPORT_S, check_peer
from gradsync.strategies.keepalive import KeepAlive

TAG_REQUEST, TAG_REPLY = 910_001, 910_002
OP_PULL, OP_LEAVE, OP_PING = 1, 2, 3


class PairAveraging(Strategy):
    name = "pair-averaging"
    synchronous = False  # no barrier: a worker may be steps ahead of another
    summary = "AD-PSGD: each step averages with one peer's model (peers in turn), no barrier"
    backends = ("gloo",)  # any-source receives
    grad_edits = "local"  # each worker steps with its own gradient; models are averaged in pairs
    exact = False

    def __init__(self, seed: int = 0, overlap: bool = True, peers: str = "rotate"):
        if peers not in ("random", "rotate"):
            raise ConfigError(f"pair-averaging: peers must be 'random' or 'rotate', got {peers!r}")
        self.seed, self.overlap, self.choice = seed, overlap, peers

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        self.me, self.peers = topo.rank, [r for r in topo.worker_ranks if r != topo.rank]
        self.hosts = ctx.two_level
        if self.hosts is not None:  # the hosts' first workers pair up; the others average in their host
            leaders = [ranks[0] for ranks in self.hosts.plan(topo)[0]]
            self.peers = [r for r in leaders if r != topo.rank] if self.hosts.leader == topo.rank else []
        self.rng = random.Random(self.seed * 7919 + topo.rank)
        self.turns, self.turn = in_turn(self.me, self.peers, topo.world_size), 0
        groups: dict[tuple, list[torch.nn.Parameter]] = {}
        for p in ctx.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self.groups = list(groups.values())
        flat = lambda g: torch.cat([p.detach().reshape(-1) for p in g])
        self.inbox = [flat(g) for g in self.groups]
        # Two snapshots when this worker answers pulls: answers read the published one.
        self.snapshots = [[b.clone() for b in self.inbox] for _ in range(2 if self.peers else 0)]
        self.published, self.reading = 0, [0, 0]
        self.answered = threading.Lock()  # guards published and reading
        self.failure: BaseException | None = None
        self.closed = False
        self.left: set[int] = set()
        self.heard = time.monotonic()  # the last request from a peer (pull or leave)
        self.pulling: tuple | None = None  # (peer, [request sent, model received]): the last step's pull
        self.thread = self.keepalive = None
        # The answers' channels, to a higher rank and to a lower one (the first use is collective:
        # every worker, serving or not).
        self.channels = (ctx.transport.channel(0), ctx.transport.channel(1))
        if self.peers:
            self.thread = threading.Thread(target=self._serve, name="gradsync-pair-averaging", daemon=True)
            self.thread.start()
            ping = torch.tensor([OP_PING, self.me])  # the peers' servers wait for requests through any pause
            self.keepalive = KeepAlive(ctx.transport, self.peers, TAG_REQUEST, lambda: ping, "pair-averaging ping")

    def _serve(self) -> None:
        transport = self.ctx.transport
        request = torch.empty(2, dtype=torch.int64)
        try:
            while len(self.left) < len(self.peers):
                try:
                    src = transport.recv_any(request, TAG_REQUEST, what="pair-averaging request")
                    if src is None:
                        continue  # no pull within the timeout: keep serving
                except Exception:  # noqa: BLE001 - after close, the group going away ends the loop
                    if self.closed:
                        return
                    raise
                op, peer = request.tolist()
                check_peer(op in (OP_PULL, OP_LEAVE, OP_PING) and peer == src and peer in self.peers, src,
                           "a pair-averaging request", f"operation {op} for worker {peer}")
                if op == OP_PING:
                    continue  # alive, but not a request: a peer that never leaves is still named at close
                self.heard = time.monotonic()
                if op == OP_LEAVE:
                    self.left.add(peer)
                    continue
                with self.answered:
                    which = self.published
                    self.reading[which] += 1
                try:
                    sends = [transport.send_async(part, peer, TAG_REPLY, what=f"model for worker {peer}",
                                                  channel=self._lane(self.me, peer))
                             for part in self.snapshots[which]]
                    for send in sends:
                        send.wait(background=True)
                finally:
                    with self.answered:
                        self.reading[which] -= 1
        except BaseException as exc:  # noqa: BLE001 - reported by the training thread
            self.failure = exc

    def step(self, apply: Callable[[], Any]) -> Any:
        if self.failure is not None:
            raise self.failure
        if self.hosts is not None:
            self._in_host("host-all-reduce", "average of the host's models")
        if not self.overlap:  # pull now and wait for it
            self._pull()
        self._average_pulled()
        if self.hosts is not None:
            self._in_host("broadcast", "the pair's average to the host's workers")
        result = apply()
        self._publish()
        if self.overlap:
            self._pull()
        return result

    def _publish(self) -> None:
        """Copy the model into the snapshot no answer reads, then let the next answers read it."""
        if not self.snapshots:
            return
        with self.answered:
            spare = 1 - self.published
            if self.reading[spare]:  # an answer begun before the last refresh is still going out:
                return  # the answers keep the published model, one step older, rather than this step wait
        with torch.no_grad():
            for group, s in zip(self.groups, self.snapshots[spare]):
                torch.cat([p.detach().reshape(-1) for p in group], out=s)
        with self.answered:
            self.published = spare

    def _pull(self) -> None:
        """Ask the next peer (in turn, or at random) for its model; it arrives while this worker
        computes its next step."""
        if not self.peers:
            return
        transport = self.ctx.transport
        if self.choice == "rotate":
            peer, self.turn = self.turns[self.turn % len(self.turns)], self.turn + 1
        else:
            peer = self.rng.choice(self.peers)
        # The receives before the request, so that their notices are on their way before the answer.
        models = [transport.recv_async(box, peer, TAG_REPLY, what=f"model of worker {peer}",
                                       channel=self._lane(peer, self.me)) for box in self.inbox]
        with self.keepalive.sending(peer):
            request = transport.send_async(torch.tensor([OP_PULL, self.me]), peer, TAG_REQUEST,
                                           what=f"pull request to worker {peer}")
        # Not waited for here: a Gloo send ends when the peer's server takes it, which may be after
        # the server has answered another worker.
        self.pulling = (peer, [request] + models)

    def _lane(self, src: int, dst: int):
        """The channel of the answers from ``src`` to ``dst``."""
        return self.channels[int(src > dst)]

    def _average_pulled(self) -> None:
        """``v <- (v + v_peer) / 2`` with the model pulled at the end of the previous step."""
        if self.pulling is None:
            return
        _, handles = self.pulling
        for handle in handles:
            handle.wait()
        self.pulling = None
        with torch.no_grad():
            for group, box in zip(self.groups, self.inbox):
                offset = 0
                for p in group:
                    p.lerp_(box[offset:offset + p.numel()].view_as(p), 0.5)
                    offset += p.numel()

    def flush(self) -> None:
        """Average in the model still on its way (local: ``state_dict()`` on one worker calls it)."""
        self._average_pulled()

    def _in_host(self, op: str, what: str) -> None:
        """Every model group through a host operation: its mean over the host's workers
        (``host-all-reduce``), or the host's first worker's copy (``broadcast``)."""
        transport, size = self.ctx.transport, len(self.hosts.local_ranks)
        if size == 1:
            return
        for group in self.groups:
            flat = torch.cat([p.detach().reshape(-1) for p in group])
            if op == "broadcast":
                transport.host_broadcast(flat, what=what)
            else:
                transport.host_allreduce(flat, what=what).div_(size)
            with torch.no_grad():
                offset = 0
                for p in group:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def close(self) -> None:
        if self.closed:
            return
        if self.thread is None:  # this worker answers no pulls
            self.closed = True
            return
        if self.pulling is not None:  # the last step's pull: its answer must be received before leaving
            for handle in self.pulling[1]:
                handle.wait()
            self.pulling = None
        self.keepalive.stop()  # after the leave message, the peers no longer listen to this worker
        for peer in self.peers:
            self.ctx.transport.send_async(torch.tensor([OP_LEAVE, self.me]), peer, TAG_REQUEST,
                                          what=f"leave message to worker {peer}").wait()
        rt = runtime.current()
        what = "wait for every worker to leave pair-averaging"
        try:  # the peers still training pull from this worker meanwhile: each request is progress
            with flight.waiting(what):
                began = time.monotonic()
                while self.thread.is_alive():
                    left = max(began, self.heard) + rt.timeout_s - REPORT_S - time.monotonic()
                    if left <= 0:
                        break
                    self.thread.join(min(left, 0.5))
        finally:
            self.closed = True
        if self.failure is not None:
            raise self.failure
        if self.thread.is_alive():
            missing = ", ".join(rt.topology.describe(r) for r in sorted(set(self.peers) - self.left))
            raise rt.explain(what, TimeoutError(
                f"{missing} did not say they were leaving within {rt.timeout_s:g} s (GRADSYNC_TIMEOUT); this "
                "worker's model is complete, it stops answering pulls now"))

    def describe(self) -> str:
        return ("pair-averaging" + (" (pull overlapped with the next step)" if self.overlap else "")
                + (", peers in turn" if self.choice == "rotate" else ", peers at random")
                + ("" if self.hosts is None else " (hosts pair up, models averaged in each host)"))

    def min_bytes_per_host(self, model_bytes: int) -> float:
        # Each worker receives one model per step, from a peer on another host as often as the peers
        # are elsewhere (every time at one worker a host); a worker chosen by several peers sends more.
        # On hosts of several workers the hosts pair up: a host receives one model a step.
        n = self.ctx.topology.num_workers
        if n == 1 or self.ctx.topology.shares_hosts:
            return float(model_bytes)
        return max(len(w) * (n - len(w)) * model_bytes / (n - 1) for w in worker_hosts(self.ctx.topology))


def in_turn(me: int, peers: list[int], world: int) -> list[int]:
    """``peers`` in the order ``peers="rotate"`` pulls from them: the next rank after ``me`` first,
    cyclically. Every worker (or every host's first worker) uses the same cycle, so at each turn
    the pulls form a permutation: each peer is asked once."""
    return sorted(peers, key=lambda p: (p - me) % world)
