"""Keep-alive pings: a server's wait for the next request outlives a pause of its workers.

Gloo fails a receive that waits longer than the process group's timeout, and closes the pairs
with it. A server that waits for its workers' next request (hybrid's row servers and
pair-averaging's model servers, which answer whichever worker sends first; dedicated ``ps`` and
``ps-async`` servers, between steps) has such a receive posted at all times, and it waits whenever
every worker runs its own code: an evaluation, a checkpoint, a grow waiting for new workers to
start. None of that is a fault, yet after ``GRADSYNC_TIMEOUT`` the job would break.

So each worker pings its servers (one fixed-format ``int64`` request the server skips) whenever
nothing went to one of them for a quarter of the timeout. A worker that died stops pinging, and
its servers' waits fail at the timeout as before; one stuck in its own code is alive, and the
peers waiting *for it* in a collective still name it there.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch

from gradsync import runtime


class KeepAlive:
    """Pings ``servers`` on ``tag`` with ``ping()`` while this worker sends them nothing else.

    The owner issues each request inside :meth:`sending`, so that no ping lands between its
    messages (each server reads a request's messages in a row, from the same sender) and none
    goes to a server that just heard from this worker. :meth:`stop` ends the pings before the
    owner's goodbye (after it, a server no longer listens to this worker)."""

    def __init__(self, transport, servers: list[int], tag: int, ping: Callable[[], torch.Tensor], what: str):
        self.transport, self.servers, self.tag, self.ping, self.what = transport, list(servers), tag, ping, what
        self.every_s = transport.timeout.total_seconds() / 4
        self.lock = threading.Lock()
        self.last = {server: time.monotonic() for server in self.servers}
        self.pings = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if self.servers:
            self._thread = threading.Thread(target=self._run, name="gradsync-keepalive", daemon=True)
            self._thread.start()
            runtime.on_stop(self.stop)  # also when the rank goes down with an error (no close runs)

    @contextlib.contextmanager
    def sending(self, *servers: int):
        """The owner issues a request to ``servers`` inside: no ping goes between its messages, and
        none to those servers for a while after."""
        with self.lock:
            now = time.monotonic()
            for server in servers:
                self.last[server] = now
            yield

    def _run(self) -> None:
        pending = []
        try:
            while not self._stopped.wait(self.every_s / 4):
                for handle in pending:  # the previous pings, long delivered
                    handle.wait(background=True)
                pending = []
                with self.lock:
                    if self._stopped.is_set() or self.transport.failure is not None:
                        return
                    now = time.monotonic()
                    for server in self.servers:
                        if now - self.last[server] >= self.every_s:
                            pending.append(self.transport.send_async(self.ping(), server, self.tag, what=self.what,
                                                                     counted=False))
                            self.last[server] = now
                            self.pings += 1
        except Exception:  # noqa: BLE001 - a broken group: the owner's own operations report it
            return

    def stop(self, wait: bool = True) -> None:
        """No ping after this returns; with ``wait``, the thread is gone (without: after a peer
        failed, where its last ping may wait out Gloo's timeout, shutdown waits for it)."""
        self._stopped.set()
        with self.lock:
            pass  # a ping being issued is issued before the owner's goodbye
        if not wait:
            return
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.transport.timeout.total_seconds())
        stoppers = getattr(runtime._RUNTIME, "stoppers", [])
        if self.stop in stoppers:
            stoppers.remove(self.stop)


def sending(keepalive: KeepAlive | None, *servers: int):
    """:meth:`KeepAlive.sending`, or nothing where the owner has no pings (NCCL, no remote server)."""
    return keepalive.sending(*servers) if keepalive is not None else contextlib.nullcontext()


class Absences:
    """A server's record of its workers' requests, pings apart: which worker stopped training while
    the others went on.

    With pings, a server's wait for requests no longer times out while its workers live; it must
    still tell a pause every worker takes (an evaluation: nobody is named) from one worker stuck in
    its own code while the others train on (a stuck data loader: it is named within the timeout,
    as a collective would name it). A worker is *behind* when its last request is at least the
    timeout old and names an earlier step than another worker's last request."""

    def __init__(self, workers: list[int], timeout_s: float):
        now = time.monotonic()
        self.timeout_s = timeout_s
        self.last = {w: (now, -1) for w in workers}  # worker -> (when, step) of its last request

    def request(self, worker: int, step: int) -> None:
        self.last[worker] = (time.monotonic(), step)

    def behind(self, among) -> list[int]:
        """The workers of ``among`` behind the others, as defined above."""
        ahead = max(step for _, step in self.last.values())
        now = time.monotonic()
        return sorted(w for w in among if now - self.last[w][0] >= self.timeout_s and self.last[w][1] < ahead)

    def error(self, rt, what: str, late: list[int]) -> Exception:
        """The error naming ``late`` (:meth:`gradsync.runtime.Runtime.explain` adds where each is)."""
        steps = ", ".join(rt.topology.describe(w) + (f" (its last: step {self.last[w][1]})" if self.last[w][1] >= 0
                                                      else " (none yet)") for w in late)
        return rt.explain(what, TimeoutError(
            f"no request for {self.timeout_s:g} s (GRADSYNC_TIMEOUT) from {steps}, while another worker reached step "
            f"{max(step for _, step in self.last.values())}"))
