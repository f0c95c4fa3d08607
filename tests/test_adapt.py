"""Monitors, policies and strategy switching (gradsync.adapt), against values known analytically or
computed here from every worker's gradients."""
from __future__ import annotations

import math

import pytest
import torch

from multirank import run_ranks

DIM, SIGMA, BATCH = 8, 1.0, 16
W_STAR = torch.linspace(-1, 1, DIM)
OFFSET = torch.full((DIM,), 0.5)  # w - w*


def analytic_noise_scale() -> float:
    """B_simple for least squares 0.5 (x.w + b - y)^2, x ~ N(0, I_D), y = x.w* + N(0, sigma^2), at
    w = w* + d, b = 0.

    Per-sample gradient: g_w = x r and g_b = r, with r = x.d - eps. So G = E[g] = (d, 0) and, by
    Isserlis' theorem, E[g_w g_w^T] = |d|^2 I + 2 d d^T + sigma^2 I, E[g_b^2] = |d|^2 + sigma^2:
    tr(Sigma) = (D + 2)|d|^2 + (D + 1) sigma^2 and B_simple = tr(Sigma) / |G|^2. Two parameters, so
    each of the two workers squares one of them for the synchronized norm."""
    d2 = float(OFFSET.pow(2).sum())
    return ((DIM + 2) * d2 + (DIM + 1) * SIGMA**2) / d2


def monitors_job(steps: int):
    import gradsync
    from gradsync.adapt import GradientVariance, NoiseScale, Throughput, links, monitor
    from gradsync.errors import ConfigError

    topo = gradsync.topology()
    model = torch.nn.Linear(DIM, 1)
    with torch.no_grad():
        model.weight.copy_(W_STAR + OFFSET)
        model.bias.zero_()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.0))  # w stays at w* + d
    ns = NoiseScale(BATCH, alpha=0.99)
    mons = monitor(opt, ns, Throughput(BATCH))
    gen = torch.Generator().manual_seed(100 + topo.rank)
    for _ in range(steps):
        x = torch.randn(BATCH, DIM, generator=gen)
        y = x @ W_STAR + SIGMA * torch.randn(BATCH, generator=gen)
        (0.5 * (model(x).squeeze(1) - y).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    noise = mons.values()
    opt.close()

    # Variance: a model with many coordinates, one step; each rank returns its local gradient too.
    torch.manual_seed(0)
    big = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 16))
    opt = gradsync.distribute(big, torch.optim.SGD(big.parameters(), lr=0.1))
    exact, whole, sampled = GradientVariance(), GradientVariance(sample=1.0), GradientVariance(sample=2000, seed=3)
    monitor(opt, exact, whole, sampled)
    torch.manual_seed(10 + topo.rank)
    loss = big(torch.randn(32, 64)).pow(2).mean()
    local = [g.clone() for g in torch.autograd.grad(loss, list(big.parameters()), retain_graph=True)]
    loss.backward()
    opt.step()
    variance = {**exact.values(), **{k + "_whole": v for k, v in whole.values().items()}, **sampled.values()}
    opt.close()

    rates = links(1 << 16, repeats=2)

    board = str(__import__("tempfile").mkdtemp()) if topo.rank == 0 else None
    small = torch.nn.Linear(2, 2)
    opt2 = gradsync.distribute(small, torch.optim.SGD(small.parameters(), lr=0.1))
    try:
        mons2 = monitor(opt2, Throughput(1), tensorboard=board)
        mons2.after_step(), mons2.after_step()
        mons2.close()
        tensorboard = "files: " + ",".join(__import__("os").listdir(board)) if board else "not rank 0"
    except ConfigError as exc:
        tensorboard = str(exc)
    opt2.close()

    refused = ""
    model = torch.nn.Linear(4, 4)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="p3")
    try:
        monitor(opt, NoiseScale(4))
    except ConfigError as exc:
        refused = str(exc)
    opt.close()
    return noise, variance, local, refused, rates, tensorboard


