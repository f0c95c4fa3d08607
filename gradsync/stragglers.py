"""Which rank holds the others back, and why: compute, its own code between steps, or its link.

In a synchronous job every worker waits at each synchronization point for the last one to arrive,
so one slow worker (a slower GPU, a busier host, a slow data loader, a slow NIC) sets the pace of
all. The flight recorder already knows, per worker, when its training thread waits in a gradsync
operation; from that each worker keeps its :class:`Pace`: per optimizer step, the seconds it
computed (from its first forward to the end of its step, less its waits), ran its own code between
steps (the data loader, logging) and waited. The worker that arrives last, busy longer than the
others while they wait for it, is the straggler (cause ``compute`` or ``between steps``).

A slow link does not show in those times: every worker of a ring waits alike. So every
:data:`PROBE_EVERY` steps the workers of a synchronous strategy time a train of
:data:`PROBE_CHUNKS` messages from each ring neighbour (:func:`probe`); the worker whose links
are all slower than the others' is named (cause ``link``) when the job spends time waiting and
its traffic at that rate accounts for a real share of the wait, before any worker is named for its
time (a slow link lengthens its neighbours' steps too).

Each worker's pace rides on its heartbeat (no extra message, no barrier); worker 0 reads its peers'
at each beat and keeps the verdict (:func:`verdict`, :func:`latest`), printed by worker 0 when it
changes (``GRADSYNC_STRAGGLERS=0`` silences it), shown in ``gradsync bench``'s table, the launcher's
SIGUSR1 and failure summary, and :class:`gradsync.adapt.Stragglers` (TensorBoard, policies).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from gradsync import trace

WINDOW = 64
"""Steps in each worker's pace: its compute, between-steps and wait times are the medians of its
last ``WINDOW`` steps. On a shared host one worker's step strays by a fifth now and then; a median
over a window ignores such strays (an average over a few steps follows them), so a 10 % straggler
stands out. After a change of pace the median follows once half the window has turned over."""
WARMUP_STEPS = 3
"""A worker's first steps in a job (or in each generation of an elastic one) are not in its pace:
a process that has just started or joined pays there for its caches, its allocator and lazy
initialisation (ResNet-50's first step after a grow: twice the others'), and would be named for it."""
THRESHOLD = 0.05
"""A worker is slow when its busy time (compute and between steps) exceeds the median of the
others' by this share of it."""
LINK_THRESHOLD = 0.25
"""A worker's links are slow when their rate is this much below the median of the other links."""
HELD = 0.25
"""A worker busier than the others is named only when they wait at least this share of the
difference longer than it does. Where every step ends at one barrier the others' extra wait equals
its extra time, so this only keeps a worker nobody waits for from being named; it is no more,
because a worker's wait also holds the collectives' own time, and their medians stray a few
percent from round to round (as much as half a 10 % straggler's excess)."""
HELD_OF_WAIT = 0.04
"""...and only when that extra wait is at least this share of the others' wait. Where the step is
mostly waiting for the network, the workers' waits differ by a few percent whoever computes
longest (ResNet-50 at 1 Gbit/s: balanced workers that read 1.07-1.13x busier "held" 0.3-2.7 % of a
2.4 s wait; BERT-base at 10 Gbit/s: 3.3 %), while a straggler the others do wait for holds more
(ResNet-50 at 10 Gbit/s, 1.1x to 2x: 16-79 %; BERT-base 1.1x: 5 %; ResNet-50 2x at 1 Gbit/s: 9 %).
A worker below it cost its job less than that share of a step in every run measured (a 1.1x
worker at 1 Gbit/s, holding 0.3-2.2 %: 0.1 % of the throughput)."""
SLOWER = 0.10
"""A worker is slower, whether or not the others wait for it, when its busy time exceeds the
median of the others' by this share (:func:`slower`): twice :data:`THRESHOLD`, since a reading that
names no one's cost must not name noise. Over 40 rounds a cell on four emulated workers, balanced
workers' busy times read at most 1.064x the others' (ResNet-50 at 1 Gbit/s; 1.014x at 10 Gbit/s,
1.034x on BERT-base), and workers slowed 1.25x and 1.5x read 1.14-1.46x (a 1.1x worker: 1.07-1.13x,
named as slower in some rounds only)."""
SETTLED = 8
"""Steps every worker's pace must hold before :func:`slower` reads it, and before worker 0's
heartbeat (:func:`observe`) reads either: a median over a job's first few steps strays by a third
or more (balanced workers read 1.46x and 1.61x apart over a round's first steps, and a 1.25x job
named a worker it had not slowed, 1.62x, for a moment), and nothing but its busy time filters the
slower reading (the verdict's rules on the others' wait filter the verdict)."""
WAIT_SHARE = 0.05
"""Links are only blamed when the workers spend at least this share of a step waiting."""
PROBE_EVERY = 100
"""Steps between link probes (the first after :data:`PROBE_FIRST` steps)."""
PROBE_FIRST = 10
PROBE_BYTES = 1 << 20
"""One message of the probe's train."""
PROBE_CHUNKS = 16
"""Messages a neighbour sends back to back (:func:`train_rate` reads their arrival times)."""
EXPLAINS = 0.25
"""A slow link is named only when the worker's bytes a step, at its links' rate rather than the
others', take at least this share of the job's wait longer (a slow probe reading on a link that
carries little cannot hold the others back)."""
PROBE_TAG = 0x53540000  # this module's point-to-point tags: PROBE_TAG + 0..99 (80 + k: the closing barrier)
ENV = "GRADSYNC_STRAGGLERS"
"""``0``: no probes and no printed line (the pace is still kept: it costs two clock reads and an append a step)."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class Pace:
    """One worker's seconds per step: computing, its own code between steps, waiting (medians over
    its last :data:`WINDOW` steps), the bytes it sent a step (their mean over the window), and the
    rate (Gbit/s) at which its ring neighbours' probes last reached it."""

    def __init__(self, window: int = WINDOW, warmup: int = WARMUP_STEPS):
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)  # (compute, between, wait)
        self._warmup = warmup  # measured steps still to leave out
        self._sent: deque[int] = deque(maxlen=window)
        self._lock = threading.Lock()  # the heartbeat's thread reads what the training thread appends
        self._sent_end: int | None = None
        self.links: dict[int, float] = {}  # peer -> Gbit/s, peer -> this worker
        self.synchronous = True  # the strategy has a barrier a step (a slow worker can hold the others)
        self.probe_watch = contextlib.nullcontext
        """The context the link probe's traffic runs inside (:func:`probe`'s ``watch``): ``gradsync
        bench`` counts the links' bytes without it."""
        self._step_end: float | None = None  # when the last step ended (perf_counter, as the tracer)
        self._forward: float | None = None  # the first forward since then
        self._waited_end = self._waited_forward = 0.0  # the recorder's wait total at those times
        self.steps = 0

    @property
    def compute(self) -> float | None:
        return self._median(0)

    @property
    def between(self) -> float | None:
        return self._median(1)

    @property
    def wait(self) -> float | None:
        return self._median(2)

    @property
    def sent(self) -> float:
        """Bytes a step (the mean over the window: a strategy may send in bursts, every few steps)."""
        with self._lock:
            sent = list(self._sent)
        return sum(sent) / len(sent) if sent else 0.0

    def _median(self, k: int) -> float | None:
        with self._lock:
            values = [s[k] for s in self._steps]
        return statistics.median(values) if values else None

    def forward(self, waited: float) -> None:
        """The model's forward starts (``waited``: the recorder's total wait so far)."""
        if self._forward is None:
            self._forward, self._waited_forward = time.perf_counter(), waited

    def end_step(self, waited: float, sent: int = 0) -> None:
        """An optimizer step ended (``sent``: the transport's total bytes sent so far)."""
        now = time.perf_counter()
        if self._sent_end is not None:
            with self._lock:
                self._sent.append(sent - self._sent_end)
        self._sent_end = sent
        if self._step_end is not None and self._forward is not None:
            between = max(0.0, self._forward - self._step_end - (self._waited_forward - self._waited_end))
            compute = max(0.0, now - self._forward - (waited - self._waited_forward))
            if self._warmup:
                self._warmup -= 1
            else:
                with self._lock:
                    self._steps.append((compute, between, waited - self._waited_end))
            tracer = trace.current()
            if tracer is not None and tracer.path is not None:  # a user's job tracing itself
                tracer.span(f"step {self.steps}", "step", self._step_end, now)
                tracer.counter("pace (ms, this step)", now, compute=compute * 1e3, between=between * 1e3,
                               wait=(waited - self._waited_end) * 1e3)
        self._step_end, self._waited_end, self._forward = now, waited, None
        self.steps += 1

    def line(self) -> str:
        """``COMPUTE BETWEEN WAIT LINKS SYNCHRONOUS SENT STEPS`` (ms; links ``peer:gbit,...`` or
        ``-``; 1 or 0; MB a step; steps in the window), for the heartbeat."""
        if not self._steps:
            return ""
        compute, between, wait = self.compute, self.between, self.wait
        links = ",".join(f"{p}:{g:.4g}" for p, g in sorted(self.links.items())) or "-"
        return (f"{compute * 1e3:.3f} {between * 1e3:.3f} {wait * 1e3:.3f} {links} "
                f"{int(self.synchronous)} {self.sent / 1e6:.6g} {len(self._steps)}")

    def as_dict(self) -> dict | None:
        if not self._steps:
            return None
        with self._lock:
            steps = len(self._steps)
        return {"compute": self.compute, "between": self.between, "wait": self.wait,
                "links": {str(p): g for p, g in self.links.items()}, "synchronous": self.synchronous,
                "sent": self.sent, "steps": steps}


