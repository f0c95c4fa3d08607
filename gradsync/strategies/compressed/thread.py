"""The communication thread of a compressed strategy: exchanges the buckets handed to it, in order.

The training thread hands bucket ``k`` over as soon as it is full (:meth:`ExchangeThread.put`), so
encoding, sending and decoding overlap the rest of backward; at the end of backward it waits for
every bucket it handed over (:meth:`ExchangeThread.wait`). The thread's collectives use a process
group of their own, apart from the script's.

A fault every worker agreed on (the bucket's message pattern was completed) is recorded in
:attr:`Faults.agreed <gradsync.strategies.compressed.faults.Faults.agreed>` and the thread goes on;
any other failure stops the thread and is raised by the training thread at its next wait.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from gradsync import runtime
from gradsync.compress import CompressionError, NonFiniteGradientError
from gradsync.strategies.compressed.faults import Faults


class ExchangeThread:
    """Runs ``exchange(k)`` for each bucket index put, one at a time, on a daemon thread."""

    def __init__(self, name: str, exchange: Callable[[int], None], faults: Faults):
        self.exchange, self.faults = exchange, faults
        self.queue: deque[int] = deque()
        self.done = 0
        self.error: BaseException | None = None
        """The thread's failure: it has stopped."""
        self.closed = False
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, k: int) -> None:
        with self.cv:
            self.queue.append(k)
            self.cv.notify_all()

    def wait(self, count: int) -> None:
        """Until ``count`` buckets were exchanged this step (or the thread failed); checks progress
        against the job's timeout while the thread may be blocked in a receive."""
        with self.cv:
            if self.done >= count or self.error is not None:
                return
            seen = [self.done, time.monotonic()]  # buckets done, and since when: the wait's progress

            def progress() -> float:
                if self.done != seen[0]:
                    seen[:] = [self.done, time.monotonic()]
                return seen[1]

            runtime.wait_until(self.cv, lambda: self.done >= count or self.error is not None,
                               "wait for the compressed buckets", progress)

    def _run(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.queue and not self.closed:
                        self.cv.wait()
                    if not self.queue:
                        return
                    k = self.queue.popleft()
                try:
                    self.exchange(k)
                except (NonFiniteGradientError, CompressionError) as exc:  # the pattern was completed
                    self.faults.agreed = self.faults.agreed or exc
                with self.cv:
                    self.done += 1
                    self.cv.notify_all()
        except BaseException as exc:  # handed to the training thread, raised at its next step()
            with self.cv:
                self.error = exc
                self.cv.notify_all()

    def abandon(self) -> None:
        """Take no more buckets and do not wait (a peer failed): see :meth:`CompressedSync.abandon`."""
        with self.cv:
            self.closed = True
            self.queue.clear()
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.thread.join()
