"""The strategy contract: how gradients (or parameters) move between ranks.

:func:`gradsync.distribute` installs the same three hook points for every strategy and calls
them; a strategy never installs autograd or module hooks itself, and nothing outside a strategy
branches on which strategy is running.

- ``on_grad_ready(i)``: parameter ``i``'s gradient was just accumulated during backward
  (``Parameter.register_post_accumulate_grad_hook``). Start sending it if you like.
- ``before_forward()``: the next forward pass is about to read the parameters. A strategy that
  updates parameters remotely (a parameter server) makes sure they have arrived.
- ``on_params_needed(indices)``: the forward pass is about to run a module that directly owns
  parameters ``indices`` (a forward pre-hook per such module; installed only for strategies that
  override this method). A strategy that lets the next forward start before every parameter has
  arrived (P3's forward overlap) waits here for just these.
- ``on_lookup(index, ids)``: an ``nn.Embedding`` / ``nn.EmbeddingBag`` whose weight is parameter
  ``index`` is about to read rows ``ids`` (a forward pre-hook on each such module; installed only
  for strategies that override this method). A strategy that keeps tables elsewhere (hybrid's
  parameter servers) brings those rows in here.
- ``after_backward()``: the backward pass that produced gradients just ended (an autograd-engine
  callback queued at the first ``on_grad_ready`` of that pass, as PyTorch DDP does; installed only
  for strategies that override it). A strategy that keeps the synchronized gradient on the workers
  waits for its collectives here, so that when ``loss.backward()`` returns ``p.grad`` already holds
  the mean over workers: gradient clipping, ``GradScaler.unscale_`` and logging see what the update
  will use.
- ``step(apply)``: the user called ``optimizer.step()``. Finish synchronization and call
  ``apply()`` (the wrapped optimizer's own step) where the strategy wants the update to happen,
  or not at all when the update happens on a server.
- ``flush()``: wait for everything in flight, so that parameters are current on this worker
  (``optimizer.flush()``; before reading, saving or evaluating the model outside ``forward``).

Server ranks call ``serve()`` instead of training; ``close()`` runs at ``gradsync.shutdown()``.
Gradient semantics every exact strategy implements (and the tests check against a single
process): the gradient of a parameter is the mean over workers of each worker's gradient, a
worker that did not use the parameter contributing zero; a parameter no worker used keeps
``grad = None``, so the optimizer skips it, exactly as PyTorch DDP does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from gradsync.topology import Topology
from gradsync.transport import Transport


@dataclass
class SyncContext:
    """What a strategy gets at attach time. ``params[i]`` is the parameter of hook index ``i``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    names: list[str]
    transport: Transport
    topology: Topology
    stats: dict = field(default_factory=dict)
    clip_grad_norm: float | None = None
    """Clip the mean gradient to this global L2 norm before each update (strategies with ``clips``)."""
    two_level: Any = None
    """The job's host groups (:class:`gradsync.transport.TwoLevel`) where its hosts run several
    workers on Gloo and the strategy may cross the network once per host (``distribute(...,
    hosts="auto")``, the default); None: flat, every worker a peer of every other."""


