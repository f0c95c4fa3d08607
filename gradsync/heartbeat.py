"""The heartbeat: every rank bumps a counter in the rendezvous store once a second, on a thread and a
store connection of its own, and reads its peers' counters to name the ones that stopped. With each
beat it also publishes where its training thread is (the step, and whether it waits in a gradsync
operation or runs the script's own code, for how long), so that a rank alive but absent from an
operation (a stuck data loader, an evaluation on one rank) is named too (:meth:`Heartbeat.positions`).

In a job of up to :data:`WATCH_ALL_MAX` ranks the heartbeat also reads every peer's counter each
beat, so it always knows since when each peer has been silent: when an operation fails the silent
peer is named at once (:meth:`Heartbeat.silent_ranks`), and a wait can end within the timeout of
the fault (:meth:`Heartbeat.watched_silent`, used by :meth:`gradsync.runtime.Runtime.overdue`).
In a larger job, where that would load the store with every pair of ranks, it watches only while a
thread of the rank has waited long in one operation (half the timeout less the silence window).
:mod:`gradsync.runtime` starts it and asks it.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from gradsync import flight, stragglers
from gradsync.topology import Topology

HEARTBEAT_S = 1.0
HEARTBEAT_STORE_S = 2.0
"""Longest a heartbeat's store call may block (a store host that vanished): shorter than the wait
in :meth:`Heartbeat.stop`, so the thread is always gone before the process group is torn down."""
SILENT_S = 2.5 * HEARTBEAT_S
"""A rank whose heartbeat did not advance for this long has stopped."""
ALIVE_S = 1.5 * HEARTBEAT_S
"""A rank whose count was seen to change this recently is alive (it beats once a second)."""
WATCH_ALL_MAX = 32
"""Up to this many ranks, every rank reads every peer's counter each beat (at most 31 store reads a
second per rank); above it, only during a long wait."""


def _within(seconds: float, make):
    """``make()``, or ``TimeoutError`` after ``seconds`` (the call is left behind in a daemon thread)."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, make()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box.append((False, exc))

    thread = threading.Thread(target=run, name="gradsync-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if not box:
        raise TimeoutError(f"no answer within {seconds:g} s")
    ok, value = box[0]
    if ok:
        return value
    raise value


class Heartbeat:
    """Bumps ``gradsync/hb/<rank>`` in the store every second, on its own store connection.

    Each beat it also reads every peer's counter (see :data:`WATCH_ALL_MAX` for large jobs), so
    that since when a peer stands still is known when an operation is slow or fails."""

    def __init__(self, addr: str, port: int, topology: Topology, prefix: str = "",
                 timeout_s: float = 30.0):
        self.topology = topology
        # Connecting may take a resent SYN (a lossy link): the job's timeout. Each call after: 2 s.
        self.store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=max(timeout_s, HEARTBEAT_STORE_S)),
                                   wait_for_workers=False)
        self.store.set_timeout(timedelta(seconds=HEARTBEAT_STORE_S))
        if prefix:  # an elastic job's generation: ranks are renumbered in each
            self.store = dist.PrefixStore(prefix, self.store)
        self.timeout_s = timeout_s
        self.watch_after_s = 0.0 if topology.world_size <= WATCH_ALL_MAX else max(HEARTBEAT_S, timeout_s / 2 - SILENT_S)
        self._seen: dict[int, tuple[int, float, bool]] = {}  # rank -> (count, still since, moved), while watching
        self.answered = time.monotonic()  # the store's last answer to this thread's beat
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gradsync-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        key, at = f"gradsync/hb/{self.topology.rank}", f"gradsync/at/{self.topology.rank}"
        while not self._stop.wait(HEARTBEAT_S):
            store = self.store
            if store is None:
                return
            recorder = flight.current()
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 - a slow or vanished store host (diagnosis says which):
                continue  # try again next beat; each call is bounded by HEARTBEAT_STORE_S
            self.answered = time.monotonic()
            if recorder is not None:
                with contextlib.suppress(Exception):  # the position is a diagnosis' detail: never the beat
                    store.set(at, recorder.position())
            if self.topology.rank == 0 and self.topology.num_workers > 1 and stragglers.enabled():
                with contextlib.suppress(Exception):  # the straggler verdict is a reading: never the beat
                    self._judge(recorder)
            if self.watch_after_s == 0.0 or (recorder is not None and recorder.longest_wait_s() >= self.watch_after_s):
                self._watch()
            else:
                with self._lock:
                    self._seen = {}

    def _judge(self, recorder) -> None:
        """Worker 0: every worker's pace, from their positions, to the straggler verdict."""
        paces = {r: p for r, (_, _, _, p) in self._positions(range(1, self.topology.num_workers)).items()}
        if recorder is not None:
            paces[0] = recorder.pace.as_dict()
        stragglers.observe(paces)

    def store_lost(self) -> bool:
        """Whether the store has not answered this rank's beats for longer than a beat and a
        bounded call (its host died, or is stopped: a stopped host's store never answers)."""
        return time.monotonic() - self.answered > HEARTBEAT_S + HEARTBEAT_STORE_S

    def beats(self) -> dict[int, int] | None:
        """Every other rank's heartbeat count now; None if the store is gone or does not answer
        within ``HEARTBEAT_STORE_S`` (a store whose host is stopped, SIGSTOP, keeps a client's
        ``add`` waiting whatever the client's timeout: the call is bounded here, see ``_within``).
        A rank whose count stays the same over ``SILENT_S`` has stopped."""
        store, others = self.store, [r for r in range(self.topology.world_size) if r != self.topology.rank]
        if store is None:
            return None
        try:
            return _within(HEARTBEAT_STORE_S, lambda: {r: store.add(f"gradsync/hb/{r}", 0) for r in others})
        except Exception:
            return None

    def positions(self) -> dict[int, tuple[int, bool, float]]:
        """Where every other rank's training thread was at its last beat: ``(step, waiting in a
        gradsync operation (None: not known), seconds it has been so)`` (see :meth:`gradsync.flight.FlightRecorder.position`);
        a rank that published nothing yet, or a store that does not answer, leaves it out."""
        return {r: where[:3] for r, where in self._positions(r for r in range(self.topology.world_size)
                                                            if r != self.topology.rank).items()}

    def _positions(self, ranks) -> dict[int, tuple[int, bool | None, float, dict | None]]:
        """:meth:`positions` of ``ranks``, each with the rank's pace (:mod:`gradsync.stragglers`; None
        before its second step, and on a server)."""
        store = self.store
        if store is None:
            return {}
        keys = {r: f"gradsync/at/{r}" for r in ranks}

        def read() -> dict[int, bytes]:
            if store.check(list(keys.values())):  # every rank published: one round trip
                return dict(zip(keys, store.multi_get(list(keys.values()))))
            return {r: store.get(k) for r, k in keys.items() if store.check([k])}

        try:
            raw = _within(HEARTBEAT_STORE_S, read)
        except Exception:  # noqa: BLE001 - no answer: nothing known
            return {}
        out, now = {}, time.time()
        for rank, value in raw.items():
            fields = value.decode().split()
            try:
                step, waiting, seconds, at = fields[:4]
            except ValueError:
                continue
            age = now - float(at)  # under a beat, unless the hosts' clocks disagree: then not counted
            known = {"1": True, "0": False}.get(waiting)  # None: not known (see FlightRecorder.position)
            out[rank] = (int(step), known, float(seconds) + (age if 0 <= age <= 2 * HEARTBEAT_S else 0.0),
                         stragglers.parse(fields[4:]))
        return out

    def say_left(self) -> None:
        """This rank is shutting down: the store's host need not stay up for it (:meth:`wait_for_leavers`)."""
        store = self.store
        if store is not None:
            with contextlib.suppress(Exception):
                _within(HEARTBEAT_STORE_S, lambda: store.set(f"gradsync/left/{self.topology.rank}", "1"))

    def left(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that said they were shutting down (:meth:`say_left`): silent, but no fault."""
        store = self.store
        if store is None or not ranks:
            return []
        try:
            return _within(HEARTBEAT_STORE_S, lambda: [r for r in ranks if store.check([f"gradsync/left/{r}"])])
        except Exception:  # noqa: BLE001 - no answer: nothing known
            return []

    def wait_for_leavers(self, poll_s: float = 0.05) -> None:
        """On the rank that serves the store, at a clean shutdown: return once every peer has said
        it is shutting down (:meth:`say_left`) or its heartbeat stood still for :data:`SILENT_S`
        (it died). A rank that finishes first (``ps-async``, ``pair-averaging``: no barrier at the
        end) would otherwise take the store away from the ones still training."""
        store = self.store
        peers = [r for r in range(self.topology.world_size) if r != self.topology.rank]
        seen: dict[int, tuple[int, float, bool]] = {}
        next_beat, said, unread, began = 0.0, False, 0, time.monotonic()
        while store is not None and peers:
            try:
                peers = _within(HEARTBEAT_STORE_S, lambda: [r for r in peers if not store.check([f"gradsync/left/{r}"])])
            except Exception:  # noqa: BLE001 - this rank's own store does not answer: nothing to keep up
                return
            if not peers:
                return
            if time.monotonic() >= next_beat:
                observed = self._observe(seen)
                unread = 0 if observed is not None else unread + 1
                if unread >= 3:  # this rank's own store stopped answering: nothing left to keep up
                    return
                seen, next_beat = observed or seen, time.monotonic() + HEARTBEAT_S / 2
                now = time.monotonic()
                peers = [r for r in peers if r not in seen or now - seen[r][1] < SILENT_S]
                if not said and now - began >= self.timeout_s:
                    said = True
                    who = ", ".join(self.topology.describe(r) for r in peers)
                    print(f"gradsync: {self.topology.describe(self.topology.rank)} has shut down and keeps the "
                          f"rendezvous store up for {who}, still running after {now - began:.0f} s (they have not "
                          "called gradsync.shutdown() or exited)", file=sys.stderr, flush=True)
            time.sleep(poll_s)

    def _observe(self, seen: dict[int, tuple[int, float, bool]]) -> dict[int, tuple[int, float, bool]] | None:
        """``seen`` (per rank: its count, since when it has had that count as far as watched, and
        whether it was seen to change) updated with the peers' counters now; None if the store is
        gone. A rank seen for the first time counts as still since now: nothing is known of it before."""
        beats = self.beats()
        if beats is None:
            return None
        now, seen = time.monotonic(), dict(seen)
        for rank, count in beats.items():
            if rank not in seen:
                seen[rank] = (count, now, False)
            elif seen[rank][0] != count:
                seen[rank] = (count, now, True)
        return seen

    def _watch(self) -> None:
        """One beat of watching (the heartbeat thread)."""
        with self._lock:
            seen = self._seen
        seen = self._observe(seen)
        if seen is not None:
            with self._lock:
                self._seen = seen

    def watched_silent(self) -> list[int]:
        """The ranks the watch has seen stand still for :data:`SILENT_S` or longer, without asking
        the store (empty when no wait has been watched)."""
        with self._lock:
            seen = self._seen
        now = time.monotonic()
        return sorted(r for r, (_, since, _) in seen.items() if now - since >= SILENT_S)

    def silent_ranks(self, window_s: float = SILENT_S, poll_s: float = 0.1, *, fresh: bool = False) -> list[int] | None:
        """Ranks whose heartbeat did not advance for ``window_s``; None if the store is gone.

        Reads the counters every ``poll_s`` until each peer is decided: alive once its count was
        seen to move within the last :data:`ALIVE_S`, silent once it has stood still for ``window_s``
        (counting what the watch saw before). After a timeout both are known at once from the
        watch. ``fresh``: the operation failed at once (a connection reset), so a peer may have
        died a moment ago, after its last beat: alive then needs a move seen from now on."""
        if self.store_lost():
            return None
        with self._lock:
            seen = self._seen
        seen = self._observe(seen)
        if seen is None:
            return None
        if fresh:  # counted from this reading: a beat sent just before dying is no sign of life
            seen = {r: (count, since, False) for r, (count, since, _) in seen.items()}
        while True:
            now = time.monotonic()
            still = {r: now - since for r, (_, since, _) in seen.items()}
            alive = {r for r, (_, _, moved) in seen.items() if moved and still[r] < min(ALIVE_S, window_s - 1e-3)}
            silent = {r for r in seen if still[r] >= window_s - 1e-3}
            undecided = [r for r in seen if r not in alive and r not in silent]
            if not undecided:
                return sorted(silent)
            time.sleep(min(poll_s, max(window_s - still[r] for r in undecided)))
            seen = self._observe(seen)
            if seen is None:
                return None

    def wait_for_peers(self, limit_s: float = SILENT_S + 2 * HEARTBEAT_S) -> None:
        """Return once no peer's heartbeat has moved for 1.5 beats (each has exited, or stopped), or
        after ``limit_s``. The store's host calls it before exiting after a peer failure: the
        others may still be naming the failed rank, which needs the store."""
        deadline, last, moved = time.monotonic() + limit_s, None, time.monotonic()
        while time.monotonic() < deadline:
            beats = self.beats()
            if beats is None:
                return
            if beats != last:
                last, moved = beats, time.monotonic()
            elif time.monotonic() - moved >= 1.5 * HEARTBEAT_S:
                return
            time.sleep(0.25)

    def stop(self, wait_s: float = HEARTBEAT_S + 2 * HEARTBEAT_STORE_S) -> None:
        """Stop the thread and wait for it: a Python thread that returns from a torch call while the
        interpreter finalizes aborts the process (pytorch/pytorch#38228), so none may outlive
        :func:`shutdown`. Its store calls are bounded by ``HEARTBEAT_STORE_S`` each, except against
        a stopped store host, which never answers: then waiting is pointless (``wait_s``)."""
        self._stop.set()
        self._thread.join(timeout=wait_s)
        self.store = None  # the client connection closes here, not during finalization
