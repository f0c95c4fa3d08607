"""What ``ps`` and ``ps-async`` share: the worker's pushes and pulls, and a server's aggregate and answer.

One step, on a worker:
1. at the first gradient of the step, tell every dedicated server "step k" (a control header);
2. push gradients to their server as soon as backward has produced a whole group
   (:mod:`~gradsync.strategies.ps.wire`);
3. at ``optimizer.step()``: push zeros for parameters that got no gradient, let the subclass have
   the servers update (:meth:`ParameterServerBase._update`), then pull every parameter from its
   server into ``param.data``.

A server sets each owned parameter's ``grad`` from the pushes it received (:meth:`_aggregate`: a
worker that did not use a parameter contributes zero; a parameter nobody used is skipped, as in
DDP), runs the user's optimizer, and answers with the updated parameters (:meth:`_answer`). When
and for whom is the subclass's: :class:`~gradsync.strategies.ps.sync.ParameterServer` or
:class:`~gradsync.strategies.ps.asynchronous.AsyncParameterServer`.

Hosts of several workers (a subclass with ``aggregates_hosts``, on Gloo: BytePS's and Parallax's
local aggregation): during backward a host's workers sum each group, with how many of them used
each tensor, onto the host's first worker (intra-host) as soon as every group before it in
backward order is complete; that worker pushes each host sum the moment it is in, and alone pulls;
at ``optimizer.step()`` the pulled parameters are broadcast inside the host. Each host's NIC
carries one push and one pull instead of one per worker; co-located servers are the hosts' first
workers. Groups are summed in one fixed order on every worker of a host (a group with an unused
tensor waits for the step, where it is summed with zeros for what was not used), so the host's
collectives always match.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from gradsync import runtime
from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.base import Strategy, SyncContext, fill_slot, mean_of_used, served_bytes_per_host
from gradsync.strategies.coded import CodedBlocks
from gradsync.strategies.ps.wire import (OP_PING, OP_STEP, OP_STOP, TAG_CONTROL, Fused, check_header, partition,
                                         plan_groups)
from gradsync.transport import wait_all
from gradsync.strategies.keepalive import Absences, KeepAlive, sending


class ParameterServerBase(Strategy):
    """Whole tensors pushed during backward, updated where they are served, pulled at step."""

    uses_servers = True
    moves_server_state = True
    mode: ClassVar[str]
    """``"sync"`` or ``"async"``: what :meth:`describe` says (and the simulator models)."""

    aggregates_hosts: ClassVar[bool] = False
    """Whether hosts of several workers aggregate inside the host (see the module docstring)."""

    def __init__(self, fuse_kb: float = 256.0, compression: str | None = None, error_feedback: bool = False):
        if fuse_kb < 0:
            raise ConfigError(f"fuse_kb must be >= 0 (0: one message per tensor), got {fuse_kb}")
        self.fuse_bytes = int(fuse_kb * 1024)
        self.coder = None if compression is None else CodedBlocks(compression, error_feedback, self.name)
        """Pushes encoded per group (:mod:`gradsync.strategies.coded`), or None."""
        self.answer_coder = None if compression is None or self.mode != "sync" else CodedBlocks(
            compression, True, self.name)
        """Synchronous servers' answers: each group's change encoded, with a residual per group (an
        asynchronous server answers each worker alone, whose parameters differ: exact answers)."""
        if self.coder is not None and not self.coder.lossless:
            self.exact = False

    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        self.host_sum = ctx.two_level if self.aggregates_hosts else None
        """The job's host groups when a host's workers aggregate before pushing, else None."""
        self.pushers = topo.worker_ranks
        """The workers that push and pull: every worker, or each host's first."""
        if self.host_sum is not None:
            self.pushers = [ranks[0] for ranks in self.host_sum.plan(topo)[0]]
        self.counts: dict[int, float] = {}
        """With host sums: how many of the host's workers used each parameter this step."""
        self.dedicated = topo.num_servers > 0
        self.servers = topo.server_ranks if self.dedicated else self.pushers
        self.owner = partition([p.numel() for p in ctx.params], self.servers)
        self.groups, self.group_owner = plan_groups(ctx.params, self.owner, self.servers, self.fuse_bytes)
        self.where = {i: (g, slot) for g, grp in enumerate(self.groups) for slot, i in enumerate(grp)}
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
        self.outbox = {g: Fused([params[i] for i in self.groups[g]], flags=True) for g in theirs}
        # Fused pulls land in a buffer and are copied out; a single tensor lands in place.
        self.pull_buf = {g: Fused([params[i] for i in self.groups[g]], flags=False)
                         for g in theirs if len(self.groups[g]) > 1}
        self.answer_buf = {g: Fused([params[i] for i in self.groups[g]], flags=False)
                           for g in mine if len(self.groups[g]) > 1}
        peers = [w for w in self.pushers if w != me]
        self.inbox = {(w, g): Fused([params[i] for i in self.groups[g]], flags=True) for w in peers for g in mine}
        self.recvs: list = []
        if self.coder is not None:
            if ctx.transport.device.type != "cpu":
                raise ConfigError(f"{self.name} with compression= runs on Gloo (CPU tensors); use casync-ps on GPUs")
            self.coder.reset(me)
            self.coded_out = {g: self._coded_message(g) for g in theirs}
            self.coded_in = {(w, g): self._coded_message(g) for w in peers for g in mine}
            if self.answer_coder is not None:
                self.answer_coder.reset(me)
                numel = {g: sum(params[i].numel() for i in grp) for g, grp in enumerate(self.groups)}
                self.coded_pull = {g: torch.zeros(self.coder.slot(numel[g]), dtype=torch.uint8) for g in theirs}
                self.answer_slot = {g: torch.zeros(self.coder.slot(numel[g]), dtype=torch.uint8) for g in mine}
                self.before: dict[int, torch.Tensor] = {}
        if self.host_sum is not None:
            # Every group's message, summed in the host in backward order (a group's first tensor
            # is its last in forward order); a group this worker pushes is summed in place.
            self.host_box = {g: self.outbox.get(g) or Fused([params[i] for i in grp], flags=True)
                             for g, grp in enumerate(self.groups)}
            self.host_order = sorted(range(len(self.groups)), key=lambda g: -self.groups[g][0])
            self.summing: list = []
        self._reset_pushes()
        self.keepalive = None
        self.absences: Absences | None = None  # a dedicated server's record of its workers' headers
        # The servers' waits for headers outlive this worker's pauses. Gloo only: NCCL matches
        # point-to-point messages in order, tags aside, so a ping could land in a push's place.
        if self.dedicated and me in self.pushers and ctx.transport.device.type == "cpu":
            ping = torch.tensor([OP_PING, 0], dtype=torch.int64, device=ctx.transport.device)
            self.keepalive = KeepAlive(ctx.transport, self.servers, TAG_CONTROL, lambda: ping, "parameter-server ping")

    def _reset_pushes(self) -> None:
        self.pending = [len(grp) for grp in self.groups]
        self.ready = [[False] * len(grp) for grp in self.groups]
        self.pushed = [False] * len(self.groups)
        self.summed = 0  # host sums issued this step (their position in host_order)

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
            with sending(self.keepalive, *self.servers):
                self.sends += [t.send_async(header, s, TAG_CONTROL, what=f"step header to rank {s}")
                               for s in self.servers]
        else:  # co-located: this worker serves its partition, so it listens for pushes now
            self.recvs = self._post_pushes([w for w in self.pushers if w != t.topology.rank])

    def _coded_message(self, g: int) -> torch.Tensor:
        """An encoded push of group ``g``: the gradients' slot, then the used flags as they are."""
        slot, flags = self._coded_layout(g)
        return torch.zeros(slot + -(-flags // 8) * 8, dtype=torch.uint8)

    def _coded_layout(self, g: int) -> tuple[int, int]:
        """``(slot bytes, flag bytes)`` of group ``g``'s encoded push."""
        grp, params = self.groups[g], self.ctx.params
        return self.coder.slot(sum(params[i].numel() for i in grp)), len(grp) * params[grp[0]].element_size()

    def _encode(self, g: int) -> torch.Tensor:
        box, out = self.outbox[g], self.coded_out[g]
        slot, flags = self._coded_layout(g)
        self.coder.encode(g, box.wire[:box.wire.numel() - box.used.numel()], out[:slot], what=f"push of {self._label(g)}")
        out[slot:slot + flags].copy_(box.used.view(torch.uint8))
        return out

    def _decode(self, workers: list[int]) -> None:
        """The encoded pushes just received from ``workers`` into their plain inboxes."""
        for w in workers:
            for g in self.owned_groups:
                box, msg = self.inbox[(w, g)], self.coded_in[(w, g)]
                slot, flags = self._coded_layout(g)
                self.coder.decode(g, msg[:slot], box.wire[:box.wire.numel() - box.used.numel()], w,
                                  f"push of {self._label(g)}")
                box.used.view(torch.uint8).copy_(msg[slot:slot + flags])

    def _post_pushes(self, workers: list[int]) -> list:
        t = self.ctx.transport
        if self.coder is not None:
            return [t.recv_async(self.coded_in[(w, g)], w, 1 + self.groups[g][0],
                                 what=f"push of {self._label(g)} from rank {w}")
                    for w in workers for g in self.owned_groups]
        return [t.recv_async(self.inbox[(w, g)].wire, w, 1 + self.groups[g][0],
                             what=f"push of {self._label(g)} from rank {w}")
                for w in workers for g in self.owned_groups]

    def on_grad_ready(self, index: int) -> None:
        if not self.open and self.ctx.topology.rank in self.pushers:
            self._open_step()
        g, slot = self.where[index]
        if self.host_sum is None and self.group_owner[g] == self.ctx.topology.rank:
            return
        if self.pushed[g]:
            raise GradsyncError(
                f"parameter {self.ctx.names[index]!r} received a second gradient after it was pushed. "
                "For gradient accumulation, run all but the last backward inside `with optimizer.no_sync():`")
        self._fill(g, slot)
        if not self.ready[g][slot]:
            self.ready[g][slot] = True
            self.pending[g] -= 1
        if self.host_sum is not None:
            self._sum_ready()
        elif self.pending[g] == 0:
            self._push(g)

    def _fill(self, g: int, slot: int) -> None:
        msg = self.outbox[g] if self.host_sum is None else self.host_box[g]
        msg.used[slot] = fill_slot(msg.parts[slot], self.ctx.params[self.groups[g][slot]].grad)

    # -- hosts of several workers ----------------------------------------------------------------
    def _sum_ready(self, rest: bool = False) -> None:
        """Issue the host sums of the groups complete so far, in backward order (``rest``: every
        group left, what was not used as zeros). The host's first worker pushes each sum on as soon
        as it is in, from the communication thread."""
        t, leader = self.ctx.transport, self.ctx.topology.rank == self.host_sum.leader
        while self.summed < len(self.host_order):
            g = self.host_order[self.summed]
            if self.pending[g] and not rest:
                return
            for slot, done in enumerate(self.ready[g]):
                if not done:
                    self._fill(g, slot)
            self.pushed[g] = True
            self.summed += 1
            push = (lambda g=g: self._push(g)) if leader and g in self.outbox else None
            self.summing.append(t.host_reduce_async(self.host_box[g].wire, what=f"host sum of {self._label(g)}",
                                                    then=push))

    def _sum_host(self) -> None:
        """The rest of the host's sums; once every sum is in, the host's first worker's own groups
        (co-located) take the host's gradients, and :attr:`counts` how many workers used each."""
        self._sum_ready(rest=True)
        wait_all(self.summing)
        self.summing = []
        if self.ctx.topology.rank != self.host_sum.leader:
            return
        params = self.ctx.params
        for g in self.owned_groups:
            box = self.host_box[g]
            for slot, (i, count) in enumerate(zip(self.groups[g], box.used.tolist())):
                self.counts[i] = count
                params[i].grad = box.parts[slot].clone() if count else None

    def _share_host(self) -> None:
        """The host's first worker's parameters (just pulled) to the host's other workers."""
        params = self.ctx.params
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        self.ctx.transport.host_broadcast(flat, what="the pulled parameters to the host's workers")
        with torch.no_grad():
            at = 0
            for p in params:
                p.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()

    def _push(self, g: int) -> None:
        self.pushed[g] = True
        owner = self.group_owner[g]
        self.sends.append(self.ctx.transport.send_async(
            self.outbox[g].wire if self.coder is None else self._encode(g), owner, 1 + self.groups[g][0],
            what=f"push of {self._label(g)} to rank {owner}"))

    def step(self, apply: Callable[[], Any]) -> Any:
        if not self.open and self.ctx.topology.rank in self.pushers:
            self._open_step()
        if self.host_sum is not None:
            self._sum_host()
            if self.ctx.topology.rank not in self.pushers:
                self._reset_pushes()
                return self._follow()
        for g in self.outbox:
            if not self.pushed[g]:  # tensors without a gradient this step: zeros, flagged unused
                for slot, done in enumerate(self.ready[g]):
                    if not done:
                        self._fill(g, slot)
                self._push(g)
        result, pulls = self._update(apply)
        self._finish_pulls(pulls)
        wait_all(self.sends)
        self.sends, self.open = [], False
        self._reset_pushes()
        if self.host_sum is not None:
            self._share_host()
        self.step_no += 1
        return result

    def _follow(self) -> None:
        """A step of a host's other workers: their part in the step's collectives, then the
        parameters their host's first worker pulled."""
        self._clip()
        self._share_host()
        self.step_no += 1

    def _clip(self) -> None:
        """Clip the owned mean gradients (subclasses that clip; collective where they do)."""

    def _update(self, apply: Callable[[], Any]) -> tuple[Any, list]:
        """After this worker's pushes: whatever update happens here, and the posted pulls."""
        return None, self._post_pulls()

    def _post_pulls(self) -> list:
        """Receives for the updated parameters of every group this rank does not own (a single
        tensor lands in place: its owner answers after this rank's own update, which skips it);
        compressed answers: for each group's encoded change."""
        t, params = self.ctx.transport, self.ctx.params
        handles = []
        for g in self.outbox:
            target = self.pull_buf[g].wire if g in self.pull_buf else params[self.groups[g][0]].data
            if self.answer_coder is not None:
                target = self.coded_pull[g]
            handles.append(t.recv_async(target, self.group_owner[g], 1 + self.groups[g][0],
                                        what=f"pull of {self._label(g)} from rank {self.group_owner[g]}"))
        return handles

    def _finish_pulls(self, handles: list) -> None:
        wait_all(handles)
        params = self.ctx.params
        if self.answer_coder is not None:
            for g in self.outbox:
                grp = self.groups[g]
                change = torch.empty(sum(params[i].numel() for i in grp), dtype=params[grp[0]].dtype)
                self.answer_coder.decode(g, self.coded_pull[g], change, self.group_owner[g],
                                         f"the update of {self._label(g)}")
                self._set_group(g, change, add=True)
            return
        with torch.no_grad():
            for g, buf in self.pull_buf.items():
                for i, part in zip(self.groups[g], buf.parts):
                    params[i].copy_(part)

    # -- server side (dedicated ranks, and co-located workers for their partition) ---------------
    def _aggregate(self, workers: list[int], divisor: int, own: bool = False) -> None:
        """Set ``grad`` of owned parameters to the workers' sum over ``divisor``; other parameters get ``None``."""
        me, params = self.ctx.topology.rank, self.ctx.params
        if self.coder is not None:
            self._decode([w for w in workers if w != me])
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
                used = self.counts.get(i, 1.0) if own and p.grad is not None else 0.0
                for m, f in zip(msgs, flags):
                    total.add_(m.parts[slot])
                    used += f[slot]
                p.grad = mean_of_used(total, used, divisor)

    def _before_update(self) -> None:
        """Compressed answers: the owned groups' values before this step's update."""
        if self.answer_coder is not None:
            self.before = {g: self._group_values(g) for g in self.owned_groups}

    def _group_values(self, g: int) -> torch.Tensor:
        return torch.cat([self.ctx.params[i].detach().reshape(-1) for i in self.groups[g]])

    def _set_group(self, g: int, values: torch.Tensor, add: bool = False) -> None:
        """Group ``g``'s parameters set to ``values`` (flat), or ``add``-ed to them."""
        at = 0
        with torch.no_grad():
            for i in self.groups[g]:
                p = self.ctx.params[i]
                part = values[at:at + p.numel()].view_as(p).to(p.device)
                p.add_(part) if add else p.copy_(part)
                at += p.numel()

    def _encode_change(self, g: int) -> torch.Tensor:
        """Group ``g``'s change by this step's update, encoded (with its residual) into its answer;
        the group set to its value before plus the decoded change, as every worker computes it."""
        before, what = self.before[g], f"the update of {self._label(g)}"
        slot = self.answer_slot[g]
        self.answer_coder.encode(g, self._group_values(g).sub_(before), slot, what=what)
        change = torch.empty_like(before)
        self.answer_coder.decode(g, slot, change, self.ctx.topology.rank, what)
        self._set_group(g, before.add_(change))
        return slot

    def _answer(self, workers: list[int]) -> list:
        """Send each owned group's updated parameters to ``workers`` (one fused message per group;
        compressed answers: its encoded change)."""
        t, me, params = self.ctx.transport, self.ctx.topology.rank, self.ctx.params
        handles = []
        for g in self.owned_groups:
            if self.answer_coder is not None:
                data = self._encode_change(g)
            elif g in self.answer_buf:
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

    def _headers(self, workers: list[int]) -> list[torch.Tensor]:
        """Each worker's next header, its pings skipped (a dedicated server's wait outlives a pause
        of every worker; one worker stuck in its own code while the others wait is named)."""
        t = self.ctx.transport
        if self.absences is None:
            self.absences = Absences(workers, t.timeout.total_seconds())
        got: dict[int, torch.Tensor] = {}
        waiting = list(workers)
        while waiting:
            headers = [torch.zeros(2, dtype=torch.int64, device=t.device) for _ in waiting]
            wait_all([t.recv_async(h, w, TAG_CONTROL, what=f"step header from rank {w}") for h, w in zip(headers, waiting)])
            for h, w in zip(headers, waiting):
                check_header(h, w)
                if int(h[0]) != OP_PING:
                    got[w] = h
                    self.absences.request(w, int(h[1]))
            waiting = [w for w in waiting if w not in got]
            late = self.absences.behind(waiting)
            if late:
                raise self.absences.error(runtime.current(), f"step header from rank {late[0]}", late)
        return [got[w] for w in workers]

    def close(self) -> None:
        """Workers tell dedicated servers to stop. Safe to call twice."""
        if self.closed or not self.dedicated or self.ctx.topology.rank not in self.pushers:
            return
        self.closed = True
        if self.keepalive is not None:
            self.keepalive.stop()  # after the stop, the servers no longer listen to this worker
        header = torch.tensor([OP_STOP, self.step_no], dtype=torch.int64, device=self.ctx.transport.device)
        t = self.ctx.transport
        wait_all([t.send_async(header, s, TAG_CONTROL, what=f"stop to rank {s}") for s in self.servers])

    def min_bytes_per_host(self, model_bytes: int) -> float:
        """Dedicated servers: a host of workers pushes and pulls everything once, a server's host serves
        every host of workers its share; co-located: each host exchanges the other hosts' shares, as
        much as a ring all-reduce (:func:`~gradsync.strategies.base.served_bytes_per_host`)."""
        return served_bytes_per_host(model_bytes, self.ctx.topology)

    def describe(self) -> str:
        where = f"{len(self.servers)} dedicated servers" if self.dedicated else f"co-located on {len(self.servers)} workers"
        fused = f"fuse_kb={self.fuse_bytes / 1024:g}" if self.fuse_bytes else "one message per tensor"
        hosts = "" if self.host_sum is None else f", host sums: {len(self.pushers)} hosts push"
        coded = "" if self.coder is None else \
            f", {self.coder.describe()} {'both ways' if self.answer_coder is not None else 'on pushes'}"
        return f"ps({self.mode}, {where}, {len(self.groups)} messages per push, {fused}{hosts}{coded})"