@pytest.fixture(scope="module")
def monitored():
    return run_ranks(monitors_job, 2, 600, timeout=120)


def test_noise_scale_matches_the_analytic_value_and_is_the_same_on_every_rank(monitored):
    (first, *_), (second, *_) = monitored
    expected = analytic_noise_scale()  # 14.5
    # 600 steps of two workers at batch 16: the EMA (alpha 0.99) averages ~100 steps of estimates
    # whose relative spread is ~1 each, so ~10 % is the expected error; 25 % is a failure.
    assert first["noise_scale"] == pytest.approx(expected, rel=0.25)
    assert first["grad_sq_norm"] == pytest.approx(float(OFFSET.pow(2).sum()), rel=0.5)
    assert first["noise_scale"] == second["noise_scale"]
    assert first["samples_per_s"] > 0 and first["step_s"] > 0


def test_gradient_variance_exact_sampled_and_whole_sample(monitored):
    (_, v0, local0, *_), (_, v1, local1, *_) = monitored
    assert v0 == v1  # one global value
    g0, g1 = (torch.cat([g.reshape(-1) for g in grads]).double() for grads in (local0, local1))
    mean = (g0 + g1) / 2
    var = ((g0 * g0 + g1 * g1) / 2 - mean * mean).clamp_min(0)
    assert v0["grad_variance"] == pytest.approx(float(var.sum()), rel=1e-4)
    assert v0["grad_variance_norm"] == pytest.approx(float(var.norm()), rel=1e-4)
    assert v0["grad_variance_sampled_whole"] == pytest.approx(v0["grad_variance"], rel=1e-5)
    # 2000 of 10 384 coordinates: a scaled sum of 2000 draws; heavy-tailed, so 30 %.
    assert v0["grad_variance_sampled"] == pytest.approx(v0["grad_variance"], rel=0.3)


def test_monitor_refuses_a_strategy_without_synchronized_gradients(monitored):
    refused = monitored[0][3]
    assert "NoiseScale" in refused and "'p3'" in refused


def test_link_probe_and_tensorboard(monitored):
    for rank, result in enumerate(monitored):
        rates, board = result[4], result[5]
        assert list(rates) == [1 - rank] and rates[1 - rank] > 0.01  # Gbit/s over loopback
    board = monitored[0][5]
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        assert "pip install tensorboard" in board
    else:
        assert board.startswith("files: events.out.tfevents")


def test_ema_takes_the_first_sample_as_is():
    from gradsync.adapt import EMA

    ema = EMA(0.5)
    assert ema.update(4.0) == 4.0 and ema.update(0.0) == 2.0


def test_global_batches_cover_each_epoch_once_whatever_the_sizes():
    from gradsync.adapt import GlobalBatches

    data = GlobalBatches(103, seed=1)
    seen, schedule = [], [(4, 1), (4, 3), (8, 2), (5, 4), (16, 2), (7, 3)]
    k = 0
    while not data.epoch_done:
        per_worker, workers = schedule[k % len(schedule)]
        parts = [data.share(per_worker * workers, r, workers) for r in range(workers)]
        assert max(p.numel() for p in parts) - min(p.numel() for p in parts) <= 1
        seen += torch.cat(parts).tolist()
        data.advance(per_worker * workers)
        k += 1
    assert sorted(seen) == list(range(103))
    data.next_epoch(1)
    assert data.global_batch(103).tolist() != seen  # a new order each epoch