def parse(fields: list[str]) -> dict | None:
    """The inverse of :meth:`Pace.line` (split into fields): a dict as :meth:`Pace.as_dict`, or None."""
    if len(fields) < 4:
        return None
    try:
        links = {} if fields[3] == "-" else {p: float(g) for p, g in (x.split(":") for x in fields[3].split(","))}
        return {"compute": float(fields[0]) / 1e3, "between": float(fields[1]) / 1e3, "wait": float(fields[2]) / 1e3,
                "links": links, "synchronous": fields[4:5] != ["0"], "sent": float((fields[5:6] or ["0"])[0]) * 1e6,
                **({"steps": int(fields[6])} if len(fields) > 6 else {})}
    except ValueError:
        return None


@dataclass(frozen=True)
class Straggler:
    rank: int
    cause: str  # "compute", "between steps" or "link"
    ratio: float  # its compute (or between-steps) time over the others' median; link: others' rate over its
    held_s: float  # seconds a step the others wait for it (link: the median wait)
    hidden: bool = False  # slower, but its extra time hides behind communication (:func:`slower`)

    def describe(self) -> str:
        if self.hidden:
            what = "computes" if self.cause == "compute" else "runs its own code between steps"
            held = (f"they wait {self.held_s * 1e3:.0f} ms a step for it" if self.held_s >= 5e-4
                    else "they do not wait for it")
            return (f"rank {self.rank} {what} {self.ratio:.2f}x as long as the others but does not hold them "
                    f"back: its extra time hides behind communication ({held})")
        if self.cause == "link":
            return (f"rank {self.rank} holds the others back: its link (its neighbours' probes reach it at "
                    f"1/{self.ratio:.2f} of the other links' rate; the workers wait {self.held_s * 1e3:.0f} ms a step)")
        what = "computes" if self.cause == "compute" else "runs its own code between steps (data loading?)"
        return (f"rank {self.rank} holds the others back: it {what} {self.ratio:.2f}x as long as the others, "
                f"who wait {self.held_s * 1e3:.0f} ms a step for it")


