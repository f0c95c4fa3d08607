"""Any compressor as a PyTorch DDP communication hook: parity with DDP where lossless, the same model on
every rank where lossy, and one clear error on every rank for a NaN on one."""
import pytest
import torch

from multirank import run_ranks, run_ranks_expect_failure


def model_and_data(rank: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6),
                                torch.nn.ReLU(), torch.nn.Linear(6, 3))
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(4)]
    return model, batches


def train(compressor, options, rank_of_nan=None, builtin_hook=None):
    """Four SGD steps under DDP (with our hook, PyTorch's ``builtin_hook``, or none); the final parameters."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradsync.compress import hook

    rank = dist.get_rank()
    model, batches = model_and_data(rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0005)  # ~500-byte buckets: several per model
    state = None
    if compressor is not None:
        state, fn = hook.comm_hook(compressor, model, **options)
        ddp.register_comm_hook(state, fn)
    elif builtin_hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, getattr(default_hooks, builtin_hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step, (x, y) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if rank_of_nan == rank and step == 1:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], (state.bytes_sent if state else 0)


def reference_and_each(configs):
    """Plain DDP's parameters, and (parameters, bytes sent) for each (compressor, options), in one job."""
    return train(None, {})[0], [train(compressor, options) for compressor, options in configs]


# Lossless configurations of each path: summable all-reduce (none, randomk at ratio 1), PowerSGD's two
# rounds at full rank, the all-gather path (topk at ratio 1), and error feedback around one of them.
LOSSLESS = [("none", {}), ("randomk", {"ratio": 1.0}), ("powersgd", {"rank": 16, "min_compression_rate": 0}),
            ("topk", {"ratio": 1.0}), ("topk", {"ratio": 1.0, "error_feedback": True})]


def test_lossless_hooks_match_plain_ddp():
    world = 2  # 3 and more workers: the ddp strategy's parity cases (tests/test_parity.py) use this hook
    for rank, (plain, runs) in enumerate(run_ranks(reference_and_each, world, LOSSLESS, timeout=90)):
        for (compressor, options), (hooked, sent) in zip(LOSSLESS, runs):
            assert sent > 0
            for a, b in zip(plain, hooked):
                # Same sums of the same values, in a different association (DDP sums then the hook
                # divides first; PowerSGD goes through P Q^T): a few float32 ulps on values of ~1.
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{compressor} {options} rank {rank}")


def ours_and_pytorchs_fp16():
    return train("fp16", {})[0], train(None, {}, None, "fp16_compress_hook")[0]


def test_fp16_hook_matches_pytorchs_fp16_hook():
    for ours, theirs in run_ranks(ours_and_pytorchs_fp16, 2, timeout=60):
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=0, atol=0)  # divide, cast, sum in fp16, cast back: same ops


LOSSY = [("onebit", {"error_feedback": True}), ("dgc", {"ratio": 0.1}), ("qsgd", {"levels": 7}),
         ("powersgd", {"rank": 1})]


def test_lossy_hooks_leave_every_rank_with_the_same_model():
    (plain, first), (_, second) = run_ranks(reference_and_each, 2, LOSSY, timeout=90)
    for config, (mine, _), (theirs, _) in zip(LOSSY, first, second):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=str(config))  # every rank sums the same payloads
        assert any(not torch.equal(a, b) for a, b in zip(plain, mine)), config  # compression changed the updates
        assert all(torch.isfinite(p).all() for p in mine), config


def test_nan_on_one_rank_raises_the_same_error_on_every_rank():
    failures = run_ranks_expect_failure(train, 2, "onebit", {}, 1, timeout=60)
    assert set(failures) == {0, 1}, failures
    for trace in failures.values():
        assert "NonFiniteGradientError" in trace and "on rank 1 has NaN/Inf" in trace
        assert "'4.bias'" in trace  # the last layer's bias: its bucket is reduced first


def test_a_bad_compressor_name_fails_at_registration():
    from gradsync.compress import hook
    from gradsync.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown compressor 'zip'"):
        hook.comm_hook("zip")
    with pytest.raises(ConfigError, match="compressor 'fp16' has no option 'ratio'"):
        hook.comm_hook("fp16", ratio=0.1)
