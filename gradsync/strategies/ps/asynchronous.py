"""Asynchronous parameter server: each worker's push applied as it arrives, no barrier (TF-PS async).

The asynchronous baseline of the TensorFlow-PS / MXNet KVStore design (Li et al., OSDI 2014): a
dedicated server takes the step header of whichever worker sends first, applies that worker's push
as one optimizer step with its gradient alone (not averaged), and answers that worker alone. No
worker waits for another, and training is not equal to the synchronous reference (``exact`` is
false): a worker's gradient was computed on parameters other workers' pushes have since moved.

Needs dedicated server ranks (``gradsync run --servers S``) and Gloo (a server receives from any
worker; NCCL has no such receive). The worker side and the wire are ``ps``'s
(:mod:`gradsync.strategies.ps.base`, :mod:`gradsync.strategies.ps.wire`). The servers' optimizer
state is never whole at a step, so it is not saved or loaded with the workers' checkpoints.
"""
from __future__ import annotations

import torch

from gradsync import runtime
from gradsync.errors import ConfigError
from gradsync.strategies.base import SyncContext
from gradsync.strategies.ps.base import ParameterServerBase
from gradsync.strategies.ps.wire import OP_PING, OP_STEP, OP_STOP, TAG_CONTROL, check_header
from gradsync.strategies.keepalive import Absences
from gradsync.transport import wait_all


class AsyncParameterServer(ParameterServerBase):
    """Push gradients to dedicated servers; each push is applied alone and answered to its worker."""

    name = "ps-async"
    synchronous = False  # no barrier: a worker may be steps ahead of another
    summary = "asynchronous parameter server: each push applied alone, no barrier (TF-PS async)"
    mode = "async"
    exact = False
    backends = ("gloo",)  # a server takes each push from whichever worker sends first
    clips = False

    def attach(self, ctx: SyncContext) -> None:
        if ctx.topology.num_servers == 0:
            raise ConfigError("ps-async needs dedicated server ranks: run with `gradsync run "
                              "--servers 1` or more (GRADSYNC_NUM_SERVERS under another launcher)")
        super().attach(ctx)

    def gather_state(self) -> None:
        self._refuse("saving")

    def load_state(self) -> None:
        self._refuse("loading")

    def _refuse(self, doing: str) -> None:
        raise ConfigError(f"{doing} the optimizer state of asynchronous servers is not supported: each applies "
                          "pushes as they come, so the state is whole at no step. Use ps (synchronous)")

    def serve(self) -> None:
        """Dedicated server loop: the first worker's header, its pushes, one update, its pull; until
        every worker has sent 'stop' (``gradsync.shutdown``)."""
        t, optimizer = self.ctx.transport, self.ctx.optimizer
        remaining = set(self.ctx.topology.worker_ranks)
        absences = Absences(sorted(remaining), t.timeout.total_seconds())
        what = "step header from any worker"
        while remaining:
            header = torch.zeros(2, dtype=torch.int64, device=t.device)
            handle = t.recv_async(header, None, TAG_CONTROL, what=what)
            handle.wait()
            worker = handle.source_rank()
            check_header(header, worker, ops=(OP_STEP, OP_STOP, OP_PING))
            if int(header[0]) == OP_PING:  # a worker away from training (gradsync.strategies.keepalive)
                late = absences.behind(remaining)
                if late:  # the others went on without it: stuck in its own code
                    raise absences.error(runtime.current(), what, late)
                continue
            absences.request(worker, int(header[1]))
            if int(header[0]) == OP_STOP:
                remaining.discard(worker)
                continue
            wait_all(self._post_pushes([worker]))
            self._aggregate([worker], 1)
            optimizer.step()
            wait_all(self._answer([worker]))