def verdict(paces: dict[int, dict], threshold: float = THRESHOLD, link_threshold: float = LINK_THRESHOLD) -> list[Straggler]:
    """The workers that hold the others back, from every worker's pace (``{rank: Pace.as_dict()}``).

    No one is named under a strategy without a barrier (a pace with ``synchronous`` false). A slow
    link comes first (it also lengthens its neighbours' steps): when the workers wait at least
    :data:`WAIT_SHARE` of a step, every link to or from one worker is ``link_threshold`` below
    the median of the links that do not touch it, and the bytes it sends a step take at least
    :data:`EXPLAINS` of the wait longer at its rate than at theirs, that worker is named for its
    link (needs three workers: with two, one link joins both). Otherwise the worker that arrives last is named for
    its time: its busy time (compute and its code between steps) exceeds the median of the
    others' by ``threshold`` of it, it waits least of all, and the others wait at least
    :data:`HELD` of the difference and :data:`HELD_OF_WAIT` of their wait longer than it does; the
    cause is the part (compute, between steps) that differs more.
    """
    paces = {r: p for r, p in paces.items() if p is not None}
    if len(paces) < 2 or not all(p.get("synchronous", True) for p in paces.values()):
        return []  # without a barrier (pair-averaging, ps-async) no worker waits for a slower one
    links = _slow_links(paces, link_threshold)
    if links:
        return links
    found = []
    for rank, p in sorted(paces.items()):
        excess, busy, held, wait, slow = _busier(paces, rank)
        last = p["wait"] < min(q["wait"] for r, q in paces.items() if r != rank)
        if last and excess > threshold * max(busy, 1e-4) and held >= max(HELD * excess, HELD_OF_WAIT * wait):
            found.append(slow)
    return found


