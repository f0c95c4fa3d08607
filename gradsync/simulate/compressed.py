"""The compressed strategies' schedules (HiPress's CaSync, Bai et al. SOSP 2021, and its baseline).

``casync-ring``, ``casync-ps`` and ``compressed-allgather`` share one shape
(:mod:`gradsync.strategies.compressed`): buckets in backward order (``plan_buckets`` with the
strategy's ``bucket_mb``), each handed, once full and in order, to one communication thread that
runs :meth:`exchange` for it; at the end of backward the training thread waits for the last bucket
and all-reduces one used flag per parameter; then the local optimizer. Buckets the cost model
leaves plain (``selective=True``) are all-reduced straight from backward, and buckets of a codec
whose payloads add up (``casync-ring`` with fp16, bf16, random-k) are encoded on the training
thread, their payload all-reduced, and decoded at the end of backward.

The costs come from the strategy and the compressor themselves:

- which buckets are compressed and into how many partitions: the strategy's decision code
  (:func:`gradsync.strategies.costmodel.decide_ring` / ``decide_ps``) fed the simulated network's
  latency and rate and the compressor's measured costs, or ``default_parts`` without ``selective``;
- encode and decode times and the wire ratio: the host's recorded line for the compressor
  (:attr:`Host.codecs`), else :func:`gradsync.strategies.costmodel.measure_codec` on this machine
  (one thread, in a child process with the emulated ranks' allocator settings, as a rank meets its
  codec), divided by :attr:`Host.codec_speed` (decodes by :attr:`Host.decode_speed` where it is given);
- the message pattern per bucket of ``s`` bytes, ``N`` workers, ratio ``r``: as each strategy's
  docstring gives it (a ring: ``2 (N-1)`` hops of ``r s / N``, each hop's decode-merge-encode after
  its message; CaSync-PS: pushes, the aggregator's decode-merge-encode, answers; all-gather:
  ``N-1`` payloads of ``r s`` received, ``N`` decodes). Every message is a header and a body: two
  latencies, and on each side two message ends of Python (:attr:`Host.message_s`);
- the host work around the codecs, as the strategies' code does it: each payload framed into one
  message (a copy of it), each decoded sum or chunk copied into the bucket, an aggregator's copy of
  its own partition and its decode of the sum it sends, the all-gather's zeroed sum.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from gradsync.compress import build, parse_spec
from gradsync.simulate.worker import ZEROED_PASSES, StrategyModel, Worker
from gradsync.strategies import costmodel

COMPRESSED = ("casync-ring", "casync-ps", "compressed-allgather")
"""The strategies modelled here: each runs once per compressor in ``--compression``."""
_CODECS: dict[tuple, tuple] = {}
PROBE_NUMEL = (1 << 20, 1 << 23)
"""Gradient sizes the compressors are timed on: 4 and 32 MB, a bucket's order (smaller ones sit in
the CPU's caches and run faster per byte than a bucket does)."""


@dataclass(frozen=True)
class CodecCost:
    """A compressor's cost lines (seconds for raw bytes) and wire ratio, as the cost model measures them."""

    encode: costmodel.Linear
    decode: costmodel.Linear
    ratio: float
    summable: bool


def codec_cost(name: str, options: dict, speed: float, decode_speed: float | None = None,
               recorded: dict | None = None) -> CodecCost:
    """The compressor's line in ``recorded`` (spec -> cost line, :attr:`Host.codecs`: another
    machine's rates) where it has one, else measured once per process and compressor on this
    machine's CPU (one thread, as a rank meets it: :func:`_measured_as_a_rank`; kept in
    :data:`_CODECS`); scaled by ``speed`` (decodes by ``decode_speed`` where given)."""
    line = recorded_line(recorded or {}, name, options)
    if line is not None:
        ea, eb, da, db, ratio = line
        enc, dec = costmodel.Linear(ea, eb), costmodel.Linear(da, db)
    else:
        key = codec_key(name, options)
        if key not in _CODECS:
            _CODECS[key] = _measured_as_a_rank(name, options)
        enc, dec, ratio = _CODECS[key]
    probe = build(name, **options)
    scale = lambda line, k: costmodel.Linear(line.a / k, line.b / k)  # noqa: E731
    return CodecCost(scale(enc, speed), scale(dec, speed if decode_speed is None else decode_speed), ratio,
                     bool(probe.summable))


