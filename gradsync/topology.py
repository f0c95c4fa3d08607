"""Who is who: one value object that knows every rank's role.

Layout contract (shared with ``gradsync run`` and documented in docs/launcher.md): of ``world_size``
ranks, the first ``world_size - num_servers`` are workers and the last ``num_servers`` are
parameter servers. Workers train; servers only serve the strategies that use them (``ps``).
Checked once, here, against the world size; everything else asks this object.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradsync.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    world_size: int
    """Number of processes in the job (workers + servers)."""
    rank: int
    """This process's global rank."""
    num_servers: int = 0
    """Ranks at the end of the range that act as parameter servers."""
    local_rank: int = 0
    """Rank within this machine (selects the GPU under NCCL)."""
    host_of: tuple[int, ...] = ()
    """Each rank's host, numbered from 0 in the order of the hosts' lowest ranks (found at
    ``gradsync.init()``, :mod:`gradsync.hosts`); empty when not known: each rank then counts as a
    host of its own, as on a cluster of one rank per host."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside the world of {self.world_size} ranks")
        if self.num_servers < 0:
            raise ConfigError(f"the number of servers must be >= 0, got {self.num_servers}")
        if self.num_servers >= self.world_size:
            raise ConfigError(
                f"{self.num_servers} servers in a world of {self.world_size} ranks leaves no worker; "
                "a job needs at least one worker (servers must be fewer than WORLD_SIZE)"
            )
        if self.host_of:
            if len(self.host_of) != self.world_size:
                raise ConfigError(f"the host layout names {len(self.host_of)} ranks in a world of {self.world_size}")
            if sorted(set(self.host_of)) != list(range(max(self.host_of) + 1)):
                raise ConfigError(f"hosts must be numbered 0, 1, ... without gaps, got {self.host_of}")

    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.num_workers))

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.num_workers, self.world_size))

    @property
    def is_worker(self) -> bool:
        return self.rank < self.num_workers

    @property
    def is_server(self) -> bool:
        return not self.is_worker

    @property
    def role(self) -> str:
        return "worker" if self.is_worker else "server"

    @property
    def role_rank(self) -> int:
        """Index within the role: worker 0..W-1 or server 0..S-1."""
        return self.rank if self.is_worker else self.rank - self.num_workers

    @property
    def hosts(self) -> list[list[int]]:
        """The ranks of each host, hosts in order; one rank a host when the layout is not known."""
        if not self.host_of:
            return [[r] for r in range(self.world_size)]
        out: list[list[int]] = [[] for _ in range(max(self.host_of) + 1)]
        for rank, host in enumerate(self.host_of):
            out[host].append(rank)
        return out

    def host(self, rank: int | None = None) -> int:
        """The host of ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return self.host_of[rank] if self.host_of else rank

    @property
    def host_ranks(self) -> list[int]:
        """The ranks on this rank's host, itself included."""
        return self.hosts[self.host()]

    @property
    def shares_hosts(self) -> bool:
        """Whether some host runs two or more workers while the job spans several hosts: where
        aggregating inside a host before crossing the network can pay."""
        hosts = [[r for r in ranks if r < self.num_workers] for ranks in self.hosts]
        return sum(1 for h in hosts if h) > 1 and any(len(h) > 1 for h in hosts)

    def describe(self, rank: int) -> str:
        """Human name of any rank, as used in error messages and log prefixes."""
        if rank < self.num_workers:
            return f"worker {rank} (rank {rank})"
        return f"server {rank - self.num_workers} (rank {rank})"