def slower(paces: dict[int, dict], threshold: float = SLOWER, named: list[Straggler] | None = None) -> list[Straggler]:
    """The workers whose busy time exceeds the median of the others' by ``threshold`` of it and
    that :func:`verdict` does not name: slower, but their extra time hides behind the others'
    communication (``hidden``; ``held_s``: what the others wait for it a step, at least 0). None
    under a strategy without a barrier, as :func:`verdict`, nor before every worker's pace holds
    :data:`SETTLED` steps (a pace without ``steps`` counts as settled). ``named``: the verdict on
    the same paces, where the caller has it."""
    paces = {r: p for r, p in paces.items() if p is not None}
    if len(paces) < 2 or not all(p.get("synchronous", True) for p in paces.values()):
        return []
    if not settled(paces):
        return []
    held_back = {s.rank for s in (verdict(paces) if named is None else named)}
    found = []
    for rank in sorted(paces):
        excess, busy, held, _, slow = _busier(paces, rank)
        if rank not in held_back and excess >= threshold * max(busy, 1e-4):
            found.append(Straggler(slow.rank, slow.cause, slow.ratio, max(0.0, held), hidden=True))
    return found


def settled(paces: dict[int, dict | None]) -> bool:
    """Whether every worker's pace that is known holds :data:`SETTLED` steps (one without
    ``steps`` counts as settled: readings stored before it was kept)."""
    return all(p.get("steps", SETTLED) >= SETTLED for p in paces.values() if p is not None)


def _busier(paces: dict[int, dict], rank: int) -> tuple[float, float, float, float, Straggler]:
    """How ``rank`` compares with the others: its busy time over their median (seconds), that
    median, how much longer they wait than it does, their median wait, and the reading as a
    :class:`Straggler` (cause: the part, compute or between steps, that differs more)."""
    p = paces[rank]
    others = [q for r, q in paces.items() if r != rank]
    busy = statistics.median(q["compute"] + q["between"] for q in others)
    wait = statistics.median(q["wait"] for q in others)
    held = wait - p["wait"]
    parts = {key: p[key] - statistics.median(q[key] for q in others) for key in ("compute", "between")}
    key = max(parts, key=parts.get)
    base = statistics.median(q[key] for q in others)
    cause = "compute" if key == "compute" else "between steps"
    return p["compute"] + p["between"] - busy, busy, held, wait, Straggler(rank, cause, p[key] / max(base, 1e-9), held)


def _slow_links(paces: dict[int, dict], link_threshold: float) -> list[Straggler]:
    rates = {(int(src), dst): g for dst, p in paces.items() for src, g in p["links"].items()}
    if len(paces) < 3 or not rates:
        return []
    step = statistics.median(p["compute"] + p["between"] + p["wait"] for p in paces.values())
    wait = statistics.median(p["wait"] for p in paces.values())
    if wait < WAIT_SHARE * step:
        return []
    found = []
    for rank in sorted(paces):
        mine = [g for (a, b), g in rates.items() if rank in (a, b)]
        rest = [g for (a, b), g in rates.items() if rank not in (a, b)]
        if not mine or not rest or max(mine) >= (1 - link_threshold) * statistics.median(rest):
            continue
        slow, usual = statistics.median(mine), statistics.median(rest)
        longer = paces[rank].get("sent", 0.0) * 8 / 1e9 * (1 / slow - 1 / usual)  # seconds a step
        if longer >= EXPLAINS * wait:
            found.append(Straggler(rank, "link", usual / slow, wait))
    return found


