"""What the :class:`~gradsync.adapt.policy.Controller` commits and restores: parameters, buffers,
optimizer state and its counters, kept in memory (restored when a worker of an elastic job dies)
and written to a checkpoint folder by worker 0 (:mod:`gradsync.adapt.durable`), from which every
worker resumes.
"""
from __future__ import annotations

import copy
import os

import torch

from gradsync import runtime
from gradsync.adapt import durable
from gradsync.optimizer import user_class


class Commits:
    """The Controller's commits (a mixin of it): reads its ``optimizer``, ``step``, ``epoch``,
    ``data``, ``batch_size``, ``shares``, ``stop_requested`` and ``rank``; restores them with
    ``set_batch_size``. Shares made for another number of workers are dropped at the next step."""

    def _configure_checkpoints(self, checkpoint_dir: str | None, checkpoint_every: int | None,
                               checkpoint_seconds: float | None) -> None:
        """Where and how often worker 0 writes commits (``GRADSYNC_CHECKPOINT_DIR`` and the
        launcher's other variables where an argument is None); no folder: none are written."""
        self.checkpoint_dir = checkpoint_dir or os.environ.get(durable.DIR_ENV) or None
        self._writer: durable.DurableCommits | None = None
        if self.checkpoint_dir is not None:
            self._check_elastic(self.optimizer.strategy)
            every = checkpoint_every if checkpoint_every is not None else int(os.environ.get(durable.EVERY_ENV, "10"))
            seconds = checkpoint_seconds
            if seconds is None and os.environ.get(durable.SECONDS_ENV):
                seconds = float(os.environ[durable.SECONDS_ENV])
            self._schedule = durable.Schedule(every, seconds)

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

    def _spread(self) -> bool:
        """The optimizer state is spread over the ranks (co-located ``ps``, ``p3``, ``hybrid``): a
        commit gathers it first, a collective every worker joins."""
        return self.optimizer._gradsync.strategy.state_location in ("workers", "servers")

    def _checkpoint_due(self) -> bool:
        """Outside an elastic job: whether this step's commit is written. Worker 0 decides alone
        unless the state is spread; then every worker must commit, and with ``checkpoint_seconds``
        (each worker's own clock) they agree by one all-reduce of the flag."""
        due = self._schedule.due(self.step)
        if not self._spread():
            return due and self.rank == 0
        if self._schedule.every_s is not None and self.num_workers > 1:
            flag = torch.tensor([1 if due else 0], dtype=torch.int64)
            runtime.current().transport.allreduce(flag, op="max", what="checkpoint due (spread optimizer state)")
            due = bool(flag)
        return due

    def commit(self) -> None:
        """Remember parameters, buffers, optimizer state and counters (restored if a worker dies).
        Where the state is spread over the ranks, every worker calls it: the strategy's parameters
        in flight are finished (``hybrid``'s tables pulled whole from their servers) and the state
        gathered, collectives the size of the tables and of the optimizer state."""
        if self._spread():
            self.optimizer.flush()
            self.optimizer.consolidate_state_dict()
        optimizer = copy.deepcopy(self.optimizer.state_dict())  # first: "here" strategies finish their updates
        model = self.optimizer._gradsync.model
        self._commit = {
            "params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()],
            "optimizer": optimizer,
            "counters": self._counters(),
        }

    def _counters(self) -> dict:
        data = self.data.state() if self.data is not None else None
        return {"step": self.step, "epoch": self.epoch, "data": data, "batch_size": self.batch_size,
                "shares": self.shares, "stop": self.stop_requested}

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
        self.shares = c.get("shares")  # commits written before shares existed have none
        if self.data is not None and c["data"] is not None:
            self.data.load(*c["data"])
