"""Compressors, one process: each one's documented error bound, unbiasedness, wire size and edge cases."""
import math

import pytest
import torch

from gradsync.compress import (COMPRESSORS, DGC, QSGD, TBQ, CompressionError, ErrorFeedback, GradDrop,
                               NonFiniteGradientError, OneBit, PowerSGD, RandomK, ScaledSign, SignSGD, TernGrad,
                               TopK, bits, build, compress_checked, register, wire_bytes)
from gradsync.compress.base import Compressor, all_finite
from gradsync.compress.cast import Identity
from gradsync.errors import ConfigError
from multirank import DEVICE

ALL = sorted(COMPRESSORS)


def roundtrip(c, x):
    payload, ctx = c.compress(x)
    return c.decompress(payload, ctx), payload


def gradient(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- every compressor: shapes, dtypes, layouts, edge cases --------------------------------------------
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_output_has_the_input_shape_and_dtype(name, dtype):
    x = gradient(64, 48).to(dtype)
    y, payload = roundtrip(build(name, key="w"), x)
    assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
    assert all(p.is_contiguous() for p in payload)


@pytest.mark.skipif(DEVICE == "cpu", reason="a GPU check: GRADSYNC_TEST_DEVICE=cuda (benchmarks/gpu_check.sh)")
@pytest.mark.parametrize("name", ALL)
def test_every_codec_runs_on_the_gradients_device_as_on_the_cpu(name):
    x = gradient(64, 48)
    on_cpu, _ = roundtrip(build(name, key="w"), x)
    y, payload = roundtrip(build(name, key="w"), x.to(DEVICE))
    assert y.device == x.to(DEVICE).device and all(p.device == y.device for p in payload), name
    assert y.shape == x.shape and y.dtype == x.dtype
    # The same draws (host generators) and the same arithmetic, up to rounding: a stochastic code
    # may round the other way at a boundary, which moves one element, not the tensor.
    err = float((y.cpu() - on_cpu).norm() / on_cpu.norm().clamp_min(1e-12))
    assert err < 1e-2, (name, err)


@pytest.mark.parametrize("name", ALL)
def test_non_contiguous_input_is_the_same_as_its_contiguous_copy(name):
    x = gradient(48, 64).T  # a transposed view
    assert not x.is_contiguous()
    a, _ = roundtrip(build(name, key="w"), x)
    b, _ = roundtrip(build(name, key="w"), x.contiguous())
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # same seed, same values: identical by construction


@pytest.mark.parametrize("name", ALL)
def test_empty_and_all_zero_tensors(name):
    for x in (torch.zeros(0), torch.zeros(0, 5)):
        y, _ = roundtrip(build(name), x)
        assert y.shape == x.shape
    x = torch.zeros(33, 17)
    y, _ = roundtrip(build(name), x)
    # No NaN from a zero norm or scale. signsgd has no zero in its one bit: 0 decodes as +1 (documented).
    assert torch.equal(y, torch.ones_like(x) if name == "signsgd" else x), name


@pytest.mark.parametrize("name", ALL)
def test_non_finite_gradient_names_the_parameter(name):
    x = gradient(10, 10)
    x[3, 4] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"'layer1.weight' on rank 3 has 1 NaN/Inf"):
        compress_checked(build(name), x, "layer1.weight", rank=3)
    x[3, 4] = float("inf")
    with pytest.raises(NonFiniteGradientError, match="layer1.weight"):
        compress_checked(build(name), x, "layer1.weight")


def test_fp16_overflow_is_an_error_not_inf():
    x = torch.tensor([1.0, 7e4, -3.0])
    with pytest.raises(CompressionError, match=r"'big' on rank 0 with fp16: a value of magnitude 7e\+04"):
        compress_checked(build("fp16"), x, "big", rank=0)
    y, _ = roundtrip(build("bf16"), x)  # bf16 has float32's range
    assert torch.isfinite(y).all()