def switching_job(work, plan):
    import gradsync
    from gradsync.adapt import Controller, Policy
    from gradsync.bench.workload import train_step

    topo = gradsync.topology()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, plan[0][0], **plan[0][1])
    spec, step, log = work.spec(), 0, []

    policies = []
    for name in ("a", "b"):  # each records its hook calls, to check the order
        p = Policy()
        for hook in ("before_train", "after_train", "before_epoch", "after_epoch", "before_step", "after_step"):
            setattr(p, hook, (lambda h, n: (lambda ctl: log.append((h, n, ctl.step))))(hook, name))
        policies.append(p)
    ctl = Controller(opt, policies, batch_size=work.batch_size)
    with ctl.train():
        for _ in ctl.epochs(1):
            for k, (strategy, options, steps) in enumerate(plan):
                if k:
                    ctl.switch_strategy(strategy, **options)
                for _ in ctl.steps(steps):
                    inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
                    train_step(model, opt, spec, inputs, target)
                    step += 1
    opt.flush()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, log, opt.strategy.name


def test_switching_strategies_keeps_parameters_and_optimizer_state_exact():
    from gradsync.bench.workload import Workload, compare, reference

    work = Workload(model="toy", batch_size=4, optimizer="adam", lr=0.01)
    plan = [("allreduce", {}, 2), ("p3", {}, 2), ("ps", {}, 2), ("casync-ring", {"compression": "none"}, 1),
            ("allreduce", {}, 2)]
    results = run_ranks(switching_job, 2, work, plan, timeout=120)
    ref = reference(work, 2, sum(s for *_, s in plan))
    for params, log, last in results:
        assert last == "allreduce"
        assert compare(params, ref, work.tolerance)["correct"], compare(params, ref, work.tolerance)
    log = results[0][1]
    assert log[:4] == [("before_train", "a", 0), ("before_train", "b", 0), ("before_epoch", "a", 0),
                       ("before_epoch", "b", 0)]
    assert log[4:8] == [("before_step", "a", 0), ("before_step", "b", 0), ("after_step", "b", 1),
                        ("after_step", "a", 1)]
    assert log[-4:] == [("after_epoch", "b", 9), ("after_epoch", "a", 9), ("after_train", "b", 9),
                        ("after_train", "a", 9)]


def averaging_job(strategy, options, steps, extra_per_rank=0, lr=0.05, close=False):
    """Train a least-squares toy with plain SGD; record every step's parameters before it and the
    local gradient (computed here, before the strategy touches anything). ``close``: close the
    optimizer at the end (the strategy lets go of the job)."""
    import gradsync

    topo = gradsync.topology()
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=lr), strategy, **options)
    gen = torch.Generator().manual_seed(topo.rank)
    before, grads, losses = [], [], []
    for step in range(steps + extra_per_rank * topo.rank):
        x = torch.randn(BATCH, DIM, generator=gen)
        y = x @ W_STAR + 0.1 * torch.randn(BATCH, generator=gen)
        flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts]).clone()
        before.append(flat(model.parameters()))
        loss = 0.5 * (model(x).squeeze(1) - y).pow(2).mean()
        grads.append(flat(torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)))
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    if close and hasattr(opt, "close"):  # a server left with exit_servers=False holds the bare optimizer
        opt.close()
    return before, grads, losses


def test_sma_blends_towards_the_average_of_the_parameters_then_applies_the_local_gradient():
    alpha, lr, steps = 0.3, 0.05, 4
    results = run_ranks(averaging_job, 3, "sma", {"alpha": alpha}, steps, timeout=60)
    for t in range(steps - 1):
        mean = sum(r[0][t] for r in results) / 3
        for before, grads, _ in results:
            expected = (1 - alpha) * before[t] + alpha * mean - lr * grads[t]
            assert torch.allclose(before[t + 1], expected, atol=1e-6), (t, before[t + 1] - expected)


