"""The compressed strategies: casync-ring, casync-ps, compressed-allgather (and selective compression).

Exactness is checked against the single-process reference in tests/test_parity.py (lossless codecs,
on every code path). Here: lossy codecs leave every worker with the same parameters and still
train; a NaN or an fp16 overflow on one worker raises the same error on every worker; bad options
fail at construction; the cost model decides as its formulas say.
"""
import math

import pytest
import torch

import gradsync
from gradsync.bench.workload import Workload, compare, reference, train_step
from gradsync.compress import CompressionError, NonFiniteGradientError, build
from gradsync.errors import ConfigError, GradsyncError
from gradsync.strategies import costmodel, resolve
from multirank import run_ranks

STEPS = 4
LOSSY = [  # (strategy, options): every path of every algorithm, in one job per worker count
    ("casync-ring", {"compression": "onebit"}),
    ("casync-ring", {"compression": "topk:ratio=0.3", "error_feedback": True, "bucket_mb": 0.001}),
    ("casync-ring", {"compression": "fp16"}),
    ("casync-ring", {"compression": "powersgd"}),
    ("casync-ring", {"compression": "randomk"}),
    ("casync-ring", {"compression": "dgc:ratio=0.1"}),
    ("casync-ps", {"compression": "onebit", "partition_mb": 0.0001}),
    ("casync-ps", {"compression": "terngrad", "bucket_mb": 0.001}),
    ("casync-ps", {"compression": "randomk", "partition_mb": 0.0001}),
    ("casync-ps", {"compression": "qsgd", "error_feedback": True}),
    ("compressed-allgather", {"compression": "onebit"}),
    # Parameter servers with encoded pushes: a compressor and residual per group or slice.
    ("ps", {"compression": "int4", "error_feedback": True}),
    ("p3", {"compression": "topk:ratio=0.1", "error_feedback": True, "slice_params": 50}),
    ("compressed-allgather", {"compression": "randomk", "bucket_mb": 0.001}),
    ("casync-ring", {"compression": "onebit", "selective": True}),
    ("casync-ps", {"compression": "tbq", "selective": True}),
]


def train_each(configs, work: Workload, steps: int):
    """Train a fresh model per configuration; each worker's final parameters and last loss."""
    topo = gradsync.topology()
    spec = work.spec()
    out = []
    for strategy, options in configs:
        model, opt = work.build()
        opt = gradsync.distribute(model, opt, strategy, **options)
        losses = []
        for step in range(steps):
            inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
            losses.append(train_step(model, opt, spec, inputs, target))
        opt.flush()  # p3: the last answers
        out.append(({n: p.detach().clone() for n, p in model.named_parameters()}, losses, opt.strategy.describe()))
        opt.close()
    return out


CLOSE = [  # fp16 rounds each average to 11 bits: these must stay within fp16's relative error
    ("casync-ring", {"compression": "fp16"}), ("casync-ps", {"compression": "fp16", "partition_mb": 0.0001}),
    ("allreduce", {"compression": "fp16"}), ("ddp", {"compression": "fp16", "find_unused_parameters": True}),
    ("compressed-allgather", {"compression": "fp16"}),
    ("ps", {"compression": "fp16", "fuse_kb": 0}), ("p3", {"compression": "fp16", "slice_params": 50}),
]


def test_lossy_codecs_leave_every_worker_with_the_same_model():
    work, workers = Workload(model="toy", batch_size=6), 3
    results = run_ranks(train_each, workers, LOSSY + CLOSE, work, STEPS, timeout=240)
    ref = {n: p.detach() for n, p in reference(work, workers, STEPS).named_parameters()}
    initial = dict(work.build()[0].named_parameters())
    for c, (strategy, options) in enumerate(LOSSY + CLOSE):
        first, losses, describe = results[0][c]
        assert strategy in describe
        for rank in range(1, workers):
            for name, value in results[rank][c][0].items():
                torch.testing.assert_close(value, first[name], rtol=0, atol=0,
                                           msg=f"{strategy} {options}: rank {rank} differs on {name}")
        assert all(math.isfinite(x) for x in losses), (strategy, options, losses)
        # Lossy, but training: parameters moved, and stayed near the exact reference.
        assert any(not torch.equal(first[n], initial[n]) for n in first), (strategy, options)
        drift = max(float((first[n] - ref[n]).abs().max()) for n in first)
        assert drift < (2e-3 if c >= len(LOSSY) else 1.0), (strategy, options, drift)


