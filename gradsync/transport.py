"""Transport: the one place where gradsync calls ``torch.distributed``.

Strategies never touch process groups or sockets; they call these methods. That keeps three
things in one file: which group a collective runs on (workers only, or the whole world with
servers), how many bytes each call puts on the wire (for the benchmark's ``bytes_per_step``),
and how a failed operation is turned into an error that names the rank that caused it.

Wire format: only tensors cross the wire. Control messages are fixed-format ``int64`` headers
(see ``gradsync.strategies.ps``); nothing is pickled.

Byte accounting uses the algorithm's cost, not a packet capture: a ring all-reduce of ``n`` bytes
over ``p`` ranks sends ``2 (p-1)/p * n`` bytes per rank, a point-to-point send sends ``n``.

Why one file of this size: being the one place that calls ``torch.distributed`` is the point; the
waits that end within the timeout of a fault (``Handle``, ``Waiter``) are how every call waits.
"""
from __future__ import annotations

import contextlib
import queue
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

HEADER_WORDS = 4
_MAIN_THREAD = threading.main_thread().ident
_BROKEN_PAIR = re.compile(r"pair|timeout|timed out|connection|closed", re.IGNORECASE)
"""What Gloo says when an operation cannot even start because a peer's connection broke."""
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def check_peer(ok: bool, peer: int, what: str, detail: str) -> None:
    """Refuse a message from ``peer`` unless ``ok``: every header field a peer supplies (a length,
    an index, an operation) is checked against what that peer may send before it sizes an
    allocation or indexes a table. ``detail`` says what was received and what was allowed."""
    if not ok:
        raise PeerProtocolError(
            f"rank {peer} sent {what} with {detail}. Nothing was allocated for it and the job stops here: "
            "every rank must run the same gradsync version, strategy and model (or the message was corrupted)")


def payload_limit(numel: int) -> int:
    """The most bytes a compressed message for ``numel`` gradient elements may hold: 16 per element
    (a value and an int64 index, the largest any codec sends) plus 4 KiB of codec metadata."""
    return 16 * numel + 4096


RECHECK_S = 0.1
"""Past the deadline (:meth:`Transport.until_overdue`), how often a blocked collective asks again."""
REPORT_S = 0.3
"""A wait is ended this long before the timeout: the time to explain the error and for the launcher
to print it, so that the user reads it within the timeout of the fault."""


def gloo_timeout(timeout_s: float) -> timedelta:
    """The process groups' own timeout for a job timeout of ``timeout_s``: :data:`REPORT_S` shorter
    (at most half), so that an operation that waits it out (DDP's reducer, a communication
    thread's receive posted just before the fault) is reported within the timeout too."""
    return timedelta(seconds=timeout_s - min(REPORT_S, timeout_s / 2))


