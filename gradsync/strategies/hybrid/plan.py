"""Which tables the hybrid strategy serves as rows, and how their rows are laid out on the servers.

At the first step every worker measures each candidate table (the fraction of its rows read, and
whether any row outside those got gradient), the ranks agree by one all-reduce (max), and the
tables found sparse get their row servers. With ``partitions="auto"`` the workers then push and
pull their real rows under 1, 2, 4, ... partitions per server and fit Parallax's cost model
``t(n) = b/n + a(n-1) + c`` to the times (:meth:`Planning._fit`). :class:`Planning` is a part of
:class:`~gradsync.strategies.hybrid.strategy.SparseHybrid`, kept apart because it runs once.
"""
from __future__ import annotations

import time

import torch

from gradsync.errors import ConfigError
from gradsync.strategies.hybrid.layout import (HEADER, OP_PING, OP_PROBE_PULL, OP_PROBE_PUSH, TAG_ANSWER, TAG_REQUEST,
                                              Layout, lazy_update)
from gradsync.strategies.hybrid.server import RowServer
from gradsync.transport import wait_all
from gradsync.strategies.keepalive import KeepAlive


class Planning:
    """The first step's decisions of :class:`~gradsync.strategies.hybrid.strategy.SparseHybrid`."""

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
            self.server = (RowServer(self, tables, topo.worker_ranks, local=topo.is_worker, pushers=self.pushers)
                           if topo.rank in self.servers else None)
            if self.host_rows is not None:
                self.host_rows.plan(self.sparse)
            if self.server is not None:
                self.server.start()
            self.layout = self._choose_layout([p.shape[0] for p in tables])
            if self.server is not None:
                self.server.configure(self.layout)
                if not topo.is_worker:  # a dedicated server holds only its partitions
                    for p in ctx.params:
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            for i in self.sparse:
                self.restore_sparse[i] = self.modules[i].sparse
                self.modules[i].sparse = True
            if topo.rank in self.pushers:  # its servers' waits for requests outlive its pauses
                ping = torch.tensor([OP_PING] + [0] * (HEADER - 1), dtype=torch.int64)
                self.keepalive = KeepAlive(ctx.transport, [s for s in self.servers if s != topo.rank], TAG_REQUEST,
                                           lambda: ping, "hybrid keep-alive ping")

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
        """Workers that push (on hosts of several workers, each host's first, with its own rows): push
        and pull this step's rows under ``layout``, ``probe_rounds`` times; seconds each."""
        if self.ctx.topology.rank not in self.pushers:
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
                    answer = torch.empty(where.numel(), values.shape[1], dtype=values.dtype, device=values.device)
                    answers.append(self.ctx.transport.recv_async(answer, server, TAG_ANSWER, what="probe rows"))
            wait_all(answers)
            wait_all(handles)
            times.append(time.perf_counter() - start)
        return times