def codec_key(name: str, options: dict) -> tuple:
    """A compressor's identity: its name and its options in order (``topk``, ``(("ratio", 0.01),)``)."""
    return name, tuple(sorted(options.items()))


def recorded_line(lines: dict, name: str, options: dict) -> list | None:
    """The cost line of compressor ``name`` with ``options`` in ``lines`` (spec, as
    ``--compression`` takes it, -> ``[encode a, encode b, decode a, decode b, ratio]``), or None."""
    want = codec_key(name, options)
    return next((line for spec, line in lines.items() if codec_key(*parse_spec(spec)) == want), None)


def _measured_as_a_rank(name: str, options: dict) -> tuple:
    """``measure_codec`` in a child process under the allocator settings of the ranks (freed blocks
    kept, large tensors on transparent huge pages: ``gradsync.bench.cli.emulated_rank_env``). In a
    plain process a decode's fresh output above glibc's 32 MB mmap ceiling is fresh pages on every
    call, which the ranks never pay (onebit's decode on a 2-core EPYC: 0.65-0.73 against 0.05-0.10 ns a byte)."""
    from gradsync.bench.cli import emulated_rank_env
    from gradsync.strategies.costmodel import Linear

    code = ("import json, sys; from gradsync.simulate.compressed import measure_here; "
            "print(json.dumps(measure_here(*json.loads(sys.argv[1]))))")
    env = {**os.environ, **emulated_rank_env()}
    run = subprocess.run([sys.executable, "-c", code, json.dumps([name, options])], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"measuring compressor {name!r} failed in a child process: {run.stderr.strip()[-2000:]}")
    ea, eb, da, db, ratio = json.loads(run.stdout.strip().splitlines()[-1])
    return Linear(ea, eb), Linear(da, db), ratio


def measure_here(name: str, options: dict) -> list[float]:
    """Encode and decode cost lines and ratio of compressor ``name`` in this process, one thread."""
    import torch

    torch.set_num_threads(1)
    enc, dec, ratio = costmodel.measure_codec(lambda: build(name, **options), torch.float32, PROBE_NUMEL, repeats=7)
    return [enc.a, enc.b, dec.a, dec.b, ratio]