# -- error bounds ------------------------------------------------------------------------------------
def test_identity_is_lossless():
    x = gradient(100)
    y, payload = roundtrip(Identity(), x)
    assert torch.equal(y, x) and wire_bytes(payload) == 400


def test_half_precision_error_bounds():
    x = torch.cat([gradient(10_000), gradient(1000) * 1e-6, torch.tensor([1e-9, 6e4])])
    y, payload = roundtrip(build("fp16"), x)
    assert ((y - x).abs() <= 2**-11 * x.abs() + 2**-25).all() and wire_bytes(payload) == 2 * x.numel()
    x = torch.cat([gradient(10_000), torch.tensor([1e30, -1e-30])])
    y, _ = roundtrip(build("bf16"), x)
    assert ((y - x).abs() <= 2**-8 * x.abs()).all()


def test_onebit_keeps_each_sign_groups_mean():
    x = gradient(1001)
    y, payload = roundtrip(OneBit(), x)
    pos, neg = x >= 0, x < 0
    torch.testing.assert_close(y[pos], x[pos].mean().expand(int(pos.sum())))
    torch.testing.assert_close(y[neg], x[neg].mean().expand(int(neg.sum())))
    torch.testing.assert_close(y.sum(), x.sum(), rtol=1e-5, atol=1e-4)  # fp32 sums of 1001 terms
    assert wire_bytes(payload) == math.ceil(1001 / 8) + 8


def test_sign_compressors():
    x = torch.tensor([0.5, -2.0, 0.0, 3.0, -0.1])
    y, payload = roundtrip(SignSGD(), x)
    assert y.tolist() == [1.0, -1.0, 1.0, 1.0, -1.0] and wire_bytes(payload) == 1
    y, payload = roundtrip(ScaledSign(), x)
    scale = x.abs().mean()
    torch.testing.assert_close(y, torch.tensor([1, -1, 1, 1, -1.0]) * scale)
    assert wire_bytes(payload) == 1 + 4


def test_tbq_sends_thresholded_values_and_keeps_the_rest():
    c = TBQ(threshold=0.5)
    x = torch.tensor([0.7, -0.2, -0.9, 0.4])
    y, payload = roundtrip(c, x)
    assert y.tolist() == [0.5, 0.0, -0.5, 0.0] and wire_bytes(payload) == 1 + 4
    torch.testing.assert_close(c.residual, x - y)
    y2, _ = roundtrip(c, x)  # 0.4 + 0.4 now passes the threshold
    assert y2.tolist() == [0.5, 0.0, -0.5, 0.5]


def test_terngrad_levels_and_clipping():
    x = gradient(5000)
    x[0] = 100.0  # an outlier, clipped to 2.5 standard deviations
    y, payload = roundtrip(TernGrad(), x)
    scale = float(y.abs().max())
    assert scale <= 2.5 * float(x.std()) + 1e-6
    assert set(y.unique().tolist()) <= {-scale, 0.0, scale}
    assert wire_bytes(payload) == math.ceil(5000 / 4) + 4


def test_qsgd_error_within_one_level_and_wire_size():
    x = gradient(1000)
    for levels, width in ((127, 8), (7, 4), (1, 2)):
        y, payload = roundtrip(QSGD(levels=levels), x)
        norms = torch.nn.functional.pad(x, (0, 24)).view(-1, 128).norm(dim=1).repeat_interleave(128)[:1000]
        assert ((y - x).abs() <= norms / levels + 1e-6).all()  # stochastic rounding moves at most one level
        assert wire_bytes(payload) == math.ceil(1000 * width / 8) + 4 * math.ceil(1000 / 128)


