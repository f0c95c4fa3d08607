"""Priority scheduling of outgoing messages with credit (P3's sender queue, ByteScheduler's credit).

A :class:`PrioritySender` owns one background thread that hands messages to the transport,
lowest priority first (a number, or any key that compares, such as ``p3``'s ``(step, position)``),
while at most ``credit_bytes`` are in flight; a second thread waits for sends to finish and returns
their credit. A message that becomes ready while others
wait in the queue therefore overtakes every queued message of lower priority, at message
granularity (Jayarajan et al., SysML 2019; Peng et al., SOSP 2019). Equal priorities leave in the
order they were put. ``credit_bytes=None`` sends everything at once, in the order put (FIFO).

Bounding what the sender has handed to the transport is what makes preemption work: what was
handed over is in the network stack's queues, where nothing can overtake it. A message larger
than the credit still goes, alone.

Credit comes back per destination: one waiting thread per peer, each in the order that peer's
messages were sent. A Gloo send completes only once the receiver has posted a matching receive,
so with a single waiting thread one busy receiver held back the credit of messages already
delivered to the others, and every link waited for the slowest peer.

Errors in either thread are kept and re-raised by :meth:`check` (and :meth:`drain`), so the
training thread reports them with the rank they name instead of hanging.

``counted=False``: the sends stay out of ``Transport.bytes_sent`` (messages inside a host, which
do not cross the network).

``idle=(seconds, callback)``: after that long with nothing queued or in flight, the sending thread
calls ``callback()`` (which may put messages): the keep-alives that stop a peer's posted receive
from timing out while training pauses between steps (an evaluation pass, a checkpoint).
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from typing import Callable

import torch

from gradsync import runtime
from gradsync.transport import Transport


class PrioritySender:
    """Send ``(priority, tensor, dst, tag)`` messages by priority under a credit (see module docstring)."""

    def __init__(self, transport: Transport, credit_bytes: int | None, name: str = "gradsync-sender",
                 idle: tuple[float, Callable[[], None]] | None = None, counted: bool = True):
        self.transport = transport
        self.counted = counted
        self.credit = credit_bytes
        self._idle_s, self._on_idle = idle if idle is not None else (None, None)
        self.name = name
        self._queue: list = []
        self._inflight: dict[int, deque] = {}  # destination -> sends not yet completed, oldest first
        self._inflight_bytes = 0
        self._sending = 0  # messages taken off the queue and not yet completed
        self._order = itertools.count()
        # One lock; the issuing thread and drain() wait on _cv, each destination's waiting thread on
        # its own condition, so that an event wakes only the threads it concerns (thousands a step).
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._reap_cv: dict[int, threading.Condition] = {}
        self._stopping = False
        self.sent_at = time.monotonic()  # when a send last completed
        self.error: BaseException | None = None
        self._threads = [threading.Thread(target=self._guard, args=(self._issue,), name=f"{name}-issue", daemon=True)]
        self._threads[0].start()

    def put(self, priority, tensor: torch.Tensor, dst: int, tag: int, what: str,
            on_sent: Callable[[], None] | None = None) -> None:
        """Queue ``tensor`` for ``dst``; ``on_sent`` runs (on the sender's thread) once it has left."""
        self.check()
        nbytes = tensor.numel() * tensor.element_size()
        with self._cv:
            heapq.heappush(self._queue, (priority, next(self._order), tensor, dst, tag, what, nbytes, on_sent))
            self._cv.notify_all()

    def drain(self) -> None:
        """Block until every queued message has been sent (progress: a send completing)."""
        with self._cv:
            if (self._queue or self._busy()) and self.error is None:
                began = time.monotonic()
                runtime.wait_until(self._cv, lambda: not (self._queue or self._busy()) or self.error is not None,
                                   "wait for queued messages to leave", lambda: max(began, self.sent_at))
        self.check()

    def close(self) -> None:
        self.drain()
        with self._cv:
            self._stopping = True
            self._wake_all()
        for thread in self._threads:
            thread.join()

    def abandon(self) -> None:
        """Stop at once, sending nothing more (a peer failed): the issuing thread ends; a thread
        waiting for a send ends when that send does (the process group going away ends it)."""
        with self._cv:
            self._stopping = True
            self._queue.clear()
            self._wake_all()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    # -- threads -------------------------------------------------------------------------------
    def _guard(self, loop: Callable[..., None], *args) -> None:
        try:
            loop(*args)
        except BaseException as exc:  # kept for the training thread, which raises it
            with self._cv:
                self.error = exc
                self._wake_all()

    def _wake_all(self) -> None:
        """Every waiting thread (called holding the lock): stopping, or an error."""
        self._cv.notify_all()
        for cv in self._reap_cv.values():
            cv.notify_all()

    def _may_send(self) -> bool:
        if not self._queue:
            return False
        return self.credit is None or not self._inflight_bytes or self._inflight_bytes + self._queue[0][6] <= self.credit

    def _busy(self) -> bool:
        return self._sending > 0

    def _issue(self) -> None:
        while True:
            with self._cv:
                idle = False
                while not self._may_send() and not self._stopping and self.error is None and not idle:
                    idle = not self._cv.wait(self._idle_s) and not self._queue and not self._busy()
                if self._stopping or self.error is not None:
                    return
                if not idle:
                    _, _, tensor, dst, tag, what, nbytes, on_sent = heapq.heappop(self._queue)
                    self._inflight_bytes += nbytes
                    self._sending += 1
            if idle:
                self._on_idle()
                continue
            handle = self.transport.send_async(tensor, dst, tag, what=what, counted=self.counted)
            with self._cv:
                pending = self._inflight.get(dst)
                if pending is None:  # first message to this peer: its own waiting thread
                    pending = self._inflight[dst] = deque()
                    self._reap_cv[dst] = threading.Condition(self._lock)
                    thread = threading.Thread(target=self._guard, args=(self._reap, dst),
                                              name=f"{self.name}-reap-{dst}", daemon=True)
                    self._threads.append(thread)
                    thread.start()
                pending.append((handle, nbytes, on_sent))
                self._reap_cv[dst].notify()

    def _reap(self, dst: int) -> None:
        """Wait for the sends to ``dst`` in order, returning each one's credit as it completes."""
        pending, cv = self._inflight[dst], self._reap_cv[dst]
        while True:
            with cv:
                while not pending and not self._stopping and self.error is None:
                    cv.wait()
                if not pending:
                    return
                handle, nbytes, on_sent = pending[0]
            handle.wait(background=True)
            if on_sent is not None:
                on_sent()
            with self._cv:
                pending.popleft()
                self.sent_at = time.monotonic()
                self._inflight_bytes -= nbytes
                self._sending -= 1
                self._cv.notify_all()
