"""Parameter server: workers push gradients, servers aggregate and update, workers pull parameters.

The TensorFlow-PS / MXNet KVStore design (Li et al., OSDI 2014), with the update on the server.
Parameters are partitioned whole across the servers, balanced by size (largest first onto the
least-loaded server). Servers are either dedicated ranks (``gradsync run --servers S``) or, with
none, the workers themselves ("co-located": worker ``r`` serves its own partition).

One step, on a worker:
1. at the first gradient of the step, tell every dedicated server "step k" (a control header);
2. push gradients to their server as soon as backward has produced a whole group (see Wire);
3. at ``optimizer.step()``: push zeros for parameters that got no gradient, then pull every
   parameter from its server into ``param.data`` (co-located: first serve the own partition).

On a server (``sync``, the default): wait for all workers' headers and pushes, average (a worker
that did not use a parameter contributes zero; a parameter nobody used is skipped, as in DDP),
run the user's optimizer on the partition, send the updated parameters to every worker. With
``mode="async"`` (dedicated servers only; the TF-PS asynchronous baseline) the server applies each
worker's push as soon as it arrives, as one optimizer step with that worker's gradient, and answers
that worker alone: no barrier, and not equal to the synchronous reference.

Wire (no pickle): control header ``int64[2] = (op, step)`` with ``op`` 1 = step, 2 = stop, on tag 0;
a push is a *group* of tensors, ``grads.flatten() ++ [used flag per tensor]`` in their dtype, on
tag ``1 + first index``; a pull is the group's parameter data on the same tag. Groups are tensors
consecutive in backward order with the same server, up to ``fuse_kb`` (default 256 KB; fusion
saves the per-message latency of the many small tensors, biases and norms, a model has);
``fuse_kb=0`` sends one message per tensor.

Clipping (``distribute(..., clip_grad_norm=C)``, sync mode): after averaging, each server adds up
the squared norm of its partition's mean gradient, one all-reduce of that number (over the workers
when co-located; over every rank, workers adding zero, when there are several dedicated servers)
gives the global norm, and each server scales its partition as ``torch.nn.utils.clip_grad_norm_``
would before it updates. A gradient changed in place between backward and step cannot reach the
servers: ``distribute`` refuses it (``grad_edits``).

Must match across ranks: the model and the optimizer's hyperparameters (servers build their own
from the same script). Optimizer state lives on the servers, one partition each.

Why one file of this size: the worker and server halves of one wire protocol (headers, fused
groups, pushes and pulls) change together and are read together.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.allreduce import plan_buckets
from gradsync.strategies.base import Strategy, SyncContext, fill_slot, mean_of_used, ring_bytes
from gradsync.strategies.optstate import StateLayout, gather, hyperparameters, install, set_hyperparameters
from gradsync.transport import check_peer, wait_all

OP_STEP, OP_STOP, OP_SAVE, OP_LOAD = 1, 2, 3, 4
TAG_CONTROL = 0


def _check_header(header: torch.Tensor, src: int, ops=(OP_STEP, OP_STOP, OP_SAVE, OP_LOAD)) -> None:
    op, step = header.tolist()
    check_peer(op in ops and step >= 0, src, "a parameter-server step header",
               f"operation {op} and step {step}")


def partition(sizes: list[int], servers: list[int]) -> list[int]:
    """Owner rank of each tensor: largest first onto the least-loaded server (ties: lowest index)."""
    load = {s: 0 for s in servers}
    owner = [servers[0]] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(servers, key=lambda s: (load[s], servers.index(s)))
        owner[i] = s
        load[s] += sizes[i]
    return owner


class _Fused:
    """One message: the tensors' data back to back, then (for pushes) one "used" flag per tensor."""

    __slots__ = ("wire", "parts", "used")

    def __init__(self, params: list[torch.Tensor], flags: bool):
        total = sum(p.numel() for p in params)
        first = params[0]
        self.wire = torch.zeros(total + (len(params) if flags else 0), dtype=first.dtype, device=first.device)
        self.parts, offset = [], 0
        for p in params:
            self.parts.append(self.wire[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.used = self.wire[total:] if flags else None


class ParameterServer(Strategy):
    """Push gradients to parameter servers during backward; pull updated parameters at step."""

    name = "ps"
    summary = "parameter server: whole tensors pushed in backward, updated on servers, pulled at step (TF-PS, KVStore)"
    uses_servers = True

    def __init__(self, mode: str = "sync", fuse_kb: float = 256.0):
        if mode not in ("sync", "async"):
            raise ConfigError(f"ps mode must be 'sync' or 'async', got {mode!r}")
        if fuse_kb < 0:
            raise ConfigError(f"fuse_kb must be >= 0 (0: one message per tensor), got {fuse_kb}")
        self.mode = mode
        if mode == "async":
            self.backends = ("gloo",)  # a server takes each push from whichever worker sends first
        self.fuse_bytes = int(fuse_kb * 1024)
        self.exact = mode == "sync"
        self.clips = mode == "sync"  # a synchronous server holds its share of the step's mean gradient
        if mode == "async":
            self.summary = "asynchronous parameter server: each push applied alone, no barrier (TF-PS async)"

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        self.dedicated = topo.num_servers > 0
        if self.mode == "async" and not self.dedicated:
            raise ConfigError("ps in async mode needs dedicated server ranks: run with `gradsync run "
                              "--servers 1` or more (GRADSYNC_NUM_SERVERS under another launcher)")
        self.servers = topo.server_ranks if self.dedicated else topo.worker_ranks
        self.owner = partition([p.numel() for p in ctx.params], self.servers)
        self._plan_groups()
        me, params = topo.rank, ctx.params
        mine = [g for g, grp in enumerate(self.groups) if self.group_owner[g] == me]
        self.owned = [i for g in mine for i in self.groups[g]]
        self.owned_groups = mine
        self.optimizer_class = type(ctx.optimizer)  # before distribute wraps it
        self.state_location = "servers" if self.dedicated else ("workers" if topo.num_workers > 1 else "optimizer")
        self.step_no = 0
        self.open = False
        self.closed = False
        self.sends: list = []
        theirs = [g for g in range(len(self.groups)) if self.group_owner[g] != me]
        self.outbox = {g: _Fused([params[i] for i in self.groups[g]], flags=True) for g in theirs}
        # Fused pulls land in a buffer and are copied out; a single tensor lands in place.
        self.pull_buf = {g: _Fused([params[i] for i in self.groups[g]], flags=False)
                         for g in theirs if len(self.groups[g]) > 1}
        self.answer_buf = {g: _Fused([params[i] for i in self.groups[g]], flags=False)
                           for g in mine if len(self.groups[g]) > 1}
        peers = [w for w in topo.worker_ranks if w != me]
        self.inbox = {(w, g): _Fused([params[i] for i in self.groups[g]], flags=True) for w in peers for g in mine}
        self.recvs: list = []
        self._reset_pushes()

    def _plan_groups(self) -> None:
        """Fuse tensors that are consecutive in backward order, go to one server and fit ``fuse_kb``.

        The plan is static (the same on every rank), so a receiver always knows what a message holds.
        """
        params, order = self.ctx.params, list(reversed(range(len(self.ctx.params))))
        self.groups: list[list[int]] = []
        self.group_owner: list[int] = []
        for server in self.servers:
            mine = [i for i in order if self.owner[i] == server]
            if self.fuse_bytes:
                planned = plan_buckets(params, mine, self.fuse_bytes, self.fuse_bytes)
            else:
                planned = [[i] for i in mine]
            self.groups += planned
            self.group_owner += [server] * len(planned)
        self.where = {i: (g, slot) for g, grp in enumerate(self.groups) for slot, i in enumerate(grp)}

    def _reset_pushes(self) -> None:
        self.pending = [len(grp) for grp in self.groups]
        self.ready = [[False] * len(grp) for grp in self.groups]
        self.pushed = [False] * len(self.groups)

    def _label(self, g: int) -> str:
        names = self.ctx.names
        grp = self.groups[g]
        return repr(names[grp[0]]) if len(grp) == 1 else f"{len(grp)} tensors from {names[grp[0]]!r}"

    # -- worker side ---------------------------------------------------------------------------
    def _open_step(self) -> None:
        self.open = True
        t = self.ctx.transport
        if self.dedicated:
            header = torch.tensor([OP_STEP, self.step_no], dtype=torch.int64, device=t.device)
            self.sends += [t.send_async(header, s, TAG_CONTROL, what=f"step header to rank {s}")
                           for s in self.servers]
        else:  # co-located: this worker serves its partition, so it listens for pushes now
            self.recvs = self._post_pushes([w for w in self.ctx.topology.worker_ranks if w != t.topology.rank])

    def _post_pushes(self, workers: list[int]) -> list:
        t = self.ctx.transport
        return [t.recv_async(self.inbox[(w, g)].wire, w, 1 + self.groups[g][0],
                             what=f"push of {self._label(g)} from rank {w}")
                for w in workers for g in self.owned_groups]

    def on_grad_ready(self, index: int) -> None:
        if not self.open:
            self._open_step()
        g, slot = self.where[index]
        if self.group_owner[g] == self.ctx.topology.rank:
            return
        if self.pushed[g]:
            raise GradsyncError(
                f"parameter {self.ctx.names[index]!r} received a second gradient after it was pushed. "
                "For gradient accumulation, run all but the last backward inside `with optimizer.no_sync():`")
        self._fill(g, slot)
        if not self.ready[g][slot]:
            self.ready[g][slot] = True
            self.pending[g] -= 1
        if self.pending[g] == 0:
            self._push(g)

    def _fill(self, g: int, slot: int) -> None:
        msg = self.outbox[g]
        msg.used[slot] = fill_slot(msg.parts[slot], self.ctx.params[self.groups[g][slot]].grad)

    def _push(self, g: int) -> None:
        self.pushed[g] = True
        owner = self.group_owner[g]
        self.sends.append(self.ctx.transport.send_async(
            self.outbox[g].wire, owner, 1 + self.groups[g][0], what=f"push of {self._label(g)} to rank {owner}"))

    def step(self, apply: Callable[[], Any]) -> Any:
        if not self.open:
            self._open_step()
        for g in self.outbox:
            if not self.pushed[g]:  # tensors without a gradient this step: zeros, flagged unused
                for slot, done in enumerate(self.ready[g]):
                    if not done:
                        self._fill(g, slot)
                self._push(g)
        result = None
        if not self.dedicated:
            wait_all(self.recvs)
            self._aggregate(self.ctx.topology.worker_ranks, own=True)
            self._clip()
            result = apply()
            # Receives before sends: Gloo carries a pair's messages both ways at once only when
            # each side posted its receive first (docs/mechanisms.md: the other order halves
            # each direction of a large exchange).
            pulls = self._post_pulls()
            self.sends += self._answer(self.ctx.topology.worker_ranks)
        else:
            if len(self.servers) > 1:
                self._clip()  # this worker's share of the norm is zero
            pulls = self._post_pulls()
        self._finish_pulls(pulls)
        wait_all(self.sends)
        self.sends, self.open = [], False
        self._reset_pushes()
        self.step_no += 1
        return result

    moves_server_state = True

    def gather_state(self) -> None:
        """Co-located: each worker's optimizer holds the state of the parameters it serves.
        Dedicated (sync): the servers' optimizers hold it; every worker asks every server, and
        workers and servers assemble it in one collective (the servers' :meth:`_save`)."""
        opt, params = self.ctx.optimizer, self.ctx.params
        if self.dedicated:
            self._tell_servers(OP_SAVE, "saving")
            install(opt, params, gather(self._layout(), [], self.ctx.transport, world=True))
            return
        install(opt, params, gather(self._layout(), self._own_pieces(), self.ctx.transport))

    def load_state(self) -> None:
        """Dedicated (sync): hand the state just loaded on the workers, and the param groups'
        hyperparameters, to the servers (the servers' :meth:`_load`). Co-located: nothing to do,
        each worker's optimizer already holds the state of what it serves."""
        if not self.dedicated:
            return
        self._tell_servers(OP_LOAD, "loading")
        self._receive_state(source=self.ctx.topology.rank == self.ctx.topology.worker_ranks[0])

    def _layout(self) -> StateLayout:
        return StateLayout(self.optimizer_class, self.ctx.optimizer, self.ctx.params)

    def _tell_servers(self, op: int, doing: str) -> None:
        if self.mode != "sync":
            raise ConfigError(f"{doing} the optimizer state of asynchronous servers is not supported: each applies "
                              "pushes as they come, so the state is whole at no step. Use ps in sync mode")
        t = self.ctx.transport
        header = torch.tensor([op, self.step_no], dtype=torch.int64, device=t.device)
        wait_all([t.send_async(header, s, TAG_CONTROL, what=f"{doing} request to rank {s}") for s in self.servers])

    def _receive_state(self, source: bool) -> None:
        """Collective over every rank: worker 0's optimizer state and hyperparameters to all. The
        servers keep the state of what they serve."""
        opt, params, t = self.ctx.optimizer, self.ctx.params, self.ctx.transport
        pieces = [(i, 0, p.numel(), opt.state[p]) for i, p in enumerate(params) if opt.state.get(p)] if source else []
        state = gather(self._layout(), pieces, t, world=True)
        hyper = torch.tensor(hyperparameters(opt), dtype=torch.float64, device=t.device)
        t.broadcast(hyper, self.ctx.topology.worker_ranks[0], world=True, what="the optimizer's hyperparameters")
        if self.ctx.topology.is_server:
            install(opt, params, {i: s for i, s in state.items() if i in set(self.owned)})
            set_hyperparameters(opt, hyper.tolist())

    def _save(self) -> None:
        """Server side of :meth:`gather_state`: contribute the owned parameters' state."""
        gather(self._layout(), self._own_pieces(), self.ctx.transport, world=True)

    def _own_pieces(self) -> list:
        """The optimizer state of the parameters this rank serves, as :func:`optstate.gather` pieces."""
        opt, params = self.ctx.optimizer, self.ctx.params
        return [(i, 0, params[i].numel(), opt.state[params[i]]) for i in self.owned if opt.state.get(params[i])]

    def _post_pulls(self) -> list:
        """Receives for the updated parameters of every group this rank does not own (a single
        tensor lands in place: its owner answers after this rank's own update, which skips it)."""
        t, params = self.ctx.transport, self.ctx.params
        handles = []
        for g in self.outbox:
            target = self.pull_buf[g].wire if g in self.pull_buf else params[self.groups[g][0]].data
            handles.append(t.recv_async(target, self.group_owner[g], 1 + self.groups[g][0],
                                        what=f"pull of {self._label(g)} from rank {self.group_owner[g]}"))
        return handles

    def _finish_pulls(self, handles: list) -> None:
        wait_all(handles)
        params = self.ctx.params
        with torch.no_grad():
            for g, buf in self.pull_buf.items():
                for i, part in zip(self.groups[g], buf.parts):
                    params[i].copy_(part)

    # -- server side (dedicated ranks, and co-located workers for their partition) ---------------
    def _aggregate(self, workers: list[int], own: bool = False) -> None:
        """Set ``grad`` of owned parameters to the workers' mean; other parameters get ``None``."""
        me, params = self.ctx.topology.rank, self.ctx.params
        divisor = len(workers) if self.mode == "sync" else 1
        for g, grp in enumerate(self.groups):
            if self.group_owner[g] != me:
                for i in grp:
                    params[i].grad = None
                continue
            msgs = [self.inbox[(w, g)] for w in workers if w != me]
            flags = [m.used.tolist() for m in msgs]
            for slot, i in enumerate(grp):
                p = params[i]
                # Sum in place: into the owner's own gradient when it has one, else a zeroed buffer.
                total = p.grad if own and p.grad is not None else torch.zeros_like(p)
                used = 1.0 if own and p.grad is not None else 0.0
                for m, f in zip(msgs, flags):
                    total.add_(m.parts[slot])
                    used += f[slot]
                p.grad = mean_of_used(total, used, divisor)

    def _clip(self) -> None:
        """Scale the owned mean gradients so the whole model's gradient norm is at most the clip
        (``clip_grad_norm_``'s rule); collective over the workers, or over every rank with several
        dedicated servers."""
        clip = self.ctx.clip_grad_norm
        if clip is None:
            return
        t, params, me = self.ctx.transport, self.ctx.params, self.ctx.topology.rank
        grads = [params[i].grad for i in self.owned if params[i].grad is not None] if me in self.servers else []
        total = torch.zeros(1, dtype=torch.float64, device=params[0].device)
        for grad in grads:
            total += grad.detach().double().square().sum()
        if len(self.servers) > 1:
            t.allreduce(total, world=self.dedicated, what="all-reduce of the squared gradient norm (clip_grad_norm)")
        coef = min(clip / (float(total.sqrt()) + 1e-6), 1.0)
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)

    def _answer(self, workers: list[int]) -> list:
        """Send each owned group's updated parameters to ``workers`` (one fused message per group)."""
        t, me, params = self.ctx.transport, self.ctx.topology.rank, self.ctx.params
        handles = []
        for g in self.owned_groups:
            if g in self.answer_buf:
                buf = self.answer_buf[g]
                with torch.no_grad():
                    for i, part in zip(self.groups[g], buf.parts):
                        part.copy_(params[i])
                data = buf.wire
            else:
                data = params[self.groups[g][0]].data
            handles += [t.send_async(data, w, 1 + self.groups[g][0], what=f"pull of {self._label(g)} to rank {w}")
                        for w in workers if w != me]
        return handles

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
        for h, w in zip(headers, workers):
            _check_header(h, w)
        return headers

    def _serve_sync(self) -> None:
        workers, optimizer = self.ctx.topology.worker_ranks, self.ctx.optimizer
        answers: list = []
        while True:
            headers = self._headers(workers)
            ops = [int(h[0]) for h in headers]
            if all(op == OP_STOP for op in ops):
                break
            if all(op == OP_SAVE for op in ops):
                self._save()
                continue
            if all(op == OP_LOAD for op in ops):
                self._receive_state(source=False)
                continue
            steps = {int(h[1]) for h in headers}
            if len(set(ops)) > 1 or len(steps) > 1:
                doing = {OP_STOP: "stopped after {} steps", OP_SAVE: "saving the state after {} steps",
                         OP_LOAD: "loading a state after {} steps", OP_STEP: "starting step {}"}
                described = ", ".join(
                    f"{self.ctx.topology.describe(w)}: "
                    + doing[int(h[0])].format(int(h[1]) + (int(h[0]) == OP_STEP))
                    for w, h in zip(workers, headers))
                raise GradsyncError(f"workers are out of step ({described}); every worker must run the "
                                    "same number of optimizer steps before gradsync.shutdown()")
            wait_all(self._post_pushes(workers))
            wait_all(answers)  # the previous pull must be on the wire before parameters change
            self._aggregate(workers)
            self._clip()
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
            _check_header(header, worker, ops=(OP_STEP, OP_STOP))
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

    def min_bytes_per_host(self, model_bytes: int) -> float:
        """Dedicated servers: a worker pushes and pulls everything once, a server serves N workers its
        share; co-located: each host exchanges the other hosts' shares, as much as a ring all-reduce."""
        n, s = self.ctx.topology.num_workers, self.ctx.topology.num_servers
        if s:
            return max(model_bytes, n * model_bytes / s)
        return ring_bytes(model_bytes, n)

    def describe(self) -> str:
        where = f"{len(self.servers)} dedicated servers" if self.dedicated else f"co-located on {len(self.servers)} workers"
        fused = f"fuse_kb={self.fuse_bytes / 1024:g}" if self.fuse_bytes else "one message per tensor"
        return f"ps({self.mode}, {where}, {len(self.groups)} messages per push, {fused})"
