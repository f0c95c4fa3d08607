"""Transport: the one place where gradsync calls ``torch.distributed``.

Strategies never touch process groups or sockets; they call these methods. That keeps three
things in one place: which group a collective runs on (workers only, or the whole world with
servers), how many bytes each call puts on the wire (for the benchmark's ``bytes_per_step``),
and how a failed operation is turned into an error that names the rank that caused it.

Wire format: only tensors cross the wire. Control messages are fixed-format ``int64`` headers
(see ``gradsync.strategies.ps``); nothing is pickled.

Byte accounting uses the algorithm's cost, not a packet capture: a ring all-reduce of ``n`` bytes
over ``p`` ranks sends ``2 (p-1)/p * n`` bytes per rank, a point-to-point send sends ``n``.

This module holds :class:`Transport`, the collectives and point-to-point calls over the job's
process groups; :mod:`~gradsync.transport.waits` how each of its operations is waited on
(:class:`Handle`, :class:`Waiter`, :func:`wait_all`), :mod:`~gradsync.transport.groups` the
collectives on a plain process group (DDP's communication hooks), :mod:`~gradsync.transport.peers`
the checks of what a peer sends. No collective or message leaves a rank outside this package.
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from gradsync import flight, trace
from gradsync.errors import PeerFailureError, PeerProtocolError
from gradsync.topology import Topology
from gradsync.transport.groups import (allgather_bytes, allgather_with_info, allreduce_sum_, allreduce_sum_async,
                                       global_rank, group_rank_and_size)
from gradsync.transport.peers import check_peer, payload_limit
from gradsync.transport.twolevel import TwoLevel
from gradsync.transport.waits import _MAIN_THREAD, RECHECK_S, REPORT_S, Handle, Waiter, gloo_timeout, wait_all

__all__ = ["HEADER_WORDS", "RECHECK_S", "REPORT_S", "Handle", "Transport", "TwoLevel", "Waiter", "allgather_bytes",
           "allgather_with_info", "allreduce_sum_", "allreduce_sum_async", "check_peer", "global_rank",
           "gloo_timeout", "group_rank_and_size", "payload_limit", "wait_all"]

HEADER_WORDS = 4
_BROKEN_PAIR = re.compile(r"pair|timeout|timed out|connection|closed", re.IGNORECASE)
"""What Gloo says when an operation cannot even start because a peer's connection broke."""
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _consecutive(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat tensor that ``tensors`` (contiguous) fill one after the other in one storage, or None."""
    first = tensors[0]
    at, size = first.data_ptr(), first.element_size()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != at or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        at += t.numel() * size
    if len(tensors) == 1:
        return first.view(-1)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (sum(t.numel() for t in tensors),))


@torch.no_grad()
def _in_chunks(tensors: list[torch.Tensor], chunk_bytes: int, sending: bool, move: Callable[[torch.Tensor], Any]) -> None:
    """``move`` each flat chunk of ``tensors`` (grouped by dtype and device, at most ``chunk_bytes``
    each): packed first where ``sending``, unpacked after where not; tensors that already lie one
    after the other in one storage go as they are. Every rank cuts the same chunks."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        chunks, size, limit = [[]], 0, max(1, chunk_bytes // group[0].element_size())
        for t in group:
            if chunks[-1] and size + t.numel() > limit:
                chunks.append([])
                size = 0
            chunks[-1].append(t)
            size += t.numel()
        flat = [_consecutive(c) for c in chunks]
        buffer = group[0].new_empty(max((sum(t.numel() for t in c) for c, f in zip(chunks, flat) if f is None),
                                        default=0))
        for chunk, covering in zip(chunks, flat):
            if covering is not None:  # already one flat tensor: nothing to pack
                move(covering)
                continue
            counts = [t.numel() for t in chunk]
            views = buffer[:sum(counts)].split(counts)
            if sending:
                torch._foreach_copy_(list(views), [t.reshape(-1) for t in chunk])
            move(buffer[:sum(counts)])
            if not sending:
                for t, view in zip(chunk, views):
                    t.copy_(view.view(t.shape))


class Transport:
    """Collectives and point-to-point messages over the job's process groups."""

    def __init__(self, topology: Topology, worker_group, device: torch.device,
                 explain: Callable[[str, BaseException], Exception] | None = None, timeout_s: float = 30.0,
                 overdue: Callable[[str], Exception | None] | None = None, two_level: TwoLevel | None = None):
        self.topology = topology
        self.timeout = timedelta(seconds=timeout_s)
        self.worker_group = worker_group
        self.device = device
        self.bytes_sent = 0
        self._explain = explain or (lambda what, exc: exc)
        self.failure: Exception | None = None
        """The peer failure this transport reported, if any: the group is broken after it (Gloo's
        pairs are left mid-message), so every later operation fails at once instead of waiting out
        the timeout again (a strategy's goodbye at exit, say)."""
        self.progress = time.monotonic()
        """When this rank's last operation completed (``time.monotonic()``)."""
        self.overdue: Callable[[str], Exception | None] = overdue or (lambda what: None)
        """Asked while a collective waits: the error to raise now, or None to go on waiting
        (:meth:`gradsync.runtime.Runtime.overdue`)."""
        self._chunked = device.type == "cpu"  # Gloo; a CUDA work's wait(timeout) means something else
        self.check_every_s = float("inf")
        """The longest a wait blocks between two ``overdue`` checks before its deadline: an elastic
        job shortens it, since there another thread may learn of a lost member (``Runtime.peer_lost``)."""
        self.waiter = Waiter() if self._chunked else None
        """Where the training thread's point-to-point waits block (Gloo only; :class:`Waiter`)."""
        self.two_level = two_level
        """The job's host groups when its hosts run several workers on Gloo (:mod:`.twolevel`), else None."""
        self._channels: list = []  # :meth:`channel`'s groups

    def until_overdue(self) -> float:
        """Seconds until the timeout, less :data:`REPORT_S`, has passed since this rank's last
        completed operation."""
        return self.progress + self.timeout.total_seconds() - REPORT_S - time.monotonic()

    def next_check(self) -> float:
        """How long a wait may block before asking ``overdue`` again: until the deadline, at most
        :attr:`check_every_s`, at least :data:`RECHECK_S`."""
        return max(RECHECK_S, min(self.until_overdue(), self.check_every_s))

    def staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where the backend reads and writes it: itself, or a copy on :attr:`device`.
        Gloo moves host memory (its point-to-point calls take no GPU tensors) and NCCL device
        memory, so a strategy's CPU control words under NCCL and a GPU model's buffers under Gloo
        both travel; an operation that writes (a receive, an all-reduce) lands in the caller's
        tensor when its handle's wait returns."""
        return tensor if tensor.device.type == self.device.type else tensor.to(self.device)

    def _landing(self, staged: torch.Tensor, tensor: torch.Tensor):
        return None if staged is tensor else (staged, tensor)

    def _issue(self, what: str, call: Callable[[], Any]):
        """``call()``, which starts an operation; a failure to start it (a pair that an earlier
        timeout closed) is explained, as a failed wait is, so the rank is marked failed."""
        try:
            return call()
        except RuntimeError as exc:
            if not _BROKEN_PAIR.search(str(exc)):
                raise  # a bad argument, not a peer: as torch says it
            raise self._explain(what, exc) from exc

    # -- collectives -------------------------------------------------------------------------
    def _group(self, world: bool):
        return dist.group.WORLD if world else self.worker_group

    def _group_size(self, world: bool) -> int:
        return self.topology.world_size if world else self.topology.num_workers

    def _record(self, what: str, op: str, nbytes: int, *, group=None, world: bool = False,
                peer: int | None = None) -> flight.Record | None:
        """This operation's entry in the rank's flight record (:mod:`gradsync.flight`). Collectives
        are numbered on their group: "world", "workers", or a private group's name."""
        if self.failure is not None:
            raise PeerFailureError(f"{what} not attempted: an earlier operation failed. {self.failure}")
        recorder = flight.current()
        if recorder is None:
            return None
        label = None
        if peer is None:
            label = ("world" if world else "workers") if group is None else getattr(group, "group_name", "private")
        return recorder.issue(what, op, nbytes, group=label, peer=peer)

    def new_worker_group(self):
        """A private process group of the workers, for a strategy that issues collectives from its
        own threads: Gloo and NCCL match collectives by their order on a group, so those must never
        interleave with the ones the training script (or gradsync) issues on the default groups.
        Collective: every rank, servers included, calls it at the same point. Its operations time
        out with the job's timeout, as the default group's do (:func:`gloo_timeout`; torch's
        default is 30 minutes)."""
        return dist.new_group(self.topology.worker_ranks, timeout=gloo_timeout(self.timeout.total_seconds()))

    def channel(self, index: int):
        """The ``index``-th private group of the workers for point-to-point messages (``channel=``
        of :meth:`send_async` and :meth:`recv_async`, which take world ranks): Gloo sends one
        message after another on each peer's pair, notices that a receive is posted included, so a
        strategy that sends large messages on a channel keeps them from holding up its small ones
        on the default pairs (a request, or a notice, behind a whole model). Made at its first use,
        collectively over the workers (dedicated servers need not call it), and kept for the
        transport's life: a strategy attached again reuses it (a group freed and made again over
        the same ranks would read its predecessor's addresses from the store)."""
        while len(self._channels) <= index:
            self._channels.append(dist.new_group(self.topology.worker_ranks, use_local_synchronization=True,
                                                 timeout=gloo_timeout(self.timeout.total_seconds())))
        return self._channels[index]

    def new_two_level(self) -> TwoLevel | None:
        """A private :class:`TwoLevel` (host groups of the strategy's own, as :meth:`new_worker_group`
        for a flat group) where the job's hosts run several workers on Gloo; else None.
        Collective: every rank calls it at the same point."""
        if self.two_level is None:
            return None
        return TwoLevel.create(self.topology, gloo_timeout(self.timeout.total_seconds()))

    def free_group(self, group) -> None:
        """Release a group from :meth:`new_worker_group` or :meth:`new_two_level` (on a rank outside
        it, nothing to do)."""
        if isinstance(group, TwoLevel):
            group.close()
            for member in group.groups():
                dist.destroy_process_group(member)
        elif group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)

    def allreduce_async(self, tensor: torch.Tensor, *, op: str = "sum", world: bool = False,
                        what: str = "all-reduce", group=None) -> Handle:
        """In-place all-reduce among the workers (or every rank with ``world=True``, or ``group``).

        ``group`` a :class:`TwoLevel` (:attr:`two_level`, or a strategy's own from
        :meth:`new_two_level`): a sum over the workers that crosses the network once per host
        (:mod:`.twolevel`); its operations run in the order they were issued, so every rank must
        issue them in the same order."""
        if isinstance(group, TwoLevel):
            return self._allreduce_two_level(tensor, what, group)
        p = self._group_size(world) if group is None else group_rank_and_size(group)[1]
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += int(2 * (p - 1) / p * nbytes)
        record = self._record(what, "all-reduce", nbytes, group=group, world=world)
        group = self._group(world) if group is None else group
        staged = self.staged(tensor)
        work = self._issue(what, lambda: dist.all_reduce(staged, op=_REDUCE_OPS[op], group=group, async_op=True))
        tracer = trace.current()
        if tracer is not None:
            token = tracer.begin_async(what, "comm", bytes=nbytes, op="all-reduce")
            work.get_future().add_done_callback(lambda _future: tracer.end_async(token))
        return Handle(work, self, what, record=record, chunked=self._chunked, landing=self._landing(staged, tensor))

    def _allreduce_two_level(self, tensor: torch.Tensor, what: str, two_level: TwoLevel) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += two_level.network_bytes(nbytes)
        return self._two_level(two_level, "all-reduce", tensor, what)

    def _two_level(self, two_level: TwoLevel, op: str, tensor: torch.Tensor, what: str, then=None) -> Handle:
        record = self._record(what, op, tensor.numel() * tensor.element_size(), group=two_level)
        staged = self.staged(tensor)
        if not staged.is_contiguous():
            raise ValueError(f"{what}: a two-level operation needs a contiguous tensor")
        tracer = trace.current()
        token = None if tracer is None else tracer.begin_async(what, "comm", bytes=tensor.numel() * tensor.element_size(),
                                                               op=f"two-level {op}")
        landing = self._landing(staged, tensor)
        if landing is not None and then is not None:  # what follows at once reads the result where it lives
            follow = then

            def then() -> None:
                tensor.copy_(staged)
                follow()
            landing = None
        done = two_level.submit(op, staged, None if token is None else lambda: tracer.end_async(token), then)
        return Handle(done, self, what, record=record, chunked=True, landing=landing)

    def host_reduce_async(self, tensor: torch.Tensor, *, what: str, then=None) -> Handle:
        """Start summing ``tensor`` in place over this host's workers onto the host's first worker
        (``two_level.leader``); intra-host, on the job's :class:`TwoLevel` (which must exist).
        ``then()`` runs on the communication thread once the sum is in, before the handle completes
        (the host's first worker pushes it on from there)."""
        return self._two_level(self.two_level, "reduce", tensor, what, then)

    def host_allreduce(self, tensor: torch.Tensor, *, what: str) -> torch.Tensor:
        """Sum ``tensor`` in place over this host's workers (intra-host)."""
        self._two_level(self.two_level, "host-all-reduce", tensor, what).wait()
        return tensor

    def host_broadcast(self, tensor: torch.Tensor, *, what: str, group: TwoLevel | None = None) -> torch.Tensor:
        """Copy ``tensor`` from the host's first worker to the host's other workers (intra-host;
        ``group``: a strategy's own :class:`TwoLevel`, default the job's)."""
        self._two_level(group or self.two_level, "broadcast", tensor, what).wait()
        return tensor

    def host_allgather_async(self, message: torch.Tensor, *, group: TwoLevel, limit: int, what: str,
                             info: tuple[int, int, int] = (0, 0, 0), then=None) -> Handle:
        """Start gathering every host worker's ``uint8`` message, each of its own length (at most
        ``limit`` bytes, checked before anything is allocated for it), and three words of ``info``,
        on ``group`` (a :class:`TwoLevel`), in its issue order: a host's workers must issue their
        gathers in one order. ``then(messages, infos)`` runs on the communication thread with them,
        in host order (this rank's own among them), before the handle completes. Intra-host: nothing
        counts in :attr:`bytes_sent`."""
        staged = self.staged(message)
        home = message.device
        record = self._record(what, "all-gather", message.numel(), group=group)
        tracer = trace.current()
        token = None if tracer is None else tracer.begin_async(what, "comm", bytes=message.numel(),
                                                               op="two-level all-gather-bytes")

        def landed(messages, infos) -> None:
            if then is not None:
                then([m.to(home) for m in messages] if home.type != staged.device.type else messages, infos)

        done = group.submit("all-gather-bytes", (staged, tuple(info), limit, what),
                            None if token is None else lambda: tracer.end_async(token), landed)
        return Handle(done, self, what, record=record, chunked=True)

    def host_allgather(self, message: torch.Tensor, *, group: TwoLevel, limit: int, what: str,
                       info: tuple[int, int, int] = (0, 0, 0)) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """Blocking :meth:`host_allgather_async`: every host worker's message and info, in host order."""
        out = []
        self.host_allgather_async(message, group=group, limit=limit, what=what, info=info,
                                  then=lambda messages, infos: out.append((messages, infos))).wait()
        return out[0]

    def host_reduce_scatter(self, tensor: torch.Tensor, *, group: TwoLevel, what: str) -> torch.Tensor:
        """``tensor`` (``group.shards`` shards of one length): the host's sum of each shard this rank
        owns (``group.cross``) lands in it; intra-host, so nothing counts in :attr:`bytes_sent`."""
        self._two_level(group, "reduce-scatter", tensor, what).wait()
        return tensor

    def host_all_gather(self, tensor: torch.Tensor, *, group: TwoLevel, what: str) -> torch.Tensor:
        """The inverse of :meth:`host_reduce_scatter`: each shard from its local owner to the host's
        other workers (intra-host)."""
        self._two_level(group, "all-gather", tensor, what).wait()
        return tensor

    def allreduce(self, tensor: torch.Tensor, *, op: str = "sum", world: bool = False,
                  what: str = "all-reduce", group=None) -> torch.Tensor:
        """Blocking :meth:`allreduce_async`."""
        self.allreduce_async(tensor, op=op, world=world, what=what, group=group).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, world: bool = False,
                  what: str = "broadcast") -> torch.Tensor:
        """In-place broadcast from global rank ``src``."""
        if self.topology.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        staged = self.staged(tensor)
        record = self._record(what, "broadcast", tensor.numel() * tensor.element_size(), world=world)
        work = self._issue(what, lambda: dist.broadcast(staged, src=src, group=self._group(world), async_op=True))
        Handle(work, self, what, record=record, chunked=self._chunked, landing=self._landing(staged, tensor)).wait()
        return tensor

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0, *, world: bool = False,
                          what: str = "broadcast", chunk_bytes: int = 64 * 2**20) -> None:
        """In-place broadcast of many tensors from global rank ``src`` (every rank passes tensors of
        the same dtypes and shapes, in one order): grouped by dtype and device and packed into flat
        chunks of at most ``chunk_bytes``, so a model's hundreds of tensors take a few messages, not
        one each. Tensors that lie one after the other in one storage (a larger tensor alone, or
        views of one flat buffer, as a receiver may allocate them) go as they are, uncopied."""
        _in_chunks(tensors, chunk_bytes, self.topology.rank == src,
                   lambda flat: self.broadcast(flat, src, world=world, what=what))

    def send_tensors(self, tensors: list[torch.Tensor], dst: int, tag: int, *, what: str,
                     chunk_bytes: int = 64 * 2**20) -> None:
        """:meth:`broadcast_tensors`' chunks, sent to ``dst`` alone (it calls :meth:`recv_tensors`)."""
        _in_chunks(tensors, chunk_bytes, True,
                   lambda flat: self.send_async(flat, dst, tag, what=what, counted=False).wait())

    def recv_tensors(self, tensors: list[torch.Tensor], src: int, tag: int, *, what: str,
                     chunk_bytes: int = 64 * 2**20) -> None:
        """Receive into ``tensors`` what ``src`` sends with :meth:`send_tensors`."""
        _in_chunks(tensors, chunk_bytes, False, lambda flat: self.recv_async(flat, src, tag, what=what).wait())

    def barrier(self, *, world: bool = True, what: str = "barrier") -> None:
        flag = torch.zeros(1, device=self.device)
        self.allreduce(flag, world=world, what=what)

    def count_external(self, nbytes: int) -> None:
        """Account bytes moved by a library gradsync does not intercept (PyTorch DDP's reducer),
        once its operations completed."""
        self.bytes_sent += nbytes
        self.progress = time.monotonic()

    # -- point to point ------------------------------------------------------------------------
    # Point-to-point messages go straight to the world process group: ``dist.isend``'s argument
    # checks cost more than the send itself for the hundreds of small messages a PS step makes.
    def send_async(self, tensor: torch.Tensor, dst: int, tag: int, *, what: str = "send",
                   counted: bool = True, channel=None) -> Handle:
        """Send ``tensor`` to ``dst`` on ``tag`` (on ``channel``, from :meth:`channel`, else on the
        world group). ``counted=False``: traffic that is not part of a training step (hybrid's
        whole-table flush) stays out of ``bytes_sent``."""
        nbytes = tensor.numel() * tensor.element_size()
        if counted:
            self.bytes_sent += nbytes
        tracer = trace.current()
        token = None if tracer is None else tracer.begin_async(what, "comm", bytes=nbytes, op="send", peer=dst)
        record = self._record(what, "send", nbytes, peer=dst)
        staged = self.staged(tensor)  # the work holds it until sent
        if channel is None:
            work = self._issue(what, lambda: dist.group.WORLD.send([staged], dst, tag))
        else:
            work = self._issue(what, lambda: channel.send([staged], dist.get_group_rank(channel, dst), tag))
        return Handle(work, self, what, token, record, local=True)

    def send_despite_failure(self, messages: list[tuple[torch.Tensor, int, int]]) -> None:
        """Send each ``(tensor, dst, tag)`` although an operation failed: a strategy that abandons its
        streams after a peer died tells the surviving peers, whose receives from this rank stay
        posted (a Gloo receive cannot be cancelled). Not recorded, traced or counted; a daemon
        thread waits for the sends, and one to the dead peer fails quietly."""
        works = []
        for tensor, dst, tag in messages:
            with contextlib.suppress(RuntimeError):
                works.append(dist.group.WORLD.send([self.staged(tensor)], dst, tag))

        def settle() -> None:
            for work in works:
                with contextlib.suppress(RuntimeError):
                    work.wait()

        threading.Thread(target=settle, name="gradsync-goodbye", daemon=True).start()

    def recv_async(self, tensor: torch.Tensor, src: Optional[int], tag: int, *,
                   what: str = "receive", traced: bool = True, channel=None) -> Handle:
        """Receive into ``tensor`` from ``src`` on the world group, or on ``channel``
        (:meth:`channel`); ``src=None`` (world group only): from whichever rank sends first.

        ``traced=False``: a receive posted ahead of its message, whose caller traces the arrival itself.
        """
        if channel is not None and src is None:
            raise ValueError("recv_async: a receive from any rank goes on the world group, not a channel")
        group, peer = (dist.group.WORLD, src) if channel is None else (channel, dist.get_group_rank(channel, src))
        staged = self.staged(tensor)
        work = self._issue(what, lambda: group.recv_anysource([staged], tag) if src is None
                           else group.recv([staged], peer, tag))
        tracer = trace.current() if traced else None
        nbytes = tensor.numel() * tensor.element_size()
        token = None if tracer is None else tracer.begin_async(what, "comm", bytes=nbytes, op="receive", peer=src)
        record = self._record(what, "receive", nbytes, peer=-1 if src is None else src)
        return Handle(work, self, what, token, record, landing=self._landing(staged, tensor))

    def recv_any(self, tensor: torch.Tensor, tag: int, *, what: str) -> Optional[int]:
        """A server thread's wait for the next request: receive into ``tensor`` from whichever rank
        sends first on ``tag``; the sender's rank, or None when nothing came within the process
        group's timeout (a quiet spell, not a failure: the caller keeps serving)."""
        handle = self.recv_async(tensor, None, tag, what=what, traced=False)
        try:
            handle.wait(background=True, quiet=True)
        except TimeoutError:
            return None
        return handle.source_rank()

    # -- messages of any length (compressed payloads) -----------------------------------------------
    # A header of ``HEADER_WORDS`` int64 goes first: the body's length in bytes, then three words
    # the sender fills (gradsync's compressed strategies: a fault code, its rank and its parameter),
    # so a receiver learns of a peer's fault from the message it was waiting for, instead of hanging.
    def send_bytes(self, message: torch.Tensor, dst: int, tag: int, *, info: tuple[int, int, int] = (0, -1, -1),
                   what: str = "send") -> list[Handle]:
        """Send a ``uint8`` message (empty: header only) and three words of ``info`` to ``dst`` on ``tag``."""
        header = torch.tensor([message.numel(), *info], dtype=torch.int64)
        handles = [self.send_async(header, dst, tag, what=what)]
        if message.numel():
            handles.append(self.send_async(message, dst, tag, what=what))
        return handles

    def recv_bytes(self, src: int, tag: int, *, limit: int, what: str = "receive",
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Receive one :meth:`send_bytes` message of at most ``limit`` bytes from ``src`` onto ``device``:
        ``(message, info)``. A header announcing more is refused (:func:`check_peer`) before the
        body is allocated. Blocks (a communication thread calls it)."""
        header = torch.empty(HEADER_WORDS, dtype=torch.int64)
        self.recv_async(header, src, tag, what=what).wait(background=True)
        length, *info = header.tolist()
        check_peer(0 <= length <= limit, src, what, f"a length of {length} bytes (at most {limit} expected)")
        message = torch.empty(length, dtype=torch.uint8, device=device)
        if length:
            self.recv_async(message, src, tag, what=what).wait(background=True)
        return message, tuple(info)

    def allgather_bytes(self, message: torch.Tensor, *, limit: int, info: tuple[int, int, int] = (0, -1, -1),
                        group=None, what: str = "all-gather"
                        ) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """Every worker's ``uint8`` message (at most ``limit`` bytes each, on ``message``'s device) and
        ``info``, in rank order (see :func:`allgather_with_info`)."""
        home, message = message.device, self.staged(message)
        size = self.topology.num_workers if group is None else group_rank_and_size(group)[1]
        self.bytes_sent += (size - 1) * message.numel()
        record = self._record(what, "all-gather", message.numel(), group=group)
        tracer = trace.current()
        token = None if tracer is None else tracer.begin_async(what, "comm", bytes=message.numel(), op="all-gather")
        recorder = flight.current()
        with recorder.blocked_in(record, main=threading.get_ident() == _MAIN_THREAD) if recorder \
                else contextlib.nullcontext():
            try:
                gathered = allgather_with_info(message, info, self.worker_group if group is None else group,
                                               limit=limit, what=what)
            except PeerProtocolError:
                raise
            except RuntimeError as exc:
                raise self._explain(what, exc) from exc
        if record is not None:
            record.done = time.time()
        if token is not None:
            tracer.end_async(token)
        self.progress = time.monotonic()
        if home.type != message.device.type:
            gathered = ([m.to(home) for m in gathered[0]], gathered[1])
        return gathered

