"""The schedule of ``hybrid`` (Parallax's sparsity-aware hybrid), on the simulated worker.

Which tables go to the row servers is decided as the strategy decides it
(:mod:`gradsync.strategies.hybrid.plan`): an embedding table read only through its lookup whose
share of rows read per step (:attr:`~gradsync.simulate.workload.Table.share`, from the model's
own batches) is at most ``sparse_threshold`` (default ``(N-1)/N``), or named in ``sparse=[...]``
and not in ``dense=[...]``; nothing at one worker. The rest is ``allreduce``'s buckets with the
strategy's ``bucket_mb`` and ``first_bucket_mb``.

A step, as :class:`~gradsync.strategies.hybrid.strategy.Hybrid` runs it:

- the forward of a table's layer first pulls the rows it reads: a header and the ids go to each
  server (8 bytes an id), the rows come back; with co-located servers 1 in N rows are the worker's
  own. A server answers step k's pulls once it applied step k-1's pushes;
- the backward of a table's layer coalesces its row gradient (one pass over the rows read) and
  pushes a header, the ids and the rows to each server; the dense parameters' buckets are
  all-reduced as ready;
- every one of those messages is sent and taken by Python threads (the worker's, the server's
  receive loop), each end at :attr:`~gradsync.simulate.worker.Host.message_s` of host time under
  the process's interpreter lock, the cost ``p3``'s slices pay: co-located, a process's worker
  and server share one lock; a server's thread woken for a request and a worker's for its rows
  run after :meth:`~gradsync.simulate.worker.Worker.wake_s` (longer where the ranks share busy
  cores);
- ``opt.step()`` waits for the dense all-reduce, then runs the optimizer on the dense parameters;
- a server, once every worker's pushes of every table are in, builds each partition's gradient
  (a zeroed partition, the rows added, divided by N) and runs the optimizer on it, table after
  table: the dense update ``hybrid`` uses for momentum SGD (``gradsync bench``'s default
  optimizer). It answers the next step's pulls once all its tables are applied, and a pull asks
  every server: the step waits for the slowest server's update
  (:meth:`~gradsync.simulate.worker.Worker.slowest_of`, with the host's ``jitter``).

Every other strategy gets each table's gradient as ``nn.Embedding`` makes it, a zeroed copy of
the whole table (:meth:`~gradsync.simulate.worker.Worker.table_grad_s`); ``hybrid`` only the rows read.

Rows are spread evenly over the servers: ``partitions="auto"`` measures the partition count that
balances them (docs/hybrid.md), which the model takes as achieved.
"""
from __future__ import annotations

from typing import Callable

from gradsync.errors import ConfigError
from gradsync.strategies.base import ring_bytes
from gradsync.simulate.engine import Barrier
from gradsync.simulate.models import Buckets
from gradsync.simulate.worker import ZEROED_PASSES, StrategyModel, Worker

ID_BYTES = 8


