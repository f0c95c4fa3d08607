"""Data sharding that survives changes of batch size, worker count and per-worker shares.

One global order per epoch (a permutation seeded by ``seed`` and the epoch, the same on every
worker) and one global position. A step takes the next ``global_batch`` indices of that order and
cuts them into consecutive slices, one per worker: near-equal ones by default, or in proportion
to ``shares`` (a list of per-worker sizes that sums to the global batch, as
:class:`gradsync.adapt.BalanceBatches` sets them); the position then advances by the global batch.
Whatever the batch size, the number of workers or the shares are at each step, the steps of an
epoch take consecutive, disjoint stretches of one permutation: no sample is skipped or seen twice
within an epoch. The state is two integers (epoch, position), which the elastic runtime hands to
new workers. The last step of an epoch takes what is left, split in proportion to the shares
(:func:`split`: fewer samples each; a worker may get none).

:class:`StepLoader` (``Controller.loader``) is a torch ``DataLoader`` over those parts: its
``batch_sampler`` plans the coming steps' parts from the controller's state (the shares, the
global batch, the position), so its worker processes load ahead as usual, and each step's batch is
checked against the part the controller gives that step. Where the plan no longer holds (new
shares, a new batch size, a resize, an epoch's end, a step redone after a failure), the loaded
batches are dropped and the loader starts again from the step under way: exact always, and a
refill of the loader's prefetch at each change.
"""
from __future__ import annotations

import collections

import torch

from gradsync.errors import ConfigError, GradsyncError


def split(total: int, shares: list[int]) -> list[int]:
    """``total`` samples cut in proportion to ``shares`` (largest remainders, ties to the lower
    rank; integer arithmetic, so every worker computes the same sizes). ``shares`` itself when it
    sums to ``total``; near-equal sizes, the first ones larger, when the shares are equal."""
    whole = sum(shares)
    if whole == total:
        return list(shares)
    sizes = [total * s // whole for s in shares]
    left = total - sum(sizes)
    by_remainder = sorted(range(len(shares)), key=lambda r: (-(total * shares[r] % whole), r))
    for r in by_remainder[:left]:
        sizes[r] += 1
    return sizes


class GlobalBatches:
    def __init__(self, dataset_size: int, seed: int = 0):
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        self.size, self.seed = dataset_size, seed
        self.epoch, self.position = 0, 0
        self._order = None

    @property
    def order(self) -> torch.Tensor:
        if self._order is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = torch.randperm(self.size, generator=gen)
        return self._order

    @property
    def epoch_done(self) -> bool:
        return self.position >= self.size

    def global_batch(self, global_batch: int) -> torch.Tensor:
        """The indices of the whole current step, all workers together."""
        return self.order[self.position:self.position + global_batch]

    def sizes(self, global_batch: int, num_workers: int, shares: list[int] | None = None) -> list[int]:
        """How many samples each worker takes this step (fewer than ``shares`` at an epoch's end)."""
        available = min(global_batch, self.size - self.position)
        return split(available, shares if shares is not None else [1] * num_workers)

    def share(self, global_batch: int, rank: int, num_workers: int, shares: list[int] | None = None) -> torch.Tensor:
        """Worker ``rank``'s slice of the current step's global batch (``shares``: every worker's
        size, summing to ``global_batch``; None: near-equal slices)."""
        sizes = self.sizes(global_batch, num_workers, shares)
        start = sum(sizes[:rank])
        return self.global_batch(global_batch)[start:start + sizes[rank]]

    def advance(self, global_batch: int) -> None:
        self.position = min(self.size, self.position + global_batch)

    def next_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._order = epoch, 0, None

    def state(self) -> tuple[int, int]:
        return self.epoch, self.position

    def load(self, epoch: int, position: int) -> None:
        if epoch != self.epoch:
            self._order = None
        self.epoch, self.position = epoch, position


class StepLoader:
    """This worker's part of each step, loaded by a torch ``DataLoader`` (:meth:`Controller.loader`).

    ``next(loader)`` (or ``loader.next()``) in the step under way returns the loader's batch of
    exactly ``ctl.batch_indices()``'s samples, or None where this worker has none that step (an
    epoch's short last step under unequal shares: skip the forward and backward, still call
    ``opt.step()``). ``options`` are the ``DataLoader``'s (``num_workers``, ``collate_fn``,
    ``pin_memory``, ``persistent_workers``, ``prefetch_factor``, ...) but for the batching, which
    the shares decide. :attr:`restarts` counts the times a plan was dropped."""

    _BATCHING = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")

    def __init__(self, ctl, dataset, **options):
        from torch.utils.data import DataLoader

        given = [key for key in self._BATCHING if key in options]
        if given:
            raise ConfigError(f"ctl.loader batches each step by the controller's shares: drop {', '.join(given)} "
                              "(the global batch is Controller(batch_size=...) times the workers)")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError(f"ctl.loader needs a dataset of indexed samples (a map-style Dataset, with __len__ "
                              f"and __getitem__), not a {type(dataset).__name__}: for a stream, draw "
                              "ctl.share()'s count of samples each step")
        if ctl.data is None:
            raise ConfigError("ctl.loader needs Controller(dataset_size=len(dataset)): the steps take their "
                              "samples from one order of the dataset's indices")
        if len(dataset) != ctl.data.size:
            raise ConfigError(f"ctl.loader: the dataset has {len(dataset)} samples, the controller's "
                              f"dataset_size is {ctl.data.size}: give Controller(dataset_size=len(dataset))")
        self._ctl = ctl
        self._plans: collections.deque[list[int]] = collections.deque()  # each planned batch, in the loader's order
        self._batches = None  # the DataLoader's iterator, while its plan holds
        self.restarts = 0
        self.loader = DataLoader(dataset, batch_sampler=_Planned(self), **options)

    def __iter__(self):
        return self

    def __next__(self):
        want = self._ctl.batch_indices().tolist()
        if not want:
            return None  # the plan skips empty parts too
        for _ in range(2):
            if self._batches is None:
                self._plans.clear()
                self._batches = iter(self.loader)
            try:
                batch = next(self._batches)
                planned = self._plans.popleft()
            except StopIteration:  # the plan ended with the epoch it was made in
                planned = None
            if planned == want:
                return batch
            self._batches = None  # the shares, the batch, the workers or the position changed: plan again
            self.restarts += 1
        raise GradsyncError(f"worker {self._ctl.rank}: ctl.loader's new plan does not begin with step "
                            f"{self._ctl.step}'s part ({len(want)} samples); please report this")

    next = __next__

    def _plan(self):
        """The parts of this worker in the steps from the one under way to the end of its epoch, as
        the controller's state today says they will be."""
        ctl, data = self._ctl, self._ctl.data
        order, position, whole = data.order, data.position, ctl.global_batch_size
        shares = ctl.shares if ctl.shares is not None else [1] * ctl.num_workers
        rank = ctl.rank
        while position < data.size:
            sizes = split(min(whole, data.size - position), shares)
            first = position + sum(sizes[:rank])
            part = order[first:first + sizes[rank]].tolist()
            if part:
                self._plans.append(part)
                yield part
            position += whole


class _Planned:
    """A ``batch_sampler``: the owner's plan, made anew each time the DataLoader iterates it."""

    def __init__(self, owner: StepLoader):
        self._owner = owner

    def __iter__(self):
        return self._owner._plan()
