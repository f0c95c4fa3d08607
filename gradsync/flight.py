"""Where every rank is: a small record of each rank's last operations, and the cross-rank summary.

A job that hangs shows nothing: every rank waits, none fails, until the timeout. To say *who waits
where*, each rank keeps its last :data:`SIZE` communication operations in a ring
(:class:`FlightRecorder`, filled by :mod:`gradsync.transport`): what (``all-reduce of bucket 7
(parameters 'fc.weight'..)``), the optimizer step, bytes, the peer, when it was issued and when
it completed, and which operation the rank is blocked in right now. Collectives also carry their
number on their group, so the ranks' sequences can be compared: the n-th collective on a group
must be the same operation on every rank.

Dumps: a rank writes its record as ``rank-R.json`` into ``GRADSYNC_FLIGHT_DIR`` (set by
``gradsync run``) when it reports a peer failure or a timeout, and whenever the launcher asks (a
``request`` file there, polled by a small thread of the rank's own, :class:`Responder`, so a rank
whose main thread is blocked still answers; it makes no torch call and touches no store). ``gradsync run`` asks when a rank fails and on ``SIGUSR1``, then
prints :func:`summarize`'s lines and writes them with every dump to ``flight-summary.json``.
Nothing crosses the wire: the files are JSON on the launcher's machine.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time

from gradsync.stragglers import Pace, slower, verdict

SIZE = 64
"""Operations each rank keeps."""
DIR_ENV = "GRADSYNC_FLIGHT_DIR"
REQUEST = "request"
ASKED = "asked by the launcher"


class Record:
    """One operation: what, on which group (and its number there), step, bytes, peer, times."""

    __slots__ = ("what", "op", "group", "seq", "step", "nbytes", "peer", "issued", "done")

    def __init__(self, what: str, op: str, group: str | None, seq: int, step: int, nbytes: int, peer: int | None):
        self.what, self.op, self.group, self.seq = what, op, group, seq
        self.step, self.nbytes, self.peer = step, nbytes, peer
        self.issued, self.done = time.time(), None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class FlightRecorder:
    """This rank's last operations (see the module docstring). Cheap: one small object per operation."""

    def __init__(self, rank: int, label: str, size: int = SIZE):
        self.rank, self.label = rank, label
        self.records: collections.deque[Record] = collections.deque(maxlen=size)
        self.counts: dict[str, int] = {}
        self.step = 1  # the optimizer step in progress, from 1 (counted by distribute's wrapped step)
        self.waiting: Record | None = None  # what the training (main) thread is blocked in
        self.since = time.monotonic()  # when the training thread last entered or left a wait
        self.waited = False  # whether the training (main) thread ever waited in a gradsync operation
        self.waited_s = 0.0  # seconds it waited in them so far (the watchdog's windows not counted)
        self._timed: list[float] = []  # when each timed wait of the training thread under way began
        self.blocked: dict[int, Record] = {}  # what each thread blocked in an operation waits for
        self.dumped_for: float = 0.0  # the request file's mtime this rank last answered
        self.pace = Pace()  # this rank's seconds per step computing and waiting (gradsync.stragglers)

    def issue(self, what: str, op: str, nbytes: int, *, group: str | None = None, peer: int | None = None) -> Record:
        """Record an operation as it is issued; ``group`` names a collective's group (numbered there)."""
        seq = -1
        if group is not None:
            seq = self.counts.get(group, 0)
            self.counts[group] = seq + 1
        record = Record(what, op, group, seq, self.step, nbytes, peer)
        self.records.append(record)
        return record

    def block(self, record: Record | None, main: bool, *, timed: bool = True) -> tuple:
        """The calling thread starts waiting for ``record`` (``main``: it is the training thread);
        pass the result to :meth:`unblock` when the wait ends. Plain calls, not a context manager:
        a communication thread waits thousands of times a step. ``timed``: the training thread's
        wait adds to :attr:`waited_s` (not a watchdog's window, which spans DDP's forward and
        backward); nested waits count once."""
        ident = threading.get_ident()
        if record is not None:
            self.blocked[ident] = record
        timed = main and timed
        if main:
            self.waiting, self.since, self.waited = record, time.monotonic(), True
        if timed:
            self._timed.append(self.since)
        return ident, record, main, timed

    def unblock(self, token: tuple) -> None:
        ident, record, main, timed = token
        self.blocked.pop(ident, None)
        now = time.monotonic()
        if main and self.waiting is record:
            self.waiting, self.since = None, now
        if timed and self._timed:
            began = self._timed.pop()
            if not self._timed:
                self.waited_s += now - began

    @contextlib.contextmanager
    def waiting_for(self, what: str):
        """The training thread waits for its own communication threads (``what``: "wait for
        parameters of 'fc.weight'"): shown in the summary as any other wait, and in :meth:`position`."""
        record = self.issue(what, "wait", 0)
        token = self.block(record, threading.current_thread() is threading.main_thread())
        try:
            yield record
        finally:
            record.done = time.time()
            self.unblock(token)

    def position(self) -> str:
        """Where the training thread is, as the heartbeat publishes it: ``"STEP WAITING SECONDS TIME"``
        (waiting: 1 while it waits in a gradsync operation, 0 while it runs the script's own code, -
        while the main thread never waited in one: the script trains on another thread, so where it
        is is not known; seconds: how long it has been so, as of TIME, this host's clock)."""
        waiting = "-" if not self.waited else int(self.waiting is not None)
        line = f"{self.step} {waiting} {time.monotonic() - self.since:.2f} {time.time():.3f}"
        pace = self.pace.line()  # then the pace, on a worker that has stepped twice
        return f"{line} {pace}" if pace else line

    @contextlib.contextmanager
    def blocked_in(self, record: Record | None, *, main: bool):
        """:meth:`block` for the length of a ``with``."""
        token = self.block(record, main)
        try:
            yield
        finally:
            self.unblock(token)

    def longest_wait_s(self) -> float:
        """How long the longest wait under way has lasted (0 when no thread waits)."""
        now = time.time()
        return max((now - r.issued for r in list(self.blocked.values())), default=0.0)

    def snapshot(self, reason: str = "") -> dict:
        now = time.time()
        waiting = self.waiting
        return {"rank": self.rank, "label": self.label, "pid": os.getpid(), "time": now, "step": self.step,
                "reason": reason, "pace": self.pace.as_dict(), "waiting": None if waiting is None else waiting.as_dict(),
                "records": [r.as_dict() for r in list(self.records)]}

    def dump(self, reason: str) -> str | None:
        """Write ``rank-R.json`` into ``GRADSYNC_FLIGHT_DIR`` (atomically); its path, or None without one."""
        folder = os.environ.get(DIR_ENV)
        if not folder:
            return None
        path = os.path.join(folder, f"rank-{self.rank}.json")
        with contextlib.suppress(OSError):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.snapshot(reason), f)
            os.replace(tmp, path)
            return path
        return None

    def answer_request(self) -> None:
        """Dump if the launcher asked since the last answer (called by :class:`Responder`)."""
        folder = os.environ.get(DIR_ENV)
        if not folder:
            return
        try:
            asked = os.stat(os.path.join(folder, REQUEST)).st_mtime
        except OSError:
            return
        if asked > self.dumped_for:
            self.dumped_for = asked
            self.dump(ASKED)


