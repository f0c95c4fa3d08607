"""Emulated compute: same parameters as the real model, gradients on the profile's clock, exact parity.

Timing assertions here are lower bounds only (a sleep can overrun, never underrun), so they hold
on a loaded machine; how closely emulation tracks real compute is a benchmark (docs/bench-emulated.md).
"""
import time

import pytest
import torch

import gradsync
from gradsync.bench.report import bound
from gradsync.bench.workload import Workload, compare, reference, train_step
from gradsync.emulate import slow
from gradsync.emulate.model import AcceleratorClock, EmulatedModel, emulated_spec
from gradsync.emulate.derive import layer_order
from gradsync.emulate.profile import Layer, Profile
from gradsync.emulate.slow import SlowRanks
from gradsync.errors import ConfigError
from gradsync.models import get_model
from multirank import run_ranks


def toy_profile(path, ms: float = 10.0) -> str:
    """A hand-made profile of the toy model: ``ms`` forward and ``2 ms`` backward for every layer."""
    spec = get_model("toy")
    inputs, _ = spec.batch(4, 0)
    names = layer_order(spec.build(), inputs)
    Profile("toy", 4, "test device", "written by the test",
            [Layer(n, ms, 2 * ms) for n in names]).save(str(path))
    return str(path)


def test_emulated_model_has_the_real_parameters():
    spec = emulated_spec("resnet50:tiny", 8, "flops:1tflops")
    real = dict(get_model("resnet50:tiny").build().named_parameters())
    emulated = dict(spec.build().named_parameters())
    assert list(emulated) == list(real)
    for name, p in emulated.items():
        assert p.shape == real[name].shape and p.requires_grad == real[name].requires_grad, name
        assert p.device.type == "cpu" and not p.is_meta


def test_gradients_arrive_in_reverse_layer_order_no_earlier_than_the_profile(tmp_path):
    spec = emulated_spec("toy", 4, toy_profile(tmp_path / "toy.json", ms=10.0), dilation=2.0)
    model = spec.build()
    ready = {}

    def on_ready(name):
        def hook(_param):
            ready.setdefault(name, time.perf_counter())
        return hook

    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(on_ready(name))
    inputs, target = spec.batch(4, 0)
    start = time.perf_counter()
    loss = spec.loss(model(*inputs), target)
    forward_s = time.perf_counter() - start
    loss.backward()
    layers = [layer.layer_name for layer in model.order]
    owners = {layer.layer_name: [n for n, p in model.named_parameters() if any(p is q for q in layer.own_params)]
              for layer in model.order}
    firsts = [min(ready[n] for n in owners[name] if n in ready) for name in reversed(layers) if any(n in ready for n in owners[name])]
    assert firsts == sorted(firsts), "gradients not in reverse forward order"
    # forward books time without sleeping; every layer's backward ends >= 20 ms x 2 after the previous.
    assert forward_s < 0.5 * 10e-3 * 2 * len(layers)
    total_forward = 10e-3 * 2 * len(layers)
    for k, t in enumerate(firsts):
        assert t - start >= total_forward + (k + 1) * 20e-3 * 2 - 1e-3, f"layer {k} came too early"


def test_clock_waits_for_a_host_blocked_in_forward_but_not_in_backward():
    clock = AcceleratorClock()
    _, end1 = clock.forward(5.0)
    time.sleep(0.03)  # the host blocks (say, a strategy waiting for parameters) longer than the layer
    start2, _ = clock.forward(5.0)
    assert start2 >= end1 + 0.02
    _, b1 = clock.backward(5.0)
    time.sleep(0.03)
    start_b2, _ = clock.backward(5.0)
    assert start_b2 == b1  # the accelerator had the next kernel queued already


def test_slow_ranks_parse_and_bad_ones_say_why():
    assert SlowRanks.parse("3:2,1:1.25").factors == {3: 2.0, 1: 1.25}
    assert str(SlowRanks.parse(" 3:2 , 1:1.25")) == "1:1.25,3:2" and not SlowRanks.parse("none")
    assert SlowRanks.union([SlowRanks.parse("3:2"), SlowRanks.parse("1:1.5")]).factor(1) == 1.5
    for bad, message in (("3", "expected RANK:FACTOR"), ("x:2", "expected RANK:FACTOR"), ("-1:2", "rank >= 0"),
                         ("1:0.5", "must be a number >= 1"), ("1:nan", ">= 1"), ("1:2,1:3", "named twice")):
        with pytest.raises(ConfigError, match=message):
            SlowRanks.parse(bad)
    with pytest.raises(ConfigError, match="named twice"):
        SlowRanks.union([SlowRanks.parse("1:2"), SlowRanks.parse("1:3")])
    with pytest.raises(ConfigError, match="rank 2 is a parameter server"):
        SlowRanks.parse("2:2").check(workers=2, servers=1)
    with pytest.raises(ConfigError, match="rank 3 is out of range: the workers are ranks 0-1"):
        SlowRanks.parse("3:2").check(workers=2, servers=1)