def test_int8_and_int4_round_to_the_nearest_level_of_their_bucket():
    x = gradient(1000) * torch.linspace(0.01, 10, 1000)  # buckets of very different scales
    for name, q, width in (("int8", 127, 8), ("int4", 7, 4)):
        c = build(name)
        y, payload = roundtrip(c, x)
        steps = torch.nn.functional.pad(x, (0, 24)).view(-1, 128).abs().amax(dim=1).repeat_interleave(128)[:1000] / q
        assert ((y - x).abs() <= steps / 2 * (1 + 1e-5)).all(), name  # half a step of its own bucket at most
        assert torch.equal(y, roundtrip(c, x)[0])  # deterministic
        assert wire_bytes(payload) == math.ceil(1000 * width / 8) + 4 * math.ceil(1000 / 128)
    assert torch.equal(roundtrip(build("int4"), torch.zeros(300))[0], torch.zeros(300))  # a zero bucket stays zero


@pytest.mark.parametrize("make", [lambda: TernGrad(clip=None), lambda: QSGD(levels=3),
                                  lambda: RandomK(ratio=0.25, unbiased=True)], ids=["terngrad", "qsgd", "randomk"])
def test_stochastic_compressors_are_unbiased(make):
    """The mean of T independent compressions is within 5 standard errors of x for every element.

    With T = 3000 and 64 elements, a correct unbiased compressor fails this with probability below
    64 * 6e-7 (two-sided normal tail at 5 sigma, Bonferroni over elements); the seeds are fixed, so
    the outcome is deterministic. A biased compressor (for instance TernGrad with clipping, or
    random-k unscaled) fails it by a wide margin, which the last assertion checks."""
    x = gradient(64, seed=1)
    c = make()
    draws = torch.stack([roundtrip(c, x)[0] for _ in range(3000)])
    stderr = draws.std(dim=0) / math.sqrt(len(draws))
    assert ((draws.mean(dim=0) - x).abs() <= 5 * stderr + 1e-7).all()
    biased = torch.stack([roundtrip(RandomK(ratio=0.25), x)[0] for _ in range(300)])  # no n/k scale
    assert (biased.mean(dim=0) - x).abs().max() > 10 * (biased.std(dim=0) / math.sqrt(300)).max()


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    x = gradient(1000)
    y, payload = roundtrip(TopK(ratio=0.05), x)
    kept = y.nonzero().view(-1)
    assert kept.numel() == 50
    assert set(kept.tolist()) == set(x.abs().argsort(descending=True)[:50].tolist())
    assert torch.equal(y[kept], x[kept]) and wire_bytes(payload) == 50 * 8


def test_randomk_indices_are_shared_by_seed_and_change_every_step():
    x = gradient(1000)
    a, b = build("randomk", key="layer.w", worker=0, ratio=0.1), build("randomk", key="layer.w", worker=3, ratio=0.1)
    first = [roundtrip(c, x)[0].nonzero().view(-1) for c in (a, b)]
    assert torch.equal(*first) and first[0].numel() == 100  # k distinct indices, the same on every worker
    second = roundtrip(a, x)[0].nonzero().view(-1)
    assert not torch.equal(second, first[0])
    payload, _ = a.compress(x)
    assert wire_bytes(payload) == 400  # values only: indices come from the shared seed


def test_per_rank_seeds_differ_for_stochastic_rounding():
    a, b = build("terngrad", key="w", worker=0), build("terngrad", key="w", worker=1)
    assert a.seed != b.seed


def test_dgc_conserves_gradient_and_clears_sent_momentum():
    """With momentum 0, what was sent plus what is still accumulated equals everything received."""
    c = DGC(ratio=0.01, momentum=0.0)
    total_in, total_out = torch.zeros(5000), torch.zeros(5000)
    for step in range(5):
        g = gradient(5000, seed=step)
        y, payload = roundtrip(c, g)
        total_in += g
        total_out += y
        assert payload[0].numel() <= 50  # never more than k = ceil(ratio * n)
    torch.testing.assert_close(total_out + c._v, total_in, rtol=1e-5, atol=1e-5)