class CompressedBuckets(StrategyModel):
    """The family's shared schedule; :meth:`exchange` is each strategy's message pattern."""

    updates_locally = True

    def bind(self, worker: Worker) -> None:
        from gradsync.strategies.allreduce import MB, plan_buckets

        super().bind(worker)
        s = self.strategy
        order = list(reversed(range(len(worker.params))))
        self.buckets = plan_buckets(worker.metas, order, int(s.bucket_mb * MB), int(s.first_bucket_mb * MB))
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.index = {p.name: i for i, p in enumerate(worker.params)}
        self.bytes = [sum(worker.params[i].nbytes for i in b) for b in self.buckets]
        host = worker.host_rates
        # on hosts of several ranks, each of the host's ranks encodes and decodes its 1/R shard of
        # what crosses hosts, at once: the host's codec work goes R times as fast
        shards = worker.per_host if worker.hosts == "local" else 1
        decode = None if host.decode_speed is None else host.decode_speed * shards
        self.codec = codec_cost(s.codec_name, s.codec_options, host.codec_speed * shards, decode, host.codecs)
        n = worker.np
        if s.selective:
            costs = costmodel.Costs(worker.net.latency_s, 0.0 if worker.net.rate_bps is None else 8 / worker.net.rate_bps,
                                    self.codec.encode, self.codec.decode, self.codec.ratio)
            decisions = [self.decide(costs, k, b) for k, b in enumerate(self.bytes)]
        else:
            decisions = [costmodel.Decision(k, b, True, self.default_parts(b), 0.0, 0.0)
                         for k, b in enumerate(self.bytes)]
        self.compressed = [d.compress for d in decisions]
        self.parts = [d.parts for d in decisions]
        one_round = self.codec.summable and s.one_round and s.sums_in_one_round
        self.summed = [c and one_round for c in self.compressed]
        self.thread = worker.thread("communication thread")
        self.collectives = worker.thread("collectives")
        self.n = n

    def decide(self, costs: costmodel.Costs, k: int, nbytes: int) -> costmodel.Decision:
        return costmodel.decide_ring(costs, k, nbytes, self.wk.np, self.codec.summable)

    def default_parts(self, nbytes: int) -> int:
        return 1

    # -- the step ------------------------------------------------------------------------------------
    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.launched = self.done = 0
        self.waiting: Callable[[], None] | None = None
        go()

    def on_layer_ready(self, step: int, layer: int) -> None:
        for p in self.wk.w.layers[layer].params:
            self.missing[self.bucket_of[self.index[p.name]]] -= 1
        while self.launched < len(self.buckets) and self.missing[self.launched] == 0:
            self._launch(self.launched)
            self.launched += 1

    def _launch(self, k: int) -> None:
        wk, s = self.wk, self.bytes[k]
        copy = wk.copy_s(s)  # packed into the bucket on the training thread
        if not self.compressed[k]:  # plain: all-reduced from backward with its flags
            wk.host.run(copy, lambda: self.collectives.submit(
                lambda finish: wk.ring(s, finish, f"plain bucket {k}"), self._finished, what=f"bucket {k}"),
                what=f"pack {k}")
        elif self.summed[k]:  # encoded on the training thread, the payload all-reduced
            wk.host.run(copy + self.codec.encode(s), lambda: self.collectives.submit(  # no framing: parts all-reduced
                lambda finish: wk.ring(self.codec.ratio * s, finish, f"summed bucket {k}"),
                lambda: wk.host.run(self._dec(s), self._finished, what=f"decode {k}"), what=f"bucket {k}"),
                what=f"pack+encode {k}")
        else:  # the thread divides, checks, and runs the strategy's pattern
            wk.host.run(copy, lambda: self.thread.submit(
                lambda finish: wk.sim.after(2 * wk.copy_s(s), lambda: self.exchange(k, s, finish)),
                self._finished, what=f"bucket {k}"), what=f"pack {k}")

    def _finished(self) -> None:
        self.done += 1
        if self.done == len(self.buckets) and self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            waiting()

    def after_backward(self, step: int, go: Callable[[], None]) -> None:
        def flags() -> None:  # one all-reduce of a used flag per parameter
            self.wk.ring(4 * len(self.wk.params), go, "used flags")

        if self.done == len(self.buckets):
            flags()
        else:
            self.waiting = flags

    def step(self, step: int, go: Callable[[], None]) -> None:
        self.local_update(go)

    # -- costs ---------------------------------------------------------------------------------------
    def waited(self, hosts: int) -> float:
        """Work that ``hosts`` workers each do before a message or collective that needs all of them
        takes the slowest one's time (:meth:`Worker.slowest_of`: the hosts' jitter)."""
        return self.wk.slowest_of(hosts)

    def _enc(self, nbytes: float) -> float:
        """Encode ``nbytes`` and frame the payload as one message (``to_bytes``: a copy of it)."""
        return self.codec.encode(nbytes) + self.wk.copy_s(self.codec.ratio * nbytes)

    def _dec(self, nbytes: float) -> float:
        return self.codec.decode(nbytes)

    def hops(self, hops: list[tuple[float, float, float]], done: Callable[[], None], name: str, uses=None) -> None:
        """Run ``(wire bytes, work seconds after it, message ends)`` hops in order on the thread,
        then ``done``. Every message is a header and a body (``transport.send_bytes``): a send or
        receive of one is two message ends (:attr:`Host.message_s` each). Each hop's message comes
        from one peer after that peer's own work: the work before it takes the slower of two
        hosts' (:meth:`waited`)."""
        wk = self.wk
        mesh = uses is None  # CaSync-PS: to and from every worker, an all-to-all (Network.mesh)
        uses = uses or [(wk.tx, 1), (wk.rx, 1)]
        if not hops:
            done()
            return
        nbytes, work, ends = hops[0]
        work *= self.waited(2)
        # the thread blocked in the hop's receive wakes (Worker.wake_s), then works
        wk.sim.transfer(nbytes, uses, lambda: wk.sim.after(wk.wake_s() + wk.ends_s(ends) + work,
                                                           lambda: self.hops(hops[1:], done, name, None if mesh else uses)),
                        latency=2 * wk.net.latency_s, name=name, lane="network",
                        efficiency=wk.mesh_efficiency() if mesh else 1.0)

    def exchange(self, k: int, s: float, done: Callable[[], None]) -> None:
        raise NotImplementedError


