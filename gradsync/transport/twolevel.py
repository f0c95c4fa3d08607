"""The two-level all-reduce of a job whose hosts run several workers (Gloo).

A flat ring puts every rank on the network: on a host of R workers behind one NIC, the host's link
carries R ranks' ring traffic. Horovod's hierarchical all-reduce and BytePS's intra-host reduce
cross the network once per host instead; here, on Gloo, for a buffer cut into S shards (S: the
most workers any host runs):

1. reduce-scatter inside the host: local worker ``j`` ends with the host's sum of shard ``j``;
2. all-reduce of each shard across hosts, among the ranks that own it (one per host): a host's
   R workers use its NIC in parallel, each for 1/S of the bytes, ``2 (H-1)/H`` model bytes per
   host NIC in all (H hosts), what one rank per host would send;
3. all-gather inside the host.

All-reduces run as a pipeline, within a buffer and from one buffer to the next: a buffer of more
than ``PIPELINE_BYTES`` is cut into parts, and while one part's step 2 is on the network the next
part's (or the next buffer's) step 1 and the previous part's step 3 run inside the host. Steps 1
and 3 use two groups of the host's workers, each with its own thread, so each group's operations
keep one order on every rank; a stream of small buffers (``allreduce-priority``'s partitions)
keeps the NIC busy as one large buffer does.

A host with fewer workers than S (an uneven layout: two hosts of 2 and 1) gives its worker ``j``
every shard ``s`` with ``s % L == j`` (L: its workers); inside it the sum is an all-reduce and the
gather one broadcast per shard. Sums are taken in another order than a flat ring's, so results
differ from it in the last bits, as any two all-reduce algorithms' do.

Intra-host traffic runs on Gloo's TCP loopback (it costs the host's CPU, not its NIC); only step 2
crosses hosts and only it counts in ``Transport.bytes_sent``. Under NCCL, whose rings and trees already follow the
machine's topology, gradsync keeps NCCL's own all-reduce.

The collectives of one :class:`TwoLevel` run on its own threads in the order they were issued (the
same on every rank, as Gloo matches collectives by their order on a group): every operation's
first part on one, the all-reduces' step 3 on another; the issuing thread gets a
:class:`~gradsync.transport.waits.Handle` and waits on it as on any collective.
"""
from __future__ import annotations

import math
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.topology import Topology
from gradsync.transport.groups import allgather_with_info
from gradsync.transport.waits import JobThread


# torch 2.13 names these `*_single` (and warns on the old names); torch 2.11 has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

PIPELINE_BYTES = 4 * 2**20
PIPELINE_PARTS = 8
"""A two-level all-reduce of more than ``PIPELINE_BYTES`` runs as up to ``PIPELINE_PARTS`` parts in a
pipeline, so the host's NIC carries one part while the next is summed inside the host."""


class _Done:
    """What the communication thread reports for one job, shaped as a Gloo work (``wait(timeout)``,
    ``is_completed()``) so that :class:`~gradsync.transport.waits.Handle` waits on it in chunks."""

    __slots__ = ("event", "error")

    def __init__(self):
        self.event = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.event.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("two-level all-reduce: timed out waiting for the communication thread")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.event.is_set()


