"""How a rank's runtime comes down: at ``gradsync.shutdown()``, at exit, and after a peer failure.

:func:`gradsync.runtime.shutdown` runs these steps on the current runtime: :func:`close` (the
strategies' closers, the goodbye to the store), :func:`stop_threads` (the heartbeat, the flight
responder, the waiter, a watchdog), :func:`leave_group`. A rank going down with an error of its own
(:func:`abandon`) runs no closer; after a peer failure the group is left as it is, and at exit
:func:`exit_after_failure` ends a process whose threads are still blocked in it.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable

import torch.distributed as dist

from gradsync import flight

_FAILED_AT_SHUTDOWN = False
"""Whether the last :func:`leave_group` found the process group broken by a peer failure."""
_LEFT_BEHIND: list[threading.Thread] = []
_LEFT_UNTIL = 0.0
"""Threads of groups left after a peer failure (:func:`left_behind`), and when the last ends at the latest."""
_RELEASED: list[weakref.ref] = []
"""Transports let go of (:func:`collect_before_forks`) that may not be freed yet."""
_HOOKED = False


def abandon(runtime, error: BaseException) -> None:
    """``runtime``'s rank is going down with ``error`` (uncaught in the script): :func:`close` then
    runs no closer (a strategy's flush or goodbye would wait on peers that wait on this rank) and,
    on the rank that serves the store, keeps it up while the others name this rank."""
    if runtime is not None and not isinstance(error, (KeyboardInterrupt, SystemExit)):
        runtime.abandoned = error


def close(runtime) -> BaseException | None:
    """Run ``runtime``'s closers, last registered first, each even if one raises (unless the rank
    is abandoned: none), then take leave of the store: a rank that does not serve it says it left,
    unless it failed (abandoned, a closer raised, or the group broke: its peers must name it); the
    one that serves it keeps it up for the ranks still running (after a failure, until their
    heartbeats stop: they may still be naming the failed rank). Returns the first closer's error."""
    error: BaseException | None = None
    abandoned = getattr(runtime, "abandoned", None) is not None
    while runtime.closers and not abandoned:
        try:
            runtime.closers.pop()()
        except BaseException as exc:  # noqa: BLE001 - the rest must still close; the caller raises it
            error = error or exc
    # A strategy that failed to close (a peer out of step) may leave peers waiting on this rank's
    # goodbye: it leaves as a failed rank does, never waiting on them.
    failed = (abandoned or error is not None
              or (runtime.transport is not None and runtime.transport.failure is not None))
    if runtime.heartbeat is not None:
        if not runtime.hosts_store:
            if not failed:  # a rank going down with an error is a fault its peers must name
                runtime.heartbeat.say_left()
        elif failed:
            runtime.heartbeat.wait_for_peers()  # they may still be naming the failed rank: keep the store up
        else:  # ranks still training need the store
            with flight.waiting("shutdown (serving the rendezvous store to the ranks still running)"):
                runtime.heartbeat.wait_for_leavers()
    return error


def stop_threads(runtime) -> None:
    """Stop ``runtime``'s threads: its stoppers (a watchdog's), the heartbeat, the flight responder,
    the transport's waiter (at once where the group failed: it is blocked for good) and its
    two-level all-reduce's threads."""
    stoppers = getattr(runtime, "stoppers", [])
    while stoppers:
        stoppers.pop()()
    if runtime.heartbeat:
        runtime.heartbeat.stop(**({"wait_s": 0.5} if runtime.store_lost else {}))
    if runtime.responder:
        runtime.responder.stop()
    transport = runtime.transport
    if transport is not None and transport.waiter is not None:  # blocked for good after a failure: no wait
        transport.waiter.close(wait_s=0.0 if transport.failure is not None else 1.0)
    two_level = getattr(transport, "two_level", None)
    if two_level is not None and transport.failure is None:
        two_level.close()


def collect_before_forks(transport) -> None:
    """``transport``'s runtime was left (an elastic regroup) or shut down. The runtime, its transport
    and its strategies refer to each other (bound methods, threads, a failure's traceback), so once
    the script lets go of them they are garbage for a while, holding process groups whose Gloo
    threads run until the groups are freed (``dist.destroy_process_group`` does not stop them).
    Whatever process collects that garbage first runs the groups' destructors: in a child forked
    meanwhile (a DataLoader's worker) they wait for threads the child does not have, and it hangs
    or crashes. So until ``transport`` is freed, every fork of this process first runs a full
    collection here, in the parent (0.01-0.12 s each, as measured here; after a regroup, usually the first fork
    alone: nothing else holds the old generation)."""
    global _HOOKED
    try:
        _RELEASED.append(weakref.ref(transport))
    except TypeError:  # None (a runtime that never formed), or a stand-in without weak references
        return
    if not _HOOKED:
        os.register_at_fork(before=_collect_if_released)
        _HOOKED = True