class Responder:
    """Polls for the launcher's request every ``interval_s`` and dumps the record (pure Python:
    file system calls only, so it never waits on a peer)."""

    def __init__(self, recorder: FlightRecorder, interval_s: float = 0.25):
        self.recorder, self.interval_s = recorder, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gradsync-flight", daemon=True)
        self._thread.start()

    @classmethod
    def start_for(cls, recorder: FlightRecorder) -> "Responder | None":
        """A responder when the launcher set ``GRADSYNC_FLIGHT_DIR``; None otherwise."""
        return cls(recorder) if os.environ.get(DIR_ENV) else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.recorder.answer_request()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_CURRENT: FlightRecorder | None = None


def current() -> FlightRecorder | None:
    return _CURRENT


def waiting(what: str):
    """:meth:`FlightRecorder.waiting_for` on this rank's recorder; nothing without one."""
    recorder = _CURRENT
    return recorder.waiting_for(what) if recorder is not None else contextlib.nullcontext()


def install(recorder: FlightRecorder | None) -> None:
    global _CURRENT
    _CURRENT = recorder


# -- the launcher's side ----------------------------------------------------------------------------
def request(folder: str) -> float:
    """Ask every rank of the job to dump (touch the request file); the time asked."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, REQUEST)
    now = time.time()
    with open(path, "a"):
        os.utime(path, (now, now))
    return now


def collect(folder: str, ranks: list[int], since: float, wait_s: float, started: float = 0.0,
            gone: set[int] = frozenset()) -> dict[int, dict]:
    """The dumps of ``ranks`` written after ``since``, waiting at most ``wait_s`` for the missing
    (not for ``gone`` ranks, which exited, nor for ranks that dumped when they reported a failure). A rank that does not answer in time (it exited, or is
    blocked) is represented by its last dump of this job (written after ``started``, e.g. when it
    reported the failure), marked ``stale``."""
    deadline = time.monotonic() + wait_s

    def read(rank: int, newer_than: float) -> dict | None:
        path = os.path.join(folder, f"rank-{rank}.json")
        with contextlib.suppress(OSError, ValueError):
            if os.stat(path).st_mtime >= newer_than:
                with open(path) as f:
                    return json.load(f)
        return None

    found: dict[int, dict] = {}
    while True:
        for rank in ranks:
            if rank not in found and (dump := read(rank, since - 0.5)) is not None:
                found[rank] = dump
            elif rank not in found and (dump := read(rank, started)) is not None and dump.get("reason") != ASKED:
                found[rank] = dump  # it reported its failure: that record is its last word
        if all(r in found or r in gone for r in ranks) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for rank in ranks:
        if rank not in found and (dump := read(rank, started)) is not None:
            found[rank] = {**dump, "stale": True}
    return found


def _where(record: dict) -> str:
    step = f"step {record['step']}"
    if record.get("group") is not None:
        step += f", collective #{record['seq']} on {record['group']}"
    return f"{record['what']} ({step})"


def _last_done(dump: dict) -> dict | None:
    return next((r for r in reversed(dump["records"]) if r["done"] is not None), None)


def _names(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def summarize(dumps: dict[int, dict], ranks: list[int]) -> list[str]:
    """Human lines: each rank's place, then who waits where, who is behind, the first divergence."""
    lines = []
    now = max((d["time"] for d in dumps.values()), default=time.time())
    for rank in ranks:
        dump = dumps.get(rank)
        if dump is None:
            lines.append(f"rank {rank}: no answer (dead, stopped, or blocked while holding Python's lock)")
            continue
        who = dump["label"]  # "worker 0 (rank 0)"
        if dump.get("stale"):
            who += f" (no answer now; its last record, {time.time() - dump['time']:.1f} s old)"
        if dump["waiting"] is not None:
            w = dump["waiting"]
            lines.append(f"{who}: waits in {_where(w)} for {now - w['issued']:.1f} s")
        else:
            last = _last_done(dump)
            done = "nothing yet" if last is None else f"{_where(last)}, {now - last['done']:.1f} s ago"
            lines.append(f"{who}: not in a gradsync operation (step {dump['step']}); last completed {done}")
    waiting: dict[str, list[int]] = {}
    for rank, dump in dumps.items():
        if dump["waiting"] is not None:
            waiting.setdefault(_where(dump["waiting"]), []).append(rank)
    idle = [r for r, d in dumps.items() if d["waiting"] is None]
    parts = [f"{_names(rs)} {'waits' if len(rs) == 1 else 'wait'} in {where}" for where, rs in waiting.items()]
    for rank in sorted(idle):
        last = _last_done(dumps[rank])
        parts.append(f"rank {rank} last completed {_where(last)}" if last else f"rank {rank} completed nothing yet")
    missing = [r for r in ranks if r not in dumps]
    if missing:
        parts.append(f"{_names(missing)} did not answer")
    if parts:
        lines.append("; ".join(parts))
    divergence = _first_divergence(dumps)
    if divergence:
        lines.append(divergence)
    paces = {r: d.get("pace") for r, d in dumps.items()}
    found = verdict(paces)
    lines += [s.describe() for s in found + slower(paces, named=found)]
    return lines