# -- the link probe --------------------------------------------------------------------------------
def probe_due(steps: int) -> bool:
    return steps == PROBE_FIRST or (steps > PROBE_FIRST and (steps - PROBE_FIRST) % PROBE_EVERY == 0)


def probe(transport, topology, nbytes: int = PROBE_BYTES, chunks: int = PROBE_CHUNKS,
          watch=contextlib.nullcontext) -> dict[int, float]:
    """Collective over the workers: the rate (Gbit/s) of the link from each ring neighbour to this
    worker. After a barrier each worker sends ``chunks`` messages of ``nbytes`` back to back to the
    next worker (then, second round, to the previous one) and notes when each of its neighbour's
    arrives (:func:`train_rate`). Point-to-point messages only (the barriers too: dissemination
    barriers), so a strategy's collectives still in flight on its own threads are not disturbed.

    ``watch()`` is a context entered once every worker has reached the probe and left once every
    worker's trains have arrived (a closing barrier): what the links carry inside it is the probe's
    own traffic, where the workers' strategy has settled first (``gradsync bench`` leaves it out of
    its count of the links' bytes)."""
    import torch  # here: the launcher reads verdicts without importing torch

    n, me = topology.num_workers, topology.rank
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=transport.device)
    inboxes = [torch.empty_like(payload) for _ in range(chunks)]
    bits = payload.numel() * 32
    out: dict[int, float] = {}
    _barrier(transport, n, me, PROBE_TAG)
    with watch():
        for k, d in enumerate((1, -1) if n > 2 else (1,)):
            to, frm = (me + d) % n, (me - d) % n
            tag = PROBE_TAG + 50 * k
            if k:
                _barrier(transport, n, me, tag)
            start = time.perf_counter()
            recvs = [transport.recv_async(inboxes[i], frm, tag + 10 + i, what="link probe") for i in range(chunks)]
            sends = [transport.send_async(payload, to, tag + 10 + i, what="link probe", counted=False)
                     for i in range(chunks)]
            arrived = []
            for h in recvs:
                h.wait()
                arrived.append(time.perf_counter())
            out[frm] = train_rate(bits, start, arrived)
            for h in sends:
                h.wait()
        _barrier(transport, n, me, PROBE_TAG + 80)  # every worker's trains have arrived
    return out


def train_rate(bits: int, start: float, arrived: list[float]) -> float:
    """The rate (Gbit/s) of a link from a train of messages of ``bits`` each, sent back to back
    from ``start`` and seen by the receiver at ``arrived``: the slower of two readings.

    The median gap between arrivals in the train's second half reads the link's sustained rate,
    past its first bytes that pass at line rate (a switch's or a token bucket's burst) and
    undisturbed by one late wake-up; but a receiver that is not scheduled for a while sees several
    messages at once, and when half the gaps collapse so does the median (readings of 6-120 Gbit/s
    on a 2.5 Gbit/s link, with four workers on two cores). The whole train, from ``start`` to the
    last arrival, cannot read faster than the link beyond its burst, whenever the receiver wakes.
    """
    half = len(arrived) // 2
    gaps = [b - a for a, b in zip(arrived[half - 1:], arrived[half:])]
    sustained = bits / max(statistics.median(gaps), 1e-9)
    whole = bits * len(arrived) / max(arrived[-1] - start, 1e-9)
    return min(sustained, whole) / 1e9


def _barrier(transport, n: int, me: int, tag: int) -> None:
    """A dissemination barrier over workers ``0..n-1`` (Hensgen et al.): ceil(log2 n) rounds."""
    import torch

    token, got = torch.zeros(1, device=transport.device), torch.zeros(1, device=transport.device)
    k, dist = 0, 1
    while dist < n:
        handles = [transport.recv_async(got, (me - dist) % n, tag + k, what="link probe barrier"),
                   transport.send_async(token, (me + dist) % n, tag + k, what="link probe barrier", counted=False)]
        for h in handles:
            h.wait()
        k, dist = k + 1, dist * 2