@pytest.mark.parametrize("options", [{}, {"peers": "random"}], ids=["rotate", "random"])
def test_pair_averaging_trains_without_a_barrier_and_ends_cleanly(options):
    # Worker r runs 40 + 5r steps: without a barrier nobody waits for the others, and each keeps
    # answering pulls until every worker has left.
    results = run_ranks(averaging_job, 3, "pair-averaging", options, 40, 5, 0.2, timeout=60)
    for before, grads, losses in results:
        assert sum(losses[-5:]) < 0.1 * sum(losses[:5])  # it learns
        # Each step averages with one peer's model (all equal at step 0, then no longer): the
        # parameters do not go where the local gradient alone would take them.
        assert not any(torch.allclose(before[t + 1], before[t] - 0.2 * grads[t]) for t in range(1, 10))
    finals = [r[0][-1] for r in results]
    spread = max(float((a - b).abs().max()) for a in finals for b in finals)
    assert spread < 0.5 * float((finals[0] - results[0][0][0]).abs().max())  # the models agree more than they moved


def averaging_twice(strategy, options, steps):
    """:func:`averaging_job` twice in one job, the first optimizer closed in between (as the bench's
    rounds attach a strategy again)."""
    return averaging_job(strategy, options, steps, close=True), averaging_job(strategy, options, steps)


def test_pair_averaging_beside_a_dedicated_server_rank_and_attached_again():
    # The server, which pair-averaging leaves idle, leaves at distribute: the answers' channels are
    # the workers' alone (a group the server also had to join would wait for it forever), and a
    # second attach in the same job reuses them.
    results = run_ranks(averaging_twice, 3, "pair-averaging", {"exit_servers": False}, 40, servers=1, timeout=90)
    for runs in results[:2]:  # the workers (the server trained alone, unsynchronized)
        for before, grads, losses in runs:
            assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_pair_averaging_in_turn_asks_each_peer_once_a_turn():
    from gradsync.errors import ConfigError
    from gradsync.strategies.pair_averaging import PairAveraging, in_turn

    for workers, world in (([0, 1, 2, 3], 4), ([0, 2, 4], 6), ([0, 1], 2)):  # ([0, 2, 4]: hosts' first workers)
        orders = {me: in_turn(me, [p for p in workers if p != me], world) for me in workers}
        for turn in range(len(workers) - 1):
            asked = sorted(orders[me][turn] for me in workers)
            assert asked == workers, (workers, turn, orders)
    assert in_turn(1, [0, 2, 3], 4) == [2, 3, 0]
    with pytest.raises(ConfigError, match="peers must be 'random' or 'rotate', got 'ring'"):
        PairAveraging(peers="ring")


def test_pair_averaging_refreshes_the_snapshot_no_answer_is_reading():
    import threading

    from gradsync.strategies.pair_averaging import PairAveraging

    pa, w = PairAveraging(), torch.nn.Parameter(torch.zeros(3))
    pa.groups, pa.snapshots = [[w]], [[torch.zeros(3)], [torch.zeros(3)]]
    pa.published, pa.reading, pa.answered = 0, [0, 0], threading.Lock()
    with torch.no_grad():
        w += 1
    pa._publish()  # into the spare copy, then published
    assert pa.published == 1 and pa.snapshots[1][0].tolist() == [1, 1, 1] and pa.snapshots[0][0].tolist() == [0] * 3
    pa.reading[0] = 1  # an answer begun before that refresh still reads the older copy
    with torch.no_grad():
        w += 1
    pa._publish()  # neither waits nor overwrites it: the answers keep the published copy
    assert pa.published == 1 and pa.snapshots[0][0].tolist() == [0] * 3 and pa.snapshots[1][0].tolist() == [1] * 3
    pa.reading[0] = 0
    pa._publish()
    assert pa.published == 0 and pa.snapshots[0][0].tolist() == [2] * 3


