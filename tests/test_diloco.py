"""``local-sgd`` and ``diloco``: parity with one process that runs every worker's inner steps and
the outer steps itself (fragments, delay, mix, Nesterov momentum included), the exactness
statement at H=1 against the data-parallel reference, and bad input."""
import copy

import pytest
import torch
from torch import nn

import gradsync
from gradsync.errors import ConfigError
from gradsync.strategies.diloco import split
from multirank import run_ranks

WORKERS, LR = 2, 0.05

# One job, several strategies in turn: (strategy, options, steps, clip_grad_norm_ in the loop).
CASES = [
    ("local-sgd", {"H": 1}, 4, None),
    ("diloco", {"H": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "compression": "topk:ratio=1"}, 4, None),  # casync-ring
    ("diloco", {"H": 3, "fragments": 3, "delay": 1}, 7, None),
    ("local-sgd", {"H": 2, "fragments": 2}, 5, 0.05),  # the user's clipping acts on each worker's own gradient
]


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)


def batch(step: int, worker: int):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def local_step(model, opt, step, worker, clip=None):
    x, y = batch(step, worker)
    nn.functional.mse_loss(model(x), y).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()


def job():
    topo = gradsync.topology()
    out = []
    for strategy, options, steps, clip in CASES:
        model, opt = build()
        opt = gradsync.distribute(model, opt, strategy, **options)
        for step in range(steps):
            local_step(model, opt, step, topo.rank, clip)
        opt.close()  # lands a fragment still in flight
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def simulate(steps: int, H: int, clip: float | None = None, outer_lr: float = 0.7, outer_momentum: float = 0.9, fragments: int = 1,
             delay: int = 0, mix: float | None = None):
    """DiLoCo in one process: every worker's model and inner optimizer, each fragment's shared
    copy and outer SGD, run in the order the strategy's docstring states."""
    mix = (0.5 if delay else 0.0) if mix is None else mix
    model, _ = build()
    workers = [copy.deepcopy(model) for _ in range(WORKERS)]
    inner = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3) for m in workers]
    runs = split([p.numel() for p in model.parameters()], fragments)
    theta = [[nn.Parameter(list(model.parameters())[i].detach().clone()) for i in run] for run in runs]
    outer = [torch.optim.SGD(t, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0) for t in theta]
    sent: dict[int, tuple[int, list]] = {}

    def land(f):
        _, mean = sent.pop(f)
        for shared, g in zip(theta[f], mean):
            shared.grad = g
        outer[f].step()
        with torch.no_grad():
            for m in workers:
                mine = list(m.parameters())
                for shared, i in zip(theta[f], runs[f]):
                    mine[i].mul_(mix).add_(shared, alpha=1 - mix)

    for t in range(1, steps + 1):
        for w, (m, opt) in enumerate(zip(workers, inner)):
            local_step(m, opt, t - 1, w, clip)
        for f in list(sent):
            if t - sent[f][0] >= delay:
                land(f)
        for f in range(fragments):
            offset = f * H // fragments
            if t >= offset and (t - offset) % H == 0:
                sent[f] = (t, [sum(shared.detach() - list(m.parameters())[i].detach() for m in workers) / WORKERS
                               for shared, i in zip(theta[f], runs[f])])
                if not delay:
                    land(f)
    for f in list(sent):
        land(f)
    mean = [sum(ps) / WORKERS for ps in zip(*(m.parameters() for m in workers))]  # close(): one model
    return [[p.detach() for p in mean] for _ in workers]


def data_parallel(steps: int):
    """One model stepped with the mean of the workers' gradients (the synchronous reference)."""
    model, opt = build()
    for step in range(steps):
        for w in range(WORKERS):
            x, y = batch(step, w)
            (nn.functional.mse_loss(model(x), y) / WORKERS).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def test_diloco_and_local_sgd_match_one_process_that_runs_every_worker():
    results = run_ranks(job, WORKERS, timeout=120)
    for c, (strategy, options, steps, clip) in enumerate(CASES):
        simulated = simulate(steps, clip=clip, **{k: v for k, v in options.items() if k != "compression"},
                             **({"outer_lr": 1.0, "outer_momentum": 0.0} if strategy == "local-sgd" else {}))
        for w in range(WORKERS):
            for i, (got, want) in enumerate(zip(results[w][c], simulated[w])):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{strategy} {options}, worker {w}, parameter {i}: {m}")
        if options["H"] == 1:  # the exactness statement: averaging every step = the mean gradient's step
            for i, (got, want) in enumerate(zip(results[0][c], data_parallel(steps))):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{strategy} {options} vs data parallel, parameter {i}: {m}")


def nan_job():
    model, opt = build()
    opt = gradsync.distribute(model, opt, "diloco", H=1, compression="topk:ratio=1")  # the casync-ring carrier
    x, y = batch(0, gradsync.topology().rank)
    nn.functional.mse_loss(model(x), y).backward()
    if gradsync.topology().rank == 1:
        model[0].weight.grad[0, 0] = float("nan")  # its local step makes the outer gradient NaN
    try:
        opt.step()
    except gradsync.GradsyncError as exc:
        error = f"{type(exc).__name__}: {exc}"
    opt.close()
    return error, bool(torch.isfinite(model[0].weight).all())