def test_dgc_picks_about_the_largest_elements():
    x = gradient(100_000)
    y, _ = roundtrip(DGC(ratio=0.01, momentum=0.0), x)
    sent = y.nonzero().view(-1)
    assert 500 <= sent.numel() <= 1000  # the sampled threshold is an estimate; at most k
    threshold = x.abs().topk(2000).values[-1]  # all sent elements are in the top 2 %
    assert (x.abs()[sent] >= threshold).all()


def test_dgc_momentum_correction_warmup_and_clipping():
    c = DGC(ratio=0.001, momentum=0.9, warmup_steps=8, clip_norm=1.0)
    assert [round(c.density(), 6) for c.calls in range(10)] == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                                                                 0.004, 0.004, 0.001, 0.001]
    c = DGC(ratio=1.0, momentum=0.9, clip_norm=1.0)
    g = gradient(100) * 10
    y1, _ = roundtrip(c, g)
    torch.testing.assert_close(y1.norm(), torch.tensor(1.0))  # clipped to norm 1, everything sent
    y2, _ = roundtrip(c, g)
    torch.testing.assert_close(y2, y1)  # momentum factor masking: sent elements' momentum was cleared
    c = DGC(ratio=0.01, momentum=0.9)  # 100 elements: k = 1, the largest, always element 0
    g = torch.full((100,), 0.1)
    g[0] = 10.0
    for _ in range(2):
        y, _ = roundtrip(c, g)
        assert y.nonzero().view(-1).tolist() == [0] and y[0] == 10.0
    # Unsent elements accumulate velocity: u = g, then 0.9 g + g; v = g + 1.9 g.
    torch.testing.assert_close(c._v[1:], torch.full((99,), 0.29))


def test_graddrop_drops_the_small_ones_into_a_residual():
    c = GradDrop(drop_ratio=0.9)
    x = gradient(1000)
    y, payload = roundtrip(c, x)
    assert payload[0].numel() == 100  # 1000 <= MIN_SAMPLE: exact threshold
    torch.testing.assert_close(y + c._residual, x)


def test_powersgd_is_exact_on_low_rank_matrices_and_sends_vectors_whole():
    u, v = gradient(64, 2), gradient(2, 48, seed=1)
    x = u @ v  # rank 2
    c = PowerSGD(rank=2)
    y, payload = roundtrip(c, x)
    torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)  # one power iteration spans a rank-2 column space
    assert wire_bytes(payload) == 4 * (64 + 48) * 2
    b = gradient(64)
    y, payload = roundtrip(c, b)
    assert torch.equal(y, b) and wire_bytes(payload) == 256


def test_powersgd_reduce_on_one_rank_is_the_projection():
    x = gradient(32, 3) @ gradient(3, 40, seed=2)
    total, mine = PowerSGD(rank=3).reduce(x, lambda t: None)
    torch.testing.assert_close(total, x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mine, total)


def test_powersgd_rank_above_the_matrix_rank_adds_no_spurious_direction():
    """A rank-1 gradient with rank 4: the extra columns are rounding noise and must stay zero."""
    x = gradient(1, 4).repeat(2, 1)
    y, _ = roundtrip(PowerSGD(rank=4, min_compression_rate=0), x)
    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


# -- error feedback ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["topk", "onebit", "powersgd", "qsgd", "efsignsgd"])
def test_error_feedback_loses_nothing_over_steps(name):
    """Sum of what was sent plus the final residual equals the sum of the gradients."""
    options = {"ratio": 0.1} if name == "topk" else {}
    c = build(name, **options) if name == "efsignsgd" else build(name, error_feedback=True, **options)
    total_in, total_out = torch.zeros(40, 30), torch.zeros(40, 30)
    for step in range(6):
        g = gradient(40, 30, seed=step)
        y, _ = roundtrip(c, g)
        total_in += g
        total_out += y
    torch.testing.assert_close(total_out + c.residual.view(40, 30), total_in, rtol=1e-5, atol=1e-5)


