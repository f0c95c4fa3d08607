"""Sparse-aware hybrid synchronization: Parallax (Kim et al., EuroSys 2019).

Embedding tables whose steps touch few rows go to parameter servers as (row ids, row values);
everything else goes through the bucketed all-reduce (:class:`~gradsync.strategies.allreduce.AllReduce`;
with ``compression=``, the codec's: the payloads all-reduced where they add up, else casync-ring's
decode-merge-encode, :func:`~gradsync.strategies.casync_ring.compressed_allreduce`).
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
of the transport's byte count); ``STOP`` at close; ``PING`` (a header alone, skipped) while a worker
sends its servers nothing else for a quarter of the timeout, so that their waits for the next request
outlive the workers' pauses (:mod:`gradsync.strategies.keepalive`).

Must match across ranks: the model and the optimizer. Gloo only (servers receive from any source).
"""
# layout.py: message codes, the row layout, lazy_update; plan.py: the first step's decisions;
# server.py: RowServer; strategy.py: SparseHybrid, the worker's side.
from gradsync._lazy import lazy_names
from gradsync.strategies.hybrid.layout import (HEADER, OP_FLUSH, OP_PING, OP_PROBE_PULL, OP_PROBE_PUSH, OP_PULL,
                                              OP_PUSH, OP_STOP,
                                              TABLES, TAG_ANSWER, TAG_REQUEST, Layout, lazy_update)
from gradsync.strategies.hybrid.server import RowServer
from gradsync.strategies.hybrid.strategy import SparseHybrid

__all__ = ["SparseHybrid", "RowServer", "Layout", "lazy_update", "TABLES", "HEADER", "TAG_REQUEST", "TAG_ANSWER",
           "OP_PULL", "OP_PUSH", "OP_FLUSH", "OP_STOP", "OP_PROBE_PUSH", "OP_PROBE_PULL", "OP_PING"]

# The old class name, kept as a deprecated alias.
lazy_names(__name__, {}, renamed={"Hybrid": "gradsync.strategies.SparseHybrid"})
