"""The schedule of ``hybrid`` (Parallax's sparsity-aware hybrid), on the simulated worker.

Which tables go to the row servers is decided as the strategy decides it
(:mod:`gradsync.strategies.hybrid.plan`): an embedding table read only through its lookup whose
share of rows read per step (:attr:`~gradsync.simulate.workload.Table.share`, from the model's
own batches) is at most ``sparse_threshold`` (default ``(N-1)/N``), or named in ``sparse=[...]``
and not in ``dense=[...]``; nothing at one worker. The rest is ``allreduce``'s buckets with the
strategy's ``bucket_mb`` and ``first_bucket_mb``.

The rows a step reads are laid out as the strategy lays them
(:meth:`~gradsync.strategies.hybrid.layout.Layout.make`: each table cut into contiguous ranges,
table t's range j on server (j + t) mod S), each server's share of them counted on the model's own
batches (:meth:`~gradsync.simulate.workload.Table.server_shares`). Ids drawn from a Zipf law (a
language model's words) put most reads in a table's first range, and its server serves most
rows. ``partitions="auto"``: of the counts the strategy's probes try (1 to 16 a server, at most a
table's rows), the one that spreads the reads most evenly; a replayed record names the count its
run chose.

A step, as :class:`~gradsync.strategies.hybrid.strategy.SparseHybrid` and its
:class:`~gradsync.strategies.hybrid.server.RowServer` run it, for one worker that stands for all
(they do the same at the same time; the busiest NIC paces their exchange) and one server that
stands for every server (the busiest's rows):

- the forward of a table's layer first pulls the rows it reads: a header and the ids go to each
  server (8 bytes an id), the rows come back; co-located, the share on the worker's own server
  stays home. Every worker pulls at once, so the busiest NIC sets the time
  (:meth:`Hybrid._factor`). A server answers step k's pulls once it applied step k-1's pushes,
  and a pull asks every server: it waits for the last answer, each sent after that server's own
  update (with the host's ``jitter``; :meth:`~gradsync.simulate.worker.Worker.last_of`);
- the backward of a table's layer coalesces its row gradient (one pass over the rows read) and
  pushes a header, the ids and the rows to each server, in the layer's backward hook; the dense
  parameters' buckets are all-reduced as ready;
- each end of a message (a send issued, a receive taken) is Python under the process's
  interpreter lock, :attr:`~gradsync.simulate.worker.Host.message_s` of host time, the cost
  ``p3``'s slices pay; co-located, a process's worker and server share one lock;
- a server's receive loop takes one message at a time, every client's in turn. Gloo moves a
  message only once its receiver posted the receive, so the loop, blocked in each receive (the
  header, the ids, the rows), wakes for each (:meth:`~gradsync.simulate.worker.Worker.wake_s`,
  longer where the ranks share busy cores); the worker's thread wakes once for the rows it waits for.
  The ranks do not run in step: the simulated worker is the last of them (the slowest rank's step
  is the one ``gradsync bench`` reports), and a loop takes the other clients' messages from when
  the worker sends its own, so a message that crosses slowly finds them taken (:meth:`Hybrid._others`);
- the push that completes a step at a server runs the update on the loop, which takes nothing
  meanwhile: each partition's gradient built (a zeroed partition, the rows added, divided by N)
  and the optimizer run on it, table after table, the dense update ``hybrid`` uses for momentum
  SGD (``gradsync bench``'s default optimizer); then the pulls of the next step are answered;
- ``optimizer.step()`` waits for the dense all-reduce, runs the optimizer on the dense
  parameters, and waits for the step's sends, which complete once the servers' loops took them.

Every other strategy gets each table's gradient as ``nn.Embedding`` makes it, a zeroed copy of
the whole table (:meth:`~gradsync.simulate.worker.Worker.table_grad_s`); ``hybrid`` only the rows read.

On hosts of several ranks (``hosts="ring"``, :mod:`gradsync.strategies.hybrid.hosts`) the dense
buckets take the two-level all-reduce, and the tables are aggregated inside the host: the host is
the exchange's peer (its first rank, the simulated worker, pushes and pulls; co-located servers are
the hosts' first ranks), and what it pushes and pulls is the union of its ranks' rows
(:meth:`~gradsync.simulate.workload.Table.host_read`). A pull first all-gathers the ranks' ids
inside the host and ends with the rows broadcast inside it; a push all-gathers the ranks' rows
inside the host and sums them on the host's communication thread, off the backward's path
(``backward()`` only queues it; ``optimizer.step()`` waits for the step's pushes to be taken).
"""
from __future__ import annotations

from typing import Callable

from gradsync.errors import ConfigError
from gradsync.strategies.base import ring_bytes
from gradsync.simulate.engine import Barrier
from gradsync.simulate.models import Buckets
from gradsync.simulate.worker import ZEROED_PASSES, StrategyModel, Worker

