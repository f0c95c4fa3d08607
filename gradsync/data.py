"""Data for the workers of a job: a sampler that shards a dataset by workers only.

torch's ``DistributedSampler`` shards by ``torch.distributed``'s world size and rank, which count
parameter-server ranks too: with ``--servers 2`` each worker would get a smaller shard and a third
of the data would never be read. :func:`sampler` gives each worker its share of the workers alone
(worker ``r`` of ``n`` reads indices ``r, r + n, ...`` of each epoch's order, exactly as
``DistributedSampler(num_replicas=n, rank=r)``), and a server an empty one (a server never trains:
:func:`gradsync.distribute` serves and leaves before the loop). Call ``set_epoch(e)`` each epoch for
a new shuffle, as with torch's. For jobs whose worker count changes while they run (``--elastic``),
use :class:`gradsync.adapt.GlobalBatches` instead.
"""
from __future__ import annotations

from torch.utils.data import Dataset, DistributedSampler


class _ServerSampler(DistributedSampler):
    """A parameter server's sampler: no indices (servers do not train)."""

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def sampler(dataset: Dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> DistributedSampler:
    """A ``DistributedSampler`` over this job's workers (initialising gradsync from the environment)."""
    from gradsync import runtime

    topo = runtime.current().topology
    if topo.is_server:
        return _ServerSampler(dataset, num_replicas=topo.num_workers, rank=0, shuffle=shuffle, seed=seed,
                              drop_last=drop_last)
    return DistributedSampler(dataset, num_replicas=topo.num_workers, rank=topo.rank, shuffle=shuffle,
                              seed=seed, drop_last=drop_last)