FAULTS = [("casync-ring", {"compression": "onebit"}), ("casync-ring", {"compression": "fp16"}),
          ("casync-ps", {"compression": "onebit", "partition_mb": 0.0001}), ("casync-ps", {"compression": "fp16"}),
          ("compressed-allgather", {"compression": "topk"}), ("casync-ring", {"compression": "randomk"}),
          ("casync-ring", {"compression": "none"})]


def error_of_one_step(opt, loss) -> tuple[str, str] | None:
    """Backward and step; the GradsyncError raised (type name, message), or None. Closes ``opt``."""
    try:
        loss.backward()
        opt.step()
        return None
    except GradsyncError as exc:
        return type(exc).__name__, str(exc)
    finally:
        opt.close()


def two_layers_with_a_nan(strategy, options, nan: bool):
    """A two-layer model under ``strategy``; with ``nan``, its first-layer gradient gets a NaN (the
    hook runs before accumulation, so the strategy sees it). Returns the model, the optimizer, the hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, **options)
    hook = model[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan"))) if nan else None
    return model, opt, hook


def nan_on_one_worker(configs, bad_rank):
    """Per configuration, one step where ``bad_rank``'s first-layer gradient has a NaN: each worker's error."""
    topo = gradsync.topology()
    out = []
    for strategy, options in configs:
        model, opt, _ = two_layers_with_a_nan(strategy, options, topo.rank == bad_rank)
        out.append(error_of_one_step(opt, model(torch.randn(4, 8)).sum()))
    return out


@pytest.mark.parametrize("hosts", [None, (0, 0, 1)], ids=["flat", "hosts-2+1"])
def test_a_nan_on_one_worker_raises_the_same_error_on_every_worker(hosts):
    # On hosts of 2 and 1 workers the bad worker (rank 1) shares a host with shard 0's owner and
    # owns shard 1: its fault must reach the owners through the host's sum, then every host.
    env = None if hosts is None else [{"GRADSYNC_HOST": f"h{h}", "LOCAL_WORLD_SIZE": str(hosts.count(h))}
                                      for h in hosts]
    results = run_ranks(nan_on_one_worker, 3, FAULTS, 1, env=env)
    for c, config in enumerate(FAULTS):
        for rank in range(3):
            outcome = results[rank][c]
            assert outcome is not None, f"{config}: rank {rank} raised nothing"
            kind, message = outcome
            assert kind == NonFiniteGradientError.__name__, (config, rank, message)
            # Every path, the one-round sums from backward included (fp16, randomk, none), names the worker.
            assert "rank 1" in message and "0.weight" in message, (config, rank, message)


def nan_through_a_server(configs, bad_rank):
    """Per configuration, one step where ``bad_rank``'s first-layer gradient has a NaN, then one
    clean step: which parameters are non-finite on this worker afterwards."""
    topo = gradsync.topology()
    out = []
    for strategy, options in configs:
        model, opt, hook = two_layers_with_a_nan(strategy, options, topo.rank == bad_rank)
        for step in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            if hook is not None:
                hook.remove()
                hook = None
        opt.flush()
        out.append(sorted(n for n, p in model.named_parameters() if not torch.isfinite(p).all()))
        opt.close()
    return out


def test_a_nan_pushed_through_encoded_servers_reaches_every_worker_as_uncompressed():
    """A block holding NaN is not encoded: its server adds NaN, so the update goes non-finite on
    every worker alike (as without compression, as under DDP), and the job goes on, no hang."""
    configs = [("p3", {"compression": "int8", "slice_params": 20}), ("ps", {"compression": "topk:ratio=0.5"}),
               ("ps", {})]
    results = run_ranks(nan_through_a_server, 2, configs, 1)
    for c, config in enumerate(configs):
        assert results[0][c] == results[1][c] and "0.weight" in results[0][c], (config, results)


PLAIN = [("casync-ring", {"selective": True, "bucket_mb": 0.001}), ("casync-ps", {"selective": True})]


def left_plain(work: Workload, steps: int, bad_rank: int):
    """Selective compression with a cost model that leaves every bucket plain (stubbed, so the path is
    certain): each configuration's parameters after training, then its error for a NaN on ``bad_rank``."""
    from gradsync.strategies.compressed import CompressedSync
    CompressedSync.decide = lambda self, costs, k, nbytes: costmodel.Decision(k, nbytes, False, 1, 0.0, 0.0)
    trained = train_each(PLAIN, work, steps)
    for _, _, describe in trained:
        assert "compresses 0/" in describe, describe
    return [params for params, _, _ in trained], nan_on_one_worker(PLAIN, bad_rank)