class Hybrid(StrategyModel):
    """``hybrid``: sparse tables through row servers, the other parameters through buckets."""

    def __init__(self, strategy, servers: int):
        super().__init__(strategy)
        self.dedicated = servers

    def bind(self, worker: Worker) -> None:
        super().bind(worker)
        n, st = worker.np, self.strategy
        threshold = st.threshold if st.threshold is not None else (n - 1) / n
        params = {p.name for p in worker.params}
        for name in st.force_sparse + st.force_dense:
            if name not in params:
                raise ConfigError(f"hybrid: {name!r} is not a trainable parameter of {worker.w.model}")
        for name in st.force_sparse:
            if name not in worker.w.tables:
                raise ConfigError(f"hybrid: {name!r} cannot go to the servers: it is not an embedding table read "
                                  f"only through its lookup (tables of {worker.w.model}: "
                                  f"{', '.join(worker.w.tables) or 'none'})")
        self.sparse = {}
        for name, table in worker.w.tables.items():
            if name in st.force_dense:
                continue
            if name in st.force_sparse or (n > 1 and table.read > 0 and table.share <= threshold):
                self.sparse[name] = table
        self.row_tables = set(self.sparse)
        index = {p.name: i for i, p in enumerate(worker.params)}
        dense = {i for i, p in enumerate(worker.params) if p.name not in self.sparse}
        mb = 2**20
        self.dense = Buckets(st, int(st.dense_options["bucket_mb"] * mb), int(st.dense_options["first_bucket_mb"] * mb),
                             flags=True, only=dense)
        self.dense.bind(worker)
        self.dense_bytes = sum(worker.params[i].nbytes for i in dense)
        self.servers = self.dedicated or n
        self.server = worker.cpu_stream("row server")  # a server's requests are served in turn
        # Each message end (a send issued, a receive taken) is Python under the interpreter lock
        # (Host.message_s): the worker's and, co-located, its server's, one at a time.
        self.interpreter = worker.cpu_stream("python threads")
        self.server_interpreter = worker.cpu_stream("server python threads") if self.dedicated else self.interpreter
        self.peers = self.dedicated or n - 1  # the servers a worker sends to (co-located: 1 in N is its own)
        self.clients = n if self.dedicated else n - 1  # the workers a server hears from
        self.tables_of_layer: dict[int, list[str]] = {}
        for name in self.sparse:
            self.tables_of_layer.setdefault(worker.params[index[name]].layer, []).append(name)
        self.applied = -1  # the last step the servers applied
        self.waiting: list[tuple[int, Callable[[], None]]] = []
        self.pushed: dict[int, Barrier] = {}  # step -> every table's pushes in

    def describe(self) -> str:
        return ", ".join(f"{name}: {t.share:.2%} of {t.rows} rows read" for name, t in self.sparse.items())

    def min_bytes_per_host(self) -> float:
        """The physical bound's traffic, as the strategy's own: the dense part's ring all-reduce and
        each worker's rows out (push) and back (pull)."""
        rows = sum(t.read * t.row_bytes for t in self.sparse.values())
        return ring_bytes(self.dense_bytes, self.wk.np) + 2 * self._remote(rows)

    # -- the wire ------------------------------------------------------------------------------------
    def _remote(self, nbytes: float) -> float:
        """Of a worker's messages to all servers, what leaves its host (co-located: its own share stays)."""
        return nbytes if self.dedicated else nbytes * (self.wk.np - 1) / self.wk.np

    def _exchange(self, nbytes: float, done: Callable[[], None], name: str, *, to_servers: bool) -> None:
        """A worker's messages of ``nbytes`` in all to the servers (``to_servers``) or from them."""
        wk = self.wk
        if not self.dedicated:  # every worker to every co-located server: an all-to-all (Network.mesh)
            wk.message(self._remote(nbytes), [(wk.tx, 1), (wk.rx, 1)], done, name, mesh=True)
            return
        arrive = Barrier(self.dedicated, done)  # every worker talks to every server: its side carries N shares
        for tx, rx in wk.servers:
            uses = [(wk.tx, 1), (rx, wk.np)] if to_servers else [(tx, wk.np), (wk.rx, 1)]
            wk.message(nbytes / self.dedicated, uses, arrive.arrive, name)

    # -- a step ----------------------------------------------------------------------------------------
    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        self.dense.before_forward(step, go)

    def before_layer(self, step: int, layer: int, go: Callable[[], None]) -> None:
        names = self.tables_of_layer.get(layer, [])
        if not names:
            go()
            return
        pulled = Barrier(len(names), go)
        for name in names:
            self._after_applied(step - 1, lambda name=name: self._pull(name, pulled.arrive))

    def _pull(self, name: str, done: Callable[[], None]) -> None:
        table, wk = self.sparse[name], self.wk
        rows = table.read * table.row_bytes
        served = rows * wk.np / self.servers if self.dedicated else rows * (wk.np - 1) / wk.np

        def request() -> None:  # a header and the ids: two sends to each server
            wk.message_ends(self.interpreter, 2 * self.peers, lambda: self._exchange(
                table.read * ID_BYTES, self._handoff(take), f"ids of {name}", to_servers=True))

        def take() -> None:  # the server's receive loop takes both, gathers the rows, sends them
            wk.message_ends(self.server_interpreter, 2 * self.clients, lambda: self.server.run(
                wk.copy_s(served), answer, what=f"gather {name}"))

        def answer() -> None:
            wk.message_ends(self.server_interpreter, self.clients, lambda: self._exchange(
                rows, self._handoff(receive), f"pull {name}", to_servers=False))

        def receive() -> None:  # the worker takes the rows and copies them into the table
            wk.message_ends(self.interpreter, self.peers, lambda: wk.host.run(
                wk.copy_s(self._remote(rows)), done, what=f"rows of {name}"))

        request()

    def _handoff(self, then: Callable[[], None]) -> Callable[[], None]:
        """A message's arrival acted on by another thread: the server thread's receive loop takes a
        request, the worker's waiting thread wakes for an answer (Host.handoff_s each)."""
        return lambda: self.wk.sim.after(self.wk.wake_s(), then)

    def on_layer_ready(self, step: int, layer: int) -> None:
        if self.sparse and step not in self.pushed:
            self.pushed[step] = Barrier(len(self.sparse), lambda: self._apply(step))
        for name in self.tables_of_layer.get(layer, []):
            table, wk = self.sparse[name], self.wk
            rows = table.read * table.row_bytes
            wk.host.run(wk.copy_s(rows), lambda name=name, table=table: self._push(step, name, table),
                        what=f"coalesce {name}")
        self.dense.on_layer_ready(step, layer)

    def _push(self, step: int, name: str, table) -> None:
        """A header, the ids and the rows (three sends to each server), taken by the servers'
        receive loops; the table's push then counts as in."""
        wk, arrived = self.wk, self.pushed[step].arrive
        wk.message_ends(self.interpreter, 3 * self.peers, lambda: self._exchange(
            table.read * (table.row_bytes + ID_BYTES), self._handoff(lambda: wk.message_ends(
                self.server_interpreter, 3 * self.clients, arrived)), f"push {name}", to_servers=True))

    def _apply(self, step: int) -> None:
        """Every worker's pushes of every table are in (they are alike): each server updates its
        partitions table by table, and answers the next step's pulls once all are applied
        (server.py's ``_apply``)."""
        del self.pushed[step]
        wk, names = self.wk, list(self.sparse)
        for i, name in enumerate(names):
            table = self.sparse[name]
            part = table.rows * table.row_bytes / self.servers
            # a zeroed partition, the rows added, divided by N, then the optimizer
            build = (ZEROED_PASSES + 1) * part + table.read * table.row_bytes * wk.np / self.servers
            last = i == len(names) - 1
            # the next pull waits for every server: for the slowest of them (Host.jitter)
            update = (wk.copy_s(build) + wk.update_s(part)) * wk.slowest_of(self.servers)
            self.server.run(update, (lambda: self._applied(step)) if last else (lambda: None),
                            what=f"update {name}")

    def _applied(self, step: int) -> None:
        self.applied = step
        ready = [go for after, go in self.waiting if after <= step]
        self.waiting = [(after, go) for after, go in self.waiting if after > step]
        for go in ready:
            go()

    def _after_applied(self, step: int, go: Callable[[], None]) -> None:
        if self.applied >= step:
            go()
        else:
            self.waiting.append((step, go))

    def after_backward(self, step: int, go: Callable[[], None]) -> None:
        self.dense.after_backward(step, go)

    def step(self, step: int, go: Callable[[], None]) -> None:
        self.wk.host.run(self.wk.update_s(self.dense_bytes), go, what="optimizer (dense)")
