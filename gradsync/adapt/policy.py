"""Adaptation policies: Python classes that watch training and change it while it runs (KungFu).

A :class:`Policy` has six hooks, ``before_``/``after_`` x ``train``/``epoch``/``step``, no-ops by
default; the :class:`Controller` calls ``before_*`` in the order the policies were given and
``after_*`` in reverse (so policies nest like context managers). Every hook receives the controller,
through which a policy reads the monitors and acts: ``set_batch_size``, ``scale_lr``,
``switch_strategy``, ``resize``. Policies must decide the same thing on every worker: decide from
monitor values (reduced over workers, so equal everywhere) or from values the policy reduced itself.

    ctl = Controller(opt, [AdaptiveBatchSize(ns, max_batch_size=256)], monitors=mons,
                     batch_size=32, dataset_size=len(data))
    with ctl.train():
        for epoch in ctl.epochs(10):
            for step in ctl.steps():
                idx = ctl.batch_indices()          # this worker's share of the global batch
                loss_fn(model(x[idx]), y[idx]).backward(); opt.step(); opt.zero_grad()

Built-in policies are in :mod:`gradsync.adapt.builtin`. The Controller is one class because every
action it offers (batch size, learning rate, strategy, workers) changes the same running state,
which an elastic job must commit and hand to joining workers as one.

Why one file of this size: the Controller alone (the built-in policies are in
:mod:`gradsync.adapt.builtin`); its elastic regrouping is the part of its loop that restores state.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from typing import Iterator

import torch

from gradsync import runtime
from gradsync.adapt import durable, elastic
from gradsync.adapt.data import GlobalBatches
from gradsync.adapt.monitors import Monitors, NoiseScale, Throughput
from gradsync.consistency import broadcast_model, check_models_match
from gradsync.errors import ConfigError, PeerFailureError
from gradsync.optimizer import detach, reattach, user_class


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


class Controller:
    """Runs the policies around the user's training loop and holds what they may change.

    ``batch_size``: samples per worker per step (policies may change it). ``dataset_size``: with it,
    :meth:`batch_indices` hands out each worker's share of one global order per epoch, so that no
    sample is skipped or seen twice within an epoch, whatever the batch size or the number of
    workers does meanwhile; :meth:`steps` then ends with the epoch.

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
        self.optimizer = optimizer
        self.policies = list(policies)
        self.monitors = monitors if monitors is not None else getattr(optimizer._gradsync, "observer", None)
        self.batch_size = batch_size
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
        """Elastic: one record per change of generation (sizes, cause, seconds it took)."""
        self.strategy_spec: list | None = None  # [name, options] after ctl.switch_strategy; None: the script's
        self._resumed = False
        self._where = (0, 1)  # (rank, workers) when this worker last left a generation
        self.checkpoint_dir = checkpoint_dir or os.environ.get(durable.DIR_ENV) or None
        self._writer: durable.DurableCommits | None = None
        if self.checkpoint_dir is not None:
            self._check_elastic(optimizer.strategy)
            every = checkpoint_every if checkpoint_every is not None else int(os.environ.get(durable.EVERY_ENV, "10"))
            seconds = checkpoint_seconds
            if seconds is None and os.environ.get(durable.SECONDS_ENV):
                seconds = float(os.environ[durable.SECONDS_ENV])
            self._schedule = durable.Schedule(every, seconds)
        member = elastic.current()
        if member is not None:
            self._check_elastic(optimizer.strategy)
            if elastic.joining():
                self._hand_over(joining=True)  # the survivors do the same in _regroup
                self._resumed = True  # the job is mid-training: no before_train / before_epoch here
                return
        if self.checkpoint_dir is not None and os.environ.get(durable.RESUME_ENV) == "1":
            self._resume()

    @staticmethod
    def _check_elastic(strategy) -> None:
        if strategy.state_location != "optimizer":
            raise ConfigError(f"elastic training and checkpoints need a strategy whose optimizer state stays in your optimizer "
                              f"(allreduce, ddp, casync-*, compressed-allgather, sma); {strategy.name!r} spreads it")

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
            yield self.step
            if self.data is not None:
                self.data.advance(self.global_batch_size)
            self.step += 1
            done += 1
            self._call("after_step")
            if elastic.current() is not None:
                self._between_steps()
            elif self.checkpoint_dir is not None and self.rank == 0 and self._schedule.due(self.step):
                self.commit()
                self._persist()

    def batch_indices(self) -> torch.Tensor:
        """This worker's sample indices for the current step (its slice of the global batch)."""
        if self.data is None:
            raise ConfigError("batch_indices needs Controller(dataset_size=...)")
        return self.data.share(self.global_batch_size, self.rank, self.num_workers)

    # -- actions ---------------------------------------------------------------------------------
    def stop(self) -> None:
        self.stop_requested = True

    def set_batch_size(self, batch_size: int) -> None:
        """Samples per worker from the next step on; monitors that need it are told."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        for m in self.monitors or []:
            if isinstance(m, (NoiseScale, Throughput)):
                m.batch_size = batch_size

    def scale_lr(self, factor: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor

    def switch_strategy(self, strategy: str, **options):
        """``optimizer.switch_strategy``, remembered by name so that workers joining an elastic job
        switch too (options must then be JSON values)."""
        if elastic.current() is not None:
            from gradsync.strategies import resolve

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
        job changed (False: the launcher refused, e.g. outside ``--min-np``..``--max-np``)."""
        start = time.perf_counter()
        gen = elastic.request_resize(num_workers)
        member = elastic.current()
        if gen <= member.gen:
            return False
        self._regroup(gen, cause=f"resize to {num_workers}", start=start, asked=time.perf_counter() - start)
        return True

    # -- elastic ---------------------------------------------------------------------------------
    def run(self, train) -> None:
        """Run ``train(ctl)``; in an elastic job, when a worker dies, restore the last commit, regroup
        without it and run ``train`` again (it continues from ``ctl.epoch``, ``ctl.step`` and the data
        position, as the ``epochs``/``steps`` iterators do). Returns when ``train`` returns, or when this
        worker was removed from the job (``ctl.detached``)."""
        member = elastic.current()
        try:
            if member is None:
                return train(self)
            if self._commit is None:
                self.commit()
            while True:
                try:
                    train(self)
                    return
                except PeerFailureError as exc:
                    self._recover(exc)
                    if self.detached:
                        return
        finally:
            self.close()

    def close(self) -> None:
        """Wait for the checkpoint being written, if any, and stop its thread (``run`` does this)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def _resume(self) -> None:
        """Every worker: load the newest whole commit of the checkpoint folder, if there is one."""
        commit = durable.latest(self.checkpoint_dir)
        if commit is None:
            print(f"gradsync: no checkpoint in {self.checkpoint_dir} yet: training starts from the beginning",
                  flush=True)
            return
        self._commit = {key: commit[key] for key in ("params", "buffers", "optimizer", "counters")}
        self._restore()
        self._resumed = True  # mid-training: no before_train / before_epoch for the epoch under way
        if self.rank == 0:
            print(f"gradsync: resumed from {commit['path']} (step {self.step})", flush=True)

    def _persist(self) -> None:
        """After a commit: worker 0 hands it to the checkpoint writer when one is due."""
        if self.checkpoint_dir is None or self.rank != 0 or not self._schedule.due(self.step):
            return
        if self._writer is None:
            self._writer = durable.DurableCommits(self.checkpoint_dir, self._schedule)
        self._writer.submit(self._commit)

    def commit(self) -> None:
        """Remember parameters, buffers, optimizer state and counters (restored if a worker dies)."""
        model = self.optimizer._gradsync.model
        self._commit = {
            "params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()],
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "counters": self._counters(),
        }

    def _counters(self) -> dict:
        data = self.data.state() if self.data is not None else None
        return {"step": self.step, "epoch": self.epoch, "data": data, "batch_size": self.batch_size,
                "stop": self.stop_requested}

    def _restore(self) -> None:
        c = self._commit
        model = self.optimizer._gradsync.model
        with torch.no_grad():
            for p, v in zip(model.parameters(), c["params"]):
                p.copy_(v)
                p.grad = None  # the failed step's gradients must not add to its redo
            for b, v in zip(model.buffers(), c["buffers"]):
                b.copy_(v)
        user_class(self.optimizer).load_state_dict(self.optimizer, copy.deepcopy(c["optimizer"]))
        self._load_counters(c["counters"])

    def _load_counters(self, c: dict) -> None:
        self.step, self.epoch, self.stop_requested = c["step"], c["epoch"], c["stop"]
        self.set_batch_size(c["batch_size"])
        if self.data is not None and c["data"] is not None:
            self.data.load(*c["data"])

    def _between_steps(self) -> None:
        member = elastic.current()
        if self._regrouped_at == self.step:
            return  # a policy resized after this step (and committed): a worker that just joined does not ask again
        if self.step % self.commit_every == 0:
            self.commit()
            self._persist()
        gen = member.agree()
        if gen > member.gen:
            self._regroup(gen, cause="resize")

    def _recover(self, exc: Exception) -> None:
        member = elastic.current() or self._member
        start = time.perf_counter()
        self._restore()
        gen = member.wait_for(member.gen, runtime.current().timeout_s if runtime.is_initialized() else 60.0)
        self._regroup(gen, cause=f"failure: {exc}".splitlines()[0][:200], failed=True, start=start)

    def _regroup(self, gen: int, *, cause: str, failed: bool = False, start: float | None = None,
                 asked: float | None = None) -> None:
        start = time.perf_counter() if start is None else start
        phases, mark = {}, [time.perf_counter()]
        if asked is not None:
            phases["request (new workers start)"] = asked
        elif failed:
            phases["restore and wait for the launcher"] = mark[0] - start

        def done(phase: str) -> None:
            now = time.perf_counter()
            phases[phase] = now - mark[0]
            mark[0] = now

        member = self._member = elastic.current() or self._member
        before = len(member.members)
        if runtime.is_initialized():
            self._where = (runtime.current().topology.rank, before)
        detach(self.optimizer, failed=failed)
        try:
            runtime.leave()
        except Exception:
            if not failed:
                raise
        done("leave")
        if not member.enter(gen, needs_state=failed):
            self.detached = self.stop_requested = True
            return
        done("new group")
        sync = self.optimizer._gradsync
        if member.any_new:  # what the new workers are doing in distribute(), in the same order
            check_models_match(sync.model, runtime.current().transport, world=False)
            broadcast_model(sync.model, runtime.current().transport, world=False, compare_first=False)
            done("model check and broadcast")
            reattach(self.optimizer, copy.deepcopy(sync.original))  # theirs; the hand-over switches all alike
        else:
            reattach(self.optimizer, copy.deepcopy(sync.template))
        if sync.observer is not None:
            for m in sync.observer:
                m.attach(sync.params, sync.names, m.every)
        done("strategy")
        if member.needs_state:  # a new worker, or restored commits that may differ; not after a shrink
            self._hand_over(joining=False)
            done("state hand-over")
        self._regrouped_at = self.step
        self.resizes.append({"generation": gen, "from": before, "to": len(member.members), "cause": cause,
                             "step": self.step, "seconds": time.perf_counter() - start, "phases": phases})
        self.commit()  # the state to come back to (the step's own commit, which this replaces, is not timed either)

    def _hand_over(self, *, joining: bool) -> None:
        """Collective in a new generation: the worker with the newest state sends it to all (parameters,
        buffers, optimizer state, counters). Joiners have none; after a failure, survivors may differ by a step."""
        transport = runtime.current().transport
        newest = -1 if joining else self.step
        t = torch.tensor([newest], dtype=torch.int64)
        transport.allreduce(t, op="max", what="elastic: newest state")
        best = int(t)
        t = torch.tensor([self.rank if newest == best else 1 << 40], dtype=torch.int64)
        transport.allreduce(t, op="min", what="elastic: state source")
        src = int(t)
        sync = self.optimizer._gradsync
        member = elastic.current()
        if src != 0 or not member.any_new:  # with new workers, distribute() just broadcast rank 0's model
            with torch.no_grad():
                for tensor in [*sync.model.parameters(), *sync.model.buffers()]:
                    transport.broadcast(tensor.data, src, what="elastic: model")
        extra = {"counters": self._counters(), "strategy": self.strategy_spec,
                 "policies": [p.state() for p in self.policies],
                 "monitors": [m.state() for m in (sync.observer or [])]}
        got = elastic.share_state(self.optimizer, extra, src)
        self._load_counters(got["counters"])
        for policy, state in zip(self.policies, got["policies"]):
            policy.load_state(state)
        for m, state in zip(sync.observer or [], got["monitors"]):
            m.load_state(state)
        self.strategy_spec = got["strategy"]
        if member.any_new and self.strategy_spec is not None:  # everyone attached the script's strategy
            self.optimizer.switch_strategy(self.strategy_spec[0], **self.strategy_spec[1])
