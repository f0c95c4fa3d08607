"""Sparse-aware hybrid synchronization: Parallax (Kim et al., EuroSys 2019).

Embedding tables whose steps touch few rows go to parameter servers as (row ids, row values);
everything else goes through the bucketed all-reduce (:class:`~gradsync.strategies.allreduce.AllReduce`).
All-reduce would move every row of a table every step; the servers move only the rows touched.

Which tables are sparse is measured at the first step, on every worker, and agreed by one
all-reduce (max over workers):
- candidates are the weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` modules (the lookups whose
  ids the strategy can see: :meth:`Strategy.on_lookup`);
- a candidate goes to the servers when the largest fraction of its rows any worker read is at most
  ``sparse_threshold`` (default: where pushing and pulling the rows costs less than all-reducing the
  table, ``(N-1)/N`` for N workers) and no row outside those read got a gradient. A table also used
  outside its lookup (tied to an output layer, say) has gradient everywhere: it is *mixed*, and
  stays dense;
- ``sparse=[names]`` forces tables onto the servers (a mixed one is then an error), ``dense=[names]``
  keeps them off. The decisions and the measured fractions are in :meth:`describe`.
A sparse table's module is switched to ``sparse=True`` (restored at close), so autograd produces
row gradients instead of a dense table of zeros; a dense gradient appearing later means the table
is used outside its lookup, and the worker says so and stops.

Servers are the dedicated server ranks if the job has any, else every worker (a thread answers the
other workers). Each sparse table is cut into ``partitions`` contiguous row ranges placed round
robin on the servers (table ``t``'s partition ``j`` on server ``(j + t) mod S``). With
``partitions="auto"`` the count is measured, Parallax's search without restarts: at the first step
the workers push and pull their real rows under 1, 2, 4, ... partitions per server, time each,
fit Parallax's model ``t(n) = b/n + a(n-1) + c`` and take its best ``n``, or the fastest count when
the fit explains less than half the probes' variance or promises no better time than that count's (``describe`` reports the probes and the choice).
More partitions spread hot rows (Zipf's head sits in the first rows) over servers; each costs a
little bookkeeping.

One step, on a worker:
1. forward: a table's lookup sends the unique ids it reads to their servers (``PULL``, one message
   per server) and writes the answers into the local table, whose other rows are stale;
2. backward: a table's row gradient is coalesced (duplicate ids summed) and pushed (``PUSH``);
3. ``step()``: empty pushes for tables no lookup used, the dense all-reduce, the user's optimizer
   on the dense parameters.
On a server, once every worker's push of step ``k`` is in: the rows' mean gradient (a worker that
did not read a row contributes zero) and the optimizer; pulls of step ``k+1`` wait for that.

Optimizer on the servers: the user's optimizer class and hyperparameters (the learning rate
follows the workers' every step), one instance per table and server. Optimizers that leave rows
without gradient untouched (SGD without momentum and weight decay, Adagrad without weight decay,
SparseAdam) update only the rows pushed; any other is given the whole partition's gradient, zeros
included, so momentum and weight decay move untouched rows exactly as in one process. Either way
the result equals the single-process reference (SparseAdam's own semantics are lazy: its reference
uses ``sparse=True`` tables). The optimizer state of sparse tables stays on the servers.

Wire (no pickle): a request header ``int64[8] = (op, step, table, partitions, n, used, lr bits, 0)``
on ``TAG_REQUEST``, then ``n`` int64 row ids, then (``PUSH``) ``n`` rows of values; answers (the
rows asked for) on ``TAG_ANSWER``. ``FLUSH`` asks for whole partitions, each answered as one
message straight from the partition into the worker's rows (``flush()``: before
reading the model outside its lookups, saving it, or comparing it; not a step's traffic, so left out
of the transport's byte count); ``STOP`` at close.

Must match across ranks: the model and the optimizer. Gloo only (servers receive from any source).
"""
from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gradsync import runtime
from gradsync.errors import ConfigError, GradsyncError, PeerFailureError
from gradsync.strategies.allreduce import AllReduce
from gradsync.strategies.base import Strategy, SyncContext, ring_bytes
from gradsync.strategies.optstate import StateLayout, gather
from gradsync.transport import check_peer, wait_all