def test_efsignsgd_is_error_feedback_over_scaled_sign():
    c = build("efsignsgd")
    assert isinstance(c, ErrorFeedback) and isinstance(c.inner, ScaledSign) and c.name == "ef-scaled-sign"
    assert not c.summable and c.describe() == "ef(scaled-sign)"


def test_error_feedback_keeps_half_precision_gradients_dtype():
    c = build("topk", error_feedback=True, ratio=0.2)
    y, _ = roundtrip(c, gradient(50).half())
    assert y.dtype == torch.float16 and c.residual.dtype == torch.float32


# -- reduce, registry, options -----------------------------------------------------------------------
def test_reduce_needs_a_summable_compressor():
    with pytest.raises(CompressionError, match="cannot be summed"):
        TopK().reduce(gradient(10), lambda t: None)
    total, mine = build("fp16").reduce(gradient(10), lambda t: t.mul_(2))  # two "ranks" holding the same
    torch.testing.assert_close(total, 2 * mine)


def test_reduce_reports_a_half_precision_sum_that_overflows():
    with pytest.raises(CompressionError, match="sum over ranks overflowed"):
        build("fp16").reduce(torch.tensor([4e4]), lambda t: t.mul_(2))


def test_registry_and_options():
    with pytest.raises(ConfigError, match="unknown compressor 'zip'; valid compressors: bf16, dgc"):
        build("zip")
    with pytest.raises(ConfigError, match="compressor 'topk' has no option 'levels'; its options: ratio"):
        build("topk", levels=3)
    with pytest.raises(ConfigError, match=r"invalid options for compressor 'topk': ratio='abc' \(a str\)"):
        build("topk", ratio="abc")
    for bad in (lambda: TopK(ratio=0), lambda: RandomK(ratio=1.5), lambda: QSGD(levels=0), lambda: QSGD(levels=200),
                lambda: TBQ(threshold=0), lambda: DGC(momentum=1.0), lambda: GradDrop(drop_ratio=1.0),
                lambda: PowerSGD(rank=0)):
        with pytest.raises(ConfigError):
            bad()

    class Halve(Identity):
        name = "halve"

        def decompress(self, payload, ctx):
            return super().decompress(payload, ctx) / 2

    register("halve", Halve)
    try:
        assert roundtrip(build("halve"), torch.ones(3))[0].tolist() == [0.5] * 3
    finally:
        del COMPRESSORS["halve"]
    assert build("qsgd", levels=7).describe() == "qsgd(seed=0, levels=7, bucket_size=128)"


def test_onebit_is_about_32x_smaller():
    x = gradient(1 << 20)
    for name, ratio in (("onebit", 31.99), ("signsgd", 32), ("tbq", 15.99), ("terngrad", 15.99), ("fp16", 2)):
        assert x.numel() * 4 / wire_bytes(build(name).compress(x)[0]) >= ratio, name


