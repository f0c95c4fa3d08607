"""The base of the compressed strategies: buckets, their paths, and what an exchange works with.

A subclass overrides :meth:`CompressedSync.exchange` (and ``algorithm``, ``decide`` for the cost
model). ``attach`` plans the buckets, decides per bucket whether to compress (and into how many
partitions), and gives each bucket its path (:mod:`~gradsync.strategies.compressed.paths`);
``synchronize`` at the end of backward waits for every bucket, sets the averaged gradients, and
raises (or defers to ``step()``) the fault every worker agreed on.

What an exchange works with, on the communication thread: :attr:`~CompressedSync.peers` (the
workers it runs among, numbered 0..n-1: every worker, or one shard's owners on hosts of several
workers, :mod:`~gradsync.strategies.compressed.hosts`), :meth:`~CompressedSync.site` (one
compressor per compression site), :meth:`~CompressedSync.encode` / :meth:`~CompressedSync.decode`
(bytes on the wire, nothing once a fault is known), :meth:`~CompressedSync.send` /
:meth:`~CompressedSync.recv` (messages that carry the fault in their header), and
:attr:`~CompressedSync.faults`.
"""
from __future__ import annotations

from typing import Any

import torch

from gradsync.compress import CompressionError, Compressor, NonFiniteGradientError, PowerSGD, build, parse_spec
from gradsync.compress.base import Payload, from_bytes, message_problem, to_bytes
from gradsync.errors import ConfigError
from gradsync.strategies import costmodel
from gradsync.strategies.allreduce import MB, BucketedSync
from gradsync.strategies.base import SyncContext, host_ring_bytes
from gradsync.strategies.compressed.faults import Faults
from gradsync.strategies.compressed.hosts import HostShards, Peers
from gradsync.strategies.compressed.paths import ExchangedBucket, PlainBucket, SummedBucket
from gradsync.strategies.compressed.thread import ExchangeThread
from gradsync.strategies.compressed.work import CodecWork
from gradsync.transport import check_peer, payload_limit

TAG_BASE = 0x43530000  # + bucket index: this family's point-to-point tags


