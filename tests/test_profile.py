"""Compute profiles: layer order, measuring, FLOP derivation, the shipped files, lookup and the CLI."""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import pytest
import torch
from torch import nn

from gradsync.emulate import cli
from gradsync.emulate.derive import from_flops, layer_flops, layer_order, measure, resolve
from gradsync.emulate.profile import PROFILE_DIR, SHIPPED, Layer, Profile, check_covers, layer_modules, parse_rate
from gradsync.errors import ConfigError
from gradsync.models import get_model


def _build(name: str, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return get_model(name).build()


@pytest.mark.parametrize("name", ["toy", "resnet50:tiny", "transformer-nmt:tiny"])
def test_layer_order_lists_every_parameter_owner_once(name):
    model = _build(name)
    order = layer_order(model, get_model(name).batch(4, seed=0)[0])
    owners = [n for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    assert len(order) == len(set(order)) == len(owners)
    assert set(order) == set(owners)


def test_layer_order_follows_the_forward_pass():
    order = layer_order(_build("resnet50:tiny"), get_model("resnet50:tiny").batch(2, seed=0)[0])
    assert order[:2] == ["stem.0.0", "stem.0.1"]  # the stem convolution, then its BatchNorm
    assert order[-1] == "fc"
    assert order.index("blocks.0.body.0.0") < order.index("blocks.1.body.0.0") < order.index("blocks.15.body.2.0")
    toy = layer_order(_build("toy"), get_model("toy").batch(4, seed=0)[0])
    assert toy[0] == "embed" and toy[-1] == "never"  # never called in forward: appended at the end


def test_transformer_root_owns_a_parameter_and_comes_first():
    # The output bias sits on the root module itself, named ''.
    order = layer_order(_build("transformer-nmt:tiny"), get_model("transformer-nmt:tiny").batch(2, seed=0)[0])
    assert order[0] == "" and "embedding" in order


def _step_ms(name: str, batch_size: int, steps: int = 5) -> float:
    spec = get_model(name)
    model = _build(name)
    inputs, target = spec.batch(batch_size, seed=0)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        spec.loss(model(*inputs), target).backward()
        times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[2:])


def test_measure_times_every_layer_and_adds_up_to_a_step():
    threads = torch.get_num_threads()
    profile = measure("resnet50:tiny", 8, steps=5, warmup=2, threads=1)
    assert torch.get_num_threads() == threads  # restored
    assert [x.name for x in profile.layers] == layer_order(_build("resnet50:tiny"), get_model("resnet50:tiny").batch(8, 0)[0])
    assert all(x.forward_ms > 0 for x in profile.layers)
    assert all(x.backward_ms >= 0 for x in profile.layers) and profile.backward_ms > 0
    assert "1 thread" in profile.device and "gradsync profile --model resnet50:tiny" in profile.source
    torch.set_num_threads(1)
    try:
        reference = _step_ms("resnet50:tiny", 8)
    finally:
        torch.set_num_threads(threads)
    # Loose on purpose: the machine is shared and noisy; this catches lost or double-counted time.
    assert 0.3 * reference < profile.step_ms < 3 * reference


def test_measure_gives_frozen_and_unused_layers_no_backward_time():
    profile = measure("toy", 4, steps=2, warmup=1, threads=1)
    by_name = {x.name: x for x in profile.layers}
    assert by_name["never"].forward_ms == by_name["never"].backward_ms == 0
    assert by_name["frozen"].backward_ms == 0 and by_name["frozen"].forward_ms > 0


def test_layer_flops_match_the_hand_count():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    order, flops = layer_flops(model, (torch.randn(5, 8),))
    assert order == ["0", "2"]
    assert flops == {"0": 2 * 5 * 8 * 16, "2": 2 * 5 * 16 * 4}  # 2 FLOPs per multiply-add


def test_flops_before_the_first_layer_are_spread_over_the_layers():
    class Prefixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

        def forward(self, x):
            return self.inner(x @ torch.ones(8, 8))  # parameter-free work before any layer

    _, flops = layer_flops(Prefixed(), (torch.randn(5, 8),))
    each = 2 * 5 * 8 * 8
    assert flops == {"inner.0": each * 1.5, "inner.1": each * 1.5}


def test_from_flops_times_the_resnet_stem_by_hand():
    profile = from_flops("resnet50:tiny", 2, 1.0)  # 1 TFLOPS: 1 ms per GFLOP
    stem = profile.layers[0]
    # 7x7 stride-2 convolution, 3 -> 8 channels, 32x32 -> 16x16, batch 2.
    flops = 2 * (2 * 8 * 16 * 16) * (3 * 7 * 7)
    assert stem.name == "stem.0.0"
    assert stem.forward_ms == pytest.approx(flops / 1e9, rel=1e-12)
    assert stem.backward_ms == pytest.approx(2 * stem.forward_ms, rel=1e-12)
    assert profile.layers[1].forward_ms == 0  # BatchNorm (and the ReLU, max-pool after it): no matrix work


def test_from_flops_falls_back_to_the_cpu_for_data_dependent_models():
    profile = from_flops("toy", 8, 1.0)  # toy branches on int(tokens[0, 0]): cannot run on meta
    assert "batch 1, scaled linearly" in profile.source
    assert {x.name for x in profile.layers} == set(layer_modules(_build("toy")))


def _published_step_ms(profile: Profile) -> float:
    if profile.throughput:
        return 1e3 * profile.batch_size / profile.throughput
    rate = re.search(r"--flops (\S+)", profile.source).group(1)
    return from_flops(profile.model, profile.batch_size, parse_rate(rate)).step_ms


@pytest.mark.parametrize("model", sorted(SHIPPED))
def test_shipped_profile_fits_its_model_and_its_published_throughput(model):
    profile = Profile.load(f"{PROFILE_DIR}/{SHIPPED[model]}")
    assert (profile.model, profile.batch_size, profile.dtype) == (model, 32, "float32")
    check_covers(profile, _build(model, "meta"))
    assert profile.step_ms == pytest.approx(_published_step_ms(profile), rel=0.01)
    if profile.throughput:
        assert f"{profile.throughput:g}" in profile.source.split("--throughput")[-1]
    # The split among layers is the FLOP split.
    derived = from_flops(model, 32, 1.0)
    scale = profile.step_ms / derived.step_ms
    for mine, theirs in zip(profile.layers, derived.layers):
        assert mine.name == theirs.name
        assert mine.forward_ms == pytest.approx(theirs.forward_ms * scale, rel=1e-4, abs=1e-9)
        assert mine.backward_ms == pytest.approx(2 * mine.forward_ms, rel=1e-9, abs=1e-12)


def test_resolve_default_and_batch_scaling():
    shipped = Profile.load(f"{PROFILE_DIR}/{SHIPPED['resnet50']}")
    assert resolve("resnet50", 32, None) == shipped == resolve("resnet50", 32, "")
    double = resolve("resnet50", 64, None)
    assert double.batch_size == 64 and "scaled linearly from batch 32 to 64" in double.source
    assert double.step_ms == pytest.approx(2 * shipped.step_ms)


@pytest.mark.parametrize("text, tflops", [("flops:15tflops", 15), ("flops:15", 15), ("flops:900gflops", 0.9)])
def test_resolve_flops_rates(text, tflops):
    assert resolve("resnet50:tiny", 4, text).step_ms == pytest.approx(from_flops("resnet50:tiny", 4, tflops).step_ms)


def test_resolve_files_and_shipped_names(tmp_path):
    path = str(tmp_path / "mine.json")
    Profile("vgg19:tiny", 8, "here", "test", [Layer("features.0", 1.0, 2.0)]).save(path)
    assert resolve("vgg19:tiny", 8, path).layers == [Layer("features.0", 1.0, 2.0)]
    name = SHIPPED["vgg19"]
    assert resolve("vgg19", 32, name) == resolve("vgg19", 32, name.removesuffix(".json")) == resolve("vgg19", 32, None)


@pytest.mark.parametrize("model, text, words", [
    ("resnet50:tiny", None, ["no shipped compute profile", "gradsync profile --model resnet50:tiny", "flops:", "vgg19-b32-v100"]),
    ("resnet50", "nonsense", ["unknown compute profile 'nonsense'", "flops:RATE", "resnet50-b32-v100"]),
    ("resnet50", "missing.json", ["unknown compute profile", "gradsync profile"]),
    ("resnet50", "flops:fast", ["bad FLOP rate 'fast'", "15tflops"]),
    ("resnet50", "flops:0", ["bad FLOP rate"]),
    ("resnet50", "vgg19-b32-v100", ["is for model 'vgg19', not 'resnet50'"]),
])
def test_resolve_explains_bad_input(model, text, words):
    with pytest.raises(ConfigError) as info:
        resolve(model, 32, text)
    for word in words:
        assert word in str(info.value)


def test_check_covers_names_the_problem():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    good = [Layer("0", 1, 2), Layer("2", 1, 2)]
    check_covers(Profile("m", 1, "d", "s", good), model)
    for layers, word in [([good[0]], "no layer '2'"), (good + [Layer("1", 0, 0)], "'1', which is not"),
                         (good + [good[0]], "'0' twice")]:
        with pytest.raises(ConfigError, match=word):
            check_covers(Profile("m", 1, "d", "s", layers), model)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gradsync")
    cli.add_parser(parser.add_subparsers())
    return cli.main(parser.parse_args(["profile", *argv]))


def test_cli_writes_a_valid_profile(tmp_path, capsys):
    out = tmp_path / "toy.json"
    assert _cli(["--model", "toy", "--batch-size", "4", "--device", "cpu", "--steps", "2", "--warmup", "0",
                 "--threads", "1", "--out", str(out)]) == 0
    profile = Profile.load(str(out))
    check_covers(profile, _build("toy"))
    assert "step" in capsys.readouterr().err
    assert _cli(["--model", "resnet50:tiny", "--throughput", "100", "--batch-size", "10"]) == 0
    derived = json.loads(capsys.readouterr().out)
    assert derived["throughput"] == 100
    assert Profile.load(str(out)).model == "toy"
    assert sum(x["forward_ms"] + x["backward_ms"] for x in derived["layers"]) == pytest.approx(100.0)


@pytest.mark.parametrize("argv", [["--model", "nope"], ["--model", "toy", "--flops", "fast"],
                                  ["--model", "toy", "--batch-size", "0"],
                                  ["--model", "toy", "--flops", "1", "--throughput", "5"]])
def test_cli_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _cli(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err
