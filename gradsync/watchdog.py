"""The watchdog: ends a rank whose training thread is blocked where no exception can reach it.

gradsync's own waits end within the timeout of a fault (:meth:`gradsync.runtime.Runtime.overdue`,
asked by the waiting thread). PyTorch's DDP reducer waits for its buckets in C++, with Gloo's
timeout counted from each operation's start, and cannot be interrupted: a peer that stops just
before the survivors' next all-reduce is named only a whole timeout after that all-reduce began.

A strategy whose waits live in such code tells the watchdog when its training thread enters a
window that may block (:meth:`Watchdog.enter`, e.g. a forward) and when it left it
(:meth:`Watchdog.leave`); its completed operations mark the transport's progress as any other
(``Transport.count_external``). While a window is open, a daemon thread asks
``Runtime.overdue`` at the transport's deadline; when it answers with an error (nothing completed
for the timeout, less the time to report, and the heartbeat saw a peer stand still) the watchdog
prints the error, dumps the flight record, and ends the process with status 1, as PyTorch's NCCL
watchdog tears down a process whose collective hung. Outside a window (evaluation, checkpointing,
the end of training) it never acts. In an elastic job the launcher's word that a member is gone
ends gradsync's own waits at once, but not the window: PyTorch's call fails on its own there (the
lost member's connections reset), and the watchdog acts only once the timeout has passed.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from gradsync import flight, runtime
from gradsync.transport import RECHECK_S, REPORT_S

IDLE_S = 0.5
"""How often the watchdog looks again while no window is open."""


def _end_process(error: BaseException) -> None:
    """Print ``error`` and end the process with status 1 (the training thread cannot be reached)."""
    print(f"gradsync: {type(error).__name__}: {error}. This rank's training thread is blocked inside "
          "PyTorch, where no exception can reach it: gradsync's watchdog ends the process",
          file=sys.stderr, flush=True)
    current = runtime._RUNTIME
    if current is not None and current.hosts_store and current.heartbeat is not None:
        current.heartbeat.wait_for_peers()  # the others may still be naming the failed rank
    sys.stdout.flush()
    os._exit(1)


class Watchdog:
    """Watches the windows a strategy opens; :func:`_end_process` when one is overdue.

    ``what`` names the operation in the error ("DDP's all-reduce"). The thread starts at the first
    :meth:`enter` and stops at :meth:`close`."""

    def __init__(self, what: str):
        self.what = what
        self.open = False
        self._closed = False
        self._wake = threading.Event()  # set by enter and close: look again now
        self._idle = False  # the thread sleeps IDLE_S, not until the deadline
        self._thread: threading.Thread | None = None
        self._token: tuple | None = None  # the flight record's wait while a window is open

    def enter(self) -> None:
        """The training thread may block from now on (the flight record shows it waiting in
        ``what``: its peers' heartbeats then do not take it for a rank stuck in its own code)."""
        self.record()
        self.open = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="gradsync-watchdog", daemon=True)
            self._thread.start()
            runtime.on_stop(self.close)  # also when the rank goes down with an error (no closer runs)
        elif self._idle:
            self._wake.set()  # a window opened long after the last progress may be overdue at once

    def record(self) -> None:
        """Show the training thread waiting in ``what`` in the flight record (from the window's start,
        and again from backward's start after :meth:`pause`)."""
        recorder = flight.current()
        if self._token is None and recorder is not None:
            self._token = recorder.block(recorder.issue(self.what, "wait", 0), True, timed=False)

    def pause(self) -> None:
        """The window stays open, but the training thread runs the script's own code (between a
        forward and its backward: the loss, a micro-batch's loading)."""
        token, self._token = self._token, None
        recorder = flight.current()
        if token is not None and recorder is not None:
            token[1].done = time.time()
            recorder.unblock(token)

    def leave(self) -> None:
        """The training thread no longer waits on its peers."""
        self.open = False
        self.pause()

    def close(self) -> None:
        """Stop the thread (it is gone when this returns: no gradsync thread outlives shutdown)."""
        self.leave()
        self._closed = True
        self._wake.set()
        stoppers = getattr(runtime._RUNTIME, "stoppers", [])
        if self.close in stoppers:
            stoppers.remove(self.close)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=IDLE_S + 1.0)

    def _next_look(self) -> float:
        current = runtime._RUNTIME
        self._idle = not self.open or current is None or current.transport is None
        return IDLE_S if self._idle else max(RECHECK_S, current.transport.until_overdue())

    def _watch(self) -> None:
        while True:
            self._wake.wait(self._next_look())
            self._wake.clear()
            current = runtime._RUNTIME
            if self._closed:
                return
            if not self.open or current is None:
                continue
            if current.peer_lost and current.transport is not None and current.transport.until_overdue() > -REPORT_S:
                # The launcher's word that a member is gone: the call inside PyTorch fails on its own
                # (a connection reset at once, else Gloo's timeout), and the rank regroups. Only a
                # call still blocked past the timeout ends the process: a survivor ended here would
                # leave its job a member short.
                continue
            error = current.overdue(self.what)
            if error is not None and self.open:
                _end_process(error)