def test_buckets_left_plain_are_exact_and_name_a_faulty_worker():
    work, workers = Workload(model="toy", batch_size=6), 3
    results = run_ranks(left_plain, workers, work, STEPS, 1)
    ref = reference(work, workers, STEPS)
    for c, config in enumerate(PLAIN):
        report = compare(results[0][0][c], ref, work.tolerance)  # the toy model has unused parameters
        assert report["correct"], (config, report)
        for rank in range(workers):
            assert all(torch.equal(v, results[0][0][c][n]) for n, v in results[rank][0][c].items()), (config, rank)
            kind, message = results[rank][1][c]
            assert kind == NonFiniteGradientError.__name__ and "rank 1" in message and "'0.weight'" in message, \
                (config, rank, message)


def overflow(strategies):
    topo = gradsync.topology()
    out = []
    for strategy in strategies:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, compression="fp16")
        scale = 1e9 if topo.rank == 1 else 1.0  # beyond fp16's 65504 on rank 1 only
        out.append(error_of_one_step(opt, model(torch.ones(2, 4)).sum() * scale))
    return out


def test_fp16_overflow_on_one_worker_raises_everywhere():
    strategies = ["casync-ring", "casync-ps", "allreduce"]
    results = run_ranks(overflow, 2, strategies)
    for c, strategy in enumerate(strategies):
        for rank in range(2):
            outcome = results[rank][c]
            assert outcome is not None and outcome[0] == CompressionError.__name__, (strategy, rank, outcome)
            assert "fp16" in outcome[1], (rank, outcome)
            # casync names the rank; allreduce only sees the NaN in the sum, and names the bucket.
            assert ("rank 1" if strategy != "allreduce" else "bucket 0") in outcome[1], (strategy, rank, outcome)


def test_fp16_overflow_on_hosts_of_several_workers_raises_the_same_error_everywhere():
    # Hosts of 2 and 1 workers: rank 1's huge gradient overflows its host's sum in every shard, so
    # both owners on that host fail to encode; every worker still raises one and the same error.
    env = [{"GRADSYNC_HOST": f"h{h}", "LOCAL_WORLD_SIZE": str(n)} for h, n in ((0, 2), (0, 2), (1, 1))]
    strategies = ["casync-ring", "casync-ps"]
    results = run_ranks(overflow, 3, strategies, env=env)
    for c, strategy in enumerate(strategies):
        outcomes = {results[rank][c] for rank in range(3)}
        assert len(outcomes) == 1, (strategy, outcomes)
        kind, message = outcomes.pop()
        assert kind == CompressionError.__name__ and "fp16" in message, (strategy, message)


def test_bad_options_fail_at_construction():
    with pytest.raises(ConfigError, match="unknown compressor 'nope'"):
        resolve("casync-ring", compression="nope")
    with pytest.raises(ConfigError, match="compressor 'topk' has no option 'rate'; its options: ratio"):
        resolve("casync-ps", compression="topk:rate=0.1")
    with pytest.raises(ConfigError, match="casync-ps cannot use powersgd"):
        resolve("casync-ps", compression="powersgd")
    with pytest.raises(ConfigError, match="compressed-allgather does not take powersgd"):
        resolve("compressed-allgather", compression="powersgd")
    with pytest.raises(ConfigError, match="allreduce sums payloads in one all-reduce, which onebit cannot"):
        resolve("allreduce", compression="onebit")
    with pytest.raises(ConfigError, match="unknown compressor"):
        resolve("ddp", compression="nope")
    with pytest.raises(ConfigError, match="partition_mb"):
        resolve("casync-ps", partition_mb=0)
    assert resolve("casync-ring", compression="none").exact
    assert not resolve("casync-ring", compression="onebit").exact
    for name in ("ps", "p3", "ps-sliced"):  # a server decodes pushes without compressing: no shared seeds
        with pytest.raises(ConfigError, match=f"{name} cannot use compression='randomk'"):
            resolve(name, compression="randomk")
        with pytest.raises(ConfigError, match="unknown compressor 'nope'"):
            resolve(name, compression="nope")
        assert resolve(name, compression="none").exact and not resolve(name, compression="int8").exact


