"""The hybrid strategy on a worker: the lookups' pulls, the row gradients' pushes, the dense
all-reduce, flush, close and checkpoints. The first step's decisions (which tables are sparse, how
many partitions) are :mod:`~gradsync.strategies.hybrid.plan`; the servers,
:mod:`~gradsync.strategies.hybrid.server`; the package's docstring has the design and the wire format."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies.allreduce import BucketedSync
from gradsync.strategies.base import Strategy, SyncContext, host_ring_bytes, worker_hosts
from gradsync.strategies.casync_ring import compressed_allreduce
from gradsync.strategies.hybrid.hosts import HostRows
from gradsync.strategies.hybrid.layout import (OP_FLUSH, OP_PULL, OP_PUSH, OP_STOP, TABLES, TAG_ANSWER, TAG_REQUEST,
                                              Layout, _lr_bits)
from gradsync.strategies.hybrid.plan import Planning
from gradsync.strategies.hybrid.server import RowServer
from gradsync.strategies.optstate import StateLayout, gather
from gradsync.transport import wait_all
from gradsync.strategies.keepalive import KeepAlive, sending


class SparseHybrid(Planning, Strategy):
    """Sparse embedding tables through parameter servers as rows, the rest through all-reduce."""

    name = "hybrid"
    summary = "Parallax: sparse embedding tables to row servers, the rest all-reduced"
    backends = ("gloo",)  # any-source receives
    uses_servers = True
    mean_over_workers = True

    def __init__(self, sparse: list[str] | None = None, dense: list[str] | None = None,
                 sparse_threshold: float | None = None, partitions: int | str = "auto",
                 probe_rounds: int = 3, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 compression: str | None = None, error_feedback: bool = False):
        # one name on its own, as `--set hybrid.sparse=embedding.weight` gives it, is a list of one
        sparse, dense = ([names] if isinstance(names, str) else names for names in (sparse, dense))
        if partitions != "auto" and (not isinstance(partitions, int) or partitions < 1):
            raise ConfigError(f"hybrid partitions must be 'auto' or an int >= 1 (per server), got {partitions!r}")
        if sparse_threshold is not None and not 0 <= sparse_threshold <= 1:
            raise ConfigError(f"hybrid sparse_threshold must be in [0, 1], got {sparse_threshold}")
        if probe_rounds < 1:
            raise ConfigError(f"hybrid probe_rounds must be >= 1, got {probe_rounds}")
        both = set(sparse or ()) & set(dense or ())
        if both:
            raise ConfigError(f"hybrid: {sorted(both)} named both sparse and dense")
        self.force_sparse, self.force_dense = list(sparse or ()), list(dense or ())
        self.threshold, self.partitions_option, self.probe_rounds = sparse_threshold, partitions, probe_rounds
        self.dense_options = dict(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)
        self.compression, self.error_feedback = compression, error_feedback
        self.dense_probe = compressed_allreduce(compression, error_feedback, **self.dense_options)  # bad codec: here
        self.exact = self.dense_probe.exact

    # -- set-up ------------------------------------------------------------------------------------
    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        index = {id(p): i for i, p in enumerate(ctx.params)}
        self.modules: dict[int, nn.Module] = {}
        for module in ctx.model.modules():
            if isinstance(module, TABLES) and id(module.weight) in index:
                self.modules.setdefault(index[id(module.weight)], module)
        names = {n: i for i, n in enumerate(ctx.names)}
        for name in self.force_sparse + self.force_dense:
            if name not in names:
                raise ConfigError(f"hybrid: {name!r} is not a trainable parameter of the model")
        for name in self.force_sparse:
            if names[name] not in self.modules:
                raise ConfigError(f"hybrid: {name!r} cannot go to the servers: it is not the weight of an "
                                  "nn.Embedding or nn.EmbeddingBag (the lookups whose row ids hybrid sees)")
        forced_dense = {names[n] for n in self.force_dense}
        self.candidates = [i for i in sorted(self.modules) if i not in forced_dense]
        self.optimizer_class = type(ctx.optimizer)  # before distribute wraps it
        # Hosts of several workers: each host's first worker alone pushes and pulls rows (hosts.py).
        group = ctx.transport.new_two_level() if ctx.two_level is not None else None
        self.host_rows = HostRows(self, group) if group is not None else None
        self.pushers = [ranks[0] for ranks in group.plan(topo)[0]] if group is not None else topo.worker_ranks
        """The workers that push and pull rows: every worker, or each host's first."""
        self.servers = topo.server_ranks if topo.num_servers else self.pushers
        self.step_no = 0
        self.decided = False
        self.sparse: list[int] = []  # hook indices of the tables on the servers, in table order
        self.table_of: dict[int, int] = {}
        self.looked: dict[int, list[torch.Tensor]] = {i: [] for i in self.candidates}
        self.arrival: list[int] = []
        self.sends: list = []
        self.pushed: set[int] = set()
        self.dense: BucketedSync | None = None
        self.server: RowServer | None = None
        self.decisions: dict[str, str] = {}
        self.touched: dict[str, list[int]] = {}
        self.probes: dict[int, float] = {}
        self.restore_sparse: dict[int, bool] = {}
        self.closed = False
        self.keepalive: KeepAlive | None = None  # from the first step's decisions, on the ranks that push
        self.stats = {"pushed_rows": 0, "pulled_rows": 0, "row_bytes": 0, "steps": 0}
        self.layout: Layout | None = None

    def _group_of(self, param: nn.Parameter) -> dict:
        for group in self.ctx.optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise ConfigError(f"hybrid: {self.ctx.names[self.ctx.params.index(param)]!r} is not in the optimizer")

    # -- the first step: measure, decide, partition --------------------------------------------------
    # -- worker side -------------------------------------------------------------------------------
    def on_lookup(self, index: int, ids: torch.Tensor) -> None:
        if index not in self.looked and index not in self.table_of:
            return
        p, name = self.ctx.params[index], self.ctx.names[index]
        ids = ids.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= p.shape[0]):
            raise GradsyncError(f"rank {self.ctx.topology.rank}: embedding {name!r} was given row ids "
                                f"{int(ids.min())}..{int(ids.max())}, outside its {p.shape[0]} rows")
        if not self.decided:
            self.looked[index].append(ids.detach().clone())
            return
        if index not in self.table_of:
            return
        self._check_server()
        if self.host_rows is not None and torch.is_grad_enabled():
            self.host_rows.pull(index, torch.unique(ids))
        else:
            self._pull(self.table_of[index], index, torch.unique(ids))

    def _pull(self, t: int, index: int, uniq: torch.Tensor) -> None:
        """Rows ``uniq`` of table ``t`` from their servers into the table."""
        p, name, rank = self.ctx.params[index], self.ctx.names[index], self.ctx.topology.rank
        answers = []
        for server, where in self.layout.split(t, uniq).items():
            if server == rank:
                self.server.wait_step(self.step_no)  # own partitions: the worker's rows are the server's
                continue
            if not where.numel():
                continue
            wanted = uniq[where]
            self.sends += self._request(server, OP_PULL, t, self.layout.partitions, wanted)
            rows = torch.empty(wanted.numel(), p.shape[1], dtype=p.dtype, device=p.device)
            answers.append((wanted, rows, self.ctx.transport.recv_async(
                rows, server, TAG_ANSWER, what=f"rows of {name!r} from rank {server}")))
        with torch.no_grad():
            for wanted, rows, handle in answers:
                handle.wait()
                p.index_copy_(0, wanted, rows)
                self.stats["pulled_rows"] += wanted.numel()
                self._wire_bytes(wanted, rows)

    def _request(self, server: int, op: int, t: int, partitions: int, ids: torch.Tensor,
                 values: torch.Tensor | None = None, used: bool = True, lr: float = 0.0) -> list:
        tr = self.ctx.transport
        header = torch.tensor([op, self.step_no, t, partitions, ids.numel(), int(used), _lr_bits(lr), 0], dtype=torch.int64)
        what = f"hybrid {('pull', 'push', 'flush', 'stop', 'probe', 'probe')[op - 1]} to rank {server}"
        messages = [header]
        if ids.numel():
            messages.append(ids.contiguous())
            if values is not None:
                messages.append(values.contiguous())
        with sending(self.keepalive, server):  # the request's messages in a row: no ping between them
            return [tr.send_async(m, server, TAG_REQUEST, what=what) for m in messages]

    def _wire_bytes(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Count the bytes of rows that went over the wire (ids and values), for the bench's bound."""
        self.stats["row_bytes"] += ids.numel() * ids.element_size() + rows.numel() * rows.element_size()

    def _rows_of(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's gradient of table ``index`` as (unique row ids, rows)."""
        p, name = self.ctx.params[index], self.ctx.names[index]
        grad = p.grad
        if grad is None:
            return (torch.empty(0, dtype=torch.int64, device=p.device),
                    torch.empty(0, p.shape[1], dtype=p.dtype, device=p.device))
        if not grad.is_sparse:
            if self.decided and self.step_no > 0:
                raise GradsyncError(
                    f"rank {self.ctx.topology.rank}: embedding {name!r} is on hybrid's parameter servers but got a "
                    "dense gradient: it is used outside its lookup (tied weights, a direct read of .weight). Its rows "
                    f"would be lost; run with dense=[{name!r}] (hybrid's option) to all-reduce it")
            rows = (grad != 0).flatten(1).any(1).nonzero().view(-1)
            return rows, grad[rows]
        g = grad.coalesce()
        return g.indices()[0], g.values()

    def _push(self, index: int) -> None:
        t, p = self.table_of[index], self.ctx.params[index]
        used = p.grad is not None
        ids, values = self._rows_of(index)
        if self.host_rows is not None:
            self.host_rows.push(index, ids, values, used, self.groups[t]["lr"])
        else:
            self._send_rows(t, ids, values, used, self.groups[t]["lr"])
        p.grad = None  # the update happens on the servers; the user's optimizer must skip it
        self.pushed.add(index)

    def _send_rows(self, t: int, ids: torch.Tensor, values: torch.Tensor, used: bool, lr: float) -> None:
        """Push table ``t``'s rows ``ids`` (their gradients ``values``) to their servers; on hosts of
        several workers the host's first worker sends its host's, from the communication thread."""
        rank = self.ctx.topology.rank
        self.stats["pushed_rows"] += ids.numel()
        split = self.layout.split(t, ids)
        own = None
        for server in self.layout.servers_of(t):
            where = split[server]
            if server == rank:
                own = where
            else:
                self._wire_bytes(ids[where], values[where])
                self.sends.extend(self._request(server, OP_PUSH, t, self.layout.partitions, ids[where], values[where],
                                                used, lr))
        if own is not None:  # last: the own push may run this server's update here, on this thread,
            self.server_push(t, ids[own], values[own], used, lr)  # and the other servers must not wait for it

    def server_push(self, t: int, ids, values, used: bool, lr: float) -> None:
        with self.server.cond:
            self.server._push(self.ctx.topology.rank, self.step_no, t, ids, values, used, lr)

    def on_grad_ready(self, index: int) -> None:
        if not self.decided:
            self.arrival.append(index)
            return
        if index in self.table_of:
            if index in self.pushed:
                raise GradsyncError(f"parameter {self.ctx.names[index]!r} received a second gradient after it was "
                                    "pushed. For gradient accumulation, run all but the last backward inside "
                                    "`with optimizer.no_sync():`")
            self._push(index)
        elif self.dense is not None:
            self.dense.on_grad_ready(self.dense_index[index])

    def _build_dense(self) -> None:
        ctx = self.ctx
        chosen = set(self.sparse)
        dense = [i for i in range(len(ctx.params)) if i not in chosen]
        self.dense_index = {i: k for k, i in enumerate(dense)}
        if dense:
            self.dense = compressed_allreduce(self.compression, self.error_feedback, **self.dense_options)
            self.dense.attach(SyncContext(ctx.model, ctx.optimizer, [ctx.params[i] for i in dense],
                                          [ctx.names[i] for i in dense], ctx.transport, ctx.topology, ctx.stats,
                                          two_level=ctx.two_level))

    def step(self, apply: Callable[[], Any]) -> Any:
        if not self.decided:  # the first step: measure, decide, then replay backward's hooks
            self._decide()
            self._build_dense()
            for index in self.arrival:
                self.on_grad_ready(index)
        self._check_server()
        for index in self.sparse:
            if index not in self.pushed:
                self._push(index)
        if self.dense is not None:
            self.dense.synchronize()
        result = apply()
        if self.host_rows is not None:
            self.host_rows.finish()
        wait_all(self.sends)
        self.sends = []
        self.pushed = set()
        self.step_no += 1
        self.stats["steps"] += 1
        return result

    def flush(self) -> None:
        """Bring every row of the sparse tables up to date on this worker (whole partitions)."""
        if not self.sparse or self.closed:
            return
        rank, answers = self.ctx.topology.rank, []
        for t, index in enumerate(self.sparse):
            p = self.ctx.params[index]
            for server in self.layout.servers_of(t):
                if server == rank:
                    self.server.wait_step(self.step_no)
                    continue
                self.sends += self._request(server, OP_FLUSH, t, self.layout.partitions, torch.empty(0, dtype=torch.int64))
                for lo, hi in self.layout.ranges(t, server):  # straight into the rows: no buffer
                    answers.append(self.ctx.transport.recv_async(
                        p.data[lo:hi], server, TAG_ANSWER, what=f"rows {lo}..{hi} of {self.ctx.names[index]!r} from rank {server}"))
        wait_all(answers)
        wait_all(self.sends)
        self.sends = []

    def settle(self) -> None:
        """The pushes still being sent, not :meth:`flush`'s pull of every partition (rows no step read)."""
        wait_all(self.sends)
        self.sends = []

    def _check_server(self) -> None:
        if self.server is not None:
            self.server.check()

    # -- server side -------------------------------------------------------------------------------
    def serve(self) -> None:
        """A dedicated server: take part in the first step's decisions, then answer until every worker stops."""
        self._decide()
        if self.server is not None:
            self.server.stop()

    def close(self) -> None:
        if self.closed:
            return
        topo = self.ctx.topology
        if topo.is_worker and not self.decided:
            self._decide(closing=True)  # dedicated servers are waiting for the first step's decisions
        if topo.is_worker and self.sparse:
            self.flush()  # the model is whole after close: every row current
        self.closed = True
        if self.keepalive is not None:
            self.keepalive.stop()  # before the stop: after it, the servers no longer listen to this worker
        if topo.is_worker and self.sparse:
            wait_all(self.sends)
            stops = [h for server in self.servers if server != topo.rank
                     for h in self._request(server, OP_STOP, 0, self.layout.partitions, torch.empty(0, dtype=torch.int64))]
            wait_all(stops)
            if self.server is not None:
                self.server.stop()
        if self.host_rows is not None:
            self.ctx.transport.free_group(self.host_rows.group)
        if self.dense is not None:
            self.dense.close()  # casync-ring's communication thread, with compression=
        for i, flag in self.restore_sparse.items():
            self.modules[i].sparse = flag

    def abandon(self) -> None:
        """After a peer failed: the tables get back their own ``sparse`` flags (the next strategy
        attached records them), the row server's loop ends with the broken group; nothing is sent."""
        self.closed = True
        if self.keepalive is not None:
            self.keepalive.stop(wait=False)
        if self.server is not None:
            self.server.closed = True
        if self.dense is not None:
            self.dense.abandon()
        for i, flag in self.restore_sparse.items():
            self.modules[i].sparse = flag

    # -- reports -----------------------------------------------------------------------------------
    @property
    def state_location(self) -> str:  # type: ignore[override]
        """The tables' optimizer state lives with their partitions: on the workers' servers
        (gathered by ``consolidate_state_dict()``) or on dedicated servers (out of reach)."""
        if not self.candidates or (self.decided and not self.sparse):
            return "optimizer"
        return "servers" if self.ctx.topology.num_servers else "workers"

    def gather_state(self) -> None:
        """Co-located servers: assemble each table's whole state in the user's optimizer (a
        collective over the workers, each row's state held by exactly one of them)."""
        if not self.sparse:
            return
        if self.server is not None and any(self.server.parts):
            self.server.wait_step(self.step_no)  # this step's update applied: the state is current
        opt, tables = self.ctx.optimizer, [self.ctx.params[i] for i in self.sparse]
        layout = StateLayout(self.optimizer_class, opt, tables)
        pieces = self.server.pieces() if self.server is not None else []  # a host's other workers serve nothing
        for t, state in gather(layout, pieces, self.ctx.transport).items():
            opt.state[tables[t]] = state

    def load_state(self) -> None:
        """The user's optimizer was loaded: its tables' state goes to the partitions (before the
        first step, the servers take it when they are set up)."""
        if not self.sparse:
            return
        self.groups = [self._group_of(self.ctx.params[i]) for i in self.sparse]  # torch's load makes new groups
        if self.server is not None:
            if any(self.server.parts):
                self.server.wait_step(self.step_no)
            self.server.seed(self.ctx.optimizer, loaded=True)

    def after_load(self) -> None:
        """Co-located servers serve the workers' own rows: no worker may pull rows before every
        worker has loaded them (a barrier over the workers)."""
        if self.sparse and self.ctx.topology.num_servers == 0 and self.ctx.topology.num_workers > 1:
            self.ctx.transport.allreduce(torch.zeros(1), what="hybrid: every worker loaded the model")

    def min_bytes_per_host(self, model_bytes: int) -> float:
        """The dense part's ring all-reduce over the hosts (of the compressed payloads, with
        ``compression=``), plus the rows out (push) and back (pull):
        on hosts of several workers the host's, counted once (this worker's count, the host's
        first: the union of its workers' rows); flat, the busiest host's workers' (each this
        worker's count: their ids differ)."""
        params = self.ctx.params
        sparse_bytes = sum(params[i].numel() * params[i].element_size() for i in self.sparse)
        row_bytes = self.stats["row_bytes"] / max(1, self.stats["steps"])
        copies = 1 if self.host_rows is not None else max(len(w) for w in worker_hosts(self.ctx.topology))
        dense = (self.dense.min_bytes_per_host(model_bytes - sparse_bytes) if self.dense is not None
                 else host_ring_bytes(model_bytes - sparse_bytes, self.ctx.topology))  # the codec's ratio, if any
        return dense + copies * row_bytes

    def host_work(self) -> dict[str, list]:
        """This rank's row server's updates so far, ``{"update": [tables updated, partition bytes,
        seconds]}`` (each a zeroed gradient of the partitions, the rows added, the optimizer run);
        empty on a rank without a server (``gradsync bench`` records them per step)."""
        if self.server is None:
            return {}
        with self.server.cond:
            return {"update": list(self.server.updates)}

    def describe(self) -> str:
        if not self.decided:
            return "hybrid(undecided: no step taken)"
        where = (f"{len(self.servers)} dedicated servers" if self.ctx.topology.num_servers
                 else f"co-located on {len(self.servers)} workers")
        parts = ""
        if self.sparse:
            probes = ", ".join(f"{p}: {s * 1e3:.0f} ms" for p, s in self.probes.items())
            parts = (f", {self.layout.partitions} partitions per table" +
                     (f" (measured {probes})" if probes else "") +
                     f", {'lazy' if self.lazy else 'dense'} server updates")
        if self.sparse and self.host_rows is not None:
            parts += f", host sums: {len(self.pushers)} hosts push"
        tables = "; ".join(f"{n}: {d}" for n, d in self.decisions.items()) or "no embedding tables"
        dense = self.dense.describe() if self.dense is not None else "no dense parameters"
        return f"hybrid({len(self.sparse)} sparse tables on {where}{parts}; {tables}; dense: {dense})"