class Strategy:
    """Base class: a no-op strategy (each rank trains alone). Subclasses override hook points."""

    name: ClassVar[str] = "local"
    exact: ClassVar[bool] = True
    """Whether final parameters equal the single-process data-parallel reference (up to fp32 rounding)."""
    uses_servers: ClassVar[bool] = False
    """Whether server ranks take part (they then call :meth:`serve`)."""
    mean_grads_at_apply: ClassVar[bool] = False
    """Whether ``apply()`` runs on every worker with every parameter's ``grad`` holding the mean over
    workers (what gradient monitors such as :class:`gradsync.adapt.NoiseScale` read)."""
    mean_over_workers: ClassVar[bool] = False
    """Whether each update uses the mean over workers of each worker's gradient, so that a worker's
    gradient weight (``optimizer.set_grad_weight``: ``num_workers * b_r / B`` for ``b_r`` of the
    global batch's ``B`` samples) makes workers with unequal batches update exactly as one process
    on the whole global batch (:class:`gradsync.adapt.BalanceBatches`)."""
    waits_recorded: ClassVar[bool] = True
    """Whether the training thread's waits on its peers go through gradsync's transport, so that the
    flight record times them (``FlightRecorder.waited_s``, which :class:`gradsync.adapt.BalanceBatches`
    takes off a step's time to find the worker's own)."""

    summary: ClassVar[str] = "each rank trains alone"
    """One line for ``gradsync strategies``: what moves when, and the design it follows."""
    backends: ClassVar[tuple[str, ...]] = ("gloo", "nccl")
    """The torch.distributed backends it runs on."""
    grad_edits: ClassVar[str] = "refused"
    """What a change to ``p.grad`` between ``backward()`` and ``optimizer.step()`` does (gradient
    clipping, ``GradScaler.unscale_``, a custom edit):

    - ``"synced"``: ``p.grad`` holds the synchronized mean when backward returns, and the update
      uses it: edits act exactly as in a single process (``allreduce``, ``ddp``, ``casync-*``).
    - ``"local"``: the update uses this worker's own gradient (model averaging: ``sma``,
      ``pair-averaging``), so edits act on it, as each worker's local step would.
    - ``"refused"``: gradients leave the worker during backward and the update happens elsewhere
      (a server, a slice's own optimizer). An edit would not reach it, so ``distribute`` compares
      each gradient's version counter at ``step()`` and raises :class:`GradientEditedError`;
      clipping is then ``distribute(..., clip_grad_norm=C)`` where :attr:`clips` is true.
    """
    period: int = 1
    """Steps from one synchronization to the next (``local-sgd``, ``diloco``: ``H``). Where it is
    more than one, most steps send nothing, so ``gradsync bench`` and the simulator report the mean
    step over whole periods, not the median (which would be a step without communication)."""
    synchronous: ClassVar[bool] = True
    """Every worker finishes each step with the others (a barrier in effect): the straggler monitor
    may then time the links at the same step on every worker (:mod:`gradsync.stragglers`)."""
    clips: ClassVar[bool] = False
    """For ``"refused"`` strategies: whether the strategy clips by the global norm of the mean
    gradient itself, where the update happens (``SyncContext.clip_grad_norm``)."""

    ctx: SyncContext

    def attach(self, ctx: SyncContext) -> None:
        self.ctx = ctx

    def adopt(self, previous: "Strategy") -> None:
        """Called before :meth:`attach` when this strategy replaces ``previous`` on the same
        parameters after an elastic shrink (the survivors of one job, ``previous`` detached cleanly
        from the old group, on every survivor alike): take over what does not depend on the group
        (buffers, a learned order), so the regroup allocates nothing. By default nothing is kept."""

    def wrap_forward(self, forward: Callable) -> Callable | None:
        """Optionally return a replacement for the model's forward (used by ``ddp``)."""
        return None

    def on_grad_ready(self, index: int) -> None:
        pass

    def before_forward(self) -> None:
        pass

    def on_params_needed(self, indices: tuple[int, ...]) -> None:
        pass

    def on_lookup(self, index: int, ids: torch.Tensor) -> None:
        pass

    def flush(self) -> None:
        pass

    def settle(self) -> None:
        """Wait until the traffic of the steps taken so far has crossed, starting none beyond it:
        where a count of those steps' bytes ends. :meth:`flush` by default (the last step's pulls
        or all-reduces still in flight); a strategy whose flush sends more than its steps would
        overrides it."""
        self.flush()

    def after_load(self) -> None:
        """The model's ``load_state_dict()`` just ended (every worker loads a checkpoint alike)."""

    def after_backward(self) -> None:
        pass

    def step(self, apply: Callable[[], Any]) -> Any:
        return apply()

    def serve(self) -> None:
        pass

    state_location: str = "optimizer"
    """Where the optimizer state lives, for ``optimizer.state_dict()`` (see
    :mod:`gradsync.strategies.optstate`): ``"optimizer"``, in the user's optimizer; ``"here"``, all of
    it on this worker, in the strategy's own pieces; ``"workers"``, spread over the workers
    (assembling it is a collective: ``optimizer.consolidate_state_dict()``); ``"servers"``, on
    dedicated servers, out of the workers' reach."""

    moves_server_state: ClassVar[bool] = False
    """With ``state_location == "servers"``: whether :meth:`gather_state` and :meth:`load_state`
    reach the dedicated servers (``ps``); otherwise saving refuses and loading happens before
    ``distribute``, where the servers run the same script."""

    def gather_state(self) -> None:
        """Put every parameter's current optimizer state, whole tensors, into the user's optimizer
        (``state_location`` ``"here"``, or ``"workers"``, where every worker calls it)."""

    def load_state(self) -> None:
        """The user's optimizer was just loaded with whole-tensor state: hand it to the pieces the
        strategy updates."""

    def close(self) -> None:
        pass

    def abandon(self) -> None:
        """A peer failed and this rank goes on (an elastic job regroups): stop this rank's own
        threads and release what it holds locally, without waiting on a peer. By default
        :meth:`close`, whose first word to a peer fails at once on the failed transport; a strategy
        whose close would leave threads running or state changed overrides it. A thread still
        blocked in a receive from the broken group ends at its timeout (a Gloo receive cannot be
        cancelled), and shutdown waits for it."""
        with contextlib.suppress(Exception):
            self.close()

    def describe(self) -> str:
        """One line for logs and reports: the strategy and its effective options."""
        return self.name

    def host_work(self) -> dict[str, list]:
        """Host work this rank has done for the strategy so far, by kind: ``[calls, bytes, seconds]``
        each (the compressed strategies' encodes and decodes); empty where none is counted."""
        return {}

    def min_bytes_per_host(self, model_bytes: int) -> float:
        """Bytes the busiest host's link must send (or receive, whichever is more) in one step.

        The lower bound of this strategy's traffic pattern, for the benchmark's physical bound
        (``T_comm_min = min_bytes_per_host / link rate``), counted per host of the topology
        (:func:`worker_hosts`): the ranks of one host may combine what they send before it
        crosses the link, so with one rank per host it is per rank. Each rank alone: nothing.
        """
        return 0.0


