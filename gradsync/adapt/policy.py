"""Adaptation policies: Python classes that watch training and change it while it runs (KungFu).

A :class:`Policy` has six hooks, ``before_``/``after_`` x ``train``/``epoch``/``step``, no-ops by
default; the :class:`Controller` calls ``before_*`` in the order the policies were given and
``after_*`` in reverse (so policies nest like context managers). Every hook receives the controller,
through which a policy reads the monitors and acts: ``set_batch_size``, ``set_shares``,
``scale_lr``, ``switch_strategy``, ``resize``. Policies must decide the same thing on every worker:
decide from monitor values (reduced over workers, so equal everywhere) or from values the policy
reduced itself.

    ctl = Controller(opt, [AdaptiveBatchSize(ns, max_batch_size=256)], monitors=mons,
                     batch_size=32, dataset_size=len(data))
    with ctl.train():
        for epoch in ctl.epochs(10):
            for step in ctl.steps():
                idx = ctl.batch_indices()          # this worker's share of the global batch
                loss_fn(model(x[idx]), y[idx]).backward(); opt.step(); opt.zero_grad()

Built-in policies are in :mod:`gradsync.adapt.builtin`. The Controller is one class because every
action it offers (batch size, learning rate, strategy, workers) changes the same running state,
which an elastic job must commit and hand to joining workers as one. Its class is written in three
modules, one per job: this one runs the policies and acts; :mod:`gradsync.adapt.commits` commits
and restores that state (in memory and to checkpoints); :mod:`gradsync.adapt.regroup` brings an
elastic job to its next generation around it (``Controller.run``).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Iterator

import torch

from gradsync import runtime
from gradsync.adapt import durable, elastic
from gradsync.adapt.commits import Commits
from gradsync.adapt.data import GlobalBatches, StepLoader, split
from gradsync.adapt.monitors import Monitors, NoiseScale, Throughput
from gradsync.adapt.regroup import Regrouping, _peer_failure
from gradsync.errors import ConfigError


class Policy:
    """Base class: every hook is a no-op. Override the ones you need."""

    def before_train(self, ctl: "Controller") -> None: ...
    def after_train(self, ctl: "Controller") -> None: ...
    def before_epoch(self, ctl: "Controller") -> None: ...
    def after_epoch(self, ctl: "Controller") -> None: ...
    def before_step(self, ctl: "Controller") -> None: ...
    def after_step(self, ctl: "Controller") -> None: ...

    def state(self) -> dict:
        """What a worker joining an elastic job needs to decide as the others do (JSON values)."""
        return {}

    def load_state(self, state: dict) -> None:
        pass


class Controller(Commits, Regrouping):
    """Runs the policies around the user's training loop and holds what they may change.

    ``batch_size``: samples per worker per step (policies may change it); the global batch is
    ``batch_size * num_workers``, split equally unless :meth:`set_shares` gave each worker its own
    share. ``dataset_size``: with it, :meth:`batch_indices` hands out each worker's share of one
    global order per epoch, so that no sample is skipped or seen twice within an epoch, whatever the
    batch size, the shares or the number of workers do meanwhile; :meth:`steps` then ends with the
    epoch. Each step the controller sets this worker's gradient weight, ``num_workers * b_r / B``
    (``optimizer.set_grad_weight``): with unequal shares, or an epoch's short last step, the update
    is still the one a single process makes on the whole global batch.

    ``checkpoint_dir`` (default ``GRADSYNC_CHECKPOINT_DIR``, which ``gradsync run --checkpoint-dir``
    sets): worker 0 also writes every ``checkpoint_every``-th step's commit there (or one each
    ``checkpoint_seconds``), atomically and off the step's path, and with ``GRADSYNC_RESUME=1``
    (``gradsync run --resume DIR``) every worker starts from the newest one
    (:mod:`gradsync.adapt.durable`).
    """

    def __init__(self, optimizer, policies: list[Policy] = (), *, monitors: Monitors | None = None,
                 batch_size: int, dataset_size: int | None = None, seed: int = 0, commit_every: int = 1,
                 checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
                 checkpoint_seconds: float | None = None):
        if getattr(optimizer, "_gradsync", None) is None:
            raise ConfigError("Controller needs an optimizer returned by gradsync.distribute")
        for p in policies:
            if not isinstance(p, Policy):
                raise ConfigError(f"{p!r} is not a gradsync.adapt.Policy")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
            raise ConfigError(f"commit_every must be an integer >= 1 (steps between commits), got {commit_every!r}")
        self.optimizer = optimizer
        self.policies = list(policies)
        self.monitors = monitors if monitors is not None else getattr(optimizer._gradsync, "observer", None)
        self.batch_size = batch_size
        self.shares: list[int] | None = None
        """Every worker's samples per step, by rank (:meth:`set_shares`); None: equal shares."""
        self.step_sizes: list[int] = []
        """Every worker's samples in the step under way, fixed when it began (fewer than the shares at
        an epoch's end; shares set during the step apply from the next one)."""
        self._asked = False  # this step: whether the loop asked for this worker's share
        self.data = GlobalBatches(dataset_size, seed) if dataset_size else None
        self.step = 0
        self.epoch = 0
        self.stop_requested = False
        self.detached = False
        self.commit_every = commit_every
        self._commit: dict | None = None
        self._member = None
        self._regrouped_at = -1
        self.resizes: list[dict] = []
        """Elastic: one record per change of generation: ``from``, ``to``, ``cause``, ``step``,
        ``seconds`` (from this worker's request, or its failure, to the regrouped job), ``pause``
        (a resize's part after every worker asked: what it cost the job; after a failure, all of
        ``seconds``) and ``phases``."""
        self.strategy_spec: list | None = None  # [name, options] after ctl.switch_strategy; None: the script's
        self._resumed = False
        self._where = (0, 1)  # (rank, workers) when this worker last left a generation
        self._configure_checkpoints(checkpoint_dir, checkpoint_every, checkpoint_seconds)
        member = elastic.current()
        if member is not None:
            self._check_elastic(optimizer.strategy)
            if elastic.joining():
                try:
                    self._hand_over(joining=True)  # the survivors do the same in _regroup
                except RuntimeError as exc:  # a worker sending the state died: regroup as the survivors do
                    failure = _peer_failure(exc)
                    if failure is None:
                        raise
                    self._recover(failure)  # no commit yet: the next generation's hand-over brings the state
                self._resumed = True  # the job is mid-training: no before_train / before_epoch here
                member = elastic.current() or self._member
                print(f"gradsync: elastic worker {member.id} joined generation {member.gen} ({len(member.members)} "
                      f"workers) at step {self.step}", flush=True)
                if self.step == 0 and self.checkpoint_dir is not None and os.environ.get(durable.RESUME_ENV) == "1":
                    # The job grew before any worker trained (hosts registering as a resumed job
                    # starts): every member is new, and every one starts from the newest commit.
                    self._resume()
                return
        if self.checkpoint_dir is not None and os.environ.get(durable.RESUME_ENV) == "1":
            self._resume()

    @staticmethod
    def _check_elastic(strategy) -> None:
        """Commits hold the whole optimizer state: refused only where no worker can gather it."""
        if strategy.state_location == "servers" and not strategy.moves_server_state:
            raise ConfigError(f"elastic training and checkpoints need the whole optimizer state on the workers; "
                              f"{strategy.name!r} keeps it on its dedicated servers, out of their reach: use "
                              "co-located servers (no --servers), or ps, whose servers hand their state over")

    # -- who we are ------------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        if self.detached:  # this worker left the job: what it was last
            return self._where[1]
        return runtime.current().topology.num_workers

    @property
    def rank(self) -> int:
        if self.detached:
            return self._where[0]
        return runtime.current().topology.rank

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_workers

    @property
    def local_batch_size(self) -> int:
        """This worker's samples in a whole step: its share, or ``batch_size``."""
        self._asked = True
        return self.shares[self.rank] if self.shares is not None else self.batch_size

    def share(self) -> tuple[int, int]:
        """This worker's part of the step under way's global batch, ``(first, count)``: for a loop
        that makes its own batches (a stream, a generator) instead of taking :meth:`batch_indices`.

        Under unequal shares a loop must ask for its part every step, through this,
        :meth:`batch_indices` or :attr:`local_batch_size`, or the step ends with a ConfigError.
        A DataLoader of fixed batch size would otherwise train on other samples than the shares
        say, under the shares' gradient weights: a wrong update, silently (:meth:`loader` is one
        that follows them)."""
        self._asked = True
        sizes = self.step_sizes or [self.batch_size] * self.num_workers
        return sum(sizes[:self.rank]), sizes[self.rank]

    def loader(self, dataset, **options):
        """A torch ``DataLoader`` of ``dataset`` that follows the shares: ``next(loader)`` in each step
        is this worker's part of it, ``batch_indices()``'s samples, loaded ahead by the loader's
        worker processes (``options``: the DataLoader's, but for the batching). See
        :class:`gradsync.adapt.data.StepLoader`."""
        return StepLoader(self, dataset, **options)

    def values(self) -> dict[str, float]:
        return self.monitors.values() if self.monitors is not None else {}

    # -- the loop --------------------------------------------------------------------------------
    def _call(self, hook: str) -> None:
        order = self.policies if hook.startswith("before") else reversed(self.policies)
        for policy in order:
            getattr(policy, hook)(self)

    @contextlib.contextmanager
    def train(self):
        if not self._resumed:
            self._call("before_train")
        yield self
        self._call("after_train")
        self._weigh(None)

    def epochs(self, count: int) -> Iterator[int]:
        while self.epoch < count and not self.stop_requested:
            if self._resumed:
                self._resumed = False  # a worker that joined mid-epoch: the others began it already
            else:
                self._call("before_epoch")
            yield self.epoch
            self._call("after_epoch")
            self.epoch += 1
            if self.data is not None:
                self.data.next_epoch(self.epoch)

    def steps(self, count: int | None = None) -> Iterator[int]:
        """Step numbers (global, across epochs); ends after ``count`` steps, or at the end of the
        epoch when there is a dataset, or when a policy called :meth:`stop`."""
        done = 0
        while (count is None or done < count) and not self.stop_requested:
            if self.data is not None and self.data.epoch_done:
                return
            self._call("before_step")
            self._begin_step()
            yield self.step
            self._check_asked()
            self._weigh(None)
            if self.data is not None:
                self.data.advance(self.global_batch_size)
            self.step += 1
            done += 1
            self._call("after_step")
            if elastic.current() is not None:
                self._between_steps()
            elif self.checkpoint_dir is not None and self._checkpoint_due():
                self.commit()
                self._persist()

    def batch_indices(self) -> torch.Tensor:
        """This worker's sample indices for the current step (its slice of the global batch)."""
        if self.data is None:
            raise ConfigError("batch_indices needs Controller(dataset_size=...)")
        self._asked = True
        return self.data.share(self.global_batch_size, self.rank, self.num_workers, self.step_sizes or self.shares)

    def _check_asked(self) -> None:
        """ConfigError after a step of unequal shares whose loop never asked for this worker's part."""
        asked, self._asked = self._asked, False
        if asked or len(set(self.step_sizes)) <= 1:
            return
        raise ConfigError(
            f"worker {self.rank}: step {self.step} split the global batch into unequal shares {self.step_sizes} "
            f"(this worker's gradient counted as {self.step_sizes[self.rank]} samples), but the training loop did "
            "not ask for its part: take each step's samples from ctl.batch_indices(), ctl.share() or "
            "ctl.local_batch_size, or load them with ctl.loader(dataset, num_workers=...), a DataLoader that "
            "follows the shares. A DataLoader of fixed batch size cannot follow them (BalanceBatches, set_shares); "
            "use it with equal shares only")

    def _begin_step(self) -> None:
        """Every worker's samples this step, and this worker's gradient weight for them."""
        if self.shares is not None and len(self.shares) != self.num_workers:
            self.shares = None  # the job has another number of workers now (elastic, resumed): equal again
        if self.data is not None:
            self.step_sizes = self.data.sizes(self.global_batch_size, self.num_workers, self.shares)
        else:
            self.step_sizes = list(self.shares or [self.batch_size] * self.num_workers)
        self._weigh(self.step_sizes)

    def _weigh(self, sizes: list[int] | None) -> None:
        """Set the gradient weight ``num_workers * b_r / B`` for ``sizes`` (1 for None); strategies that
        do not average over workers keep 1 (their updates never combine gradients by a mean)."""
        if not self.optimizer.strategy.mean_over_workers:
            return
        total = sum(sizes) if sizes else 0
        self.optimizer.set_grad_weight(len(sizes) * sizes[self.rank] / total if total else 1.0)

    # -- actions ---------------------------------------------------------------------------------
    def stop(self) -> None:
        self.stop_requested = True

    def set_batch_size(self, batch_size: int) -> None:
        """Samples per worker from the next step on (unequal shares keep their proportions); monitors
        that need it are told."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        if self.shares is not None:
            self.shares = split(batch_size * len(self.shares), self.shares)
        for m in self.monitors or []:
            if isinstance(m, (NoiseScale, Throughput)):
                m.batch_size = batch_size

    def set_shares(self, shares: list[int] | None) -> None:
        """Give worker ``r`` ``shares[r]`` samples of each global batch from the next step on (None:
        equal shares again). Collective in effect: every worker calls it with the same list after
        the same step. The shares sum to the global batch (``batch_size * num_workers``); a worker may
        get 0 (it skips forward and backward and still calls ``step()``). The gradient weights keep the
        update exact, so the strategy must average over workers (``Strategy.mean_over_workers``)."""
        if shares is None:
            self.shares = None
            return
        n, total = self.num_workers, self.global_batch_size
        if len(shares) != n or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shares):
            raise ConfigError(f"set_shares needs {n} integers >= 0, one per worker, got {shares!r}")
        if sum(shares) != total:
            raise ConfigError(f"set_shares: the shares must sum to the global batch {total} (batch_size "
                              f"{self.batch_size} x {n} workers), got {sum(shares)}")
        strategy = self.optimizer.strategy
        if len(set(shares)) > 1 and not strategy.mean_over_workers:
            raise ConfigError(f"unequal shares need a strategy that averages gradients over workers (allreduce, ddp, "
                              f"ps, p3, casync-*, ...); {strategy.name!r} does not")
        self.shares = None if len(set(shares)) == 1 else list(shares)

    def scale_lr(self, factor: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor

    def switch_strategy(self, strategy: str, **options):
        """``optimizer.switch_strategy``, remembered by name so that workers joining an elastic job
        switch too (options must then be JSON values)."""
        from gradsync.strategies import resolve

        if self.shares is not None and not resolve(strategy, **options).mean_over_workers:
            raise ConfigError(f"strategy {strategy!r} does not average gradients over workers, which the unequal "
                              f"shares {self.shares} need; set_shares(None) first")
        if elastic.current() is not None:
            self._check_elastic(resolve(strategy, **options))
            try:
                json.dumps(options)
            except TypeError as exc:
                raise ConfigError(f"in an elastic job, switch_strategy takes a name and JSON options: {exc}") from None
        new = self.optimizer.switch_strategy(strategy, **options)
        self.strategy_spec = [strategy, options]
        return new

    def resize(self, num_workers: int) -> bool:
        """Resize the elastic job to ``num_workers`` now (collective: every worker calls it after the
        same step, as a policy does). Growing waits for the new workers to start. Returns whether the
        job changed (False: the launcher refused, e.g. outside ``--min-np``..``--max-np``). The step's
        commit comes first, as between steps (where ``ps``, ``p3`` and ``hybrid`` gather their
        optimizer state), so the regroup does not gather it again."""
        if elastic.current() is not None:
            self._commit_step()
        start, asked = time.perf_counter(), {}
        gen = elastic.request_resize(num_workers, timings=asked)
        member = elastic.current()
        if gen <= member.gen:
            return False
        self._regroup(gen, cause=f"resize to {num_workers}", start=start, asked=asked)
        return True