OP_PULL, OP_PUSH, OP_FLUSH, OP_STOP, OP_PROBE_PUSH, OP_PROBE_PULL = 1, 2, 3, 4, 5, 6
TAG_REQUEST, TAG_ANSWER = 920_001, 920_002
HEADER = 8
TABLES = (nn.Embedding, nn.EmbeddingBag)


def _lr_bits(lr: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(lr)))[0]


def _lr(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class Layout:
    """Each sparse table cut into ``partitions`` contiguous row ranges (fewer for a table with
    fewer rows), table ``t``'s partition ``j`` on ``servers[(j + t) % S]``."""

    partitions: int
    bounds: tuple[torch.Tensor, ...]
    """Per table: ``P_t + 1`` row boundaries."""
    owner: tuple[torch.Tensor, ...]
    """Per table: the server rank of each partition."""

    @classmethod
    def make(cls, rows: list[int], partitions: int, servers: list[int]) -> "Layout":
        bounds, owner = [], []
        for t, n in enumerate(rows):
            p = max(1, min(partitions, n))
            bounds.append(torch.tensor([n * j // p for j in range(p + 1)], dtype=torch.int64))
            owner.append(torch.tensor([servers[(j + t) % len(servers)] for j in range(p)], dtype=torch.int64))
        return cls(partitions, tuple(bounds), tuple(owner))

    def part_of(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(ids, self.bounds[t][1:-1], right=True)

    def split(self, t: int, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """The positions in ``ids`` that each server holds: ``{server: index tensor}``."""
        owners = self.owner[t][self.part_of(t, ids)]
        return {int(s): (owners == s).nonzero().view(-1) for s in torch.unique(self.owner[t])}

    def servers_of(self, t: int) -> list[int]:
        return sorted({int(s) for s in self.owner[t]})

    def ranges(self, t: int, server: int) -> list[tuple[int, int]]:
        b = self.bounds[t].tolist()
        return [(b[j], b[j + 1]) for j, s in enumerate(self.owner[t].tolist()) if s == server]


def lazy_update(optimizer_class: type, hyper: dict) -> bool:
    """Whether this optimizer leaves a row without gradient exactly where it is (then servers update
    only the rows pushed, with a sparse gradient)."""
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        return True
    no_decay = not hyper.get("weight_decay", 0)
    if issubclass(optimizer_class, torch.optim.Adagrad):
        return no_decay
    if issubclass(optimizer_class, torch.optim.SGD):
        return no_decay and not hyper.get("momentum", 0)
    return False


class RowServer:
    """The server side: owned partitions of the sparse tables, their optimizers, and the message loop.

    Runs on a thread (co-located: beside the worker; dedicated: the server rank's own). Applying a
    step and answering pulls happen under one lock, on whichever thread brings in the last push.
    """

    def __init__(self, owner: "Hybrid", tables: list[nn.Parameter], workers: list[int], local: bool):
        self.h, self.tables, self.workers = owner, tables, workers
        self.widths, self.dtypes = [p.shape[1] for p in tables], [p.dtype for p in tables]
        self.row_counts = [p.shape[0] for p in tables]  # a dedicated server later keeps only its partitions
        self.me = owner.ctx.topology.rank
        self.remote = set(w for w in workers if w != self.me)
        self.local = local  # this rank is also a worker (co-located)
        self.cond = threading.Condition()
        self.step = 0
        self.layout: Layout | None = None
        self.pushes: dict[int, dict[int, tuple]] = {}
        self.deferred: list[tuple] = []
        self.answers: list = []
        self.failure: BaseException | None = None
        self.flush_bytes = 0
        self.closed = False
        self.thread: threading.Thread | None = None
        self.last_request = time.monotonic()

    # -- set-up --------------------------------------------------------------------------------
    def configure(self, layout: Layout) -> None:
        """Take the final layout: partitions as parameters of their own, one optimizer per table."""
        h = self.h
        self.parts: list[list[tuple[int, int, nn.Parameter]]] = []
        self.optimizers: list[torch.optim.Optimizer | None] = []
        for t, table in enumerate(self.tables):
            parts = []
            for lo, hi in layout.ranges(t, self.me):
                # Co-located: a view, so the worker's own rows are the server's. Dedicated: a copy.
                rows = table.data[lo:hi] if self.local else table.data[lo:hi].clone()
                parts.append((lo, hi, nn.Parameter(rows)))
            self.parts.append(parts)
            hyper = h.hyper[t]
            self.optimizers.append(h.optimizer_class([p for _, _, p in parts], **hyper) if parts else None)
        self.seed(h.ctx.optimizer)
        for table in self.tables:  # now in the partitions; gather_state() assembles it again
            h.ctx.optimizer.state.pop(table, None)
        with self.cond:
            self.layout = layout
            self.cond.notify_all()

    def seed(self, optimizer: torch.optim.Optimizer, *, loaded: bool = False) -> None:
        """Cut the tables' state in the user's ``optimizer`` (a checkpoint loaded, or the state of
        the strategy switched from) into the partitions' optimizers. A table without state keeps
        its partitions' fresh state, or, when ``loaded``, has none (as torch's load would leave it)."""
        def rows(value, lo: int, hi: int):  # a per-row entry is cut; scalars and numbers are copied
            if not torch.is_tensor(value):
                return value
            return value[lo:hi].clone() if value.shape == table.shape else value.clone()

        for table, parts, opt in zip(self.tables, self.parts, self.optimizers):
            if opt is None:
                continue
            whole = optimizer.state.get(table)
            for lo, hi, part in parts:
                if whole:
                    opt.state[part] = {key: rows(value, lo, hi) for key, value in whole.items()}
                elif loaded:
                    opt.state.pop(part, None)

    def pieces(self) -> list:
        """This server's optimizer state as ``(table, first element, elements, state)`` pieces."""
        return [(t, lo * part.shape[1], part.numel(), opt.state[part])
                for t, (parts, opt) in enumerate(zip(self.parts, self.optimizers)) if opt is not None
                for lo, _, part in parts if opt.state.get(part)]

    def start(self) -> None:
        if self.remote:
            self.thread = threading.Thread(target=self._run, name="gradsync-hybrid-server", daemon=True)
            self.thread.start()

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        t = self.h.ctx.transport
        try:
            while self.remote:
                header = torch.empty(HEADER, dtype=torch.int64)
                try:
                    src = t.recv_any(header, TAG_REQUEST, what="hybrid request")
                except Exception:  # noqa: BLE001 - after close, the group going away ends the loop
                    if self.closed:
                        return
                    raise
                if src is None:
                    continue  # no request within the timeout: keep serving
                self.last_request = time.monotonic()
                op, step, table, partitions, n, used, lr_bits, _ = header.tolist()
                self._check_header(src, op, table, n)
                if op == OP_STOP:
                    with self.cond:
                        self.remote.discard(src)
                        self.cond.notify_all()
                    continue
                ids = torch.empty(n, dtype=torch.int64)
                if n:
                    t.recv_async(ids, src, TAG_REQUEST, what=f"row ids from rank {src}", traced=False).wait(background=True)
                    self._check_ids(src, table, ids)
                values = None
                if op in (OP_PUSH, OP_PROBE_PUSH):
                    values = torch.empty(n, self.widths[table], dtype=self.dtypes[table])
                    if n:
                        t.recv_async(values, src, TAG_REQUEST, what=f"rows from rank {src}", traced=False).wait(background=True)
                self.handle(src, op, step, table, partitions, ids, values, bool(used), _lr(lr_bits))
        except BaseException as exc:  # noqa: BLE001 - reported by the training thread
            self.failure = exc
            with self.cond:
                self.cond.notify_all()

    def _check_header(self, src: int, op: int, table: int, n: int) -> None:
        """A request's header against what a worker may ask, before anything is allocated for it."""
        check_peer(OP_PULL <= op <= OP_PROBE_PULL, src, "a hybrid request", f"operation {op}")
        if op == OP_STOP:
            return
        check_peer(0 <= table < len(self.row_counts), src, "a hybrid request", f"table {table} (there are {len(self.row_counts)})")
        rows = self.row_counts[table]
        check_peer(0 <= n <= rows, src, f"a hybrid request for table {table}", f"{n} row ids (it has {rows} rows)")

    def _check_ids(self, src: int, table: int, ids: torch.Tensor, owned: bool = False) -> None:
        """Row ids a worker sent: within the table (``owned``: within this server's partitions)."""
        rows = self.row_counts[table]
        if owned:
            inside = torch.zeros(ids.shape, dtype=torch.bool)
            for lo, hi, _ in self.parts[table]:
                inside |= (ids >= lo) & (ids < hi)
        else:
            inside = (ids >= 0) & (ids < rows)
        if not bool(inside.all()):
            bad = int(ids[~inside][0])
            where = "outside this server's partitions" if owned else f"outside 0..{rows - 1}"
            check_peer(False, src, f"row ids of table {table}", f"row {bad}, {where}")

    def handle(self, src: int, op: int, step: int, table: int, partitions: int, ids: torch.Tensor,
               values: torch.Tensor | None, used: bool, lr: float) -> None:
        if op == OP_PROBE_PUSH:  # the aggregation's cost, not its result
            torch.zeros(ids.numel(), values.shape[1], dtype=values.dtype).index_add_(0, torch.arange(ids.numel()), values)
            return
        if op == OP_PROBE_PULL:
            self._send(src, self.tables[table].data[ids], "probe rows")
            return
        with self.cond:
            while self.layout is None:
                self.cond.wait()
            if self.layout.partitions != partitions:
                raise GradsyncError(f"hybrid server {self.me}: rank {src} uses {partitions} partitions, this server "
                                    f"{self.layout.partitions}")
            if op in (OP_PUSH, OP_PULL) and ids.numel():
                self._check_ids(src, table, ids, owned=True)
            if op == OP_PUSH:
                self._push(src, step, table, ids, values, used, lr)
            elif op in (OP_PULL, OP_FLUSH):
                if step > self.step:
                    self.deferred.append((src, step, table, ids, op))
                else:
                    self._answer(src, table, ids, op)
            else:
                raise GradsyncError(f"hybrid server {self.me}: unknown request {op} from rank {src}")

    def _push(self, src: int, step: int, table: int, ids, values, used: bool, lr: float) -> None:
        if step != self.step:
            raise GradsyncError(f"hybrid server {self.me}: rank {src} pushed step {step} while this server is at step "
                                f"{self.step}; every worker must run the same number of optimizer steps")
        self.pushes.setdefault(table, {})[src] = (ids, values, used, lr)
        expected = len(self.workers) * sum(1 for parts in self.parts if parts)
        if sum(len(p) for p in self.pushes.values()) == expected:
            self._apply()

    def _apply(self) -> None:
        # Every worker pushed this step after reading its pulls: the answers sent so far are done.
        for handle, _ in self.answers:
            handle.wait(background=True)
        self.answers = []
        n = len(self.workers)
        for t, parts in enumerate(self.parts):
            if not parts:
                continue
            pushes = list(self.pushes[t].values())
            used = any(u for _, _, u, _ in pushes)
            opt = self.optimizers[t]
            for group in opt.param_groups:
                group["lr"] = pushes[0][3]
            if not used:
                continue
            ids = torch.cat([i for i, _, _, _ in pushes])
            values = torch.cat([v for _, v, _, _ in pushes])
            for lo, hi, p in parts:
                mask = (ids >= lo) & (ids < hi)
                local, rows = ids[mask] - lo, values[mask]
                if self.h.lazy:  # an empty gradient still counts the step (Adam's bias correction)
                    p.grad = torch.sparse_coo_tensor(local.view(1, -1), rows / n, p.shape, check_invariants=False).coalesce()
                else:
                    p.grad = torch.zeros_like(p).index_add_(0, local, rows).div_(n)
            opt.step()
            for _, _, p in parts:
                p.grad = None
        self.pushes = {}
        self.step += 1
        self.cond.notify_all()
        waiting, self.deferred = self.deferred, []
        for src, step, table, ids, op in waiting:
            if step > self.step:
                self.deferred.append((src, step, table, ids, op))
            else:
                self._answer(src, table, ids, op)

    def rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.numel(), self.widths[table], dtype=self.dtypes[table])
        for lo, hi, p in self.parts[table]:
            mask = (ids >= lo) & (ids < hi)
            out[mask] = p.data[ids[mask] - lo]
        return out

    def _answer(self, src: int, table: int, ids: torch.Tensor, op: int) -> None:
        if op == OP_FLUSH:  # each partition as it lies, one message each: no copy of the table
            for _, _, p in self.parts[table]:
                self.flush_bytes += p.numel() * p.element_size()
                self._send(src, p.data, "partition", counted=False)
            return
        self._send(src, self.rows(table, ids), "rows")

    def _send(self, dst: int, rows: torch.Tensor, what: str, counted: bool = True) -> None:
        handle = self.h.ctx.transport.send_async(rows, dst, TAG_ANSWER, what=f"{what} to rank {dst}", counted=counted)
        self.answers.append((handle, rows))

    # -- the co-located worker's own partitions --------------------------------------------------
    def wait_step(self, step: int) -> None:
        """Wait until this server applied ``step`` updates (the co-located worker's own partitions)."""
        def missing() -> list[int]:
            tables = [t for t, parts in enumerate(self.parts) if parts]
            return [w for w in self.workers if any(w not in self.pushes.get(t, {}) for t in tables)]

        self._await(lambda: self.step >= step or self.failure is not None, missing,
                    f"waiting for the update of step {step}, whose pushes from", patient=False)
        self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        """Wait until every worker said stop (a dedicated server: as long as they train)."""
        if self.thread is not None:
            self._await(lambda: not self.remote or self.failure is not None, lambda: sorted(self.remote),
                        "waiting for the workers to close; stop from", patient=not self.local)
            self.thread.join(runtime.current().timeout_s)
            self.closed = True
        for handle, _ in self.answers:
            handle.wait(background=True)
        self.check()

    def _await(self, done, waiting_for, what: str, *, patient: bool) -> None:
        """Wait until ``done()``, failing as soon as a rank in ``waiting_for()`` stops beating.

        The server thread's any-source receive never notices a dead sender by itself, so the
        heartbeat decides: a rank whose count stays the same for ``SILENT_S`` is named. Without
        counters to read, a ``patient`` wait (a dedicated server, which waits as long as the
        workers train) fails when no request came for ``GRADSYNC_TIMEOUT``; any other wait fails
        ``GRADSYNC_TIMEOUT`` after it began.
        """
        rt = runtime.current()
        began = time.monotonic()
        since = None  # (when, heartbeat counts) at the start of the current window
        while True:
            with self.cond:
                if done():
                    return
                self.cond.wait(1.0)
                if done():
                    return
                ranks = waiting_for()
            now = time.monotonic()
            dead = []
            # No counters: no heartbeat (the user's process group), or rank 0, which holds the
            # store, has left (it may simply have finished first): fall back to the timeout.
            beats = rt.heartbeat.beats() if rt.heartbeat is not None else None
            if beats is not None:
                if since is None:
                    since = (now, beats)
                elif now - since[0] >= runtime.SILENT_S:
                    dead = [r for r in ranks if r in beats and beats[r] == since[1].get(r)]
                    since = (now, beats)
            if patient:
                late = beats is None and now - max(began, self.last_request) > rt.timeout_s
            else:
                late = now - began > rt.timeout_s
            if dead or late:
                who = ", ".join(rt.topology.describe(r) for r in (dead or ranks))
                raise PeerFailureError(
                    f"hybrid on rank {self.me}: {what} {who} "
                    + ("never came: it stopped responding" if dead else
                       f"did not come within {rt.timeout_s:g} s (GRADSYNC_TIMEOUT); workers must run the same "
                       "number of optimizer steps"))


class Hybrid(Strategy):
    """Sparse embedding tables through parameter servers as rows, the rest through all-reduce."""

    name = "hybrid"
    summary = "Parallax: sparse embedding tables to row servers, the rest all-reduced"
    backends = ("gloo",)  # any-source receives
    uses_servers = True

    def __init__(self, sparse: list[str] | None = None, dense: list[str] | None = None,
                 sparse_threshold: float | None = None, partitions: int | str = "auto",
                 probe_rounds: int = 3, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0):
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
        if self.candidates and ctx.transport.device.type != "cpu":
            raise ConfigError("hybrid's parameter servers need Gloo (they receive from any source); NCCL has none")
        self.optimizer_class = type(ctx.optimizer)  # before distribute wraps it
        self.servers = topo.server_ranks if topo.num_servers else topo.worker_ranks
        self.step_no = 0
        self.decided = False
        self.sparse: list[int] = []  # hook indices of the tables on the servers, in table order
        self.table_of: dict[int, int] = {}
        self.looked: dict[int, list[torch.Tensor]] = {i: [] for i in self.candidates}
        self.arrival: list[int] = []
        self.sends: list = []
        self.pushed: set[int] = set()
        self.dense: AllReduce | None = None
        self.server: RowServer | None = None
        self.decisions: dict[str, str] = {}
        self.touched: dict[str, list[int]] = {}
        self.probes: dict[int, float] = {}
        self.restore_sparse: dict[int, bool] = {}
        self.closed = False
        self.stats = {"pushed_rows": 0, "pulled_rows": 0, "row_bytes": 0, "steps": 0}
        self.layout: Layout | None = None

    def _group_of(self, param: nn.Parameter) -> dict:
        for group in self.ctx.optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise ConfigError(f"hybrid: {self.ctx.names[self.ctx.params.index(param)]!r} is not in the optimizer")

    # -- the first step: measure, decide, partition --------------------------------------------------
    def _decide(self, closing: bool = False) -> None:
        """Every rank (servers too) agrees on the sparse tables from each worker's first step."""
        ctx, topo = self.ctx, self.ctx.topology
        k = len(self.candidates)
        stats = torch.zeros(3 * k + 1, dtype=torch.float64)
        stats[-1] = float(closing)
        if topo.is_worker and not closing:
            for slot, i in enumerate(self.candidates):
                stats[slot], stats[k + slot], stats[2 * k + slot] = self._measure(i)
        ctx.transport.allreduce(stats, op="max", world=True, what="hybrid's sparse-table measurement")
        self.decided = True
        if stats[-1]:
            return
        n = topo.num_workers
        threshold = self.threshold if self.threshold is not None else (n - 1) / n
        forced = {ctx.names.index(name) for name in self.force_sparse}
        for slot, i in enumerate(self.candidates):
            name, fraction, mixed, used = ctx.names[i], float(stats[slot]), bool(stats[k + slot]), bool(stats[2 * k + slot])
            module = self.modules[i]
            if mixed and i in forced:
                raise ConfigError(f"hybrid: {name!r} was named sparse, but it gets gradient on rows its lookup did not "
                                  "read (it is used outside its embedding lookup, e.g. tied to an output layer); "
                                  "its updates would be lost on the servers. Leave it dense")
            if getattr(module, "max_norm", None) is not None:
                self.decisions[name] = "dense (max_norm rewrites rows in forward)"
            elif mixed:
                self.decisions[name] = "dense (used outside its lookup)"
            elif i in forced or (used and fraction <= threshold):
                self.decisions[name] = f"sparse ({fraction:.2%} of rows read)" + (" (named)" if i in forced else "")
                self.sparse.append(i)
            else:
                self.decisions[name] = f"dense ({fraction:.2%} of rows read)" if used else "dense (not used at step 1)"
        self.table_of = {i: t for t, i in enumerate(self.sparse)}
        if self.sparse:
            tables = [ctx.params[i] for i in self.sparse]
            for t, i in enumerate(self.sparse):
                if ctx.params[i].dim() != 2:
                    raise ConfigError(f"hybrid: table {ctx.names[i]!r} must be 2-D")
            self.groups = [self._group_of(p) for p in tables]  # the lr is read from here at every push
            self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.groups]
            self.lazy = lazy_update(self.optimizer_class, self.hyper[0])
            self.server = (RowServer(self, tables, topo.worker_ranks, local=topo.is_worker)
                           if topo.rank in self.servers else None)
            if self.server is not None:
                self.server.start()
            self.layout = self._choose_layout([p.shape[0] for p in tables])
            if self.server is not None:
                self.server.configure(self.layout)
                if not topo.is_worker:  # a dedicated server holds only its partitions
                    for p in ctx.params:
                        p.data = torch.empty(0, dtype=p.dtype)
            for i in self.sparse:
                self.restore_sparse[i] = self.modules[i].sparse
                self.modules[i].sparse = True

    def _measure(self, i: int) -> tuple[float, float, float]:
        """(fraction of rows read, mixed use, used) of candidate ``i`` on this worker's first step."""
        p = self.ctx.params[i]
        ids = torch.unique(torch.cat(self.looked[i])) if self.looked[i] else torch.empty(0, dtype=torch.int64)
        grad = p.grad
        if grad is None:
            return ids.numel() / p.shape[0], 0.0, 0.0
        if grad.is_sparse:
            rows = torch.unique(grad.coalesce().indices()[0])
            mixed = not bool(torch.isin(rows, ids).all())
        else:
            nonzero = (grad != 0).flatten(1).any(1)
            mixed = int(nonzero.sum()) > int(nonzero[ids].sum())
        return ids.numel() / p.shape[0], float(mixed), 1.0

    def _choose_layout(self, rows: list[int]) -> Layout:
        s = len(self.servers)
        if self.partitions_option != "auto":
            return Layout.make(rows, self.partitions_option * s, self.servers)
        per_server = [1, 2, 4, 8, 16]
        candidates = [m * s for m in per_server if m * s <= max(rows)] or [s]
        for p in candidates:
            # Each round's time is the slowest worker's; a count's time, the median of its rounds.
            elapsed = torch.tensor(self._probe(Layout.make(rows, p, self.servers)), dtype=torch.float64)
            self.ctx.transport.allreduce(elapsed, op="max", world=True, what="hybrid's partition probe")
            self.probes[p] = float(elapsed.median())
        return Layout.make(rows, self._fit(self.probes), self.servers)

    @staticmethod
    def _fit(probes: dict[int, float], min_r2: float = 0.5) -> int:
        """Parallax's cost model ``t(n) = b/n + a(n-1) + c`` fitted to the probes; its best integer ``n``
        in the probed range. With fewer than 3 probes, or a fit that explains less than ``min_r2`` of
        the probes' variance, or whose best is predicted no faster than the fastest probe measured
        (differences within noise), the fastest probe."""
        ns = sorted(probes)
        fastest = min(ns, key=lambda n: (probes[n], n))
        if len(ns) < 3:
            return fastest
        x = torch.tensor([[1.0 / n, n - 1.0, 1.0] for n in ns], dtype=torch.float64)
        y = torch.tensor([[probes[n]] for n in ns], dtype=torch.float64)
        b, a, c = torch.linalg.lstsq(x, y).solution.view(-1).tolist()
        predicted = x @ torch.tensor([[b], [a], [c]], dtype=torch.float64)
        spread = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float(((y - predicted) ** 2).sum()) / spread if spread > 0 else 0.0
        model = lambda n: b / n + a * (n - 1) + c  # noqa: E731
        best = min(range(ns[0], ns[-1] + 1), key=lambda n: (model(n), n))
        if r2 < min_r2 or model(best) >= probes[fastest]:  # the fit promises nothing a probe did not do
            return fastest
        return best

    def _probe(self, layout: Layout) -> list[float]:
        """Workers: push and pull this step's rows under ``layout``, ``probe_rounds`` times; seconds each."""
        if not self.ctx.topology.is_worker:
            return [0.0] * self.probe_rounds
        times = []
        for _ in range(self.probe_rounds):
            start = time.perf_counter()
            handles, answers = [], []
            for t, i in enumerate(self.sparse):
                ids, values = self._rows_of(i)
                for server, where in layout.split(t, ids).items():
                    if server == self.ctx.topology.rank or not where.numel():
                        continue
                    handles += self._request(server, OP_PROBE_PUSH, t, layout.partitions, ids[where], values[where])
                    handles += self._request(server, OP_PROBE_PULL, t, layout.partitions, ids[where])
                    answer = torch.empty(where.numel(), values.shape[1], dtype=values.dtype)
                    answers.append(self.ctx.transport.recv_async(answer, server, TAG_ANSWER, what="probe rows"))
            wait_all(answers)
            wait_all(handles)
            times.append(time.perf_counter() - start)
        return times

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
        t, rank = self.table_of[index], self.ctx.topology.rank
        uniq = torch.unique(ids)
        answers = []
        for server, where in self.layout.split(t, uniq).items():
            if server == rank:
                self.server.wait_step(self.step_no)  # own partitions: the worker's rows are the server's
                continue
            if not where.numel():
                continue
            wanted = uniq[where]
            self.sends += self._request(server, OP_PULL, t, self.layout.partitions, wanted)
            rows = torch.empty(wanted.numel(), p.shape[1], dtype=p.dtype)
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
        handles = [tr.send_async(header, server, TAG_REQUEST, what=what)]
        if ids.numel():
            ids = ids.contiguous()
            handles.append(tr.send_async(ids, server, TAG_REQUEST, what=what))
            if values is not None:
                values = values.contiguous()
                handles.append(tr.send_async(values, server, TAG_REQUEST, what=what))
        return handles

    def _wire_bytes(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Count the bytes of rows that went over the wire (ids and values), for the bench's bound."""
        self.stats["row_bytes"] += ids.numel() * ids.element_size() + rows.numel() * rows.element_size()

    def _rows_of(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's gradient of table ``index`` as (unique row ids, rows)."""
        p, name = self.ctx.params[index], self.ctx.names[index]
        grad = p.grad
        if grad is None:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, p.shape[1], dtype=p.dtype)
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
        t, rank = self.table_of[index], self.ctx.topology.rank
        p = self.ctx.params[index]
        used = p.grad is not None
        ids, values = self._rows_of(index)
        lr = self.groups[t]["lr"]
        self.stats["pushed_rows"] += ids.numel()
        split = self.layout.split(t, ids)
        for server in self.layout.servers_of(t):
            where = split[server]
            if server == rank:
                self.server_push(t, ids[where], values[where], used, lr)
            else:
                self._wire_bytes(ids[where], values[where])
                self.sends += self._request(server, OP_PUSH, t, self.layout.partitions, ids[where], values[where], used, lr)
        p.grad = None  # the update happens on the servers; the user's optimizer must skip it
        self.pushed.add(index)

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
            self.dense = AllReduce(**self.dense_options)
            self.dense.attach(SyncContext(ctx.model, ctx.optimizer, [ctx.params[i] for i in dense],
                                          [ctx.names[i] for i in dense], ctx.transport, ctx.topology, ctx.stats))

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
        if topo.is_worker and self.sparse:
            wait_all(self.sends)
            stops = [h for server in self.servers if server != topo.rank
                     for h in self._request(server, OP_STOP, 0, self.layout.partitions, torch.empty(0, dtype=torch.int64))]
            wait_all(stops)
            if self.server is not None:
                self.server.stop()
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
        if any(self.server.parts):
            self.server.wait_step(self.step_no)  # this step's update applied: the state is current
        opt, tables = self.ctx.optimizer, [self.ctx.params[i] for i in self.sparse]
        layout = StateLayout(self.optimizer_class, opt, tables)
        for t, state in gather(layout, self.server.pieces(), self.ctx.transport).items():
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
        """The dense part's ring all-reduce, plus each worker's rows out (push) and back (pull)."""
        params = self.ctx.params
        sparse_bytes = sum(params[i].numel() * params[i].element_size() for i in self.sparse)
        row_bytes = self.stats["row_bytes"] / max(1, self.stats["steps"])
        return ring_bytes(model_bytes - sparse_bytes, self.ctx.topology.num_workers) + row_bytes

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
        tables = "; ".join(f"{n}: {d}" for n, d in self.decisions.items()) or "no embedding tables"
        dense = self.dense.describe() if self.dense is not None else "no dense parameters"
        return f"hybrid({len(self.sparse)} sparse tables on {where}{parts}; {tables}; dense: {dense})"