def test_a_slow_rank_reads_its_factor_from_the_launchers_variable(tmp_path, monkeypatch):
    spec = emulated_spec("toy", 4, toy_profile(tmp_path / "toy.json", ms=1.0), dilation=3.0)
    monkeypatch.setenv(slow.ENV, "0:1.5,1:2")
    monkeypatch.setenv("RANK", "1")
    model = spec.build()
    assert model.slowdown == 2.0 and model.clock.dilation == 6.0
    monkeypatch.setenv("RANK", "2")  # not named: the profile's speed
    assert spec.build().clock.dilation == 3.0
    monkeypatch.setenv(slow.ENV, "1:fast")
    with pytest.raises(ConfigError, match="GRADSYNC_SLOW=1:fast"):
        spec.build()


def test_a_slowed_models_step_takes_factor_times_the_profile(tmp_path):
    path = toy_profile(tmp_path / "toy.json", ms=4.0)
    spec = emulated_spec("toy", 4, path)
    profile_s = sum(layer.forward_ms + layer.backward_ms for layer in Profile.load(path).layers) / 1e3

    def step_s(slowdown):
        model = EmulatedModel(get_model("toy").build_meta(), Profile.load(path), slowdown=slowdown)
        inputs, target = spec.batch(4, 0)
        start = time.perf_counter()
        spec.loss(model(*inputs), target).backward()
        return time.perf_counter() - start

    balanced, slowed = step_s(1.0), step_s(2.0)
    assert balanced >= profile_s and slowed >= 2 * profile_s  # sleeps overrun, never underrun
    assert slowed > 1.5 * balanced, (balanced, slowed)  # and the balanced step did not overrun by a third


def train(strategy, work, steps):
    topo = gradsync.topology()
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False)
    if topo.is_server:
        return None
    for step in range(steps):
        train_step(model, opt, spec, *work.batch(spec, step, topo.rank, topo.num_workers))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy,workers,servers", [("allreduce", 2, 0), ("ps", 2, 1), ("ddp", 2, 0)])
def test_strategies_on_emulated_compute_match_the_reference(tmp_path, strategy, workers, servers):
    work = Workload(model="toy", batch_size=4, compute=f"emulated:{toy_profile(tmp_path / 'toy.json', ms=1.0)}")
    results = run_ranks(train, workers + servers, strategy, work, 3, servers=servers)
    ref = reference(Workload(**{**work.__dict__, "dilation": 0.0}), workers, 3)
    report = compare(results[0], ref, work.tolerance)
    assert report["correct"], report


def test_emulated_gradients_differ_between_batches():
    spec = emulated_spec("toy", 4, "flops:1tflops", dilation=0.0)
    model = spec.build()
    grads = []
    for seed in (0, 1):
        inputs, target = spec.batch(4, seed)
        spec.loss(model(*inputs), target).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
        model.zero_grad()
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert abs(float(cosine)) < 0.5, "emulated gradients of different batches should not be parallel"


def test_bad_compute_and_profiles_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown compute"):
        Workload(model="toy", compute="quantum").spec()
    with pytest.raises(ConfigError, match="no dilation"):
        Workload(model="toy", dilation=2.0).spec()
    other = tmp_path / "other.json"
    Profile("toy", 4, "d", "s", [Layer("embed", 1.0, 1.0)]).save(str(other))
    with pytest.raises(ConfigError, match="does not fit the model"):
        emulated_spec("toy", 4, str(other)).build()


def test_bound_and_efficiency_arithmetic():
    config = {"rate_bps": 1e9, "dilation": 1.0, "workload": {"compute": "emulated"}}
    # 100 MB ring all-reduce over 4 hosts at 1 Gbit/s: 2*3/4*100e6*8/1e9 = 1.2 s > 0.1 s of compute.
    b = bound(2 * 3 / 4 * 100e6, 0.1, 4 * 32, config)
    assert b["t_comm_min_s"] == pytest.approx(1.2)
    assert b["ideal_samples_per_s"] == pytest.approx(1280.0)
    assert b["bound_samples_per_s"] == pytest.approx(128 / 1.2)
    loopback = bound(1e9, 0.1, 128, {**config, "rate_bps": None})
    assert loopback["t_comm_min_s"] is None and loopback["bound_samples_per_s"] == pytest.approx(1280.0)