ID_BYTES = 8


class _Latch:
    """Counts ``count`` arrivals; what :meth:`then` is given runs once all are in (at once if they are)."""

    def __init__(self, count: int):
        self.count, self.waiting = count, []

    def arrive(self) -> None:
        self.count -= 1
        if self.count == 0:
            waiting, self.waiting = self.waiting, []
            for go in waiting:
                go()

    def then(self, go: Callable[[], None]) -> None:
        if self.count <= 0:
            go()
        else:
            self.waiting.append(go)


class Hybrid(StrategyModel):
    """``hybrid``: sparse tables through row servers, the other parameters through buckets."""

    def __init__(self, strategy, servers: int):
        super().__init__(strategy)
        self.dedicated = servers

    def bind(self, worker: Worker) -> None:
        super().bind(worker)
        n, st = worker.workers, self.strategy  # the strategy decides on every worker's reads
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
        self.sparse = {}  # in the model's parameter order (the workload's), as the strategy numbers its tables
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
        # hosts of several ranks: the host is the exchange's peer, its rows the union of its ranks'
        self.ranks = worker.per_host if worker.hosts != "flat" else 1
        self.read = {name: t.host_read(self.ranks) for name, t in self.sparse.items()}
        self.sums = worker.cpu_stream("host sums")  # the host's communication thread (its first rank's sums)
        n = worker.np
        self.servers = self.dedicated or n
        self.partitions, self.shares = self._layout(st.partitions_option)
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
        self.loop = worker.thread("row server receive loop")  # one message at a time (not busy while blocked)
        self.applied = -1  # the last step the servers applied
        self.updates: list[float] | None = None  # each table's update, as the next pulls see it (_apply)
        self.waiting: list[tuple[int, Callable[[], None]]] = []
        self.pushed: dict[int, int] = {}  # step -> the tables whose pushes are in
        self.issued: dict[int, _Latch] = {}  # step -> the worker's pushes sent (in its backward hooks)
        self.taken: dict[int, _Latch] = {}  # step -> its pushes taken by the servers' loops (its sends complete)

    def _layout(self, option) -> tuple[int, dict[str, list[float]]]:
        """The partition count per table and each table's share of reads on each server. ``auto``:
        of the counts the strategy probes (1 to 16 per server, at most a table's rows), the one
        that spreads the reads the most evenly (its probes measure what spreads them; the model
        has no cost per partition)."""
        def shares(p: int) -> dict[str, list[float]]:
            return {name: t.server_shares(i, p, self.servers) for i, (name, t) in enumerate(self.sparse.items())}

        if option != "auto":
            return option * self.servers, shares(option * self.servers)
        most = max((t.rows for t in self.sparse.values()), default=0)
        counts = [m * self.servers for m in (1, 2, 4, 8, 16) if m * self.servers <= most] or [self.servers]
        laid = {p: shares(p) for p in counts}
        best = min(counts, key=lambda p: (self._busiest(laid[p]), p))
        return best, laid[best]

    def _busiest(self, shares: dict[str, list[float]]) -> float:
        """The bytes the busiest links of the exchange carry, each table's (see :meth:`_factor`)."""
        return sum(self._factor(shares[name]) * self.read[name] * t.row_bytes for name, t in self.sparse.items())

    def _factor(self, shares: list[float]) -> float:
        """Of a table's rows a worker reads, how many cross the busiest NIC in one direction while
        every worker pushes (or pulls) them at once: co-located, a host sends its rows for the other
        servers (``1 - s``) and its server receives ``s`` of each other worker's (``(N-1) s``);
        dedicated, server ``s``'s NIC carries ``N s``. Spread evenly, ``(N-1)/N`` and ``N/S``."""
        n = self.wk.np
        if self.dedicated:
            return n * max(shares)
        return max(max(1.0 - s, (n - 1) * s) for s in shares)

    def describe(self) -> str:
        if not self.sparse:
            return ""
        hosts = f"; each host's {self.ranks} ranks' rows summed and pulled once" if self.ranks > 1 else ""
        return ", ".join(f"{name}: {t.share:.2%} of {t.rows} rows read, {max(self.shares[name]):.0%} on the busiest "
                         f"of {self.servers} servers" for name, t in self.sparse.items()) + \
            f"; {self.partitions} partition{'s' if self.partitions != 1 else ''} per table{hosts}"

    def min_bytes_per_host(self) -> float:
        """The physical bound's traffic, as the strategy's own: the dense part's ring all-reduce and
        each peer's rows out (push) and back (pull): a worker's, or on hosts of several ranks the
        host's union, counted once."""
        rows = sum(self.read[name] * t.row_bytes for name, t in self.sparse.items())
        return ring_bytes(self.dense_bytes, self.wk.np) + 2 * self._remote(rows)

    # -- the wire ------------------------------------------------------------------------------------
    def _remote(self, nbytes: float) -> float:
        """Of a worker's messages to all servers, what leaves its host (co-located: its own share stays)."""
        return nbytes if self.dedicated else nbytes * (self.wk.np - 1) / self.wk.np

    def _exchange(self, nbytes: float, name: str, done: Callable[[], None], what: str, *, to_servers: bool) -> None:
        """A worker's messages of ``nbytes`` of table ``name`` in all to the servers (``to_servers``)
        or from them, each server's share of them (:attr:`shares`)."""
        wk, shares = self.wk, self.shares[name]
        if not self.dedicated:  # every worker to every co-located server: an all-to-all (Network.mesh),
            # paced by the busiest NIC (_factor)
            wk.message(nbytes * self._factor(shares), [(wk.tx, 1), (wk.rx, 1)], done, what, mesh=True)
            return
        arrive = Barrier(self.dedicated, done)  # every worker talks to every server: its side carries N shares
        for (tx, rx), share in zip(wk.servers, shares):
            uses = [(wk.tx, 1), (rx, wk.np)] if to_servers else [(tx, wk.np), (wk.rx, 1)]
            wk.message(nbytes * share, uses, arrive.arrive, what)

    def _gather_in_host(self, nbytes: float, done: Callable[[], None], what: str) -> None:
        """An all-gather inside the host of ``nbytes`` from each of its ranks (each sends them to
        every other, all at once, over the host's :attr:`~gradsync.simulate.worker.Worker.intra` link)."""
        if self.ranks == 1:
            done()
            return
        self.wk.sim.transfer((self.ranks - 1) * nbytes, [(self.wk.intra, self.ranks)], done, name=what, lane="intra-host")

    # -- a step ----------------------------------------------------------------------------------------
    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        self.issued[step] = _Latch(len(self.sparse))
        self.taken[step] = _Latch(len(self.sparse))
        self.dense.before_forward(step, go)

    def before_layer(self, step: int, layer: int, go: Callable[[], None]) -> None:
        names = self.tables_of_layer.get(layer, [])
        if not names:
            go()
            return
        pulled = Barrier(len(names), go)
        for name in names:
            self._pull(step, name, pulled.arrive)

    def _receive(self, count: int, then: Callable[[Callable[[], None]], None], what: str) -> None:
        """The servers' receive loop takes ``count`` receives, waking for each, their ends under the
        server's interpreter, then ``then(finish)``, the loop busy until ``finish``."""
        wk = self.wk
        self.loop.submit(lambda finish: wk.sim.after(count * wk.wake_s(), lambda: wk.message_ends(
            self.server_interpreter, count, lambda: then(finish))), what=what)

    def _others(self, receives: int) -> None:
        """The loop takes the other clients' messages like the worker's (:meth:`_take`), from when
        the worker sends its own: the ranks do not run in step, and the worker that stands for
        all is the last of them (the slowest rank's step is the one measured)."""
        if self.clients > 1:
            self._receive(receives * (self.clients - 1), lambda finish: finish(), "take (other workers)")

    def _take(self, receives: int, then: Callable[[Callable[[], None]], None]) -> None:
        """The loop takes the worker's message (``receives`` receives), then ``then(finish)``;
        after the other clients' (:meth:`_others`) where it is still taking them. One worker
        alone sends nothing to take."""
        self._receive(receives if self.clients else 0, then, "take")

    def _pull(self, step: int, name: str, done: Callable[[], None]) -> None:
        table, wk = self.sparse[name], self.wk
        if self.ranks > 1:  # the host's ids gathered first, the rows shared last
            rows = self.read[name] * table.row_bytes
            shared = lambda: wk.inside(rows, done, f"rows of {name} in host")  # noqa: E731
            self._gather_in_host(table.read * ID_BYTES, lambda: self._pull_rows(step, name, shared),
                                 f"ids of {name} in host")
        else:
            self._pull_rows(step, name, done)

    def _pull_rows(self, step: int, name: str, done: Callable[[], None]) -> None:
        table, wk, shares = self.sparse[name], self.wk, self.shares[name]
        rows = self.read[name] * table.row_bytes
        served = rows * self.clients * max(shares)  # the busiest server's answers
        received = rows if self.dedicated else rows * (1 - min(shares))  # the worker whose own server holds least

        def answer() -> None:  # once applied: the rows gathered and sent back
            self.server.run(wk.copy_s(served), lambda: wk.message_ends(self.server_interpreter, self.clients, lambda: (
                self._exchange(rows, name, lambda: wk.sim.after(wk.wake_s() if self.peers else 0.0, receive),
                               f"pull {name}", to_servers=False))),
                what=f"gather {name}")

        def receive() -> None:  # the worker takes the rows and copies them into the table
            wk.message_ends(self.interpreter, self.peers, lambda: wk.host.run(
                wk.copy_s(received), done, what=f"rows of {name}"))

        # a header and the ids: two sends to each server, taken by its loop, answered once applied
        wk.message_ends(self.interpreter, 2 * self.peers, lambda: (self._others(2), self._exchange(
            self.read[name] * ID_BYTES, name, lambda: self._take(2, lambda finish: (
                finish(), self._after_applied(step - 1, answer))), f"ids of {name}", to_servers=True)))

    def on_layer_ready(self, step: int, layer: int) -> None:
        for name in self.tables_of_layer.get(layer, []):
            table, wk = self.sparse[name], self.wk
            rows = table.read * table.row_bytes
            push = self._host_push if self.ranks > 1 else self._push
            wk.host.run(wk.copy_s(rows), lambda name=name, table=table, push=push: push(step, name, table),
                        what=f"coalesce {name}")
        self.dense.on_layer_ready(step, layer)

    def _host_push(self, step: int, name: str, table) -> None:
        """Hosts of several ranks: backward queues the host's sum and goes on; the ranks' rows are
        all-gathered inside the host, summed by its first rank's communication thread, pushed on."""
        wk = self.wk
        self.issued[step].arrive()
        self._gather_in_host(table.read * (table.row_bytes + ID_BYTES), lambda: self.sums.run(
            wk.copy_s(self.ranks * table.read * table.row_bytes), lambda: self._push(step, name, table, queued=True),
            what=f"sum {name} in host"), f"rows of {name} in host")

    def _push(self, step: int, name: str, table, queued: bool = False) -> None:
        """A header, the ids and the rows (three sends to each server), taken by the servers'
        loops; the push that completes the step runs the update there. ``queued``: the host's sum,
        which backward already counted as issued."""
        wk, taken = self.wk, self.taken[step]

        def sent() -> None:
            if not queued:
                self.issued[step].arrive()
            self._others(3)
            self._exchange(self.read[name] * (table.row_bytes + ID_BYTES), name, lambda: self._take(3, lambda finish: (
                taken.arrive(), self._pushed(step, finish))), f"push {name}", to_servers=True)

        wk.message_ends(self.interpreter, 3 * self.peers, sent)

    def _pushed(self, step: int, finish: Callable[[], None]) -> None:
        self.pushed[step] = self.pushed.get(step, 0) + 1
        if self.pushed[step] < len(self.sparse):
            finish()
            return
        del self.pushed[step]
        self._apply(step, finish)

    def _apply(self, step: int, finish: Callable[[], None]) -> None:
        """Every worker's pushes of every table are in (they are alike): each server updates its
        partitions table by table on the loop that took the last push, and answers the next
        step's pulls once all are applied (server.py's ``_apply``)."""
        names = list(self.sparse)
        if self.updates is None:  # the same every step
            updates = [self._update_s(name) for name in names]
            late = self._late(sum(updates)) / max(sum(updates), 1e-30)
            self.updates = [update * late for update in updates]
        for i, (name, update) in enumerate(zip(names, self.updates)):
            last = i == len(names) - 1
            self.server.run(update, (lambda: (self._applied(step), finish())) if last else (lambda: None),
                            what=f"update {name}")

    def _update_s(self, name: str) -> float:
        """A server's update of its partitions of table ``name``: a zeroed gradient, the rows added
        (the busiest server's), divided by N, then the optimizer."""
        table, wk = self.sparse[name], self.wk
        part = table.rows * table.row_bytes / self.servers
        build = (ZEROED_PASSES + 1) * part + self.read[name] * table.row_bytes * wk.np * max(self.shares[name])
        return wk.copy_s(build) + wk.update_s(part)

    def _late(self, update_s: float) -> float:
        """The update's time as the next pulls see it: they wait for every server's answer, each sent
        after that server's own update (Host.jitter), the busiest's taking the longest on its NIC
        (Worker.last_of). Spread evenly, the slowest server's update."""
        rate = self.wk.net.rate_bps
        if not rate:
            return update_s * self.wk.slowest_of(self.servers)
        answers = [sum(self.read[name] * t.row_bytes * self.clients * self.shares[name][s] for name, t in self.sparse.items())
                   * 8 / rate for s in range(self.servers)]
        return self.wk.last_of(update_s, answers)

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
        """``backward()`` returns once its hooks sent the pushes; ``optimizer.step()`` begins by
        waiting for the dense buckets."""
        self.issued[step].then(lambda: self.dense.after_backward(step, go))

    def step(self, step: int, go: Callable[[], None]) -> None:
        """The optimizer over the dense parameters, then a wait for the step's sends to complete."""
        del self.issued[step]
        self.wk.host.run(self.wk.update_s(self.dense_bytes), lambda: self.taken.pop(step).then(go),
                         what="optimizer (dense)")