def _first_divergence(dumps: dict[int, dict]) -> str | None:
    """The first collective number on a group where two ranks issued different operations."""
    by_group: dict[str, dict[int, dict[int, str]]] = {}
    for rank, dump in dumps.items():
        for r in dump["records"]:
            if r.get("group") is not None:
                by_group.setdefault(r["group"], {}).setdefault(rank, {})[r["seq"]] = r["what"]
    for group, per_rank in sorted(by_group.items()):
        common = set.intersection(*(set(s) for s in per_rank.values())) if len(per_rank) > 1 else set()
        for seq in sorted(common):
            whats = {rank: seqs[seq] for rank, seqs in per_rank.items()}
            if len(set(whats.values())) > 1:
                first = min(whats)
                other = next(r for r in sorted(whats) if whats[r] != whats[first])
                return (f"ranks diverge at collective #{seq} on {group}: rank {other} issued {whats[other]!r} where "
                        f"rank {first} issued {whats[first]!r}")
    return None


def report(folder: str, ranks: list[int], reason: str, wait_s: float = 2.5, started: float = 0.0,
           gone: set[int] = frozenset()) -> list[str]:
    """Ask every rank to dump, collect, and write ``flight-summary.json``; the summary lines.
    ``started``, ``gone``: see :func:`collect`."""
    since = request(folder)
    dumps = collect(folder, ranks, since, wait_s, started, gone)
    lines = summarize(dumps, ranks)
    with contextlib.suppress(OSError):
        with open(os.path.join(folder, "flight-summary.json"), "w") as f:
            json.dump({"reason": reason, "time": since, "summary": lines,
                       "ranks": {str(r): d for r, d in sorted(dumps.items())}}, f, indent=1)
    return lines
