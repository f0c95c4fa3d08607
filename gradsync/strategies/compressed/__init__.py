"""What the compressed strategies share: buckets, their paths, one communication thread, compression sites, faults.

``casync-ring`` and ``casync-ps`` (HiPress's CaSync, Bai et al. SOSP 2021) and their baseline
``compressed-allgather`` differ only in :meth:`CompressedSync.exchange`, which turns one bucket of this
worker's (already averaged) gradients into the bucket of everyone's. What they share lives here:

- **Bulk synchronization** (:mod:`.sync`). Gradients are fused into buckets in backward order
  (``bucket_mb``, the first ``first_bucket_mb``; :func:`gradsync.strategies.allreduce.plan_buckets`),
  so small gradients travel together and a compressor's per-call cost is paid per bucket, not per
  bias vector.
- **Paths** (:mod:`.paths`). Each bucket travels one of three ways, chosen once at attach: plain
  (all-reduced from backward), summed (compressed and all-reduced from backward, where the codec's
  payloads add up in one round), or exchanged by the communication thread.
- **Overlap** (:mod:`.thread`). An exchanged bucket goes to the communication thread as soon as it
  is full (and every earlier one went), so encoding, sending and decoding overlap the rest of
  backward; the end of backward waits for the last bucket.
- **Compression sites.** Each place that compresses (a worker's own gradient, a ring hop that
  re-encodes a merged sum, a PS aggregator re-encoding its result) has its own compressor instance,
  built by :func:`gradsync.compress.build` with a key every rank derives alike, so state (residuals,
  momentum, error feedback) is fed back at the site that lost it, and shared seeds agree. What the
  encodes and decodes cost is counted per rank (:mod:`.work`).
- **Selective compression** (``selective=True``): :mod:`gradsync.strategies.costmodel` decides per
  bucket whether to compress (and for ``casync-ps`` into how many partitions); ``decisions`` holds
  the choices. A bucket it leaves plain costs what ``allreduce`` costs.
- **Used flags.** After the exchanged buckets, one all-reduce of one flag per parameter tells how
  many workers produced each gradient: zero leaves ``grad = None``, as in DDP (exact strategies'
  semantics). Plain and summed buckets carry theirs in their own all-reduce.
- **Hosts of several workers** (:mod:`.hosts`). Each bucket is summed inside the host uncompressed,
  each shard exchanged compressed among its owners (one worker a host), and copied back inside the
  host: only what crosses hosts is compressed. One rank a host, or one host: flat, every worker a
  peer of every other.
- **Faults** (:mod:`.faults`). A NaN/Inf gradient or a codec failure on one worker travels in the
  message headers (or the all-reduced fault report), so every worker raises the same error naming
  the rank and the parameter: no rank raises while the others hang.
"""
from gradsync.strategies.compressed.faults import FAULT_COMPRESSION, FAULT_NONFINITE, Fault, Faults
from gradsync.strategies.compressed.sync import TAG_BASE, CompressedSync

__all__ = ["CompressedSync", "FAULT_COMPRESSION", "FAULT_NONFINITE", "Fault", "Faults", "TAG_BASE"]