class Handle:
    """An operation in flight. ``wait()`` raises a :class:`PeerFailureError` that names the peer.

    A Gloo collective is waited on in chunks that end at the transport's deadline (the timeout after
    its last completed operation): there the ``overdue`` check may end the wait early, when a
    peer's heartbeat has stopped too (so the error comes within the timeout of the fault, not of
    the operation's start). A point-to-point wait cannot be resumed once interrupted (Gloo closes
    the pair): the training thread hands it to the transport's :class:`Waiter` and asks ``overdue``
    while it waits for the waiter's answer; other threads block until done or Gloo's own timeout."""

    __slots__ = ("_work", "_owner", "_what", "_done", "_trace", "_record", "_chunked", "ticket", "_local", "_landing")

    def __init__(self, work, owner: "Transport", what: str, trace_token=None,
                 record: flight.Record | None = None, *, chunked: bool = False, local: bool = False,
                 landing: tuple[torch.Tensor, torch.Tensor] | None = None):
        self._work = work
        self._owner = owner
        self._what = what
        self._done = False
        self._trace = trace_token  # a point-to-point operation's trace event, ended by wait()
        self._record = record  # its entry in this rank's flight record
        self._chunked = chunked
        self._local = local  # a send: it completes once buffered, which does not prove the peer alive
        self.ticket: list | None = None
        """Tickets of a point-to-point wait queued on the :class:`Waiter`, waited for in order (wait_all:
        the whole list's, then this operation's own)."""
        self._landing = landing
        """``(staged, tensor)``: the operation wrote a copy on the backend's device (:meth:`Transport.staged`),
        copied into the caller's tensor once done."""

    def _block(self, main: bool) -> None:
        work = self._work
        if not self._chunked:
            waiter = self._owner.waiter
            if main and waiter is not None:
                if self.ticket is None:
                    self.ticket = waiter.submit([work])[0]
                for ticket in self.ticket:
                    waiter.wait(ticket, self._owner, self._what)
            else:
                work.wait()
            return
        while True:
            try:
                work.wait(timeout=timedelta(seconds=max(RECHECK_S, self._owner.until_overdue())))
                return
            except RuntimeError:
                if work.is_completed():  # finished (or failed) meanwhile: its own outcome counts
                    work.wait()
                    return
            error = self._owner.overdue(self._what)
            if error is not None:
                raise error

    def wait(self, *, background: bool = False, quiet: bool = False) -> None:
        """Block until done. ``background``: a communication thread waits, not training (no wait
        span, and the flight record does not show the rank blocked in it). ``quiet``: Gloo's
        timeout is a quiet spell, no peer's fault (a server waiting for any request): it raises
        ``TimeoutError`` without explaining it or marking the transport failed."""
        if self._done:
            return
        tracer = trace.current()
        recorder = flight.current()
        main = not background and threading.get_ident() == _MAIN_THREAD
        token = recorder.block(self._record, main) if recorder is not None else None
        try:
            if tracer is None or background:
                self._block(main)
            else:
                with tracer.waiting(self._what):
                    self._block(main)
        except PeerFailureError:
            raise
        except RuntimeError as exc:
            if quiet and re.search("timed? ?out", str(exc), re.IGNORECASE):
                raise TimeoutError(str(exc)) from exc
            # Explained while still registered as waiting: the heartbeat keeps what it watched meanwhile.
            raise self._owner._explain(self._what, exc) from exc
        finally:
            if token is not None:
                recorder.unblock(token)
        self._done = True
        if self._landing is not None:
            staged, tensor = self._landing
            tensor.copy_(staged)
        if not self._local:
            self._owner.progress = time.monotonic()
        if self._record is not None:
            self._record.done = time.time()
        if self._trace is not None and tracer is not None:
            tracer.end_async(self._trace)

    def source_rank(self) -> int:
        """For a receive from any source: the rank the message came from."""
        return self._work._source_rank()


class Waiter:
    """One daemon thread that blocks in point-to-point waits for the training thread.

    Gloo's point-to-point ``wait(timeout)`` cannot be resumed once it times out (the pair is
    closed), so the training thread cannot wait in chunks as it does for collectives. Instead this
    thread calls the plain ``wait()`` and the training thread sleeps on the operation's event in
    chunks that end at the transport's deadline, asking ``overdue`` there: a stopped peer is named
    within the timeout of the fault, not of the receive's start. :func:`wait_all` hands over a whole
    list at once and sleeps until all of it is done (one thread switch per list, not per message:
    a parameter server's step waits on dozens). After such an error the thread stays blocked until
    Gloo's own timeout; the process is leaving by then."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, works: list) -> tuple[list[list], list]:
        """Queue ``works`` to be waited on in order: one ticket (``[event, error or None]``) each, and
        one for the whole list (set when the last is done or the first fails)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gradsync-p2p-waiter", daemon=True)
            self._thread.start()
        tickets, whole = [[threading.Event(), None] for _ in works], [threading.Event(), None]
        self._jobs.put((works, tickets, whole))
        return tickets, whole

    def wait(self, ticket: list, owner: "Transport", what: str) -> None:
        """Block until ``ticket``'s operation is done; raise its error, or ``owner.overdue``'s."""
        done = ticket[0]
        while not done.wait(max(RECHECK_S, owner.until_overdue())):
            error = owner.overdue(what)
            if error is not None:
                raise error
        if ticket[1] is not None:
            raise ticket[1]

    def close(self, wait_s: float = 1.0) -> None:
        """Let the thread end once its current wait (if any) is done; wait up to ``wait_s`` for it."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(wait_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            works, tickets, whole = job
            for work, ticket in zip(works, tickets):
                try:
                    work.wait()
                except BaseException as exc:  # noqa: BLE001 - handed to the training thread as is
                    ticket[1] = exc
                    whole[0].set()
                ticket[0].set()
            whole[0].set()


class Transport:
    """Collectives and point-to-point messages over the job's process groups."""

    def __init__(self, topology: Topology, worker_group, device: torch.device,
                 explain: Callable[[str, BaseException], Exception] | None = None, timeout_s: float = 30.0,
                 overdue: Callable[[str], Exception | None] | None = None):
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
        self.waiter = Waiter() if self._chunked else None
        """Where the training thread's point-to-point waits block (Gloo only; :class:`Waiter`)."""

    def until_overdue(self) -> float:
        """Seconds until the timeout, less :data:`REPORT_S`, has passed since this rank's last
        completed operation."""
        return self.progress + self.timeout.total_seconds() - REPORT_S - time.monotonic()

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

    def free_group(self, group) -> None:
        """Release a group from :meth:`new_worker_group` (on a rank outside it, nothing to do)."""
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)

    def allreduce_async(self, tensor: torch.Tensor, *, op: str = "sum", world: bool = False,
                        what: str = "all-reduce", group=None) -> Handle:
        """In-place all-reduce among the workers (or every rank with ``world=True``, or ``group``)."""
        p = self._group_size(world)
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
                   counted: bool = True) -> Handle:
        """Send ``tensor`` to ``dst`` on ``tag``. ``counted=False``: traffic that is not part of a
        training step (hybrid's whole-table flush) stays out of ``bytes_sent``."""
        nbytes = tensor.numel() * tensor.element_size()
        if counted:
            self.bytes_sent += nbytes
        tracer = trace.current()
        token = None if tracer is None else tracer.begin_async(what, "comm", bytes=nbytes, op="send", peer=dst)
        record = self._record(what, "send", nbytes, peer=dst)
        staged = self.staged(tensor)  # the work holds it until sent
        work = self._issue(what, lambda: dist.group.WORLD.send([staged], dst, tag))
        return Handle(work, self, what, token, record, local=True)

    def recv_async(self, tensor: torch.Tensor, src: Optional[int], tag: int, *,
                   what: str = "receive", traced: bool = True) -> Handle:
        """Receive into ``tensor`` from ``src`` (``None``: from whichever rank sends first).

        ``traced=False``: a receive posted ahead of its message, whose caller traces the arrival itself.
        """
        world = dist.group.WORLD
        staged = self.staged(tensor)
        work = self._issue(what, lambda: world.recv_anysource([staged], tag) if src is None
                           else world.recv([staged], src, tag))
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
        self.bytes_sent += (self.topology.num_workers - 1) * message.numel()
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


