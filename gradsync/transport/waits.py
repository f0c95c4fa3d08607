"""Waits that end within the timeout of a fault, however long the operation itself may block.

Gloo times an operation from its start, so a wait for an operation issued after a peer died would
otherwise end a whole timeout after that start, not after the fault. Here every wait ends at the
transport's deadline instead (the timeout after this rank's last completed operation, less
:data:`REPORT_S`), where the transport's ``overdue`` check decides whether a peer stopped: a
collective is waited on in chunks (:class:`Handle`), a point-to-point wait of the training thread
is handed to a thread that blocks in it (:class:`Waiter`, :func:`wait_all`), since Gloo cannot
resume one once interrupted.

``owner`` below is the :class:`~gradsync.transport.Transport` that issued the operation: its
``until_overdue()``, ``overdue(what)``, ``progress``, ``waiter`` and ``_explain``.
"""
from __future__ import annotations

import queue
import re
import threading
import time
from datetime import timedelta

import torch

from gradsync import flight, trace
from gradsync.errors import PeerFailureError

_MAIN_THREAD = threading.main_thread().ident

RECHECK_S = 0.1
"""Past the deadline (``Transport.until_overdue``), how often a blocked collective asks again."""
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

    def __init__(self, work, owner, what: str, trace_token=None,
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
        """``(staged, tensor)``: the operation wrote a copy on the backend's device
        (:meth:`~gradsync.transport.Transport.staged`), copied into the caller's tensor once done."""

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
                work.wait(timeout=timedelta(seconds=self._owner.next_check()))
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


class JobThread:
    """A daemon thread, started with the first job, that runs ``handle(job)`` for each job put, in
    order; :class:`Waiter` and :class:`~gradsync.transport.twolevel.TwoLevel` each have one."""

    def __init__(self, name: str, handle):
        self._name, self._handle = name, handle
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def close(self, wait_s: float = 1.0) -> None:
        """Let the thread end once the jobs put so far are done; wait up to ``wait_s`` for it."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(wait_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._handle(job)


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
        self._thread = JobThread("gradsync-p2p-waiter", self._wait_out)

    def submit(self, works: list) -> tuple[list[list], list]:
        """Queue ``works`` to be waited on in order: one ticket (``[event, error or None]``) each, and
        one for the whole list (set when the last is done or the first fails)."""
        tickets, whole = [[threading.Event(), None] for _ in works], [threading.Event(), None]
        self._thread.put((works, tickets, whole))
        return tickets, whole

    def wait(self, ticket: list, owner, what: str) -> None:
        """Block until ``ticket``'s operation is done; raise its error, or ``owner.overdue``'s."""
        done = ticket[0]
        while not done.wait(owner.next_check()):
            error = owner.overdue(what)
            if error is not None:
                raise error
        if ticket[1] is not None:
            raise ticket[1]

    def close(self, wait_s: float = 1.0) -> None:
        """Let the thread end once its current wait (if any) is done; wait up to ``wait_s`` for it."""
        self._thread.close(wait_s)

    @staticmethod
    def _wait_out(job) -> None:
        works, tickets, whole = job
        for work, ticket in zip(works, tickets):
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread as is
                ticket[1] = exc
                whole[0].set()
            ticket[0].set()
        whole[0].set()


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

