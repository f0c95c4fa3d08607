"""Watching the ranks until all exit or the first fails, saying why, and stopping every rank's group.

Stopping: SIGTERM (and SIGCONT, for a stopped rank) to every rank's process group, SIGKILL to
whatever is left after the grace period. SIGINT/SIGTERM to the launcher are recorded and stop the
job the same way; SIGUSR1 prints where every rank is (:mod:`gradsync.flight`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable

from gradsync import flight
from gradsync.launch.output import _Output
from gradsync.launch.spawn import _Rank

_POLL_S = 0.05
"""How often the launcher looks at its children."""


def _signal_groups(ranks: list[_Rank], sig: int) -> None:
    for rank in ranks:
        if rank.proc.pid is None:  # a forked rank that never started (gradsync.launch.forkserver)
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rank.proc.pid, sig)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it cannot answer anything."""
    with contextlib.suppress(OSError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    return False


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone is there
    return True


def _live_groups(pgids: set[int]) -> set[int]:
    """The groups in ``pgids`` with a member that is not a zombie (orphaned zombies may never be reaped)."""
    existing = set(filter(_group_exists, pgids))
    if not existing or not os.path.isdir("/proc"):
        return existing
    live = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
            if state != "Z" and int(pgrp) in existing:
                live.add(int(pgrp))
    return live


def _stop(ranks: list[_Rank], grace_s: float) -> None:
    """SIGTERM every rank's group, SIGKILL whatever is left after ``grace_s``, reap the ranks.
    SIGCONT follows the SIGTERM, so a stopped rank (SIGSTOP, Ctrl-Z) ends now, not after the grace."""
    _signal_groups(ranks, signal.SIGTERM)
    _signal_groups(ranks, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for rank in ranks:
            rank.proc.poll()  # reap, so an exited rank's pid stops counting as a group member
        if not _live_groups({rank.proc.pid for rank in ranks} - {None}):
            break
        time.sleep(_POLL_S)
    _signal_groups(ranks, signal.SIGKILL)
    for rank in ranks:
        rank.proc.wait()


@contextlib.contextmanager
def _trap_signals(usr1: bool = False):
    """Record SIGINT/SIGTERM instead of dying, so the launcher can stop its children first.
    ``usr1``: SIGUSR1 sets a flag that :func:`_wait_for_failure` turns into the cross-rank
    summary (:mod:`gradsync.flight`) instead of ending the launcher."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.signal(sig, lambda signum, _frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    if usr1:
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda _signum, _frame: _USR1.set())
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


_USR1 = threading.Event()


def _wait_for_failure(ranks: list[_Rank], caught: list[int], on_usr1: Callable[[], None] | None = None
                      ) -> _Rank | None:
    """Block until all ranks exit 0 (None), one fails (it), or the launcher is signalled (None)."""
    running = list(ranks)
    while running and not caught:
        if _USR1.is_set() and on_usr1 is not None:
            _USR1.clear()
            on_usr1()
        for rank in list(running):
            code = rank.proc.poll()
            if code is not None:
                running.remove(rank)
                if code != 0:
                    return rank
        time.sleep(_POLL_S)
    return None


def _report_flight(folder: str | None, ranks: list[_Rank], reason: str, out: _Output) -> None:
    """Print where every rank is (each dumps its flight record on request; :mod:`gradsync.flight`)."""
    if folder is None:
        return
    started = min((rank.started for rank in ranks), default=0.0)
    gone = {rank.spec.rank for rank in ranks if rank.proc.poll() is not None or _stopped(rank.proc.pid)}
    lines = flight.report(folder, [rank.spec.rank for rank in ranks], reason, started=started, gone=gone)
    if not lines:
        return
    text = [f"gradsync run: where each rank is ({reason}):"] + [f"    {line}" for line in lines]
    text.append(f"gradsync run: every rank's last operations: {os.path.join(folder, 'flight-summary.json')}")
    with out.lock, contextlib.suppress(Exception):
        out.stderr.write("\n".join(text) + "\n")
        out.stderr.flush()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _failure_message(rank: _Rank) -> str:
    code, spec = rank.proc.returncode, rank.spec
    if code < 0:
        how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
    else:
        how = f"failed with exit code {code}"
    lines = [f"gradsync run: {spec.label} (rank {spec.rank}) {how}"]
    if rank.tail:
        lines.append(f"gradsync run: last {len(rank.tail)} stderr lines of {spec.label}:")
        lines += [f"    {line}" for line in rank.tail]
    else:
        lines.append(f"gradsync run: {spec.label} wrote nothing to stderr")
    return "\n".join(lines)