def switch_policy_job(work, steps):
    import time as _time

    import gradsync
    from gradsync.adapt import Controller, StrategySwitch
    from gradsync.bench.workload import train_step
    from gradsync.strategies import AllReduce

    class Slow(AllReduce):  # the same all-reduce, 30 ms slower per step
        name = "slow-allreduce"

        def step(self, apply):
            _time.sleep(0.03)
            return super().step(apply)

    gradsync.register("slow-allreduce", Slow)
    topo = gradsync.topology()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, "slow-allreduce")
    policy = StrategySwitch(["slow-allreduce", "allreduce", ("slow-allreduce", {"bucket_mb": 1})], probe_steps=3)
    ctl = Controller(opt, [policy], batch_size=work.batch_size)
    spec = work.spec()
    with ctl.train():
        for step in ctl.steps(steps):
            inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
            train_step(model, opt, spec, inputs, target)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, policy.history, opt.strategy.name


@pytest.mark.alone  # compares the candidates' measured step times
def test_strategy_switch_probes_every_candidate_keeps_the_fastest_and_stays_exact():
    from gradsync.bench.workload import Workload, compare, reference

    work = Workload(model="toy", batch_size=4, optimizer="sgd", lr=0.01)
    results = run_ranks(switch_policy_job, 2, work, 14, timeout=120)
    ref = reference(work, 2, 14)
    for params, history, last in results:
        assert compare(params, ref, work.tolerance)["correct"]
        assert last == "allreduce"
    history = results[0][1]
    assert [event for _, event, _ in history] == ["probe", "measured", "measured", "measured", "chose"]
    measured = {label: t for _, event, (label, t) in (h for h in history if h[1] == "measured")}
    assert measured["allreduce"] + 0.02 < min(measured["slow-allreduce"], measured["slow-allreduce(bucket_mb=1)"])
    assert history == results[1][1]  # every worker decided alike, on the same (all-reduced) times
    assert history[-1][2] == "allreduce"


class FakeController:
    """What AdaptiveBatchSize touches: the step, the batch and the learning rate."""

    def __init__(self, batch, workers, lr):
        self.step, self.batch_size, self.num_workers, self.lr = 0, batch, workers, lr

    @property
    def global_batch_size(self):
        return self.batch_size * self.num_workers

    def set_batch_size(self, b):
        self.batch_size = b

    def scale_lr(self, f):
        self.lr *= f


@pytest.mark.parametrize("scaling, lr_after", [("linear", 0.4), ("sqrt", 0.2), (None, 0.1)])
def test_adaptive_batch_size_doubles_while_the_noise_scale_exceeds_twice_the_global_batch(scaling, lr_after):
    from gradsync.adapt import AdaptiveBatchSize

    class Noise:
        value = math.nan

    noise = Noise()
    policy = AdaptiveBatchSize(noise, max_batch_size=64, every=5, lr_scaling=scaling)
    ctl = FakeController(16, 2, 0.1)
    readings = {5: math.nan, 10: 60.0, 15: 70.0, 20: 300.0, 25: 1e6, 30: 1e6}
    for step in range(1, 31):
        ctl.step = step
        noise.value = readings.get(step, 1e9)  # off-schedule steps are never looked at
        policy.after_step(ctl)
    # 60 < 2*32: no; 70 > 64: 16 -> 32; 300 > 128: 32 -> 64; then capped at 64.
    assert [(s, b) for s, _, b in policy.history] == [(15, 32), (20, 64)]
    assert ctl.batch_size == 64 and ctl.lr == pytest.approx(lr_after)