class CaSyncRing(CompressedBuckets):
    """Decode-merge-encode around the ring: ``N`` chunks; ``N-1`` reduce-scatter hops, each followed
    by decode, add and re-encode (the last by the final encode and its decode), then ``N-1``
    all-gather hops, each followed by a decode."""

    def exchange(self, k: int, s: float, done: Callable[[], None]) -> None:
        n, chunk = self.n, s / self.n
        wire = self.codec.ratio * chunk
        merge = self._dec(chunk) + self.wk.copy_s(chunk)
        placed = self._dec(chunk) + self.wk.copy_s(chunk)  # a finished chunk decoded into the bucket
        ends = 4  # a message sent to the next worker and one taken from the previous
        scatter = [(wire, merge + self._enc(chunk), ends) for _ in range(n - 2)] + [(wire, merge + self._enc(chunk) + placed, ends)]
        gather = [(wire, placed, ends) for _ in range(n - 1)]
        self.wk.sim.after(self._enc(chunk) * self.waited(2),
                          lambda: self.hops(scatter + gather, done, f"ring bucket {k}", self.wk.ring_links))


class CaSyncPS(CompressedBuckets):
    """Partitions aggregated by co-located workers: encode and push, decode-merge-encode at the
    aggregator, answer, decode. With ``K`` partitions, ``K`` workers aggregate one each (a different
    set per bucket); the step waits for an aggregator, whose link carries the other ``N-1``
    workers' pushes of its partition in and its ``N-1`` answers out, beside its own ``K-1`` pushes
    and answers (fewer: ``K <= N``). With one partition, everyone waits for the bucket's aggregator."""

    def decide(self, costs: costmodel.Costs, k: int, nbytes: int) -> costmodel.Decision:
        return costmodel.decide_ps(costs, k, nbytes, self.wk.np)

    def default_parts(self, nbytes: int) -> int:
        return self.wk.np if nbytes >= self.strategy.partition_bytes else 1

    def exchange(self, k: int, s: float, done: Callable[[], None]) -> None:
        wk, n, parts = self.wk, self.n, min(self.parts[k], self.n)
        part = s / parts
        wire = (n - 1) * self.codec.ratio * part  # an aggregator's fan-in, and then its fan-out
        # the aggregator copies its own partition, adds each decoded push, encodes the sum and
        # decodes it into its bucket as every worker does; the others decode the answers into theirs
        placed = self._dec(part) + wk.copy_s(part)
        # messages per worker (it aggregates a partition with the chance parts / n): its pushes and
        # the pushes it takes, then its answers and the answers it takes; two ends each
        ends = 4 * parts * (n - 1) / n
        push = (wire, wk.copy_s(part) + (n - 1) * (self._dec(part) + wk.copy_s(part)) + self._enc(part) + placed, ends)
        pull = (wire, (parts - 1) * placed, ends)
        pushed = min(parts, n - 1)  # partitions a worker encodes for others (it aggregates at most one)
        # an aggregator waits for every other worker's push
        wk.sim.after(pushed * self._enc(part) * self.waited(n), lambda: self.hops([push, pull], done, f"ps bucket {k}"))


class CompressedAllGather(CompressedBuckets):
    """Encode, all-gather every payload (``N-1`` of ``r s`` each way, after the lengths' all-gather),
    decode and add all ``N``."""

    def exchange(self, k: int, s: float, done: Callable[[], None]) -> None:
        wk, n = self.wk, self.n
        # a zeroed sum, each payload decoded and added, the sum copied into the bucket
        after = ZEROED_PASSES * wk.copy_s(s) + n * (self._dec(s) + wk.copy_s(s)) + wk.copy_s(s)
        # Python's part of the message: the lengths' and the payloads' all-gathers issued (a header
        # and a body sent), and each peer's header and body taken and checked
        ends = 2 + 2 * (n - 1)

        def gather() -> None:
            wk.sim.transfer((n - 1) * self.codec.ratio * s, [(wk.tx, 1), (wk.rx, 1)],
                            lambda: wk.sim.after(wk.wake_s() + wk.ends_s(ends) + after, done), latency=2 * (n - 1) * wk.net.latency_s,
                            name=f"all-gather bucket {k}", lane="network")

        wk.sim.after(self._enc(s) * self.waited(n), gather)  # the all-gather waits for every worker
