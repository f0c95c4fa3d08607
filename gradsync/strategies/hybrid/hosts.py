"""The hybrid strategy on hosts of several workers: a host's rows combined on its first worker
(Parallax's local aggregation), so each table's traffic crosses the network once per host.

On Gloo, where the job's hosts run several workers (``distribute(..., hosts="auto")``):

- push: each worker's row gradient of a table (its unique row ids and their rows) goes to the
  host's other workers in one length-checked all-gather inside the host; the host's first worker
  (its *leader*) takes the union of the ids, sums the rows of each id over the host's workers (in
  host order) and alone pushes them to the servers, flagged used when any of the host's workers
  used the table. Servers wait for one push per host and divide by the job's workers, so the
  update is the flat one;
- pull: a lookup's unique ids are all-gathered inside the host; the leader pulls the union once
  (its own server's partitions are its own rows) and broadcasts the rows, which every worker of
  the host writes into its table.

A host's collectives must come in one order on all its workers. Tables are summed in one fixed
order (highest parameter index first, as backward reaches them): a table's sum is issued once it
and every table before it is ready on this worker, and a table a worker did not use goes in empty
at ``optimizer.step()``. Lookups come in forward order, so every worker of a host must look up
the same tables in the same order each step (one model's forward does; a lookup that depends on
the data needs ``hosts="flat"``): each exchange says which step, table and direction it is, and a
host whose workers disagree stops with a :class:`~gradsync.errors.GradsyncError` that says what
each of them was doing. The exchanges run on a :class:`TwoLevel` of the strategy's own, whose thread keeps them
apart from the dense all-reduce's. A lookup under ``torch.no_grad()`` (an evaluation, which may
run on one worker alone) pulls its own rows flat. Whole-table flushes (checkpoints, close) are
each worker's own, as flat.
"""
from __future__ import annotations

import torch

from gradsync.errors import GradsyncError
from gradsync.transport import check_peer, wait_all

ID_BYTES = 8
PULL, PUSH = 0, 1