def test_bad_adaptation_inputs_are_clear_errors():
    from gradsync.adapt import AdaptiveBatchSize, GradientVariance, NoiseScale, ScheduledResize, StrategySwitch, Throughput
    from gradsync.errors import ConfigError
    from gradsync.launch.elastic import launch_elastic

    cases = [(lambda: NoiseScale(0), "batch_size must be >= 1"),
             (lambda: Throughput(-1), "batch_size must be >= 1"),
             (lambda: NoiseScale(8, alpha=1.0), "alpha must be in [0, 1)"),
             (lambda: GradientVariance(sample=0), "a count >= 1 or a fraction in (0, 1]"),
             (lambda: GradientVariance(sample=1.5), "a count >= 1 or a fraction in (0, 1]"),
             (lambda: StrategySwitch(["allreduce"]), "at least two candidate strategies"),
             (lambda: StrategySwitch(["allreduce", "ps"], probe_steps=1), "probe_steps must be >= 2"),
             (lambda: AdaptiveBatchSize(NoiseScale(8), 64, lr_scaling="cubic"), "lr_scaling must be"),
             (lambda: ScheduledResize({10: 0}), "step 10 -> 0 workers is not a valid entry")]
    for make, message in cases:
        with pytest.raises(ConfigError, match=__import__("re").escape(message)):
            make()
    result = launch_elastic(["true"], np=3, min_np=1, max_np=2)  # before anything starts
    assert result.returncode == 2 and "--min-np (1) <= -np (3) <= --max-np (2)" in result.message


def failed_switch_job(work, steps):
    import gradsync
    from gradsync.bench.workload import train_step
    from gradsync.errors import ConfigError
    from gradsync.strategies import AllReduce

    class Broken(AllReduce):
        name = "broken"

        def attach(self, ctx):
            raise ConfigError("broken strategy: attach refused")

    gradsync.register("broken", Broken)
    topo = gradsync.topology()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, "allreduce")
    spec, message = work.spec(), ""
    for step in range(steps):
        if step == 2:
            try:
                opt.switch_strategy("broken")
            except ConfigError as exc:
                message = str(exc)
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, message, opt.strategy.name


def test_a_switch_that_fails_keeps_training_on_the_old_strategy():
    from gradsync.bench.workload import Workload, compare, reference

    work = Workload(model="toy", batch_size=4)
    ref = reference(work, 2, 5)
    for params, message, name in run_ranks(failed_switch_job, 2, work, 5, timeout=60):
        assert "attach refused" in message and name == "allreduce"
        assert compare(params, ref, work.tolerance)["correct"]  # no step ran unsynchronized or twice-hooked


def pair_averaging_peer_dies(steps):
    import os

    import gradsync

    topo = gradsync.topology()
    model = torch.nn.Linear(4, 1)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "pair-averaging")
    for step in range(steps):
        if topo.rank == 1 and step == 3:
            os._exit(17)  # no goodbye: its peer must not wait forever
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_pair_averaging_names_a_peer_that_died_instead_of_hanging():
    from multirank import run_ranks_expect_failure

    failures = run_ranks_expect_failure(pair_averaging_peer_dies, 2, 10, timeout=60, env={"GRADSYNC_TIMEOUT": "5"})
    assert "exited with code 17" in failures[1]
    assert "PeerFailureError" in failures[0] and "worker 1 (rank 1) stopped responding" in failures[0], failures[0][-800:]


def test_pair_averaging_on_hosts_of_several_workers_pairs_the_hosts():
    # Two hosts of two workers (named as a launcher would): each step a host averages inside, its
    # first worker pairs with the other host's; it learns and ends cleanly, as the flat form does.
    env = [{"GRADSYNC_HOST": f"h{r // 2}", "LOCAL_WORLD_SIZE": "2"} for r in range(4)]
    results = run_ranks(averaging_job, 4, "pair-averaging", {}, 30, 0, 0.2, timeout=60, env=env)
    for before, grads, losses in results:
        assert sum(losses[-5:]) < 0.1 * sum(losses[:5])
    # A step ends with one model in the host (its average, paired with another host's) before each
    # worker applies its own gradient: undoing that gradient gives the same model on both workers.
    shared = lambda r, t: results[r][0][t] + 0.2 * results[r][1][t - 1]
    for t in range(1, 30):
        for a, b in ((0, 1), (2, 3)):
            torch.testing.assert_close(shared(a, t), shared(b, t), rtol=0, atol=1e-6)
    assert any(not torch.allclose(shared(0, t), shared(2, t), atol=1e-4) for t in range(1, 30))  # hosts differ
