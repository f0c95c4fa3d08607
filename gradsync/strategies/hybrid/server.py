"""The row server of the hybrid strategy: the partitions of the sparse tables a server owns, their
optimizers, and the loop that answers the workers' pulls and applies their pushes."""
from __future__ import annotations

import threading
import time

import torch
from torch import nn

from gradsync import flight, runtime, trace
from gradsync.errors import GradsyncError, PeerFailureError
from gradsync.heartbeat import SILENT_S
from gradsync.strategies.base import Strategy
from gradsync.strategies.hybrid.layout import (HEADER, OP_FLUSH, OP_PING, OP_PROBE_PULL, OP_PROBE_PUSH, OP_PULL,
                                              OP_PUSH, OP_STOP,
                                              TAG_ANSWER, TAG_REQUEST, Layout, _lr)
from gradsync.transport import check_peer


class RowServer:
    """The server side: owned partitions of the sparse tables, their optimizers, and the message loop.

    Runs on a thread (co-located: beside the worker; dedicated: the server rank's own). Applying a
    step and answering pulls happen under one lock, on whichever thread brings in the last push.
    """

    def __init__(self, owner: Strategy, tables: list[nn.Parameter], workers: list[int], local: bool,
                 pushers: list[int] | None = None):
        self.h, self.tables, self.workers = owner, tables, workers
        self.pushers = pushers or workers
        """Whose pushes make a step: every worker, or each host's first, whose push is its host's
        sum (the mean still divides by every worker)."""
        self.widths, self.dtypes = [p.shape[1] for p in tables], [p.dtype for p in tables]
        self.devices = [p.device for p in tables]  # where the rows live (the tables may be released later)
        self.row_counts = [p.shape[0] for p in tables]  # a dedicated server later keeps only its partitions
        self.me = owner.ctx.topology.rank
        self.remote = set(w for w in workers if w != self.me)
        self.local = local  # this rank is also a worker (co-located)
        self.cond = threading.Condition()
        self.step = 0
        self.layout: Layout | None = None
        self.pushes: dict[int, dict[int, tuple]] = {}
        self.deferred: list[tuple] = []
        self.early: list[tuple] = []  # pushes of the next step, from a worker that has nothing to pull here
        self.answers: list = []
        self.failure: BaseException | None = None
        self.flush_bytes = 0
        self.updates = [0, 0, 0.0]  # the steps applied: calls, partition bytes, seconds (Strategy.host_work)
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
                if op == OP_PING:
                    continue  # a worker away from training (gradsync.strategies.keepalive)
                if op == OP_STOP:
                    with self.cond:
                        self.remote.discard(src)
                        self.cond.notify_all()
                    continue
                device = self.devices[table]  # the transport stages what Gloo moves through host memory
                ids = torch.empty(n, dtype=torch.int64, device=device)
                if n:
                    t.recv_async(ids, src, TAG_REQUEST, what=f"row ids from rank {src}", traced=False).wait(background=True)
                    self._check_ids(src, table, ids)
                values = None
                if op in (OP_PUSH, OP_PROBE_PUSH):
                    values = torch.empty(n, self.widths[table], dtype=self.dtypes[table], device=device)
                    if n:
                        t.recv_async(values, src, TAG_REQUEST, what=f"rows from rank {src}", traced=False).wait(background=True)
                self.handle(src, op, step, table, partitions, ids, values, bool(used), _lr(lr_bits))
        except BaseException as exc:  # noqa: BLE001 - reported by the training thread
            self.failure = exc
            with self.cond:
                self.cond.notify_all()

    def _check_header(self, src: int, op: int, table: int, n: int) -> None:
        """A request's header against what a worker may ask, before anything is allocated for it."""
        check_peer(OP_PULL <= op <= OP_PING, src, "a hybrid request", f"operation {op}")
        if op in (OP_STOP, OP_PING):
            return
        check_peer(0 <= table < len(self.row_counts), src, "a hybrid request", f"table {table} (there are {len(self.row_counts)})")
        rows = self.row_counts[table]
        check_peer(0 <= n <= rows, src, f"a hybrid request for table {table}", f"{n} row ids (it has {rows} rows)")

    def _check_ids(self, src: int, table: int, ids: torch.Tensor, owned: bool = False) -> None:
        """Row ids a worker sent: within the table (``owned``: within this server's partitions)."""
        rows = self.row_counts[table]
        if owned:
            inside = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
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
            torch.zeros(ids.numel(), values.shape[1], dtype=values.dtype, device=values.device).index_add_(
                0, torch.arange(ids.numel(), device=values.device), values)
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
                check_peer(src in self.pushers, src, "a hybrid push", "no right to push (its host's first worker "
                           "pushes its host's rows)")
                self._push(src, step, table, ids, values, used, lr)
            elif op in (OP_PULL, OP_FLUSH):
                if step > self.step:
                    self.deferred.append((src, step, table, ids, op))
                else:
                    self._answer(src, table, ids, op)
            else:
                raise GradsyncError(f"hybrid server {self.me}: unknown request {op} from rank {src}")

    def _push(self, src: int, step: int, table: int, ids, values, used: bool, lr: float) -> None:
        if step == self.step + 1:  # taken once this step's pushes are all in (see _apply)
            self.early.append((src, step, table, ids, values, used, lr))
            return
        if step != self.step:
            raise GradsyncError(f"hybrid server {self.me}: rank {src} pushed step {step} while this server is at step "
                                f"{self.step}; every worker must run the same number of optimizer steps")
        self.pushes.setdefault(table, {})[src] = (ids, values, used, lr)
        expected = len(self.pushers) * sum(1 for parts in self.parts if parts)
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
            tracer, started = trace.current(), time.perf_counter()
            nbytes = sum(p.numel() * p.element_size() for _, _, p in parts)
            ids = torch.cat([i for i, _, _, _ in pushes])
            values = torch.cat([v for _, v, _, _ in pushes])
            for lo, hi, p in parts:
                mask = (ids >= lo) & (ids < hi)
                local, rows = ids[mask] - lo, values[mask]
                if self.h.lazy:  # an empty gradient still counts the step (Adam's bias correction)
                    p.grad = torch.sparse_coo_tensor(local.view(1, -1), rows / n, p.shape, check_invariants=False).coalesce()
                elif p.grad is None:  # the buffer is kept: a fresh one would be fresh pages every step
                    p.grad = torch.zeros_like(p).index_add_(0, local, rows).div_(n)
                else:
                    p.grad.zero_().index_add_(0, local, rows).div_(n)
            opt.step()
            if self.h.lazy:
                for _, _, p in parts:
                    p.grad = None
            finished = time.perf_counter()
            self.updates[0] += 1
            self.updates[1] += nbytes
            self.updates[2] += finished - started
            if tracer is not None:
                tracer.span(f"update of table {t} ({ids.numel()} rows pushed)", "server", started, finished)
        self.pushes = {}
        self.step += 1
        self.cond.notify_all()
        waiting, self.deferred = self.deferred, []
        for src, step, table, ids, op in waiting:
            if step > self.step:
                self.deferred.append((src, step, table, ids, op))
            else:
                self._answer(src, table, ids, op)
        early, self.early = self.early, []
        for push in early:  # in arrival order; one may complete this step and apply it in turn
            self._push(*push)

    def rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.numel(), self.widths[table], dtype=self.dtypes[table], device=self.devices[table])
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
            return [w for w in self.pushers if any(w not in self.pushes.get(t, {}) for t in tables)]

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
        with flight.waiting("hybrid: " + what.split(",")[0]):  # a wait on peers, not the script's own code
            self._await_in(done, waiting_for, what, patient=patient)

    def _await_in(self, done, waiting_for, what: str, *, patient: bool) -> None:
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
                elif now - since[0] >= SILENT_S:
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