class TwoLevel:
    """The process groups of a job whose hosts run several workers, and the all-reduce over them.

    Made by :meth:`create` (collective: every rank, servers included, at the same point)."""

    group_name = "two-level"
    """How the flight record names the operations issued here."""
    _OPS = ("all-reduce", "reduce", "broadcast", "host-all-reduce", "reduce-scatter", "all-gather", "all-gather-bytes")

    def __init__(self, topology: Topology, local, local_ranks: list[int], shards: int,
                 cross: dict[int, tuple[list[int], object]], local_gather=None):
        self.topology = topology
        self.local = local
        """This host's workers' group (None: the host runs one worker)."""
        self.local_gather = local_gather if local_gather is not None else local
        """The same workers' second group: the all-reduces' step 3, on its own thread."""
        self.local_ranks = local_ranks
        self.shards = shards
        """S: the most workers any host runs; buffers are cut into S shards."""
        self.cross = cross
        """Shard -> (the ranks that own it, one per host; their group), for the shards this rank owns."""
        self._thread = JobThread("gradsync-two-level", self._run)
        self._gathers = JobThread("gradsync-two-level-gather", self._finish_part)
        self._failed: BaseException | None = None
        """The first operation's failure: the operations queued after it fail at once, without a
        collective (each would block on the broken groups until their timeout)."""

    @staticmethod
    def plan(topology: Topology) -> tuple[list[list[int]], int, list[list[int]]]:
        """``(workers of each host, S, owners of each shard)`` of the layout (hosts without workers left out)."""
        hosts = [[r for r in ranks if r < topology.num_workers] for ranks in topology.hosts]
        hosts = [h for h in hosts if h]
        shards = max(len(h) for h in hosts)
        owners = [[h[s % len(h)] for h in hosts] for s in range(shards)]
        return hosts, shards, owners

    @classmethod
    def create(cls, topology: Topology, timeout: timedelta) -> "TwoLevel":
        """Every host's local group and every shard's cross-host group, each made once, by every
        rank in the same order (``dist.new_group`` is collective over the whole job)."""
        hosts, shards, owners = cls.plan(topology)
        me = topology.rank
        local, local_gather, local_ranks = None, None, []
        for ranks in hosts:
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if me in ranks:
                local, local_ranks = group, ranks
        for ranks in hosts:
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if me in ranks:
                local_gather = group
        made: dict[tuple[int, ...], object] = {}
        cross = {}
        for s, ranks in enumerate(owners):
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                cross[s] = (ranks, made[key])
        return cls(topology, local, local_ranks, shards, cross, local_gather)

    def network_bytes(self, nbytes: int) -> int:
        """Bytes this rank sends across hosts for an all-reduce of ``nbytes``: its shards' rings."""
        piece = math.ceil(nbytes / self.shards)
        return sum(int(2 * (len(ranks) - 1) / len(ranks) * piece) for ranks, _ in self.cross.values())

    def submit(self, op: str, tensor: torch.Tensor, on_done=None, then=None) -> _Done:
        """Queue ``op`` on ``tensor`` (contiguous, on the CPU): ``"all-reduce"``, a sum over every
        worker; ``"reduce"``, a sum over this host's workers onto its first; ``"broadcast"``, from
        the host's first worker to the others; ``"host-all-reduce"``, a sum over this host's
        workers; ``"reduce-scatter"`` and ``"all-gather"``, steps 1 and 3 alone, on a tensor of S
        shards of one length (a strategy runs its own step 2 on the shards of :attr:`cross`): the
        host's sum of each shard lands at the shard's local owner (other shards are left
        undefined), then each owner's shards reach the host's other workers; ``"all-gather-bytes"``,
        every host worker's ``uint8`` message of its own length, ``tensor`` being ``(message,
        info, limit, what)`` (:func:`~gradsync.transport.groups.allgather_with_info` on the host's
        group). ``then()`` runs on the communication thread after a successful operation and before
        its waiters wake (a failure in it fails the operation): what must follow at once, as the
        push of a host's sum; after ``"all-gather-bytes"`` it is given the messages and the infos,
        in host order. ``on_done()`` runs there once it is done (or failed)."""
        if op not in self._OPS:
            raise ValueError(f"unknown two-level operation {op!r}")
        done = _Done()
        self._thread.put((op, tensor, done, on_done, then))
        return done

    @property
    def leader(self) -> int:
        """The first worker of this rank's host: where :meth:`submit`'s reduce lands."""
        return self.local_ranks[0]

    def groups(self) -> list:
        """This rank's process groups here (to release a private one)."""
        found = []
        for group in [self.local, self.local_gather] + [g for _, g in self.cross.values()]:
            if group is not None and all(group is not g for g in found):
                found.append(group)
        return found

    def close(self) -> None:
        """Let the threads end after the jobs queued so far."""
        self._thread.close()
        self._gathers.close()

    def _check(self, op: str) -> None:
        if self._failed is not None:
            first = (str(self._failed).splitlines() or [repr(self._failed)])[0]
            raise RuntimeError(f"two-level {op}: not run, an earlier two-level operation on these groups "
                               f"failed: {first}")

    def _end(self, done: _Done, on_done, exc: BaseException | None = None) -> None:
        """An operation is over (failed with ``exc``): wake its waiters, then run ``on_done``."""
        if exc is not None:
            done.error = exc
            if self._failed is None:
                self._failed = exc
        done.event.set()
        if on_done is not None:
            on_done()

    def _run(self, job) -> None:
        op, tensor, done, on_done, then = job
        if op == "all-reduce":
            self._start_allreduce(tensor.view(-1), done, on_done, then)
            return
        result = ()
        try:
            self._check(op)
            if op == "all-gather-bytes":
                result = self._gather_bytes(*tensor)
            elif op == "reduce-scatter":
                self._scatter(tensor.view(-1))
            elif op == "all-gather":
                self._gather(tensor.view(-1), self.local)
            elif self.local is not None and op == "reduce":
                dist.reduce(tensor, dst=self.leader, group=self.local)
            elif self.local is not None and op == "host-all-reduce":
                dist.all_reduce(tensor, group=self.local)
            elif self.local is not None:
                dist.broadcast(tensor, src=self.leader, group=self.local)
            if then is not None:
                then(*result)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._end(done, on_done, exc)
            return
        self._end(done, on_done)

    def _gather_bytes(self, message: torch.Tensor, info: tuple[int, int, int], limit: int,
                      what: str) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """Every host worker's message and info, in host order (a host of one: its own)."""
        if self.local is None:
            return [message], [tuple(info)]
        return allgather_with_info(message, info, self.local, limit=limit, what=what)

    def _start_allreduce(self, flat: torch.Tensor, done: _Done, on_done, then) -> None:
        """Steps 1 and 2 of each part of ``flat``, the part then handed to the gather thread, which
        waits for its step 2 and runs its step 3 (:meth:`_finish_part`) while this thread goes on
        to the next part or the next operation. Every rank cuts the same parts and issues each
        group's operations in the same order."""
        n = flat.numel()
        parts = max(1, min(PIPELINE_PARTS, n * flat.element_size() // PIPELINE_BYTES))
        bounds = [n * i // parts for i in range(parts + 1)]
        for i in range(parts):
            view = flat[bounds[i]:bounds[i + 1]]
            last = i == parts - 1
            try:
                self._check("all-reduce")
                padded = view
                if view.numel() % self.shards:  # shards of one length on every rank: pad with zeros
                    padded = view.new_zeros(math.ceil(view.numel() / self.shards) * self.shards)
                    padded[:view.numel()] = view
                self._scatter(padded)
                shard = self._shards(padded)
                works = self._cross_async({k: shard[k] for k in self.cross})
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, after the parts before it
                self._gathers.put((None, None, exc, True, done, on_done, then))
                return
            self._gathers.put((view, padded, works, last, done, on_done, then))

    def _finish_part(self, job) -> None:
        """Step 3 of one part, once its step 2 is done; after an all-reduce's last part, its
        ``then`` and its waiters."""
        view, padded, works, last, done, on_done, then = job
        if done.event.is_set():  # an earlier part of this all-reduce failed
            return
        try:
            if isinstance(works, BaseException):
                raise works
            for work in works:
                work.wait()
            self._gather(padded, self.local_gather)
            if padded is not view:
                view.copy_(padded[:view.numel()])
            if not last:
                return
            if then is not None:
                then()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._end(done, on_done, exc)
            return
        self._end(done, on_done)

    def _shards(self, padded: torch.Tensor) -> list[torch.Tensor]:
        if padded.numel() % self.shards:
            raise ValueError(f"{padded.numel()} elements are not {self.shards} shards of one length")
        piece = padded.numel() // self.shards
        return [padded[k * piece:(k + 1) * piece] for k in range(self.shards)]

    def _scatter(self, padded: torch.Tensor) -> None:
        """Step 1: the host's sum of each shard at its local owner (of every shard, on an uneven host)."""
        shard = self._shards(padded)
        if self.local is None:
            return
        if len(self.local_ranks) == self.shards:  # every shard has its own local owner
            mine = shard[self.local_ranks.index(self.topology.rank)]
            total = mine.clone()
            _reduce_scatter(total, padded, group=self.local)
            mine.copy_(total)
        else:  # an uneven host: sum it whole
            dist.all_reduce(padded, group=self.local)

    def _gather(self, padded: torch.Tensor, group) -> None:
        """Step 3 on ``group`` (one of this host's two): each shard from its local owner to the
        host's other workers."""
        shard = self._shards(padded)
        size = len(self.local_ranks)
        if group is None:
            return
        if size == self.shards:
            _all_gather(padded, shard[self.local_ranks.index(self.topology.rank)].clone(), group=group)
        else:
            for k in range(self.shards):
                dist.broadcast(shard[k], src=self.local_ranks[k % size], group=group)

    def _cross_async(self, parts: dict[int, torch.Tensor]) -> list:
        return [dist.all_reduce(part, group=self.cross[s_][1], async_op=True)
                for s_, part in parts.items() if len(self.cross[s_][0]) > 1]