def ring_bytes(model_bytes: int, num_workers: int) -> float:
    """A ring all-reduce: every host sends and receives ``2 (N-1)/N`` of the data (Patarasuk & Yuan)."""
    return 2 * (num_workers - 1) / num_workers * model_bytes


def worker_hosts(topology: Topology) -> list[list[int]]:
    """The workers of each host that runs any, hosts in order (one worker a host where the layout
    is not known): the hosts a strategy's bound counts, as :meth:`Strategy.min_bytes_per_host` does."""
    return [w for w in ([r for r in ranks if r < topology.num_workers] for ranks in topology.hosts) if w]


def host_ring_bytes(model_bytes: float, topology: Topology) -> float:
    """A ring all-reduce over the hosts that run workers, each host's workers summed inside it
    first: :func:`ring_bytes` over the hosts (over the workers at one worker a host)."""
    return ring_bytes(model_bytes, len(worker_hosts(topology)))


def served_bytes_per_host(model_bytes: int, topology: Topology, holders: list[int] | None = None) -> float:
    """Parameter servers' traffic, the busiest host's: each host with workers pushes, once for all
    its workers, the share of the model held on other hosts and pulls it back; a host holding a
    share takes it in from every other host with workers and answers each. Holders are
    ``holders``, else the dedicated servers, else (co-located) the workers, each holding an equal
    share.

    One rank a host: dedicated servers ``max(M, N M / S)``; co-located, a ring's ``2 (N-1)/N M``."""
    hosts = worker_hosts(topology)
    if not topology.num_servers and len({len(w) for w in hosts}) == 1:  # co-located, even: a ring's
        return host_ring_bytes(model_bytes, topology)
    holders = holders or topology.server_ranks or topology.worker_ranks
    most = 0.0
    for ranks in topology.hosts:
        here = sum(1 for r in ranks if r in holders)
        works = int(any(r < topology.num_workers for r in ranks))
        out = works * (len(holders) - here) * model_bytes / len(holders) + here * (len(hosts) - works) * model_bytes / len(holders)
        most = max(most, out)
    return most


def fill_slot(slot: torch.Tensor, grad: torch.Tensor | None) -> float:
    """Copy ``grad`` into its place in an outgoing message; 1.0 ("used"), or zeros and 0.0 for ``None``."""
    if grad is None:
        slot.zero_()
        return 0.0
    slot.copy_(grad)
    return 1.0


def mean_of_used(total: torch.Tensor, used_count: float, num_workers: int) -> torch.Tensor | None:
    """The data-parallel gradient from a sum over workers: ``None`` when no worker used it."""
    if used_count == 0:
        return None
    return total.div_(num_workers)