def _collect_if_released() -> None:
    if any(ref() is not None for ref in _RELEASED):
        gc.collect()
    _RELEASED[:] = [ref for ref in _RELEASED if ref() is not None]


def left_behind(timeout_s: float) -> None:
    """A group broken by a peer failure was left and this process goes on (an elastic job's
    survivor): its threads still blocked in a receive that no peer will answer (a Gloo receive
    cannot be cancelled) end at the group's timeout, at most ``timeout_s`` from now. Remember
    them: :func:`leave_group` waits for them at shutdown, since one returning while the
    interpreter finalizes would abort the process."""
    global _LEFT_UNTIL
    me = threading.current_thread()
    _LEFT_BEHIND.extend(t for t in threading.enumerate() if t.name.startswith("gradsync") and t.is_alive()
                        and t is not me and t not in _LEFT_BEHIND)
    _LEFT_UNTIL = max(_LEFT_UNTIL, time.monotonic() + timeout_s)


def _wait_left_behind() -> None:
    """Wait for the threads :func:`left_behind` remembered, until their group's timeout."""
    alive = [t for t in _LEFT_BEHIND if t.is_alive()]
    if alive:
        left = _LEFT_UNTIL - time.monotonic()
        print(f"gradsync: waiting up to {max(left, 0):.0f} s for {len(alive)} thread(s) blocked in the process group "
              "that a failed peer broke (their receives end at its timeout)", file=sys.stderr, flush=True)
        for thread in alive:
            thread.join(max(0.0, _LEFT_UNTIL - time.monotonic()))
    _LEFT_BEHIND.clear()


def leave_group(runtime) -> None:
    """Destroy ``runtime``'s process group where it owns it, unless a peer failure broke it (a
    thread may still be blocked in it: :func:`exit_after_failure`), and then warn of any gradsync
    thread still running."""
    global _FAILED_AT_SHUTDOWN
    failed = runtime.transport is not None and runtime.transport.failure is not None
    if runtime.owns_group and dist.is_initialized() and not failed:
        dist.destroy_process_group()
    if not failed:
        _wait_left_behind()
        warn_live_threads(runtime.store_lost, stacklevel=4)  # at the caller of gradsync.shutdown()
    _FAILED_AT_SHUTDOWN = failed


def warn_live_threads(store_lost: bool, stacklevel: int) -> None:
    """Say which gradsync thread is still running after shutdown: one blocked in a torch call when
    the interpreter finalizes would abort the process at exit, so this is a bug worth reporting.
    Not the heartbeat's, when the store's host stopped answering: that call never returns.
    ``stacklevel``: :func:`warnings.warn`'s, the frame the warning names."""
    expected = ("gradsync-heartbeat", "gradsync-store-call") if store_lost else ()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("gradsync") and t.name not in expected
             and t.is_alive() and t is not threading.current_thread()]
    if alive:
        warnings.warn(f"gradsync threads still running after shutdown: {', '.join(alive)}; the process may "
                      "abort at exit. Please report this with the strategy used", RuntimeWarning, stacklevel=stacklevel)


def at_exit(shutdown: Callable[[], None]) -> None:
    """``atexit``: ``shutdown()``, then :func:`exit_after_failure`; an error of ``shutdown`` is
    printed first (atexit would print it only after the interpreter's own exit, which may not come)."""
    try:
        shutdown()
    except BaseException as exc:
        print(f"gradsync: while shutting down: {type(exc).__name__}: {exc}", file=sys.stderr)
        exit_after_failure()
        raise
    exit_after_failure()


def exit_after_failure() -> None:
    """After a peer failure, end the process here rather than let the interpreter finalize while a
    gradsync thread is still blocked in a torch call on the broken group (a receive from a peer
    whose link is down returns only at the operation timeout). Such a thread returning during
    finalization is ended by ``pthread_exit``, which aborts the process (SIGABRT,
    pytorch/pytorch#38228) and hides the job's exit status. The error is already printed: flush
    the standard streams and the logging handlers and exit with status 1."""
    recorder = flight.current()
    if not _FAILED_AT_SHUTDOWN or recorder is None:
        return
    me = threading.get_ident()
    if not any(ident != me for ident in list(recorder.blocked)):
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    os._exit(1)