@pytest.mark.parametrize("width", bits.WIDTHS)
def test_bit_packing_round_trips(width):
    for n in (0, 1, 7, 8, 9, 1001):
        codes = torch.randint(0, 1 << width, (n,), dtype=torch.uint8)
        packed = bits.pack(codes, width)
        assert packed.numel() == bits.packed_bytes(n, width)
        assert torch.equal(bits.unpack(packed, width, n), codes)
        offset = torch.cat([codes.new_zeros(3), codes])[3:]  # a view that does not start on a word
        assert torch.equal(bits.pack(offset, width), packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_select_decodes_one_bit_codes_to_two_values(dtype):
    one, zero = torch.tensor(0.5, dtype=dtype), torch.tensor(-2.0, dtype=dtype)
    for n in (0, 1, 9, 1001):
        codes = torch.randint(0, 2, (n,), dtype=torch.uint8)
        got = bits.select(bits.pack(codes, 1), n, one, zero)
        assert got.dtype == dtype and torch.equal(got, torch.where(codes.bool(), one, zero))


def test_all_finite_is_exact_also_when_the_sum_overflows():
    big = torch.full((4,), 3e38)  # every element finite, the sum is not
    assert all_finite(big) and all_finite(torch.full((8,), 6e4, dtype=torch.float16)) and all_finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for x in (big.clone(), torch.ones(5, dtype=torch.bfloat16)):
            x[2] = bad
            assert not all_finite(x)
    assert not all_finite(torch.tensor([float("inf"), float("-inf")]))


def test_every_registered_compressor_is_a_compressor():
    for name in ALL:
        assert isinstance(build(name), Compressor), name


# -- specs, the codecs command, the convergence benchmark ---------------------------------------------
def test_parse_spec():
    from gradsync.compress import parse_spec

    assert parse_spec("topk") == ("topk", {})
    assert parse_spec("dgc:ratio=0.01,momentum=0,clip_norm=none,seed=3") == (
        "dgc", {"ratio": 0.01, "momentum": 0, "clip_norm": None, "seed": 3})
    assert parse_spec("randomk:unbiased=true") == ("randomk", {"unbiased": True})
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        parse_spec("topk:0.1")


def test_codecs_command_measures_each_compressor(tmp_path, capsys):
    import json

    from gradsync.cli import main

    out = tmp_path / "codecs.json"
    assert main(["codecs", "--size", "0.05", "--shape", "rows=100", "--repeats", "1", "--json", str(out),
                 "--compressors", "onebit,topk:ratio=0.01,powersgd:rank=2"]) == 0
    records = {r["compressor"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"onebit", "topk:ratio=0.01", "powersgd:rank=2"}
    assert 31 < records["onebit"]["ratio"] < 32 and records["topk:ratio=0.01"]["ratio"] == pytest.approx(50)
    assert records["powersgd:rank=2"]["ratio"] == pytest.approx(100 * 500 / (2 * 600))
    assert all(r["encode_gb_s"] > 0 and r["decode_gb_s"] > 0 for r in records.values())
    assert "topk(ratio=0.01)" in capsys.readouterr().out
    assert main(["codecs", "--compressors", "zip"]) == 2
    assert main(["codecs", "--compressors", "topk:ratio=5"]) == 2
    assert "topk ratio must be in (0, 1], got 5" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--size", "-1"], "--size must be > 0"),
    (["--size", "0"], "--size must be > 0"),
    (["--size", "1e9"], "GB available"),  # refused before torch tries to allocate it
    (["--shape", "rows=0"], "--shape must be rows=N with N >= 1"),
    (["--shape", "columns=4"], "--shape must be rows=N with N >= 1"),
    (["--size", "0.0001"], "fewer than one row of 1024"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_codecs_command_refuses_sizes_and_counts_it_cannot_measure(argv, message, capsys):
    from gradsync.cli import main

    assert main(["codecs", *argv]) == 2
    assert message in capsys.readouterr().err


def test_convergence_benchmark_lossless_equals_exact_and_lossy_still_trains():
    from gradsync.compress import convergence

    task = convergence.teacher_task(samples=2000)
    exact = convergence.train(None, task=task, steps=40)
    lossless = convergence.train("topk", ratio=1.0, task=task, steps=40)
    assert lossless["loss"] == exact["loss"] and lossless["curve"] == exact["curve"]  # same floats, same order
    onebit = convergence.train("onebit", error_feedback=True, task=task, steps=40)
    assert onebit["loss"] < exact["curve"][0][1] and onebit["loss"] != exact["loss"]


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_every_compressor_refuses_a_tensor_that_is_not_floating_point(name):
    for codec in (build(name), build(name, error_feedback=True)):
        with pytest.raises(CompressionError, match=r"compresses floating-point gradients; got a torch.int64 tensor "
                                                   r"of shape \[4, 5\]"):
            codec.compress(torch.arange(20).view(4, 5))