class CompressedSync(BucketedSync):
    """Base of the compressed strategies: override :meth:`exchange` (and ``algorithm`` for the cost model)."""

    algorithm = "ring"
    sums_in_one_round = False
    """Whether buckets whose codec sums in one all-reduce (fp16, bf16, random-k, identity) skip the
    communication thread: compressed and all-reduced from backward like ``allreduce``'s buckets."""

    def __init__(self, compression: str = "onebit", error_feedback: bool = False, selective: bool = False,
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0, broadcast_buffers: bool = True,
                 **compressor_options: Any):
        name, options = parse_spec(compression)
        options.update(compressor_options)
        probe = build(name, **options)  # a bad name or option fails here, not in backward
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ConfigError(f"bucket sizes must be > 0 MB, got bucket_mb={bucket_mb}, first_bucket_mb={first_bucket_mb}")
        self.codec_name, self.codec_options = name, options
        self.error_feedback = error_feedback
        self.broadcast_buffers = broadcast_buffers
        self.selective = selective
        self.summable = probe.summable
        self.one_round = probe.summable and not isinstance(probe, PowerSGD)
        self.exact = probe.lossless
        self.bucket_mb, self.first_bucket_mb = bucket_mb, first_bucket_mb
        self.check_codec(probe)

    def check_codec(self, probe: Compressor) -> None:
        """Reject a compressor this algorithm cannot use (ConfigError)."""

    # -- setup ---------------------------------------------------------------------------------------
    def attach(self, ctx: SyncContext) -> None:
        super().attach(ctx)
        topo = ctx.topology
        self.group = ctx.transport.new_worker_group()  # our thread's collectives, apart from the script's
        # Hosts of several workers: the thread's host sums and shard exchanges, on groups of our own too.
        self.hosts = ctx.transport.new_two_level() if ctx.two_level is not None else None
        self.workers = topo.worker_ranks
        self.n = topo.num_workers
        self.me = topo.worker_ranks.index(topo.rank) if topo.is_worker else -1
        self.flat = Peers(self.workers, self.me, self.group)
        self.peers = self.flat
        """Whom the exchange running on the communication thread talks to (set by it alone)."""
        self.host_form = HostShards(self, self.hosts) if self.hosts is not None and topo.is_worker else None
        self.span = self.host_form.num_hosts if self.host_form is not None else self.n
        """How many workers one exchange runs among: the hosts, or every worker (flat)."""
        self.sites: dict[str, Compressor] = {}
        self.faults = Faults(topo.rank, ctx.names, self.codec_name)
        self.work = CodecWork()
        self.closed = False
        self.ratio = 1.0
        # Past the gradients: used flags and the fault report of a plain (all-reduced) bucket.
        self._make_buckets(list(reversed(range(len(ctx.params)))), int(self.bucket_mb * MB),
                           int(self.first_bucket_mb * MB), extra=lambda group: len(group) + 3)
        self.flags = torch.zeros(len(ctx.params), dtype=torch.float32)
        self.paths = [ExchangedBucket(self)] * len(self.buckets)
        self.thread = None
        if topo.is_worker:
            self.decisions = self._decide()
            self.compressed = [d.compress for d in self.decisions]
            self.parts = [d.parts for d in self.decisions]
            self.paths = [self._path(d) for d in self.decisions]
            self.thread = ExchangeThread(f"gradsync-{self.name}", self._exchange_bucket, self.faults)
        self.threaded = sum(1 for path in self.paths if path.threaded)

    def _path(self, decision: costmodel.Decision):
        if self.selective and not decision.compress:
            return PlainBucket(self)
        if self.sums_in_one_round and self.one_round and self.host_form is None:
            return SummedBucket(self)  # (on hosts of several workers: the thread's shard exchange)
        return ExchangedBucket(self)

    def _decide(self) -> list[costmodel.Decision]:
        """Per bucket: compress or not, and partitions (for ``ps``). Without ``selective``: always compress."""
        sizes = [b.numel * b.buffer.element_size() for b in self.buckets]
        dtype = self.buckets[0].buffer.dtype if self.buckets else torch.float32
        encode, decode, ratio = costmodel.measure_codec(lambda: build(self.codec_name, **self.codec_options), dtype)
        self.ratio = ratio
        if not self.selective:
            self.costs = None
            return [costmodel.Decision(k, s, True, self.default_parts(s), 0.0, 0.0) for k, s in enumerate(sizes)]
        latency, per_byte = costmodel.measure_link(self._allreduce, self.n)
        mine = costmodel.Costs(latency, per_byte, encode, decode, ratio).as_tensor()
        self.ctx.transport.allreduce(mine, op="max", what="cost model figures", group=self.group)
        self.costs = costmodel.Costs.from_tensor(mine)  # the slowest worker's figures, alike on every rank
        self.ratio = self.costs.ratio
        return [self.decide(self.costs, k, s) for k, s in enumerate(sizes)]

    def default_parts(self, nbytes: int) -> int:
        return 1

    def decide(self, costs: costmodel.Costs, bucket: int, nbytes: int) -> costmodel.Decision:
        return costmodel.decide_ring(costs, bucket, nbytes, self.span, self.summable)

    # -- hook points: BucketedSync's on_grad_ready and step ----------------------------------------
    def synchronize(self) -> None:
        """Send what backward did not (unused parameters), wait for every bucket, set averaged gradients."""
        for k in range(self.next_launch, len(self.buckets)):
            self._send(k)
        for path, bucket in zip(self.paths, self.buckets):
            path.wait(bucket)
        self.thread.wait(self.threaded)
        errors = [path.finish(k, bucket) for k, (path, bucket) in enumerate(zip(self.paths, self.buckets))]
        ranked = sorted(zip(self.paths, errors), key=lambda pe: pe[0].precedence)
        error = self.thread.error or self.faults.agreed or next((e for _, e in ranked if e is not None), None)
        self.deferred = self.faults.agreed = None
        if error is None and self.threaded:
            for path, bucket in zip(self.paths, self.buckets):
                for slot, i in enumerate(bucket.indices):
                    self.flags[i] = bucket.used[slot] if path.threaded else 0.0
            self.ctx.transport.allreduce(self.flags, what="all-reduce of the used flags", group=self.ctx.two_level)
        counts = self.flags.tolist()
        for path, bucket in zip(self.paths, self.buckets):
            for slot, count in enumerate(path.used(bucket, counts)):
                self.ctx.params[bucket.indices[slot]].grad = bucket.views[slot] if count else None
            bucket.reset()
        self.thread.done = 0
        self.next_launch = 0
        if isinstance(error, (NonFiniteGradientError, CompressionError)):
            self._defer(error)  # agreed by every worker through the fault headers
        elif error is not None:
            raise error

    def _launch(self, k: int) -> None:
        self.next_launch = k + 1
        self.paths[k].launch(k, self.buckets[k])

    def _exchange_bucket(self, k: int) -> None:
        """On the communication thread: bucket ``k``'s exchange, its fault raised when every worker knows it."""
        self.paths[k].run(k, self.buckets[k])

    # -- what the algorithms use -----------------------------------------------------------------------
    def exchange(self, k: int, flat: torch.Tensor) -> None:
        """Replace ``flat`` (this worker's averaged bucket ``k``, or one shard of it) by the sum over
        :attr:`peers` (every worker, or one shard's owners, each holding its host's sum), in place."""
        raise NotImplementedError

    def site(self, k: int, where: str) -> Compressor:
        """The compressor instance of one compression site of bucket ``k`` (alike keys on every rank)."""
        key = f"{k}/{where}" if self.peers.shard is None else f"{k}/{self.peers.shard}/{where}"
        if key not in self.sites:
            if self.compressed[k]:
                self.sites[key] = build(self.codec_name, key=key, worker=self.me,
                                        error_feedback=self.error_feedback, **self.codec_options)
            else:
                self.sites[key] = build("none")
        return self.sites[key]

    def summable_bucket(self, k: int) -> bool:
        """Whether bucket ``k``'s payloads add up (plain buckets always do)."""
        return self.summable or not self.compressed[k]

    def compress(self, codec: Compressor, tensor: torch.Tensor | None, param: int = -1) -> tuple[Payload | None, Any]:
        """``codec.compress(tensor)``, or ``(None, None)`` once a fault is known (or this is one)."""
        if self.faults.known is not None or tensor is None:
            return None, None
        try:
            return self.work.compress(codec, tensor)
        except CompressionError:
            self.faults.note_compression(param)
            return None, None

    def encode(self, codec: Compressor, tensor: torch.Tensor | None, param: int = -1
               ) -> tuple[torch.Tensor, Payload | None, Any]:
        """``(message, payload, ctx)``; an empty message once a fault is known (or this is one)."""
        payload, ctx = self.compress(codec, tensor, param)
        if payload is None:
            return torch.empty(0, dtype=torch.uint8), None, None
        return to_bytes(payload), payload, ctx

    def decode(self, codec: Compressor, message: torch.Tensor, like: torch.Tensor, ctx: Any = None,
               shape_like: Payload | None = None) -> torch.Tensor | None:
        """The tensor in ``message`` (None once a fault is known); ``ctx`` defaults to one for ``like``."""
        if self.faults.known is not None:
            return None
        return self.decompress(codec, from_bytes(message, shape_like), codec.context_for(like) if ctx is None else ctx)

    def decompress(self, codec: Compressor, payload: Payload, ctx: Any) -> torch.Tensor:
        """``codec.decompress(payload, ctx)``, counted in :meth:`host_work` and traced as a ``decode``."""
        return self.work.decompress(codec, payload, ctx)

    def host_work(self) -> dict[str, list]:
        """This rank's encodes and decodes since :meth:`attach`, each ``[calls, raw bytes,
        seconds]`` (``gradsync bench`` records them per step as ``codec_work``)."""
        return self.work.totals()

    def send(self, message: torch.Tensor, worker: int, k: int) -> list:
        """Bucket ``k``'s ``message`` to peer ``worker`` (a number among :attr:`peers`); headers only
        (the fault) once a fault is known.

        Wire (no pickle): ``transport.send_bytes``, an ``int64[4]`` header (body length, fault code,
        fault rank, fault parameter) and a body in :func:`gradsync.compress.base.to_bytes`'s format."""
        body, dst = (message if self.faults.known is None else message[:0]), self.peers.ranks[worker]
        return self.ctx.transport.send_bytes(body, dst, TAG_BASE + k, info=self.faults.header,
                                             what=f"compressed bucket {k} to rank {dst}")

    def recv(self, worker: int, k: int) -> torch.Tensor:
        """Bucket ``k``'s next message from peer ``worker``; a fault in its header becomes known."""
        src = self.peers.ranks[worker]
        message, info = self.ctx.transport.recv_bytes(src, TAG_BASE + k, limit=payload_limit(self.buckets[k].numel),
                                                      device=self.ctx.params[0].device,
                                                      what=f"compressed bucket {k} from rank {src}")
        self.faults.note_header(info)
        if message.numel() and self.faults.known is None:
            problem = message_problem(message)
            check_peer(problem is None, src, f"compressed bucket {k}", problem)
        return message

    def _allreduce(self, tensor: torch.Tensor) -> None:
        self.ctx.transport.allreduce(tensor, what="compressed all-reduce", group=self.peers.group)

    # -- the rest of the contract ----------------------------------------------------------------------
    def abandon(self) -> None:
        """After a peer failed: the exchange thread takes no more buckets; an exchange under way
        ends with the broken group."""
        self.closed = True
        if self.thread is not None:
            self.thread.abandon()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.thread is not None:
            self.thread.close()
        if self.ctx.topology.is_worker and self.thread.error is None:
            self.ctx.transport.allreduce(torch.zeros(1), what="end of the compression group", group=self.group)
        self.ctx.transport.free_group(self.group)
        self.ctx.transport.free_group(self.hosts)

    def min_bytes_per_host(self, model_bytes: int) -> float:
        return host_ring_bytes(model_bytes * self.ratio, self.ctx.topology)

    def report(self) -> str:
        """The per-bucket decisions, one line each (selective compression's cost model, or "always")."""
        return "\n".join(d.row() for d in getattr(self, "decisions", []))

    def describe(self) -> str:
        codec = self.codec_name + ("".join(f",{k}={v}" for k, v in self.codec_options.items())
                                   if self.codec_options else "")
        text = f"{self.name}({codec}{', error feedback' if self.error_feedback else ''}, {len(self.buckets)} buckets"
        if self.host_form is not None:
            text += f", two-level over {self.span} hosts: compressed across them, plain inside"
        if self.selective and hasattr(self, "decisions"):
            total = sum(d.nbytes for d in self.decisions) or 1
            chosen = [d for d in self.decisions if d.compress]
            share = sum(d.nbytes for d in chosen) / total
            text += f", selective: compresses {len(chosen)}/{len(self.decisions)} buckets ({share:.0%} of bytes)"
        return text + ")"
