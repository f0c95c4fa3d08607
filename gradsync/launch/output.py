"""Forwarding the ranks' output: each child line re-emitted whole, prefixed with its rank's label,
stdout to stdout and stderr to stderr, and written to the rank's log; the last stderr lines kept."""
from __future__ import annotations

import contextlib
import sys
import threading
import time

from gradsync.launch.spawn import _Rank


class _Output:
    """Re-emits child lines. One lock for both streams and all logs, so lines never interleave."""

    def __init__(self, prefix: bool):
        # Resolved at launch time, so a caller's replaced sys.stdout (pytest capture, a pipe) is honoured.
        self.stdout, self.stderr = sys.stdout, sys.stderr
        self.prefix = prefix
        self.lock = threading.Lock()

    def emit(self, rank: _Rank, line: bytes, is_err: bool) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        text = line.decode("utf-8", "replace")
        if self.prefix:
            text = f"[{rank.spec.label}] {text}"
        stream = self.stderr if is_err else self.stdout
        with self.lock:
            # A failing write (closed pipe, unencodable text) must not stop draining the child's
            # pipe: a child blocked on a full pipe would hang the job.
            with contextlib.suppress(Exception):
                if rank.log is not None:
                    rank.log.write(line)
                    rank.log.flush()
            with contextlib.suppress(Exception):
                stream.write(text)
                stream.flush()


def _pump(pipe, rank: _Rank, is_err: bool, out: _Output) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            if is_err:
                rank.tail.append(line.decode("utf-8", "replace").rstrip("\n"))
            out.emit(rank, line, is_err)

def _start_pumps(rank: _Rank, out: _Output) -> None:
    for pipe, is_err in ((rank.proc.stdout, False), (rank.proc.stderr, True)):
        thread = threading.Thread(target=_pump, args=(pipe, rank, is_err, out), daemon=True)
        thread.start()
        rank.pumps.append(thread)


def _close(ranks: list[_Rank], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for rank in ranks:
        for thread in rank.pumps:  # the pipes are at EOF once the groups are dead
            thread.join(max(0.0, deadline - time.monotonic()))
        if rank.log is not None:
            rank.log.close()
