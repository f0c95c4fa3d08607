"""Parameter server: workers push gradients, servers aggregate and update, workers pull parameters.

The TensorFlow-PS / MXNet KVStore design (Li et al., OSDI 2014), with the update on the server.
Parameters are partitioned whole across the servers, balanced by size (largest first onto the
least-loaded server). Servers are either dedicated ranks (``gradsync run --servers S``) or, with
none, the workers themselves ("co-located": worker ``r`` serves its own partition).

One step, on a worker:
1. at the first gradient of the step, tell every dedicated server "step k" (a control header);
2. push each gradient to its server as soon as backward produces it (one message per tensor);
3. at ``optimizer.step()``: push zeros for parameters that got no gradient, then pull every
   parameter from its server into ``param.data`` (co-located: first serve the own partition).

On a server (``sync``, the default): wait for all workers' headers and pushes, average (a worker
that did not use a parameter contributes zero; a parameter nobody used is skipped, as in DDP),
run the user's optimizer on the partition, send the updated parameters to every worker. With
``mode="async"`` (dedicated servers only; the TF-PS asynchronous baseline) the server applies each
worker's push as soon as it arrives, as one optimizer step with that worker's gradient, and answers
that worker alone: no barrier, and not equal to the synchronous reference.

Wire (no pickle): control header ``int64[2] = (op, step)`` with ``op`` 1 = step, 2 = stop, on tag 0;
a push of parameter ``i`` is ``grad.flatten() ++ [used]`` in the parameter's dtype on tag ``1 + i``;
a pull is the parameter's data on tag ``1 + i``.

Must match across ranks: the model and the optimizer's hyperparameters (servers build their own
from the same script). Optimizer state lives on the servers, one partition each.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.base import Strategy, SyncContext, mean_of_used
from gradsync.transport import wait_all

OP_STEP, OP_STOP = 1, 2
TAG_CONTROL = 0


def partition(sizes: list[int], servers: list[int]) -> list[int]:
    """Owner rank of each tensor: largest first onto the least-loaded server (ties: lowest index)."""
    load = {s: 0 for s in servers}
    owner = [servers[0]] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(servers, key=lambda s: (load[s], servers.index(s)))
        owner[i] = s
        load[s] += sizes[i]
    return owner


class _Message:
    """A push on the wire: ``grad.flatten() ++ [used]``, with views to fill and read it cheaply."""

    __slots__ = ("wire", "grad", "used")

    def __init__(self, param: torch.Tensor):
        self.wire = torch.zeros(param.numel() + 1, dtype=param.dtype, device=param.device)
        self.grad = self.wire[:-1].view_as(param)
        self.used = self.wire[-1:]


class ParameterServer(Strategy):
    """Push gradients to parameter servers during backward; pull updated parameters at step."""

    name = "ps"
    uses_servers = True

    def __init__(self, mode: str = "sync"):
        if mode not in ("sync", "async"):
            raise ConfigError(f"ps mode must be 'sync' or 'async', got {mode!r}")
        self.mode = mode
        self.exact = mode == "sync"

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        self.dedicated = topo.num_servers > 0
        if self.mode == "async" and not self.dedicated:
            raise ConfigError("ps in async mode needs dedicated server ranks: run with `gradsync run "
                              "--servers 1` or more (GRADSYNC_NUM_SERVERS under another launcher)")
        self.servers = topo.server_ranks if self.dedicated else topo.worker_ranks
        self.owner = partition([p.numel() for p in ctx.params], self.servers)
        self.owned = [i for i, s in enumerate(self.owner) if s == topo.rank]
        self.step_no = 0
        self.open = False
        self.closed = False
        self.sends: list = []
        self.pushed = [False] * len(ctx.params)
        self.push_buf = {i: _Message(ctx.params[i]) for i, s in enumerate(self.owner) if s != topo.rank}
        # Buffers for other workers' pushes of the parameters this rank serves.
        peers = [w for w in topo.worker_ranks if w != topo.rank]
        self.inbox = {(w, i): _Message(ctx.params[i]) for w in peers for i in self.owned}
        self.recvs: list = []

    # -- worker side ---------------------------------------------------------------------------
    def _open_step(self) -> None:
        self.open = True
        t = self.ctx.transport
        if self.dedicated:
            header = torch.tensor([OP_STEP, self.step_no], dtype=torch.int64, device=self.ctx.transport.device)
            self.sends += [t.send_async(header, s, TAG_CONTROL, what=f"step header to rank {s}")
                           for s in self.servers]
        else:  # co-located: this worker serves its partition, so it listens for pushes now
            self.recvs = self._post_pushes([w for w in self.ctx.topology.worker_ranks if w != t.topology.rank])

    def _post_pushes(self, workers: list[int]) -> list:
        t = self.ctx.transport
        return [t.recv_async(self.inbox[(w, i)].wire, w, 1 + i, what=f"push of {self.ctx.names[i]!r} from rank {w}")
                for w in workers for i in self.owned]

    def on_grad_ready(self, index: int) -> None:
        if not self.open:
            self._open_step()
        if self.owner[index] != self.ctx.topology.rank:
            self._push(index)

    def _push(self, i: int) -> None:
        if self.pushed[i]:
            raise GradsyncError(
                f"parameter {self.ctx.names[i]!r} received a second gradient after it was pushed. "
                "For gradient accumulation, run all but the last backward inside `with optimizer.no_sync():`")
        msg, grad = self.push_buf[i], self.ctx.params[i].grad
        if grad is None:
            msg.wire.zero_()
        else:
            msg.grad.copy_(grad)
            msg.used.fill_(1)
        self.pushed[i] = True
        self.sends.append(self.ctx.transport.send_async(
            msg.wire, self.owner[i], 1 + i, what=f"push of {self.ctx.names[i]!r} to rank {self.owner[i]}"))

    def step(self, apply: Callable[[], Any]) -> Any:
        if not self.open:
            self._open_step()
        me = self.ctx.topology.rank
        for i in range(len(self.ctx.params)):
            if self.owner[i] != me and not self.pushed[i]:
                self._push(i)
        result = None
        if not self.dedicated:
            wait_all(self.recvs)
            self._aggregate(self.ctx.topology.worker_ranks, own=True)
            result = apply()
            self.sends += self._answer(self.ctx.topology.worker_ranks)
        wait_all(self._pull())
        wait_all(self.sends)
        self.sends, self.open = [], False
        self.pushed = [False] * len(self.ctx.params)
        self.step_no += 1
        return result

    def _pull(self) -> list:
        t, me = self.ctx.transport, self.ctx.topology.rank
        return [t.recv_async(self.ctx.params[i].data, s, 1 + i, what=f"pull of {self.ctx.names[i]!r} from rank {s}")
                for i, s in enumerate(self.owner) if s != me]

    # -- server side (dedicated ranks, and co-located workers for their partition) ---------------
    def _aggregate(self, workers: list[int], own: bool = False) -> None:
        """Set ``grad`` of owned parameters to the workers' mean; other parameters get ``None``."""
        me = self.ctx.topology.rank
        divisor = len(workers) if self.mode == "sync" else 1
        for i, p in enumerate(self.ctx.params):
            if self.owner[i] != me:
                p.grad = None
                continue
            # Sum in place: into the owner's own gradient when it has one, else a zeroed buffer.
            total = p.grad if own and p.grad is not None else torch.zeros_like(p)
            used = 1.0 if own and p.grad is not None else 0.0
            for w in workers:
                if w != me:
                    msg = self.inbox[(w, i)]
                    total.add_(msg.grad)
                    used += msg.used.item()
            p.grad = mean_of_used(total, used, divisor)

    def _answer(self, workers: list[int]) -> list:
        t, me = self.ctx.transport, self.ctx.topology.rank
        return [t.send_async(self.ctx.params[i].data, w, 1 + i, what=f"pull of {self.ctx.names[i]!r} to rank {w}")
                for w in workers if w != me for i in self.owned]

    def serve(self) -> None:
        """Dedicated server loop: runs until every worker has sent 'stop' (``gradsync.shutdown``)."""
        if self.mode == "sync":
            self._serve_sync()
        else:
            self._serve_async()

    def _headers(self, workers: list[int]) -> list[torch.Tensor]:
        headers = [torch.zeros(2, dtype=torch.int64, device=self.ctx.transport.device) for _ in workers]
        wait_all([self.ctx.transport.recv_async(h, w, TAG_CONTROL, what=f"step header from rank {w}")
                  for h, w in zip(headers, workers)])
        return headers

    def _serve_sync(self) -> None:
        workers, optimizer = self.ctx.topology.worker_ranks, self.ctx.optimizer
        answers: list = []
        while True:
            headers = self._headers(workers)
            ops = [int(h[0]) for h in headers]
            if all(op == OP_STOP for op in ops):
                break
            steps = {int(h[1]) for h in headers}
            if OP_STOP in ops or len(steps) > 1:
                described = ", ".join(
                    f"{self.ctx.topology.describe(w)}: "
                    + (f"stopped after {int(h[1])} steps" if h[0] == OP_STOP else f"starting step {int(h[1]) + 1}")
                    for w, h in zip(workers, headers))
                raise GradsyncError(f"workers are out of step ({described}); every worker must run the "
                                    "same number of optimizer steps before gradsync.shutdown()")
            wait_all(self._post_pushes(workers))
            wait_all(answers)  # the previous pull must be on the wire before parameters change
            self._aggregate(workers)
            optimizer.step()
            answers = self._answer(workers)
        wait_all(answers)

    def _serve_async(self) -> None:
        t, optimizer = self.ctx.transport, self.ctx.optimizer
        remaining = set(self.ctx.topology.worker_ranks)
        while remaining:
            header = torch.zeros(2, dtype=torch.int64, device=self.ctx.transport.device)
            handle = t.recv_async(header, None, TAG_CONTROL, what="step header from any worker")
            handle.wait()
            worker = handle.source_rank()
            if int(header[0]) == OP_STOP:
                remaining.discard(worker)
                continue
            wait_all(self._post_pushes([worker]))
            self._aggregate([worker])
            optimizer.step()
            wait_all(self._answer([worker]))

    def close(self) -> None:
        """Workers tell dedicated servers to stop. Safe to call twice."""
        if self.closed or not self.dedicated or self.ctx.topology.is_server:
            return
        self.closed = True
        header = torch.tensor([OP_STOP, self.step_no], dtype=torch.int64, device=self.ctx.transport.device)
        t = self.ctx.transport
        wait_all([t.send_async(header, s, TAG_CONTROL, what=f"stop to rank {s}") for s in self.servers])

    def describe(self) -> str:
        where = f"{len(self.servers)} dedicated servers" if self.dedicated else f"co-located on {len(self.servers)} workers"
        return f"ps({self.mode}, {where})"
