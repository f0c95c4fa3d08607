"""Naming the rank at fault: a failed operation, a wait past its deadline, an error raised inside PyTorch.

Every rank runs a heartbeat thread (:mod:`gradsync.heartbeat`) that bumps a counter in the
rendezvous store once a second. When an operation fails, the rank names the ranks whose counter
stopped: "worker 1 (rank 1) stopped responding" instead of Gloo's "Connection reset by peer"; or,
where every counter moves, the ranks alive but absent from the operation, in their own code.
:class:`PeerDiagnosis` holds the rules; :class:`gradsync.runtime.Runtime` is the state it reads.
"""
from __future__ import annotations

import re
import sys
import time

from gradsync import flight
from gradsync.errors import GradsyncError, PeerFailureError
from gradsync.heartbeat import SILENT_S, Heartbeat
from gradsync.topology import Topology
from gradsync.transport import REPORT_S, Transport

PEER_TROUBLE = re.compile(r"gloo|nccl|c10d|connection (reset|closed|refused)|timed out", re.IGNORECASE)
"""An error from PyTorch's own communication, as its messages say it."""


class PeerDiagnosis:
    """The failure diagnosis of a rank's runtime (mixed into :class:`gradsync.runtime.Runtime`):
    it reads the fields below and marks ``store_lost`` when the store stops answering."""

    topology: Topology
    transport: Transport | None
    timeout_s: float
    heartbeat: Heartbeat | None
    store_lost: bool
    elastic: object
    peer_lost: str | None

    def explain(self, what: str, exc: BaseException) -> PeerFailureError:
        """Turn a failed communication into an error naming the rank(s) at fault: the ones whose
        heartbeat stopped, else the ones alive but absent from the operation (:meth:`behind`)."""
        me = self.topology.describe(self.topology.rank)
        # Gloo's "Application timeout caused pair closure": this rank's own operation on that pair
        # timed out earlier (the pair closed then), so the peer is no more at fault than any other
        message = str(exc).lower()
        timed_out = isinstance(exc, TimeoutError) or "timed out" in message or "application timeout" in message
        lost = self._lost_notice(0.0 if timed_out else SILENT_S)  # after a timeout it would have come
        if lost:
            return self._failed(PeerFailureError(f"{what} failed on {me}: {lost}. Original error: {exc}"))
        silent = self.heartbeat.silent_ranks(fresh=not timed_out) if self.heartbeat else []
        if silent:  # a rank that shut down cleanly (no barrier at the end: ps-async) is no fault
            gone = self.heartbeat.left(silent)
            silent = [r for r in silent if r not in gone]
        behind = self.behind() if timed_out and silent == [] else []
        if silent is None:
            self.store_lost = True
            cause = ("rank 0, which hosts the rendezvous store, is unreachable "
                     f"(it has probably exited, crashed or been stopped; or {me}'s own network link is down)")
            # the store's host may have ended on an earlier failure (a rank it waited for died):
            # what this rank's heartbeat saw stand still before the store went away came first
            earlier = [r for r in (self.heartbeat.watched_silent() if self.heartbeat else []) if r != self.topology.rank]
            if earlier:
                cause = (", ".join(self.topology.describe(r) for r in earlier) + " stopped responding first "
                         "(its heartbeat stood still while this rank waited), then " + cause)
        elif silent:
            cause = ", ".join(self.topology.describe(r) for r in silent) + " stopped responding"
            if len(silent) >= 2 and len(silent) == self.topology.world_size - 1:
                cause += (f" (every peer fell silent at once: {me}'s own network link or host is the likely "
                          "cause, not the peers)")
        elif behind:
            cause = "; ".join(
                f"{self.topology.describe(r)} is alive but has not reached this operation: it has been in its own "
                f"code (not in a gradsync operation) for {seconds:.1f} s at step {step}" for r, step, seconds in behind)
            cause += (" (a stuck data loader, an evaluation or a checkpoint on one rank only, a deadlock?). "
                      f"Every rank waits for it; the timeout is {self.timeout_s:g} s (raise it with "
                      "gradsync.init(timeout_s=...) or GRADSYNC_TIMEOUT if that rank's work legitimately takes longer)")
        else:
            cause = (f"no peer died; the operation did not complete within {self.timeout_s:g} s. "
                     "Either ranks issued different operations (different models, step counts or "
                     "strategies) or a step takes longer than the timeout (raise it with "
                     "gradsync.init(timeout_s=...) or GRADSYNC_TIMEOUT)")
        return self._failed(PeerFailureError(f"{what} failed on {me}: {cause}. Original error: {exc}"))

    def _failed(self, error: PeerFailureError) -> PeerFailureError:
        """Mark the transport failed with ``error`` and dump the flight record."""
        if self.transport is not None:
            self.transport.failure = error
        recorder = flight.current()
        if recorder is not None:  # for the launcher's cross-rank summary (gradsync.flight)
            recorder.dump(str(error))
        return error

    def _lost_notice(self, within_s: float) -> str | None:
        """In an elastic job, the launcher's word that a member is gone (``peer_lost``, set by the
        membership's watch): waited for up to ``within_s`` after an operation failed at once (a
        connection reset), since the launcher sees a worker's process end sooner than its
        heartbeat's silence shows."""
        if self.elastic is None:
            return None
        deadline = time.monotonic() + within_s
        while not self.peer_lost and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.peer_lost

    def behind(self) -> list[tuple[int, int, float]]:
        """The workers alive but absent from synchronization, as their heartbeats last published
        it: ``(rank, step, seconds)`` for each whose training thread has run the script's own code,
        outside every gradsync operation, for at least half the timeout (a rank merely computing a
        step shorter than the timeout is never named). Servers are never behind: they only serve; nor
        is a rank whose training thread is not known (a loop on a thread other than the main one)."""
        if self.heartbeat is None:
            return []
        positions = self.heartbeat.positions()
        workers = set(self.topology.worker_ranks)
        return sorted((r, step, seconds) for r, (step, waiting, seconds) in positions.items()
                      if r in workers and waiting is False and seconds >= self.timeout_s / 2)

    def overdue(self, what: str, since: float | None = None) -> PeerFailureError | None:
        """The error to end a wait with now, or None to go on waiting.

        A wait ends early when nothing this rank waited on has completed for the timeout (less the
        :data:`~gradsync.transport.REPORT_S` it takes to say so; a send's completion does not count:
        it proves only that the message was buffered) and the heartbeat watch has seen a peer stand
        still (:meth:`Heartbeat.watched_silent`), or the store has stopped answering its beats (its
        host, rank 0, is stopped or cut off, and the watch sees nothing): that peer has been
        unreachable since about the last completion, so the error comes within the timeout of the
        fault even for an operation issued after it (Gloo's own timeout counts from the
        operation's start). A link that comes back within the timeout is survived: operations
        complete meanwhile, or the heartbeat moves.

        ``since``: a training thread that waits on its strategy's communication threads (which
        no Gloo timeout ends: their other traffic, keep-alives included, keeps completing) passes
        when what it waits for last arrived (or its wait began). That wait ends at the timeout
        after it, whatever else completed, naming the ranks that hold it back (:meth:`explain`)."""
        heartbeat, transport = self.heartbeat, self.transport
        if transport is None:
            return None
        if self.peer_lost:  # every wait ends, a communication thread's too: the job regroups without it
            if transport.failure is not None:
                return PeerFailureError(str(transport.failure))
            me = self.topology.describe(self.topology.rank)
            return self._failed(PeerFailureError(f"{what} failed on {me}: {self.peer_lost}"))
        if transport.failure is not None:
            return None
        now, limit = time.monotonic(), self.timeout_s - REPORT_S
        idle_s = now - transport.progress
        if heartbeat is not None and idle_s >= limit:
            silent = heartbeat.watched_silent()
            silent = [r for r in silent if r not in heartbeat.left(silent)]
            if not silent and heartbeat.store_lost():  # the store's host stopped: the watch sees nothing
                return self.explain(what, TimeoutError(
                    f"nothing completed for {idle_s:.1f} s (the timeout is {self.timeout_s:g} s) while the "
                    "rendezvous store did not answer"))
            if silent:
                who = ", ".join(self.topology.describe(r) for r in silent)
                return self.explain(what, TimeoutError(
                    f"nothing completed for {idle_s:.1f} s (the timeout is {self.timeout_s:g} s) while {who} "
                    "stayed silent"))
        if since is None or now - since < limit:
            return None
        return self.explain(what, TimeoutError(
            f"nothing this wait needs arrived for {now - since:.1f} s (the timeout is {self.timeout_s:g} s)"))


def explain_uncaught(runtime: PeerDiagnosis | None, error: BaseException) -> None:
    """For an error about to leave the script uncaught: a communication failure raised inside
    PyTorch (DDP's reducer, a user's own collective) never passed through gradsync; say on stderr
    which peer went silent, as gradsync's own operations do. Never raises."""
    if (runtime is not None and isinstance(error, RuntimeError) and not isinstance(error, GradsyncError)
            and PEER_TROUBLE.search(str(error))):
        try:
            explained = runtime.explain("a collective inside PyTorch (DDP's all-reduce, or the script's own)", error)
            print(f"gradsync: {str(explained).split('. Original error')[0]}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - the diagnosis must never hide the original error
            pass
