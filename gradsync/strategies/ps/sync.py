"""Parameter server: workers push gradients, servers aggregate and update, workers pull parameters.

The TensorFlow-PS / MXNet KVStore design (Li et al., OSDI 2014), with the update on the server,
synchronous: a server waits for every worker's header and pushes of a step, averages, runs the
user's optimizer on its partition and sends the updated parameters to every worker, so training
equals the single-process reference. Servers are either dedicated ranks (``gradsync run --servers
S``) or, with none, the workers themselves ("co-located": worker ``r`` serves its own partition at
its ``optimizer.step()``). The worker side and the wire are shared with ``ps-async``
(:mod:`gradsync.strategies.ps.base`, :mod:`gradsync.strategies.ps.wire`).

Clipping (``distribute(..., clip_grad_norm=C)``): after averaging, each server adds up the squared
norm of its partition's mean gradient, one all-reduce of that number (over the workers when
co-located; over every rank, workers adding zero, when there are several dedicated servers) gives
the global norm, and each server scales its partition as ``torch.nn.utils.clip_grad_norm_`` would
before it updates. A gradient changed in place between backward and step cannot reach the servers:
``distribute`` refuses it (``grad_edits``).

``compression="int8"`` (any codec without a shared seed; ``error_feedback=True`` keeps a residual
per group) encodes each push that crosses the network, and servers decode before they add; each
answer is the group's change by the update, encoded with a residual per group on the server, which
sets the group to what every worker computes from it (:mod:`gradsync.strategies.coded`). Exact
with a lossless codec; Gloo only.

Must match across ranks: the model and the optimizer's hyperparameters (servers build their own
from the same script). Optimizer state lives on the servers, one partition each;
``optimizer.state_dict()`` gathers it and ``load_state_dict()`` hands it back to them.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.ps.base import ParameterServerBase
from gradsync.strategies.optstate import StateLayout, gather, hyperparameters, install, set_hyperparameters
from gradsync.strategies.keepalive import sending
from gradsync.strategies.ps.wire import OP_LOAD, OP_SAVE, OP_STEP, OP_STOP, TAG_CONTROL
from gradsync.transport import wait_all


class ParameterServer(ParameterServerBase):
    """Push gradients to parameter servers during backward; pull updated parameters at step."""

    name = "ps"
    summary = "parameter server: whole tensors pushed in backward, updated on servers, pulled at step (TF-PS, KVStore)"
    mode = "sync"
    clips = True  # a synchronous server holds its share of the step's mean gradient
    mean_over_workers = True
    aggregates_hosts = True

    def __new__(cls, mode: str = "sync", fuse_kb: float = 256.0, compression: str | None = None,
                error_feedback: bool = False):
        """``mode="async"`` is the older spelling of :class:`AsyncParameterServer` (``ps-async``)."""
        if mode not in ("sync", "async"):
            raise ConfigError(f"ps mode must be 'sync' or 'async', got {mode!r}")
        if mode == "async" and cls is ParameterServer:
            from gradsync.strategies.ps.asynchronous import AsyncParameterServer

            warnings.warn("ParameterServer(mode='async') is AsyncParameterServer (strategy 'ps-async'); "
                          "use that class", DeprecationWarning, stacklevel=2)
            return AsyncParameterServer(fuse_kb=fuse_kb, compression=compression, error_feedback=error_feedback)
        return super().__new__(cls)

    def __init__(self, mode: str = "sync", fuse_kb: float = 256.0, compression: str | None = None,
                 error_feedback: bool = False):
        super().__init__(fuse_kb, compression, error_feedback)

    def _update(self, apply: Callable[[], Any]) -> tuple[Any, list]:
        """Co-located: serve the own partition (every worker's pushes, the user's optimizer, answers);
        dedicated: this worker's (zero) share of the clipping norm."""
        if self.dedicated:
            if len(self.servers) > 1:
                self._clip()  # this worker's share of the norm is zero
            return None, self._post_pulls()
        wait_all(self.recvs)
        self._aggregate(self.pushers, self.ctx.topology.num_workers, own=True)
        self._clip()
        self._before_update()
        result = apply()
        # Receives before sends: Gloo carries a pair's messages both ways at once only when each
        # side posted its receive first (docs/mechanisms.md: the other order halves each
        # direction of a large exchange).
        pulls = self._post_pulls()
        self.sends += self._answer(self.pushers)
        return result, pulls

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

    # -- the servers' optimizer state ------------------------------------------------------------
    def gather_state(self) -> None:
        """Co-located: each worker's optimizer holds the state of the parameters it serves.
        Dedicated: the servers' optimizers hold it; every worker asks every server, and workers and
        servers assemble it in one collective (the servers' :meth:`_save`)."""
        opt, params = self.ctx.optimizer, self.ctx.params
        if self.dedicated:
            self._tell_servers(OP_SAVE, "saving")
            install(opt, params, gather(self._layout(), [], self.ctx.transport, world=True))
            return
        install(opt, params, gather(self._layout(), self._own_pieces(), self.ctx.transport))

    def load_state(self) -> None:
        """Dedicated: hand the state just loaded on the workers, and the param groups'
        hyperparameters, to the servers (the servers' :meth:`_receive_state`). Co-located: nothing
        to do, each worker's optimizer already holds the state of what it serves."""
        if not self.dedicated:
            return
        self._tell_servers(OP_LOAD, "loading")
        self._receive_state(source=self.ctx.topology.rank == self.ctx.topology.worker_ranks[0])

    def _layout(self) -> StateLayout:
        return StateLayout(self.optimizer_class, self.ctx.optimizer, self.ctx.params)

    def _tell_servers(self, op: int, doing: str) -> None:
        t = self.ctx.transport
        if t.topology.rank not in self.pushers:  # the servers hear from each host's first worker
            return
        header = torch.tensor([op, self.step_no], dtype=torch.int64, device=t.device)
        with sending(self.keepalive, *self.servers):
            handles = [t.send_async(header, s, TAG_CONTROL, what=f"{doing} request to rank {s}") for s in self.servers]
        wait_all(handles)

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

    # -- the dedicated server --------------------------------------------------------------------
    def serve(self) -> None:
        """Dedicated server loop: one update per step once every worker's pushes are in; runs until
        every worker has sent 'stop' (``gradsync.shutdown``)."""
        workers, optimizer = self.pushers, self.ctx.optimizer
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
                raise self._out_of_step(workers, headers)
            wait_all(self._post_pushes(workers))
            wait_all(answers)  # the previous pull must be on the wire before parameters change
            self._aggregate(workers, self.ctx.topology.num_workers)
            self._clip()
            self._before_update()
            optimizer.step()
            answers = self._answer(workers)
        wait_all(answers)

    def _out_of_step(self, workers: list[int], headers: list[torch.Tensor]) -> GradsyncError:
        doing = {OP_STOP: "stopped after {} steps", OP_SAVE: "saving the state after {} steps",
                 OP_LOAD: "loading a state after {} steps", OP_STEP: "starting step {}"}
        described = ", ".join(
            f"{self.ctx.topology.describe(w)}: " + doing[int(h[0])].format(int(h[1]) + (int(h[0]) == OP_STEP))
            for w, h in zip(workers, headers))
        return GradsyncError(f"workers are out of step ({described}); every worker must run the "
                             "same number of optimizer steps before gradsync.shutdown()")