def gather(transport, topology, pace: Pace) -> dict[int, dict | None]:
    """Collective over the workers: every worker's pace (the same dict on each), for :func:`verdict`."""
    import torch

    n, me = topology.num_workers, topology.rank
    table = torch.zeros(n, 9, dtype=torch.float64, device=transport.device)
    mine = pace.as_dict()
    if mine is not None:
        prev, nxt = (me - 1) % n, (me + 1) % n
        table[me] = torch.tensor([1.0, mine["compute"], mine["between"], mine["wait"],
                                  pace.links.get(prev, 0.0), pace.links.get(nxt, 0.0) if n > 2 else 0.0,
                                  float(pace.synchronous), pace.sent, mine["steps"]])
    transport.allreduce(table, world=False, what="straggler readings")
    out: dict[int, dict | None] = {}
    for r, (known, compute, between, wait, from_prev, from_next, synchronous, sent, steps) in enumerate(table.tolist()):
        links = {p: g for p, g in (((r - 1) % n, from_prev), ((r + 1) % n, from_next)) if g > 0}
        out[r] = {"compute": compute, "between": between, "wait": wait, "links": links,
                  "synchronous": synchronous > 0, "sent": sent, "steps": int(steps)} if known else None
    return out


# -- worker 0's view -------------------------------------------------------------------------------
CONFIRM = 3
"""Beats in a row a verdict must hold before it is reported (a single noisy reading is not)."""
CONFIRM_HIDDEN = 10
"""...and a hidden slower worker (:func:`slower`): it costs the job little, so its reading can wait
for more beats, and nothing but its busy time filters it."""
REPEAT_S = 60.0


class _View:
    def __init__(self):
        self.latest: list[Straggler] = []  # the confirmed verdict
        self.hidden: list[Straggler] = []  # the confirmed slower workers it does not name
        self.candidate: tuple = ()
        self.hidden_candidate: tuple = ()
        self.streak = 0
        self.hidden_streak = 0
        self.said_at = 0.0


_VIEW = _View()


def latest() -> list[Straggler]:
    """Worker 0's latest confirmed verdict (empty on the other ranks, and while no worker holds
    the others back)."""
    return list(_VIEW.latest)


def latest_hidden() -> list[Straggler]:
    """Worker 0's latest confirmed slower workers that hold no one back (:func:`slower`)."""
    return list(_VIEW.hidden)


def _key(found: list[Straggler]) -> tuple:
    return tuple((s.rank, s.cause) for s in found)


def observe(paces: dict[int, dict]) -> list[Straggler]:
    """Worker 0's heartbeat: a verdict from every worker's pace. Once the same workers are named
    for the same causes :data:`CONFIRM` beats in a row it becomes :func:`latest` and is printed
    (again every :data:`REPEAT_S` while it holds; once more when it clears). The hidden slower
    workers (:func:`slower`) likewise, after :data:`CONFIRM_HIDDEN` beats, printed once. Until
    every worker's pace has :data:`SETTLED` steps (a job's start, a bench round's, an elastic
    job's new generation) a beat changes nothing."""
    if not settled(paces):
        return _VIEW.latest
    view, found = _VIEW, verdict(paces)
    hidden = slower(paces, named=found)
    key, hidden_key = _key(found), _key(hidden)
    view.streak = view.streak + 1 if key == view.candidate else 1
    view.hidden_streak = view.hidden_streak + 1 if hidden_key == view.hidden_candidate else 1
    view.candidate, view.hidden_candidate = key, hidden_key
    now = time.perf_counter()
    if view.streak >= CONFIRM:
        before, view.latest = _key(view.latest), found
        if key != before or (key and now - view.said_at >= REPEAT_S):
            if _say("; ".join(s.describe() for s in found) or "no rank holds the others back any longer"):
                view.said_at = now
    if view.hidden_streak >= CONFIRM_HIDDEN:
        before, view.hidden = _key(view.hidden), hidden
        if hidden_key != before:
            _say("; ".join(s.describe() for s in hidden) or "no rank is slower than the others any longer")
    return view.latest


def _say(text: str) -> bool:
    if not enabled():
        return False
    print(f"gradsync: {text}", file=sys.stderr, flush=True)
    tracer = trace.current()
    if tracer is not None:
        tracer.instant(text, "step", time.perf_counter())
    return True


def reset() -> None:
    """Forget the verdict (a new job in this process)."""
    global _VIEW
    _VIEW = _View()
