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
"""
from __future__ import annotations

import torch


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