def wait_all(handles) -> None:
    """Wait for every handle, in order. The training thread queues all point-to-point waits on the
    transport's :class:`Waiter` at once."""
    handles = list(handles)
    if len(handles) > 1 and threading.get_ident() == _MAIN_THREAD:
        waiter = handles[0]._owner.waiter
        pending = [h for h in handles if not h._done and not h._chunked and h.ticket is None]
        if waiter is not None and len(pending) > 1:
            tickets, whole = waiter.submit([h._work for h in pending])
            for handle, ticket in zip(pending, tickets):
                handle.ticket = [ticket]
            pending[0].ticket.insert(0, whole)
    for handle in handles:
        handle.wait()


# -- collectives on a plain process group (for code that runs inside PyTorch's DDP, no Transport) --
def group_rank_and_size(group=None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    """The job-wide rank of ``group``'s rank ``rank`` (``group`` None: the whole job)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def allreduce_sum_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` (default: the whole job)."""
    dist.all_reduce(tensor, group=group)
    return tensor


def allreduce_sum_async(tensor: torch.Tensor, group=None) -> torch.futures.Future:
    """Start summing ``tensor`` in place over ``group``: a future that completes with the collective."""
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def allgather_bytes(message: torch.Tensor, group=None, *, limit: int,
                    what: str = "all-gather") -> list[torch.Tensor]:
    """Every rank's ``uint8`` message, each at most ``limit`` bytes (lengths first, checked, then one
    padded all-gather)."""
    return allgather_with_info(message, (0, 0, 0), group, limit=limit, what=what)[0]


def allgather_with_info(message: torch.Tensor, info: tuple[int, int, int], group=None, *, limit: int,
                        what: str = "all-gather") -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
    """:func:`allgather_bytes`, and three words of ``info`` from every rank (as in :meth:`Transport.send_bytes`)."""
    size = dist.get_world_size(group)
    header = torch.tensor([message.numel(), *info], dtype=torch.int64, device=message.device)
    headers = [torch.empty_like(header) for _ in range(size)]
    dist.all_gather(headers, header, group=group)
    rows = [h.tolist() for h in headers]
    for r, row in enumerate(rows):
        check_peer(0 <= row[0] <= limit, global_rank(group, r), what,
                   f"a length of {row[0]} bytes (at most {limit} expected)")
    longest = max(1, max(row[0] for row in rows))
    padded = torch.zeros(longest, dtype=torch.uint8, device=message.device)
    padded[: message.numel()] = message
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [g[: row[0]] for g, row in zip(gathered, rows)], [tuple(row[1:]) for row in rows]
