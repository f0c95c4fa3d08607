"""The user's optimizer, wrapped: ``step()`` first lets the strategy synchronize.

The optimizer is wrapped, not replaced (Horovod's habit): :func:`wrap` gives it a class made for
it, a subclass of both :class:`DistributedOptimizer` and the user's own class, named like the
latter. ``isinstance`` checks, ``state_dict`` and learning-rate schedulers keep working, and the
methods below come first. :func:`detach` and :func:`reattach` take a strategy off and put a fresh
one on (``switch_strategy``, an elastic job's regroup).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math

import torch

from gradsync import flight, hooks, runtime, stragglers
from gradsync.checks import check_backend, check_clip
from gradsync.errors import ConfigError, GradientEditedError, GradsyncError
from gradsync.strategies import Strategy, SyncContext, resolve
from gradsync.syncstate import SyncState


class DistributedOptimizer:
    """What a distributed optimizer adds to the user's optimizer class. The per-optimizer state is
    ``self._gradsync`` (a :class:`~gradsync.syncstate.SyncState`)."""

    _gradsync: SyncState

    @property
    def strategy(self) -> Strategy:
        """The strategy that synchronizes this optimizer's steps."""
        return self._gradsync.strategy

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # torch.amp.GradScaler then hands step() the overflow flag (``found_inf``) instead of
        # unscaling: its unscale does not bump the version counters check_unedited reads.
        return self._gradsync.refuses_edits

    def step(self, closure=None):
        """Run ``closure`` if given, then the strategy's step, which applies the user's optimizer
        where the strategy updates (here, on the servers, or per slice)."""
        sync = self._gradsync
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads_unedited()
        apply = sync.traced(sync.user_step or super().step)
        if sync.clip is not None and not sync.refuses_edits:
            apply = sync.clipped(apply)
        if sync.observer is None:
            sync.strategy.step(apply)
        else:
            sync.strategy.step(sync.observed(apply))
            sync.observer.after_step()
        sync.steps += 1
        recorder = flight.current()
        if recorder is not None:
            recorder.step += 1
            recorder.pace.synchronous = sync.strategy.synchronous
            recorder.pace.end_step(recorder.waited_s, runtime.current().transport.bytes_sent)
            if sync.strategy.synchronous and stragglers.probe_due(sync.steps) and stragglers.enabled():
                self._probe_links(recorder, sync.strategy)
        return loss

    @staticmethod
    def _probe_links(recorder, strategy: Strategy) -> None:
        """Every worker times its ring neighbours' links, at the same step (gradsync.stragglers),
        once the step's traffic still in flight has crossed (``p3``'s pulls): the probe times the
        links alone."""
        rt = runtime.current()
        # Not in an elastic job (a joiner counts its steps anew), nor where workers share hosts (a
        # neighbour on the same host is no network link).
        if rt.topology.num_workers > 1 and rt.elastic is None and not rt.topology.shares_hosts:
            strategy.settle()
            recorder.pace.links = stragglers.probe(rt.transport, rt.topology, watch=recorder.pace.probe_watch)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward passes inside this block are not synchronized;
        the next backward outside it sends the accumulated gradients."""
        self._gradsync.enabled = False
        try:
            yield
        finally:
            self._gradsync.enabled = True

    def set_grad_weight(self, weight: float) -> None:
        """Multiply this worker's gradients by ``weight`` before they are synchronized, from the next
        backward on (in gradsync's gradient hook, once per parameter per synchronized backward; inside
        ``no_sync`` nothing, so it applies once to the accumulated gradient).

        For workers that take unequal shares of a global batch: worker ``r`` with ``b_r`` of the ``B``
        samples sets ``num_workers * b_r / B``; the strategy's mean over workers is then the mean
        gradient over all ``B`` samples, the update one process on the whole batch makes (a worker
        with no samples sets 0 and still calls ``step()``). The same as multiplying your loss by the
        weight; do one or the other. :class:`gradsync.adapt.Controller` sets it every step itself.
        Only strategies that average over workers take it (``Strategy.mean_over_workers``: allreduce,
        allreduce-priority, ddp, ps, ps-sliced, p3, casync-*, compressed-allgather, hybrid)."""
        sync = self._gradsync
        weight = float(weight)
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{sync.where()}: the gradient weight must be a finite number >= 0, got {weight}")
        if weight != 1.0 and not sync.strategy.mean_over_workers:
            raise ConfigError(f"{sync.where()}: a gradient weight needs a strategy whose update is the mean over "
                              f"workers of their gradients; {sync.strategy.name!r} updates otherwise")
        sync.grad_weight = weight

    def flush(self) -> None:
        """Wait until every synchronization in flight has finished: parameters are then current
        (strategies that overlap the next forward with communication, such as ``p3``, otherwise
        finish a parameter only when the next forward reaches it)."""
        self._gradsync.strategy.flush()

    def close(self) -> None:
        """End synchronization: close the strategy (dedicated servers leave their loop) and remove
        gradsync's hooks, so that the model and this optimizer can be freed. Also done at
        ``gradsync.shutdown()``; calling it twice is harmless."""
        self._gradsync.close()

    def switch_strategy(self, strategy, **options) -> Strategy:
        """Continue with another strategy from the next step on, keeping parameters and optimizer
        state (KungFu's strategy adaptation). Collective: every worker calls it after the same step,
        with the same strategy. Parameters in flight are finished first; state spread over the
        workers (``ps``, ``p3``) is gathered and handed to the new strategy."""
        sync = self._gradsync
        new = resolve(strategy, **options)
        check_backend(new, runtime.current().transport)
        self._check_switch(new)
        check_clip(sync.clip, new)
        template = copy.deepcopy(new)
        detach(self)
        try:
            reattach(self, new)
        except BaseException:
            sync.remove_hooks()  # whatever the failed attach installed
            reattach(self, copy.deepcopy(sync.template))  # train on with the old strategy, not unsynchronized
            raise
        sync.template = template
        return new

    def consolidate_state_dict(self) -> None:
        """Collective over the workers (every worker calls it, after the same step): gather the
        optimizer state that ``ps`` (co-located or dedicated servers), ``p3`` and ``hybrid`` keep
        spread over the ranks, so that ``state_dict()`` on any worker returns all of it (as
        ``ZeroRedundancyOptimizer`` does). Other strategies need no call; it is harmless there."""
        sync = self._gradsync
        self._check_server_state("gathered")
        sync.strategy.gather_state()
        sync.consolidated = sync.steps

    def state_dict(self):
        """The whole optimizer state, as torch lays it out (see :mod:`gradsync.strategies.optstate`)."""
        sync = self._gradsync
        if sync.steps:
            self._check_server_state("saved")
        self._check_consolidated()
        if sync.strategy.state_location == "here":
            sync.strategy.gather_state()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load on every worker (a collective where the state is spread: the strategy hands it to
        the ranks that update, dedicated servers included)."""
        sync = self._gradsync
        self._check_server_state("loaded here; load it before gradsync.distribute (the servers run the same "
                                 "script and take it then)")
        super().load_state_dict(state_dict)
        sync.strategy.load_state()
        sync.consolidated = sync.steps

    # -- checks ------------------------------------------------------------------------------------
    def _check_grads_unedited(self) -> None:
        """Under a strategy that sent the gradients during backward, refuse a step whose gradients
        changed since (a GradScaler's step included: it would update with scaled gradients)."""
        sync = self._gradsync
        if sync.refuses_edits and getattr(self, "found_inf", None) is not None:
            raise GradientEditedError(
                f"rank {runtime.current().topology.rank}: a torch.amp.GradScaler calls optimizer.step(), but "
                f"strategy {sync.strategy.name!r} sent the gradients during backward, still multiplied by the loss "
                "scale, and updates elsewhere: the update would use them scaled, and could not skip a step whose "
                "gradients overflowed. For mixed precision use bf16 autocast, which needs no GradScaler, or a "
                "strategy that synchronizes at the end of backward (allreduce, ddp, casync-ring, casync-ps, "
                "compressed-allgather)")
        sync.check_unedited()

    def _check_switch(self, new: Strategy) -> None:
        """The job can move from the current strategy to ``new``."""
        sync = self._gradsync
        if runtime.current().topology.num_servers and (sync.strategy.uses_servers or new.uses_servers):
            raise ConfigError(f"{sync.where()}: cannot switch strategies in a job with dedicated servers "
                              "(they serve one strategy until shutdown); use co-located servers")
        if sync.grad_weight != 1.0 and not new.mean_over_workers:
            raise ConfigError(f"{sync.where()}: this worker's gradients are weighted ({sync.grad_weight:g}), which "
                              f"strategy {new.name!r} cannot honour: its update is not the mean over workers")
        if sync.observer is not None and not new.mean_grads_at_apply and any(
                m.needs_mean_grads for m in sync.observer):
            raise ConfigError(f"{sync.where()}: the attached monitors read synchronized gradients, which "
                              f"strategy {new.name!r} does not produce")

    def _check_server_state(self, doing: str) -> None:
        """The optimizer state can be ``doing`` (gathered, saved, loaded) here."""
        sync = self._gradsync
        strategy = sync.strategy
        if strategy.state_location == "servers" and not strategy.moves_server_state:
            raise GradsyncError(f"{sync.where()}: the optimizer state lives on the dedicated servers of "
                                f"{strategy.name!r} and cannot be {doing}; checkpoint the model, or use co-located "
                                "servers (or ps, whose servers hand their state over)")

    def _check_consolidated(self) -> None:
        """State spread over the ranks was gathered after the last step."""
        sync = self._gradsync
        where = sync.strategy.state_location
        if where in ("workers", "servers") and sync.consolidated != sync.steps:
            holder = "the dedicated servers hold" if where == "servers" else "each worker holds"
            raise GradsyncError(f"{sync.where()}: {holder} the optimizer state of the parameters they "
                                "serve; call optimizer.consolidate_state_dict() on every worker after the last "
                                "step, then state_dict() on any of them")


def wrap(optimizer: torch.optim.Optimizer, sync: SyncState) -> torch.optim.Optimizer:
    """Make ``optimizer`` a :class:`DistributedOptimizer` in place (the same object, returned)."""
    base = type(optimizer)
    members = {"__module__": base.__module__, "__doc__": base.__doc__}
    # A torch LR scheduler created before distribute has replaced ``step`` on the instance by a
    # wrapper around the class's step, which would hide ours and train without synchronizing.
    # Synchronize around that wrapper instead, and carry its marks (the scheduler checks them).
    sync.user_step = optimizer.__dict__.pop("step", None)
    marks = getattr(sync.user_step, "__dict__", {})
    if marks:
        members["step"] = _marked_step(marks)
    optimizer.__class__ = type(base.__name__, (DistributedOptimizer, base), members)
    optimizer._gradsync = sync
    return optimizer


def _marked_step(marks: dict):
    """:meth:`DistributedOptimizer.step` under attributes ``marks``."""
    @functools.wraps(DistributedOptimizer.step)
    def step(self, closure=None):
        return DistributedOptimizer.step(self, closure)
    step.__dict__.update(marks)
    return step


def user_class(optimizer) -> type:
    """The class the user made ``optimizer`` with, under the one :func:`wrap` gave it."""
    return type(optimizer).__bases__[1]


def detach(optimizer, *, failed: bool = False) -> None:
    """Take the strategy off (finishing what is in flight and gathering spread optimizer state into
    the user's optimizer, unless ``failed``: after a peer died, only local clean-up is possible)."""
    sync = optimizer._gradsync
    old = sync.strategy
    if failed:
        old.abandon()  # never raises
    else:
        old.flush()
        if old.state_location in ("here", "workers") and sync.consolidated != sync.steps:
            old.gather_state()  # unless gathered since the last step (an elastic commit just did)
        old.close()
    sync.remove_hooks()
    runtime.forget(sync.close)


def reattach(optimizer, strategy: Strategy, *, previous: Strategy | None = None) -> None:
    """Attach ``strategy`` (fresh, not attached before) to a distributed optimizer whose strategy was
    taken off by :func:`detach`, on the current process group; hand it the optimizer state.
    ``previous``: the strategy it replaces after an elastic shrink, whose group-independent parts
    it may take over (:meth:`~gradsync.strategies.base.Strategy.adopt`)."""
    sync = optimizer._gradsync
    if previous is not None:
        strategy.adopt(previous)
    wrapped, optimizer.__class__ = optimizer.__class__, user_class(optimizer)  # strategies take the user's class
    try:
        strategy.attach(SyncContext(sync.model, optimizer, sync.params, sync.names, runtime.current().transport,
                                    runtime.current().topology, clip_grad_norm=sync.clip,
                                    two_level=runtime.current().transport.two_level))
    finally:
        optimizer.__class__ = wrapped
    sync.strategy = strategy
    hooks.install(sync)
    strategy.load_state()
    sync.consolidated = sync.steps
    runtime.on_shutdown(sync.close)