class HostRows:
    """One worker's part in its host's row sums and shared pulls (a :class:`SparseHybrid`'s)."""

    def __init__(self, owner, group):
        self.h, self.group = owner, group
        self.leader = owner.ctx.topology.rank in group.local_ranks[:1]  # a dedicated server is in no host group
        self.order: list[int] = []
        """The tables' hook indices in the order their sums are issued."""
        self.ready: dict[int, tuple] = {}  # index -> (ids, values, used, lr), waiting for its turn
        self.summing: list = []
        self.issued = 0

    def plan(self, sparse: list[int]) -> None:
        self.order = sorted(sparse, reverse=True)

    # -- push ------------------------------------------------------------------------------------
    def push(self, index: int, ids: torch.Tensor, values: torch.Tensor, used: bool, lr: float) -> None:
        """Queue table ``index``'s rows; issue the host sums whose turn has come."""
        self.ready[index] = (ids, values, used, lr)
        while self.issued < len(self.order) and self.order[self.issued] in self.ready:
            self._sum(self.order[self.issued])
            self.issued += 1

    def _sum(self, index: int) -> None:
        ids, values, used, lr = self.ready.pop(index)
        t, name = self.h.table_of[index], self.h.ctx.names[index]
        message = torch.cat([ids.contiguous().view(torch.uint8), values.contiguous().view(-1).view(torch.uint8)])
        info = self._info(ids.numel(), t, PUSH, used)

        def then(messages: list, infos: list) -> None:
            self._agree(infos, info)
            if self.leader:
                self._combine(t, messages, infos, lr)

        self.summing.append(self.h.ctx.transport.host_allgather_async(
            message, group=self.group, limit=self._limit(index), info=info, what=f"host rows of {name!r}", then=then))

    def _combine(self, t: int, messages: list, infos: list, lr: float) -> None:
        """The leader, on the communication thread: the host's union of ids, its rows summed, pushed on."""
        index = self.h.sparse[t]
        p, name = self.h.ctx.params[index], self.h.ctx.names[index]
        width, size = p.shape[1], p.element_size()
        what, ids, rows = f"host rows of {name!r}", [], []
        for rank, message, (n, _, _) in zip(self.group.local_ranks, messages, infos):
            check_peer(0 <= n <= p.shape[0] and message.numel() == n * (ID_BYTES + width * size), rank, what,
                       f"{n} rows in {message.numel()} bytes")
            ids.append(_row_ids(rank, message[:n * ID_BYTES], p.shape[0], what))
            rows.append(message[n * ID_BYTES:].view(p.dtype).view(n, width))
        union, where = torch.unique(torch.cat(ids), return_inverse=True)
        summed = torch.zeros(union.numel(), width, dtype=p.dtype, device=p.device)
        summed.index_add_(0, where, torch.cat(rows))
        self.h._send_rows(t, union, summed, any(code & 1 for _, _, code in infos), lr)

    def finish(self) -> None:
        """Wait until every host sum of this step is in (and, on the leader, pushed on)."""
        wait_all(self.summing)
        self.summing, self.issued = [], 0

    # -- pull ------------------------------------------------------------------------------------
    def pull(self, index: int, ids: torch.Tensor) -> None:
        """The rows of the host's lookup of table ``index`` (``ids``: this worker's unique ids),
        pulled once by the leader and written into every host worker's table."""
        h, p, name = self.h, self.h.ctx.params[index], self.h.ctx.names[index]
        what, info = f"host lookup of {name!r}", self._info(ids.numel(), h.table_of[index], PULL, False)
        messages, infos = h.ctx.transport.host_allgather(ids.contiguous().view(torch.uint8), group=self.group,
                                                         limit=self._limit(index), info=info, what=what)
        self._agree(infos, info)
        union = torch.unique(torch.cat([_row_ids(rank, message, p.shape[0], what)
                                        for rank, message in zip(self.group.local_ranks, messages)]))
        if not union.numel():
            return
        if self.leader:
            h._pull(h.table_of[index], index, union)
            rows = p.detach()[union]
        else:
            rows = torch.empty(union.numel(), p.shape[1], dtype=p.dtype, device=p.device)
        h.ctx.transport.host_broadcast(rows, group=self.group, what=f"host rows of {name!r} from its first worker")
        if not self.leader:
            with torch.no_grad():
                p.index_copy_(0, union, rows)

    def _limit(self, index: int) -> int:
        """The most bytes a host worker may send for table ``index``: every row once, ids and values
        (a lookup's ids alone are less: one limit, so that workers that disagree learn it from
        :meth:`_agree`, not from a length refused on one side only)."""
        p = self.h.ctx.params[index]
        return p.shape[0] * (ID_BYTES + p.shape[1] * p.element_size())

    def _info(self, n: int, t: int, op: int, used: bool) -> tuple[int, int, int]:
        """An exchange's three words: its row count, its step, and ``(table, op, used)`` packed."""
        return n, self.h.step_no, 4 * t + 2 * op + int(used)

    def _agree(self, infos: list, mine: tuple[int, int, int]) -> None:
        """Every host worker's exchange must be this one (its step, table and direction)."""
        def says(info) -> str:
            _, step, code = info
            table = self.h.ctx.names[self.h.sparse[code // 4]] if 0 <= code // 4 < len(self.h.sparse) else code // 4
            return f"{('looks up', 'pushes')[code // 2 % 2]} table {table!r} at step {step}"

        if any((step, code // 2) != (mine[1], mine[2] // 2) for _, step, code in infos):
            others = ", ".join(f"rank {r} {says(info)}" for r, info in zip(self.group.local_ranks, infos))
            raise GradsyncError(
                f"hybrid on rank {self.h.ctx.topology.rank}: the workers of this host disagree on their next row "
                f"exchange ({others}). On hosts of several workers every worker of a host must look up the same "
                "tables in the same order each step; a lookup that depends on the data needs "
                "distribute(..., hosts=\"flat\")")


def _row_ids(rank: int, raw: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """The row ids in host worker ``rank``'s bytes ``raw``, each checked to lie within the table."""
    check_peer(raw.numel() % ID_BYTES == 0, rank, what, f"{raw.numel()} bytes of row ids")
    ids = raw.view(torch.int64)
    check_peer(bool(((ids >= 0) & (ids < rows)).all()), rank, what, f"a row id outside 0..{rows - 1}")
    return ids