def test_encoded_pushes_keep_a_residual_per_key_and_refuse_a_bad_slot():
    """``ps``/``p3``'s push codec: with error feedback what a key's pushes decode to plus its
    residual is what was pushed, key by key; a non-finite block arrives as NaN (the update goes
    non-finite, as uncompressed); a slot whose length a peer forged is refused naming the peer."""
    from gradsync.errors import PeerProtocolError
    from gradsync.strategies.coded import CodedBlocks

    coder = CodedBlocks("topk:ratio=0.25", True, "p3")
    gen = torch.Generator().manual_seed(0)
    blocks = {key: [torch.randn(40, generator=gen) for _ in range(3)] for key in (0, 1)}
    decoded = {key: torch.zeros(40) for key in blocks}
    slot = torch.zeros(coder.slot(40), dtype=torch.uint8)
    for t in range(3):
        for key in (0, 1):
            coder.encode(key, blocks[key][t], slot, what=f"slice {key}")
            out = torch.empty(40)
            coder.decode(key, slot, out, peer=1, what=f"slice {key}")
            assert int((out != 0).sum()) <= 10  # a quarter of the elements travel
            decoded[key] += out
    for key in (0, 1):
        residual = coder.encoders[key].residual
        torch.testing.assert_close(decoded[key] + residual, sum(blocks[key]), rtol=0, atol=1e-5)
    coder.encode(0, torch.full((40,), float("nan")), slot, what="slice 0")
    out = torch.zeros(40)
    coder.decode(0, slot, out, peer=1, what="slice 0")
    assert out.isnan().all()
    slot[:8].view(torch.int64).fill_(10**6)
    with pytest.raises(PeerProtocolError, match="rank 1 sent a compressed push of slice 0 with a length of 1000000"):
        coder.decode(0, slot, out, peer=1, what="slice 0")


# -- the cost model ---------------------------------------------------------------------------------------------
def costs(rate_gbps, encode_gbps, ratio=1 / 32, latency=50e-6):
    codec = costmodel.Linear(20e-6, 1 / (encode_gbps * 1e9))
    return costmodel.Costs(latency, 8 / (rate_gbps * 1e9), codec, codec, ratio)


def test_compression_pays_on_slow_links_and_not_on_fast_ones():
    big = 64 << 20
    assert costmodel.decide_ring(costs(1, 2), 0, big, 4, summable=False).compress
    assert not costmodel.decide_ring(costs(100, 0.2), 0, big, 4, summable=False).compress
    assert costmodel.decide_ps(costs(1, 2), 0, big, 4).compress
    assert not costmodel.decide_ps(costs(100, 0.2), 0, big, 4).compress


def test_the_ps_cost_model_spreads_large_buckets_over_every_aggregator():
    decision = costmodel.decide_ps(costs(1, 2), 0, 64 << 20, 8)
    assert decision.parts == 8 and decision.compressed_s < decision.plain_s
    assert "compress, 8 part(s)" in decision.row()
    # A tiny bucket: per-message latency dominates, one aggregator is cheapest.
    assert costmodel.decide_ps(costs(1, 2), 0, 1024, 8).parts == 1


def test_formulas_match_the_documented_counts():
    c = costs(1, 2)
    s, n = 8 << 20, 4
    plain = 2 * (n - 1) * (c.latency + s / n * c.seconds_per_byte)
    assert costmodel.ring_cost(c, s, n, compressed=False, summable=False) == pytest.approx(plain)
    merged = 2 * (n - 1) * (2 * c.latency + c.ratio * s / n * c.seconds_per_byte) + n * c.encode(s / n) \
        + (2 * n - 1) * c.decode(s / n)
    assert costmodel.ring_cost(c, s, n, compressed=True, summable=False) == pytest.approx(merged)


def test_measured_link_and_codec_costs_are_positive_and_linear():
    enc, dec, ratio = costmodel.measure_codec(lambda: build("onebit"), torch.float32)
    assert enc.b > 0 and dec.b > 0
    assert ratio == pytest.approx(1 / 32, rel=0.05)
    latency, per_byte = costmodel.measure_link(lambda t: None, 1)
    assert (latency, per_byte) == (0.0, 0.0)


def test_a_codecs_cold_first_call_is_not_timed():
    """A compressor's first decode pays for fresh output pages, which a training run pays once: the
    probe warms each size with an untimed call, so the cost line is the warm one."""
    import time

    from gradsync.compress import Compressor

    class ColdFirstDecode(Compressor):  # onebit whose first decode per instance is 50 ms late, the rest free
        def __init__(self):
            self.inner, self.out = build("onebit"), None

        def compress(self, tensor):
            return self.inner.compress(tensor)

        def decompress(self, payload, ctx):
            if self.out is None:
                time.sleep(0.05)
                self.out = self.inner.decompress(payload, ctx)
            return self.out  # warm calls cost microseconds: a loaded machine cannot reach 25 ms

    enc, dec, _ = costmodel.measure_codec(ColdFirstDecode, torch.float32, repeats=1)
    assert dec(4 << 20) < 0.025  # the timed decode is a warm one, not the cold call's 50 ms
