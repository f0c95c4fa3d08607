"""``gradsync bench`` end to end, on the toy model so it takes seconds."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gradsync.bench.report import FIELDS
from gradsync.bench.workload import Workload, compare, reference


def bench(*args, timeout=240, cwd=None):
    return subprocess.run([sys.executable, "-m", "gradsync.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


TESTS = os.path.dirname(os.path.abspath(__file__))


def test_every_strategy_with_a_dedicated_server(tmp_path):
    out = tmp_path / "records.json"
    proc = bench("--model", "toy", "--np", "2", "--servers", "1", "--batch-size", "4", "--steps", "3",
                 "--warmup", "1", "--rounds", "2", "--check-steps", "3", "--json", str(out), "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["strategy"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"ddp", "allreduce", "ps", "ps-async"}
    for name, r in records.items():
        assert set(FIELDS) <= set(r), name
        assert r["samples_per_s_min"] <= r["samples_per_s"] <= r["samples_per_s_max"]
        assert r["bytes_per_step"] > 0 and r["compute_s"] > 0 and r["np"] == 2 and r["servers"] == 1
        # Three processes were running; None only if the measured steps lasted less than one clock tick
        # (/proc/stat counts 10 ms ticks; these toy steps take milliseconds).
        assert r["host_cpu_busy"] is None or 0 < r["host_cpu_busy"] <= 1, (name, r["host_cpu_busy"])
        assert 0 < r["optimizer_s"] < r["step_s"], name  # the user's optimizer.step(), within the step
        assert 0 < r["batch_s"], name  # making each batch, before the step's timer starts
        # each step's workers' mean is at most its slowest worker's, and so is the median of it
        assert 0 < r["worker_step_s"] <= r["step_s"] * (1 + 1e-9), name
    for name in ("ddp", "allreduce", "ps"):  # ps-async workers pull at different times: no agreement
        assert records[name]["workers_max_diff"] == 0.0, f"{name}: workers disagree"
        assert records[name]["correct"] is True, records[name]
        assert records[name]["max_abs_diff"] < 1e-8
    assert records["ps-async"]["correct"] is None  # not expected to equal the synchronous reference
    assert (tmp_path / "o" / "bench.png").stat().st_size > 1000
    assert "samples/s" in proc.stdout


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """One bench run read by several checks: a monitored variant, two strategies that are not exact
    or take no monitors, and a compressed one."""
    out = tmp_path_factory.mktemp("mixed") / "records.json"
    proc = bench("--model", "toy", "--np", "2", "--batch-size", "4", "--steps", "3", "--warmup", "1", "--rounds", "1",
                 "--check-steps", "2", "--strategies", "allreduce,sma,p3,casync-ring", "--monitors", "noise-scale",
                 "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, {r["strategy"]: r for r in json.loads(out.read_text())}


def test_monitored_variants_and_the_loss_of_strategies_that_are_not_exact(mixed_run):
    proc, records = mixed_run
    assert list(records) == ["allreduce", "allreduce@noise-scale", "sma", "p3", "casync-ring", "casync-ring@noise-scale"]
    assert "note: sma runs without monitors" in proc.stdout and "note: p3 runs without monitors" in proc.stdout
    assert records["allreduce@noise-scale"]["correct"] is True  # a monitor only reads
    assert records["sma"]["correct"] is None and records["sma"]["eval_loss"] > 0
    assert records["sma"]["ref_eval_loss"] > 0 and records["sma"]["eval_loss"] != records["sma"]["ref_eval_loss"]
    assert "sma: not exact; held-out loss" in proc.stdout


def test_the_compressors_host_work_is_recorded_per_step(mixed_run):
    _, records = mixed_run
    assert "host_work" not in records["allreduce"]  # it counts none
    work = records["casync-ring"]["host_work"]
    toy_bytes = 4 * sum(p.numel() for p in Workload("toy", 4).build()[0].parameters())
    # per compressed bucket at N = 2: this worker's half encoded, the other's decoded and merged, the
    # sum encoded and placed (decoded), the other half of the sum decoded: two encodes of half the
    # bucket and three decodes, every step (the smallest buckets go plain, uncounted)
    assert 0 < work["encode"]["bytes"] <= toy_bytes and work["decode"]["bytes"] == 1.5 * work["encode"]["bytes"], work
    assert work["encode"]["calls"] >= 2 and work["decode"]["calls"] == 1.5 * work["encode"]["calls"], work
    assert 0 < work["encode"]["seconds"] < records["casync-ring"]["step_s"], work


def test_a_users_own_model_is_measured_and_checked(tmp_path):
    out = tmp_path / "records.json"
    proc = bench("--model", "user_models:mlp", "-np", "2", "--strategies", "allreduce,ddp", "--batch-size", "4",
                 "--steps", "2", "--warmup", "1", "--rounds", "1", "--check-steps", "2", "--json", str(out), cwd=TESTS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["strategy"]: r for r in json.loads(out.read_text())}
    assert set(records) >= {"allreduce", "ddp"}
    assert all(r["correct"] is True for name, r in records.items() if name in ("allreduce", "ddp")), records


def test_the_check_catches_a_wrong_model():
    """The comparison flags a model that missed one averaged step: it can fail."""
    work = Workload(model="toy", batch_size=4, dtype="float64")
    good, bad = reference(work, 2, 3), reference(work, 2, 2)
    params = {n: p.detach() for n, p in good.named_parameters()}
    assert compare(params, good, work.tolerance)["correct"]
    assert not compare({n: p.detach() for n, p in bad.named_parameters()}, good, work.tolerance)["correct"]
    one_worker = reference(work, 1, 3)
    assert not compare({n: p.detach() for n, p in one_worker.named_parameters()}, good, work.tolerance)["correct"]


@pytest.mark.parametrize("args,message", [
    (["--np", "0"], "--np must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--servers", "-1"], "--servers must be >= 0"),
    (["--strategies", "allreduce,nope"], "valid strategies: allreduce, allreduce-priority, casync-ps, casync-ring, compressed-allgather, ddp, diloco, hybrid, local-sgd, p3, pair-averaging, ps, ps-async, ps-sliced, sma"),
    (["--model", "nope"], "valid models:"),
    (["--model", "no_such_module_here:build"], "cannot import module 'no_such_module_here'"),
    (["--model", "user_models:nope"], "module 'user_models' has no function 'nope'"),
    (["--model", "user_models:not_a_triple"], "must return (model, make_batch, loss) or a ModelSpec"),
    (["--model", "user_models:not_a_module"], "the first value returned must be an nn.Module"),
    (["--model", "user_models:vector_loss"], "loss must return a scalar float tensor"),
    (["--model", "user_models:broken_batch"], "make_batch(2, generator) failed"),
    (["-np", "0"], "--np must be >= 1"),
    (["--model", "resnet50:huge"], "valid sizes: full, tiny"),
    (["--set", "ps.fuse_kb=-1"], "fuse_kb must be >= 0"),
    (["--set", "ps.nope=1"], "strategy 'ps' has no option 'nope'; its options: mode, fuse_kb"),
    (["--set", "fuse_kb=1"], "expected STRATEGY.KEY=VALUE"),
    (["--strategies", "p3", "--set", "p3.slice_params=0"], "slice_params must be an integer >= 1"),
    (["--tune", "--tune-steps", "0"], "--tune-steps must be >= 1"),
    (["--strategies", "p3", "--set", "p3.overlap=maybe"], "overlap must be True or False, got 'maybe'"),
    (["--strategies", "p3", "--set", "p3.elementwise_optimizer=yes"], "elementwise_optimizer must be True, False"),
    (["--lr", "-1"], "--lr must be > 0, got -1"),
    (["--model", "resnet50", "--np", "9999"], "9999 ranks of resnet50 (97 MB of parameters) need at least"),
    (["--trace", TESTS], "is a folder; name a file in it"),  # refused before the run, not after it
    (["--json", TESTS], "is a folder; name a file in it"),
    (["--out", __file__], "is a file; name a folder"),
    (["--ranks-per-host", "2"], "--ranks-per-host places ranks on emulated hosts: it needs --net"),
    (["--net", "1gbit", "--np", "2,3", "--ranks-per-host", "2"], "--ranks-per-host 2 must divide --np 3"),
    (["--net", "1gbit", "--ranks-per-host", "0"], "--ranks-per-host must be >= 1"),
    (["--net", "1gbit", "--server-hosts", "shared"], "--server-hosts places dedicated servers: it needs --servers"),
    (["--servers", "1", "--server-hosts", "own"], "--server-hosts places ranks on emulated hosts: it needs --net"),
    (["--strategies", "sma@balance"], "sma@balance: BalanceBatches needs a strategy that averages gradients"),
    (["--strategies", "ddp@balance"], "ddp is not one"),  # its reducer waits where gradsync cannot time it
    (["--strategies", "casync-ring@balance", "--compression", "onebit"], "add --balance"),
])
def test_bad_arguments_are_argument_errors(cli, args, message):
    code, _, err = cli("bench", *args, cwd=TESTS)
    assert code == 2 and message in err, err


def test_compression_specs_expand_per_strategy_and_skip_refused_pairs(capsys):
    from gradsync.bench.args import _with_compression

    def fail(message):
        raise AssertionError(message)

    names = _with_compression(["ddp", "allreduce", "casync-ps", "ps"], "onebit;powersgd", fail)
    assert names == ["ddp+onebit", "ddp+powersgd", "ddp", "allreduce", "casync-ps+onebit", "ps+onebit", "ps"]
    notes = capsys.readouterr().out
    assert "allreduce runs plain, without onebit" in notes and "casync-ps skips powersgd" in notes
    assert "ps runs plain, without powersgd" in notes  # a server decodes without the shared seed
    with pytest.raises(AssertionError, match="unknown compressor 'zip'"):
        _with_compression(["casync-ring"], "zip", fail)
    with pytest.raises(AssertionError, match="none of --strategies casync-ps takes"):
        _with_compression(["casync-ps"], "powersgd", fail)  # not casync-ps with its default onebit


def test_balance_gives_the_slow_worker_less_and_stays_exact(tmp_path):
    """``STRATEGY@balance`` on emulated compute with worker 1 three times as slow: BalanceBatches
    moves samples to worker 0, and the run equals the reference replaying the same shares, in fp32
    over the timed run and in float64 over the replay."""
    out = tmp_path / "records.json"
    proc = bench("--model", "toy", "--compute", "emulated:flops:0.00001", "--np", "2", "--slow", "1:3",
                 "--batch-size", "8", "--strategies", "allreduce", "--balance", "--steps", "8", "--warmup", "2",
                 "--rounds", "2", "--check-steps", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["strategy"]: r for r in json.loads(out.read_text())}
    assert list(records) == ["allreduce", "allreduce@balance"]
    balanced = records["allreduce@balance"]
    assert sum(balanced["shares"]) == 16 and balanced["shares"][0] > balanced["shares"][1] >= 1, balanced["shares"]
    assert "shares" not in records["allreduce"]
    assert balanced["correct"] is True and balanced["fp32_max_abs_diff"] < 1e-5, balanced
    assert balanced["samples_per_s"] > records["allreduce"]["samples_per_s"], records
    assert "allreduce@balance: BalanceBatches' shares of the global batch at the end" in proc.stdout


def test_a_worker_share_is_its_slice_of_the_equal_batches_end_to_end():
    work = Workload(model="toy", batch_size=4)
    spec = work.spec()
    equal = [work.batch(spec, 3, w, 2) for w in range(2)]
    parts = [work.batch(spec, 3, w, 2, shares=[1, 7]) for w in range(2)]
    assert [p[0][0].shape[0] for p in parts] == [1, 7]
    assert torch.equal(torch.cat([p[0][0] for p in parts]), torch.cat([e[0][0] for e in equal]))
    assert torch.equal(torch.cat([p[1] for p in parts]), torch.cat([e[1] for e in equal]))


def test_reference_weights_unequal_shares_by_their_samples():
    """Shares weighted by samples: a model whose loss is a mean over samples without batch statistics
    (toy's BatchNorm has them) trains as with equal shares, whatever the split."""
    from gradsync.bench.workload import shares_at

    assert shares_at([[0, [4, 4]], [2, [5, 3]], [4, [4, 4]]], 1) is None
    assert shares_at([[0, [4, 4]], [2, [5, 3]], [4, [4, 4]]], 3) == [5, 3]
    assert shares_at([[0, [4, 4]], [2, [5, 3]], [4, [4, 4]]], 4) is None
    work = Workload(model="user_models:mlp", batch_size=4, dtype="float64")
    sys.path.insert(0, TESTS)
    try:
        equal = reference(work, 2, 3)
        split = reference(work, 2, 3, shares=[[0, [1, 7]], [1, [6, 2]]])
    finally:
        sys.path.remove(TESTS)
    for a, b in zip(equal.parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    toy = Workload(model="toy", batch_size=4, dtype="float64")  # per-worker BatchNorm: the split shows
    assert any(not torch.equal(a, b) for a, b in zip(reference(toy, 2, 2).parameters(),
                                                       reference(toy, 2, 2, shares=[[0, [3, 5]]]).parameters()))


def test_reference_averages_per_worker_batches():
    """With one worker the reference is plain training; with two it differs (different data)."""
    work = Workload(model="toy", batch_size=4)
    torch.manual_seed(0)
    one, two = reference(work, 1, 2), reference(work, 2, 2)
    assert any(not torch.equal(a, b) for a, b in zip(one.parameters(), two.parameters()))


def test_tune_probes_the_space_and_measures_with_the_choice(tmp_path):
    out = tmp_path / "records.json"
    proc = bench("--model", "toy", "--np", "2", "--batch-size", "4", "--strategies", "ddp,p3",
                 "--tune", "--tune-steps", "1", "--steps", "2", "--warmup", "1", "--rounds", "1",
                 "--check-steps", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["strategy"]: r for r in json.loads(out.read_text())}
    assert "tuning" not in records["ddp"]  # nothing to tune
    from gradsync.strategies import STRATEGIES

    for name in ("p3",):  # allreduce-priority's space: tests/test_priority.py
        tuning = records[name]["tuning"]
        probes = 1 + sum(len(values) - 1 for values in STRATEGIES[name].tune_space.values())
        assert len(tuning["probes"]) == probes  # the defaults, then every other value of each knob once
        best = min(tuning["probes"], key=lambda p: p["step_s"])
        assert tuning["chosen"] == best["options"]
        size = tuning["chosen"]["slice_params" if name == "p3" else "partition_params"]
        assert f"<= {size} params" in records[name]["describe"]  # the measured run used the choice
        assert records[name]["correct"] is True
        assert f"tuning {name} ({probes} probes of 1 steps)" in proc.stdout


def _agreement(chunk, perturb):
    import gradsync
    from gradsync.bench.worker import workers_agree

    model, _ = Workload(model="toy", batch_size=4).build()
    if perturb and gradsync.topology().rank == 1:
        with torch.no_grad():
            list(model.parameters())[-1].view(-1)[-1] += 0.5
    return workers_agree(model, chunk=chunk)


@pytest.mark.parametrize("chunk", [7, 1 << 22])  # parameters split across and packed into chunks
def test_workers_agree_finds_one_differing_element(chunk):
    from multirank import run_ranks

    assert run_ranks(_agreement, 2, chunk, True) == [pytest.approx(0.5, abs=1e-6)] * 2  # fp32 rounding of x + 0.5
    assert run_ranks(_agreement, 2, chunk, False) == [0.0, 0.0]


def _freed_after_close(strategy):
    import gc
    import weakref

    import gradsync
    from gradsync.bench.workload import train_step

    work = Workload(model="toy", batch_size=4)
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy)
    inputs, target = work.batch(spec, 0, gradsync.topology().rank, gradsync.topology().num_workers)
    train_step(model, opt, spec, inputs, target)
    opt.close()
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    return ref() is None


@pytest.mark.parametrize("strategy", ["allreduce", "p3", "allreduce-priority"])
def test_a_closed_strategy_lets_its_model_go(strategy):
    """The bench builds one model per strategy and round: a closed one must not stay in memory."""
    from multirank import run_ranks

    assert run_ranks(_freed_after_close, 2, strategy) == [True, True]


@pytest.mark.parametrize("raw,value", [("False", False), ("false", False), ("TRUE", True), ("None", None),
                                       ("4", 4), ("0.5", 0.5), ("fifo", "fifo")])
def test_set_values_are_typed(raw, value):
    """``--set p3.overlap=False`` must be the boolean: the string "False" would be truthy."""
    from gradsync.bench.args import _overrides
    out = _overrides([f"p3.overlap={raw}"], ["p3"], parser_error=pytest.fail)
    assert out == {"p3": {"overlap": value}} and type(out["p3"]["overlap"]) is type(value)


def test_host_cpu_sees_a_busy_core():
    """The CPU share is measured, not assumed: spinning one core for 0.3 s shows as >= 0.3 s of busy
    ticks (machine-wide, so other load can only add to it)."""
    import os
    import time

    from gradsync.bench.worker import host_cpu

    tick = os.sysconf("SC_CLK_TCK")
    before = host_cpu()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    after = host_cpu()
    busy, total = after[0] - before[0], after[1] - before[1]
    assert busy >= 0.25 * tick and total >= busy


def test_a_cpu_bound_run_is_named():
    from gradsync.bench.report import cpu_bound_note, cpu_busy

    assert cpu_busy([[90, 100], [50, 100]], cores=2) == pytest.approx(0.7)
    assert cpu_busy(None) is None and cpu_busy([[0, 0]]) is None
    # 2 cores, 18 ticks: 90 ms of wall time, too short to resolve (CI once saw 0.0 with three processes up)
    assert cpu_busy([[0, 10], [0, 8]], cores=2) is None
    cool = {"strategy": "ps", "net": "10 Gbit/s", "compute": "emulated", "host_cpu_busy": 0.6}
    hot = {**cool, "strategy": "p3", "host_cpu_busy": 0.95}
    assert cpu_bound_note([cool, {**cool, "host_cpu_busy": None}]) is None
    note = cpu_bound_note([cool, hot])
    assert "p3 at 10 Gbit/s (95%)" in note and "ps at" not in note and "--dilation" in note
    assert cpu_bound_note([{**hot, "compute": "real", "net": "loopback"}]) is None  # the model runs on the CPU


def test_ranks_outnumbering_the_cores_at_too_little_dilation_are_named():
    from gradsync.bench.report import shared_cores_note

    run = {"strategy": "allreduce", "np": 4, "servers": 0, "net": "1 Gbit/s", "net_bps": 1e9,
           "compute": "emulated", "dilation": 1.0}
    note = shared_cores_note([run, {**run, "net": "10 Gbit/s", "net_bps": 1e10, "dilation": 10.0}], cores=2)
    assert "4 ranks at 1 Gbit/s (dilation 1)" in note and "10 Gbit/s" not in note and "--dilation 2 " in note
    assert shared_cores_note([{**run, "dilation": 2.0}], cores=2) is None  # a core's time each
    assert shared_cores_note([{**run, "servers": 1, "dilation": 2.0}], cores=2) is not None  # 5 ranks: 2.5
    assert shared_cores_note([{**run, "net": "loopback", "net_bps": None}], cores=2) is None  # no dilation there
    assert shared_cores_note([{**run, "compute": "real"}], cores=2) is None  # the model runs on the CPU
    assert shared_cores_note([run], cores=4) is None


def test_rounds_rotate_the_order_of_the_strategies():
    """Each strategy takes every place in the order once over as many rounds as strategies."""
    from gradsync.bench.worker import rotated

    names = ["ddp", "allreduce", "ps"]
    orders = [rotated(names, r) for r in range(3)]
    assert orders[0] == names and orders[1] == ["allreduce", "ps", "ddp"]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert all(len({o[place] for o in orders}) == 3 for place in range(3))
    assert rotated(names, 3) == names and rotated([], 2) == []


def test_host_links_count_per_step_from_the_device_counters():
    from gradsync.bench.report import link_bytes_per_step
    from gradsync.bench.worker import HostLinks, link_sum
    from gradsync.cluster.counters import dev_bytes

    text = ("Inter-|   Receive |  Transmit\n face |bytes packets errs drop fifo frame compressed multicast|bytes ...\n"
            "    lo:  900 9 0 0 0 0 0 0  900 9 0 0 0 0 0 0\n"
            "  eth0: 5000 40 0 0 0 0 0 0 7000 50 0 0 0 0 0 0\n")
    assert dev_bytes(text) == (7000, 5000)  # (tx, rx)
    readings = iter([[(0, 0), (10, 5)], [(310, 95), (20, 5)], [(400, 100), (20, 5)], [(490, 100), (22, 7)]])
    links = HostLinks([1, 2])
    links.read = lambda: next(readings)
    links.start()
    links.step()
    links.step()
    links.end()  # after the flush: the last step's tail is in
    assert links.total == [[310, 95], [10, 0]] and links.steps == 2
    first = {"total": links.total, "steps": links.steps}
    links.start()  # a second round counts from its own start
    links.step()
    links.end()
    assert links.total == [[90, 0], [2, 2]] and links.steps == 1
    assert link_sum(first, {"total": links.total, "steps": 1}) == {"total": [[400, 95], [12, 2]], "steps": 3}
    # the straggler monitor's link probe runs inside a step: what the links carry meanwhile is left out
    readings = iter([[(0, 0), (0, 0)], [(50, 40), (5, 5)], [(1050, 1040), (1005, 1005)], [(1100, 1100), (1010, 1010)]])
    links.read = lambda: next(readings)
    links.start()
    links.step()
    with links.probe():
        pass
    links.end()
    assert links.total == [[100, 100], [10, 10]] and links.probe_bytes == [[1000, 1000], [1000, 1000]]
    probed = {"total": links.total, "steps": 1, "probe": links.probe_bytes}
    assert link_sum(probed, probed)["probe"] == [[2000, 2000], [2000, 2000]]
    got = link_bytes_per_step({"total": [[300, 90], [10, 0]], "steps": 2})
    assert got == {"host_tx_bytes_per_step": 150.0, "host_rx_bytes_per_step": 45.0,
                   "hosts_tx_bytes_per_step": [150.0, 5.0], "hosts_rx_bytes_per_step": [45.0, 0.0]}


def test_min_bytes_per_host_counts_hosts_and_is_unchanged_at_one_rank_a_host():
    from types import SimpleNamespace

    from gradsync.launch.emulated import placement
    from gradsync.strategies import resolve
    from gradsync.strategies.base import ring_bytes
    from gradsync.topology import Topology

    def at(name, np, servers=0, per_host=1, where="own", model=1000):
        strategy = resolve(name)
        hosts = tuple(placement(np, servers, per_host, where))
        strategy.ctx = SimpleNamespace(topology=Topology(np + servers, 0, servers, host_of=hosts))
        return strategy.min_bytes_per_host(model)

    assert placement(4, 2, 2) == [0, 0, 1, 1, 2, 2] and placement(4, 3, 2, "shared") == [0, 0, 1, 1, 0, 1, 0]
    for n in (1, 2, 3, 4):  # one rank a host: today's formulas, to the bit
        assert at("allreduce", n) == at("ddp", n) == ring_bytes(1000, n) == at("ps", n) == at("p3", n)
        assert at("ps", n, 1) == max(1000, n * 1000 / 1) and at("p3", n, 3) == max(1000, n * 1000 / 3)
        assert at("pair-averaging", n) == 1000.0
    # two workers a host: a ring over the hosts; servers on their own host serve each host once;
    # servers on the workers' hosts leave each host the other hosts' share, as a ring
    assert at("allreduce", 4, per_host=2) == ring_bytes(1000, 2) and at("allreduce", 2, per_host=2) == 0
    assert at("ps", 4, 1, per_host=2) == 2000 and at("ps", 4, 2, per_host=2, where="shared") == ring_bytes(1000, 2)
    assert at("pair-averaging", 4, per_host=2) == 1000  # the hosts pair up: one model into each host a step
