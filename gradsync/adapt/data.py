"""Data sharding that survives changes of batch size and worker count.

One global order per epoch (a permutation seeded by ``seed`` and the epoch, the same on every
worker) and one global position. A step takes the next ``global_batch`` indices of that order and
worker ``r`` of ``n`` takes the ``r``-th of ``n`` near-equal slices; the position then advances by the
global batch. Whatever the batch size or ``n`` are at each step, the steps of an epoch take
consecutive, disjoint stretches of one permutation: no sample is skipped or seen twice within an
epoch. The state is two integers (epoch, position), which the elastic runtime hands to new workers.
The last step of an epoch takes what is left (fewer samples; a worker may get none).
"""
from __future__ import annotations

import torch


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

    def share(self, global_batch: int, rank: int, num_workers: int) -> torch.Tensor:
        """Worker ``rank``'s slice of the current step's global batch."""
        batch = self.global_batch(global_batch)
        base, extra = divmod(batch.numel(), num_workers)
        start = rank * base + min(rank, extra)
        return batch[start:start + base + (rank < extra)]

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