def test_a_non_finite_outer_gradient_is_the_same_error_on_every_worker():
    results = run_ranks(nan_job, WORKERS, timeout=60)
    for rank, (error, finite) in enumerate(results):
        assert error.startswith("NonFiniteGradientError") and "'0.weight (outer gradient)' on rank 1" in error, error
        assert finite == (rank == 0)  # the final average is skipped: worker 0 keeps its own, finite model


@pytest.mark.parametrize("options,words", [
    ({"H": 0}, "H (inner steps between synchronizations) must be an integer >= 1"),
    ({"H": 2.5}, "must be an integer >= 1"),
    ({"fragments": 0}, "fragments must be an integer >= 1"),
    ({"H": 4, "delay": 4}, "delay (inner steps a fragment's synchronization overlaps) must be an integer in [0, H)"),
    ({"mix": 1.5}, "mix must be in [0, 1]"),
    ({"outer_lr": 0}, "outer_lr must be > 0"),
    ({"outer_momentum": 1.0}, "outer_momentum must be in [0, 1)"),
    ({"compression": "int3"}, "unknown compressor 'int3'"),
    ({"outer_optimizer": "sgd"}, "outer_optimizer must be a callable"),
])
def test_bad_options_name_the_option(options, words):
    with pytest.raises(ConfigError) as err:
        gradsync.strategies.resolve("diloco", **options)
    assert words in str(err.value)


def attach_job(options):
    model, opt = build()
    try:
        gradsync.distribute(model, opt, "diloco", **options)
    except ConfigError as exc:
        return str(exc)
    return None


def lbfgs(params):
    return torch.optim.LBFGS(params)


def misfit_job():
    return [attach_job({"fragments": 7}), attach_job({"fragments": 2, "outer_optimizer": lbfgs})]


def test_fragments_and_outer_optimizers_that_do_not_fit_the_model():
    errors = run_ranks(misfit_job, 1, timeout=60)[0]
    assert "fragments=7 exceeds the model's 6 trainable parameters" in errors[0], errors
    assert "LBFGS is not known to be one" in errors[1] and "Use fragments=1" in errors[1], errors


def test_fragments_are_runs_of_whole_parameters_of_about_equal_size():
    sizes = [100, 1, 1, 50, 50, 3, 200]
    for fragments in range(1, 8):
        runs = split(sizes, fragments)
        assert [i for run in runs for i in run] == list(range(7)) and all(runs), runs
    assert split(sizes, 2) == [[0, 1, 2, 3, 4, 5], [6]]
    assert split(sizes, 7) == [[i] for i in range(7)]


def test_the_simulator_synchronizes_every_H_steps_and_hides_a_delayed_fragment():
    from gradsync.simulate import Host, Network, simulate
    from gradsync.simulate.workload import synthetic

    # 2 workers, 0.5 s of compute a step, 1000 B of parameters over a 1000 B/s link (a 1 s ring).
    free, net = Host(copy_Bps=1e18, update_Bps=1e18, handoff_s=0.0), Network(rate_bps=8000.0, latency_s=0.0)
    work = synthetic([(0.25, 0.25, [500, 500])])
    every = simulate("local-sgd", work, 2, net, host=free, options={"H": 4}, steps=3, warmup=1)
    assert every["period"] == 4 and every["steps"] == 4  # one whole period after the warm-up
    assert every["step_s"] == pytest.approx((4 * 0.5 + 1.0) / 4)  # the mean, not the median (0.5)
    assert every["bytes_per_step"] == pytest.approx(1000 / 4)
    # Two fragments of 500 B (0.5 s each), each sent one step before it lands: hidden behind compute.
    streamed = simulate("diloco", work, 2, net, host=free, options={"H": 4, "fragments": 2, "delay": 1})
    assert streamed["step_s"] == pytest.approx(0.5)
    waited = simulate("diloco", work, 2, net, host=free, options={"H": 4, "fragments": 2})
    assert waited["step_s"] == pytest.approx((4 * 0.5 + 2 * 0.5) / 4)


def test_advise_ranks_the_rare_strategies_with_their_measured_loss_gap():
    from gradsync.advise import candidates, loss_gap

    labels = [label for label, _, _ in candidates(0, [])]
    assert {"local-sgd H=10", "diloco H=50", "diloco H=50 streaming int4"} <= set(labels)
    gap = loss_gap("diloco", {"H": 50})  # from the run gradsync ships (or the user's own)
    assert "against allreduce at equal tokens" in gap and "%" in gap, gap
    assert "not measured here" in loss_gap("diloco", {"H": 7})


def test_the_shipped_experiment_reports_bytes_time_and_curves(tmp_path, monkeypatch):
    import contextlib
    import io
    import types

    from gradsync.experiment import cli

    monkeypatch.setenv("GRADSYNC_STORE", str(tmp_path / "mine.sqlite"))  # an empty store: the shipped run answers
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(types.SimpleNamespace(action="validate", store=None, names=["diloco-communication"],
                                              all=False, target=None)) == 0
        cli.main(types.SimpleNamespace(action="report", store=None, names=["diloco-communication"], all=False,
                                       target=None, out=str(tmp_path)))
    page = (tmp_path / "diloco-communication.md").read_text()
    assert "**5 of 5 relations hold**" in page and "`bytes_sent`:" in page and "`seconds_to_target`:" in page
    assert "(diloco-communication-curves.png)" in page
    assert (tmp_path / "diloco-communication-curves.png").stat().st_size > 10_000
