"""The standard PyTorch training loop under every strategy, against a single-process reference.

A user's loop does more than ``backward(); step()``: it clips gradients, accumulates them over
micro-batches (``no_sync``), follows an LR schedule, runs the forward under ``torch.autocast`` and
scales the loss with ``torch.amp.GradScaler``. Each feature runs here on 2 workers and is compared
with one process that averages the workers' gradients and then does exactly what the user's loop
does. Strategies that cannot honour a feature must refuse it with a clear error on every rank
(never train a silently different model).

Tolerances: fp32 phases use the workload's SGD tolerance (rounding of a sum in another order, see
``gradsync.bench.workload.OPTIMIZERS``). Autocast phases run the matmuls in bf16; both sides
compute each worker's batch with the same bf16 operations, but a parameter a few ulps apart can
round to a neighbouring bf16 value in the next forward (a 2^-8 relative change of one weight),
so they allow 1e-4 + 1e-3 |p|: a missed or unaveraged gradient moves parameters by ~lr = 0.05.
"""
import math
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import gradsync
from gradsync.compress import CompressionError
from gradsync.errors import ConfigError, GradientEditedError
from multirank import DEVICE, FORK_PROBES, run_ranks, run_ranks_expect_failure

WORKERS, STEPS, LR, CLIP = 2, 3, 0.05, 0.05
FP32_TOL, BF16_TOL = (1e-5, 1e-4), (1e-4, 1e-3)

# name -> (options, dedicated servers, exact). Options make every code path short: slices and
# partitions of 40 elements cut through the tensors; lossless codecs keep compression exact.
STRATEGIES = {
    "allreduce": ({}, 0, True),
    "ddp": ({}, 0, True),
    "casync-ring": ({"compression": "none"}, 0, True),
    "casync-ps": ({"compression": "none", "bucket_mb": 0.001}, 0, True),
    "compressed-allgather": ({"compression": "topk:ratio=1"}, 0, True),
    "ps": ({}, 0, True),
    "ps-async": ({}, 1, False),
    "p3": ({"slice_params": 40}, 0, True),
    "ps-sliced": ({"slice_params": 40}, 0, True),
    "allreduce-priority": ({"partition_params": 40}, 0, True),
    "hybrid": ({}, 0, True),
    "sma": ({}, 0, False),
    "pair-averaging": ({}, 0, False),
}


# Autocast as a user's loop runs it: bf16 on the CPU, fp16 (with the GradScaler) on CUDA.
KIND = torch.device(DEVICE).type
AMP_DTYPE = torch.float16 if KIND == "cuda" else torch.bfloat16


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(DEVICE)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def batch(step: int, worker: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * worker + micro)
    return torch.randn(8, 6, generator=g).to(DEVICE), torch.randn(8, 3, generator=g).to(DEVICE)


def loss_of(model, step, worker, micro=0, amp=False, poison=False):
    x, y = batch(step, worker, micro)
    with torch.autocast(KIND, dtype=AMP_DTYPE, enabled=amp):
        loss = nn.functional.mse_loss(model(x).float(), y)
    return loss * math.inf if poison else loss


def poisoned(step: int, worker: int) -> bool:
    """The scaler phase: worker 1's loss at step 1 overflows, so every rank must skip that step."""
    return step == 1 and worker == 1


# -- what every worker runs ----------------------------------------------------------------------
def run_phase(phase: str, strategy: str, options: dict):
    """Train ``STEPS`` steps with one loop feature; return the parameters (and the scaler's scales)."""
    topo = gradsync.topology()
    model, opt = build()
    extra = {"clip_grad_norm": CLIP} if phase == "clip-option" else {}
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False, **extra, **options)
    if topo.is_server:
        return None
    me = topo.rank
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if phase == "schedule" else None
    scaler = torch.amp.GradScaler(KIND, init_scale=2.0 ** 10) if phase == "scaler" else None
    scales = []
    for step in range(STEPS):
        if phase == "accumulate":
            with opt.no_sync():
                loss_of(model, step, me, micro=0).backward()
            loss_of(model, step, me, micro=1).backward()
        elif phase == "twice":  # each backward synchronizes: the mean of the sum, as under DDP
            loss_of(model, step, me, micro=0).backward()
            loss_of(model, step, me, micro=1).backward()
        elif phase == "scaler":
            scaler.scale(loss_of(model, step, me, amp=True, poison=poisoned(step, me))).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad()
            continue
        else:
            loss_of(model, step, me, amp=phase == "autocast").backward()
        if phase == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    opt.flush()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return {"params": params, "scales": scales}


def run_phases(phases: list[str], strategy: str, options: dict):
    out = {}
    for phase in phases:
        try:
            out[phase] = run_phase(phase, strategy, options)
        except ConfigError as exc:  # raised by distribute before any collective: every rank alike
            out[phase] = {"refused": str(exc)}
    gradsync.shutdown()
    # A gradsync thread alive past shutdown could be inside a torch call when the interpreter
    # finalizes, which aborts the process at exit (pytorch#38228): none may be left.
    return {"phases": out, "threads": [t.name for t in threading.enumerate() if t.name.startswith("gradsync")]}


# -- the single process --------------------------------------------------------------------------
def reference(phase: str):
    """One process: each step, every worker's gradient, averaged; then the user's loop's own steps."""
    model, opt = build()
    params = list(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if phase == "schedule" else None
    scaler = torch.amp.GradScaler(KIND, init_scale=2.0 ** 10) if phase == "scaler" else None
    scales = []
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for w in range(WORKERS):
            opt.zero_grad()
            if phase in ("accumulate", "twice"):
                loss_of(model, step, w, micro=0).backward()
                loss_of(model, step, w, micro=1).backward()
            elif phase == "scaler":
                scaler.scale(loss_of(model, step, w, amp=True, poison=poisoned(step, w))).backward()
            else:
                loss_of(model, step, w, amp=phase == "autocast").backward()
            for t, p in zip(total, params):
                t.add_(p.grad)
        for t, p in zip(total, params):
            p.grad = t / WORKERS
        if phase == "scaler":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            continue
        if phase in ("clip", "clip-option"):
            torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        if sched is not None:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, scales


def assert_matches(got: dict, phase: str, tolerance):
    ref, _ = reference(phase)
    atol, rtol = tolerance
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=rtol, msg=lambda m: f"{phase}, {name}: {m}")


def phases_for(strategy: str) -> list[str]:
    """The features each strategy must run; the in-place edits of the rest are tested below."""
    cls = gradsync.strategies.STRATEGIES[strategy]
    grad_edits = getattr(cls, "grad_edits", None) or cls.func.grad_edits
    base = ["accumulate", "schedule", "autocast", "clip-option"]
    if grad_edits == "refused":
        return base
    if grad_edits == "local":  # each worker's GradScaler would skip on its own overflow: not agreed
        return base + ["clip"]
    return base + ["clip", "scaler", "twice"]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_loop_features_match_the_single_process_reference(strategy):
    options, servers, exact = STRATEGIES[strategy]
    phases = phases_for(strategy)
    out = run_ranks(run_phases, WORKERS + servers, phases, strategy, options, servers=servers, timeout=180)
    assert all(not rank["threads"] for rank in out), [rank["threads"] for rank in out]
    results = [rank["phases"] for rank in out]
    first = results[0]
    for phase in phases:
        got = first[phase]
        if "refused" in got:
            # Only strategies that update piece by piece may refuse, and only clipping by option.
            assert phase == "clip-option", (phase, got)
            assert strategy in ("p3", "ps-sliced", "allreduce-priority", "hybrid", "ps-async"), got
            assert "cannot clip by the global gradient norm" in got["refused"]
            continue
        for rank in range(1, WORKERS):
            assert results[rank][phase]["scales"] == got["scales"], f"{phase}: ranks skipped different steps"
        if not exact:  # model averaging and async updates differ from the reference by design
            assert all(torch.isfinite(v).all() for v in got["params"].values()), phase
            continue
        assert_matches(got["params"], phase, BF16_TOL if phase in ("autocast", "scaler") else FP32_TOL)
        for rank in range(1, WORKERS):
            for name, value in results[rank][phase]["params"].items():
                torch.testing.assert_close(value, got["params"][name], rtol=0, atol=0)
        if phase == "scaler":
            _, scales = reference(phase)
            assert got["scales"] == scales and scales[1] < scales[0], (got["scales"], scales)


# -- in-place edits where they cannot reach the update ----------------------------------------------
def clip_in_place(strategy: str, options: dict):
    topo = gradsync.topology()
    model, opt = build()
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False, **options)
    if topo.is_server:
        return None
    loss_of(model, 0, topo.rank).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()


REFUSED = [s for s in STRATEGIES if "clip" not in phases_for(s)]


@pytest.mark.parametrize("strategy", REFUSED)
def test_a_gradient_edited_after_it_was_sent_is_an_error_on_every_rank(strategy):
    options, servers, _ = STRATEGIES[strategy]
    errors = run_ranks_expect_failure(clip_in_place, WORKERS + servers, strategy, options, servers=servers,
                                      wait_for=range(WORKERS), timeout=60)
    assert sorted(errors) == list(range(WORKERS)), errors
    for rank, text in errors.items():
        assert "GradientEditedError" in text and f"rank {rank}:" in text, text
        assert "changed in place between backward() and optimizer.step()" in text, text


def scaled_steps(strategy: str, options: dict, overflow: bool):
    """The standard GradScaler loop; with ``overflow`` every worker's first loss is Inf (a skipped step)."""
    topo = gradsync.topology()
    model, opt = build()
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False, **options)
    if topo.is_server:
        return None
    scaler = torch.amp.GradScaler(KIND, init_scale=2.0 ** 10)
    for step in range(2):
        scaler.scale(loss_of(model, step, topo.rank, amp=True, poison=overflow and step == 0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


@pytest.mark.parametrize("strategy,overflow", [("ps", False), ("p3", True)])
def test_a_gradscaler_under_a_strategy_that_sent_the_scaled_gradients_is_an_error(strategy, overflow):
    # Its unscale_ leaves the version counters alone, so only the scaler's own hand-over shows it:
    # without the error, ps would update with 1024x the gradient, and p3 fail at the next backward.
    options, servers, _ = STRATEGIES[strategy]
    errors = run_ranks_expect_failure(scaled_steps, WORKERS + servers, strategy, options, overflow,
                                      servers=servers, wait_for=range(WORKERS), timeout=60)
    assert sorted(errors) == list(range(WORKERS)), errors
    for rank, text in errors.items():
        assert "GradientEditedError" in text and f"rank {rank}: a torch.amp.GradScaler calls optimizer.step()" in text
        assert "use bf16 autocast" in text, text


def test_the_refused_strategies_are_those_that_update_elsewhere():
    """Strategies that update on servers or per slice; the rest keep the synchronized gradient."""
    assert set(REFUSED) == {"ps", "ps-async", "p3", "ps-sliced", "allreduce-priority", "hybrid"}


def test_ps_with_several_dedicated_servers_clips_by_the_global_norm():
    """The servers add up their partitions' squared norms (workers add zero) before updating."""
    results = [rank["phases"] for rank in
               run_ranks(run_phases, WORKERS + 2, ["clip-option"], "ps", {"fuse_kb": 0}, servers=2, timeout=120)]
    assert_matches(results[0]["clip-option"]["params"], "clip-option", FP32_TOL)


# -- activation checkpointing ---------------------------------------------------------------------
class _Recomputed(nn.Module):
    """The first layer outside ``torch.utils.checkpoint``, the rest recomputed in backward: the first
    layer's gradient arrives after the recomputed block's (after a nested backward, if reentrant)."""

    def __init__(self, seq: nn.Sequential, reentrant: bool):
        super().__init__()
        self.seq, self.reentrant = seq, reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.seq[1:], self.seq[0](x), use_reentrant=self.reentrant)


def train_recomputed(strategy: str, reentrant: bool):
    seq, opt = build()
    model = _Recomputed(seq, reentrant)
    opt = gradsync.distribute(model, opt, strategy)
    for step in range(STEPS):
        x, y = batch(step, gradsync.topology().rank)
        nn.functional.mse_loss(model(x.requires_grad_(reentrant)), y).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    params = {n: p.detach().clone() for n, p in seq.named_parameters()}
    gradsync.shutdown()
    return params


@pytest.mark.parametrize("strategy", ["allreduce", "p3"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_matches_the_reference(strategy, reentrant):
    got = run_ranks(train_recomputed, WORKERS, strategy, reentrant, timeout=60)[0]
    assert_matches(got, "plain", FP32_TOL)


def test_clipping_is_active_in_these_tests():
    """Otherwise the clip phases would pass without clipping anything."""
    clipped, _ = reference("clip")
    plain, _ = reference("plain")
    assert any((clipped[n] - plain[n]).abs().max() > 1e-3 for n in plain)


def test_bad_clip_values_are_refused():
    model, opt = build()
    for bad in (0, -1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ConfigError, match="clip_grad_norm must be a positive finite number"):
            gradsync.distribute(model, opt, "allreduce", clip_grad_norm=bad)
    with pytest.raises(ConfigError, match="hosts='two-level': expected 'auto'"):
        gradsync.distribute(model, opt, "allreduce", hosts="two-level")


def test_gradient_edited_error_is_a_gradsync_error():
    assert issubclass(GradientEditedError, gradsync.errors.GradsyncError)


# -- a DataLoader sharded by workers only ------------------------------------------------------------
def dataset():
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 3, generator=g))


def train_from_loader(strategy: str):
    topo = gradsync.topology()
    sampler = gradsync.sampler(dataset(), shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=5, sampler=sampler)
    model, opt = build()
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False)
    if topo.is_server:
        return len(sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    opt.flush()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy,servers", [("allreduce", 0), ("ps", 1)])
def test_a_dataloader_with_gradsync_sampler_shards_by_workers_only(strategy, servers):
    results = run_ranks(train_from_loader, WORKERS + servers, strategy, servers=servers, timeout=120)
    data = dataset()
    model, opt = build()
    samplers = [torch.utils.data.DistributedSampler(data, num_replicas=WORKERS, rank=w, shuffle=True, seed=3)
                for w in range(WORKERS)]
    for epoch in range(2):
        orders = []
        for s in samplers:
            s.set_epoch(epoch)
            orders.append(list(s))
        assert sorted(i for o in orders for i in o) == list(range(len(data)))  # every sample once
        for step in range(len(orders[0]) // 5):
            opt.zero_grad()
            total = [torch.zeros_like(p) for p in model.parameters()]
            for order in orders:
                x, y = data[order[5 * step:5 * step + 5]]
                nn.functional.mse_loss(model(x), y).backward()
                for t, p in zip(total, model.parameters()):
                    t.add_(p.grad)
                opt.zero_grad()
            for t, p in zip(total, model.parameters()):
                p.grad = t / WORKERS
            opt.step()
    for name, value in model.named_parameters():
        torch.testing.assert_close(results[0][name], value.detach(), atol=FP32_TOL[0], rtol=FP32_TOL[1])
    if servers:
        assert results[WORKERS] == 0  # a server's sampler is empty


EVALUATE_AFTER_TRAINING = FORK_PROBES + """
import sys
import torch
import gradsync


def train():
    model = torch.nn.Linear(6, 3)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), sys.argv[1])
    for _ in range(3):
        torch.nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    gradsync.shutdown()

train()  # its model, optimizer and strategy are garbage now, holding the job's process groups
data = torch.utils.data.TensorDataset(torch.randn(40, 6))
loader = torch.utils.data.DataLoader(data, batch_size=5, num_workers=2, worker_init_fn=collect_garbage, timeout=30)
print("evaluated", sum(len(x) for (x,) in loader), "gloo threads", gloo_threads(), flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads by /proc/self/task")
@pytest.mark.parametrize("strategy", ["allreduce", "p3", "ddp"])
def test_a_dataloader_after_training_in_a_function_and_shutdown_loads(tmp_path, strategy):
    """Training in a function, ``gradsync.shutdown()``, then an evaluation DataLoader with workers.
    The optimizer, strategy, transport and runtime the function let go of hold the job's process
    groups in reference cycles; freed in a loader's worker, a Gloo group's destructor waits for
    threads the child does not have (a hang, or a crash). The fork collects them first, in the
    trainer, and their Gloo threads end."""
    script = tmp_path / "evaluate.py"
    script.write_text(EVALUATE_AFTER_TRAINING)
    proc = subprocess.run([sys.executable, "-m", "gradsync.cli", "run", "-np", "2", "--", sys.executable, str(script),
                           strategy], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("evaluated 40 gloo threads 0") == 2, proc.stdout


# -- module buffers (BatchNorm statistics) ------------------------------------------------------------
def train_with_batchnorm(strategy: str, options: dict, evaluate: bool = True):
    """Three steps of a BatchNorm model on each worker's own data, with an evaluation forward on
    worker 0 alone in between (``evaluate``; it must not wait for the others); every buffer afterwards."""
    rank = gradsync.topology().rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=LR), strategy, **options)
    for step in range(STEPS):
        x, y = batch(step, rank)
        nn.functional.mse_loss(model(x * (1 + rank)), y).backward()
        opt.step()
        opt.zero_grad()
        if evaluate and rank == 0:  # under DDP it would wait for a broadcast the others never join
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
    return {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("strategy", ["allreduce", "casync-ring"])
def test_buffers_follow_worker_0_before_each_training_forward_as_under_ddp(strategy):
    options = STRATEGIES[strategy][0]
    ddp = run_ranks(train_with_batchnorm, WORKERS, "ddp", {}, False, timeout=120)
    ours = run_ranks(train_with_batchnorm, WORKERS, strategy, options, timeout=120)
    local = run_ranks(train_with_batchnorm, WORKERS, strategy, {**options, "broadcast_buffers": False}, timeout=120)
    for rank in range(WORKERS):
        for name, value in ddp[rank].items():
            torch.testing.assert_close(ours[rank][name], value, atol=FP32_TOL[0], rtol=FP32_TOL[1],
                                       msg=f"rank {rank} {name}")
    # Without the broadcast each worker keeps statistics of its own data only.
    assert not torch.allclose(local[0]["1.running_mean"], local[1]["1.running_mean"])
    assert not torch.allclose(local[1]["1.running_mean"], ours[1]["1.running_mean"])


# -- a NaN that a sparse codec does not sample --------------------------------------------------------
def nan_outside_the_sample() -> str:
    """allreduce with random-k keeping 1 of 400 elements; worker 1's gradient has one NaN."""
    rank = gradsync.topology().rank
    torch.manual_seed(0)
    model = nn.Linear(400, 1, bias=False)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=LR), "allreduce",
                              compression="randomk:ratio=0.0025")
    if rank == 1:
        model.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([7]), float("nan")))
    model(torch.randn(2, 400)).sum().backward()
    try:
        opt.step()
    except CompressionError as exc:
        return str(exc)
    return "stepped"


def test_a_nan_outside_a_sparse_codecs_sample_reaches_every_worker():
    for message in run_ranks(nan_outside_the_sample, WORKERS, timeout=60):
        assert "randomk all-reduce of bucket 0 ('weight'..) holds NaN/Inf" in message, message


# -- a parameter the forward does not use ------------------------------------------------------------
class _HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def train_half_used(strategy: str, options: dict):
    """Three steps of a model whose ``unused`` layer gets no gradient. Returns what was raised (or
    None), and, after the rank gave up on it as a script's uncaught error does (``abandon``), the
    warnings of ``shutdown`` and the gradsync threads still alive."""
    import warnings

    from gradsync import runtime

    torch.manual_seed(0)
    model = _HalfUsed().to(DEVICE)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=LR), strategy, **options)
    error = None
    try:
        for step in range(STEPS):
            opt.zero_grad()
            model(batch(step, gradsync.topology().rank)[0][:, :4]).sum().backward()
            opt.step()
        opt.flush()  # the last step's parameters, where they arrive at the next forward (p3)
    except ConfigError as exc:
        error = str(exc)
        runtime.abandon(exc)
    params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradsync.shutdown()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("gradsync") and t.is_alive()]
    return error, [str(w.message) for w in caught], alive, params


def half_used_reference() -> dict:
    """One process: each step's mean gradient over the workers' batches, then the same SGD step."""
    torch.manual_seed(0)
    model = _HalfUsed()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for w in range(WORKERS):
            (model(batch(step, w)[0].cpu()[:, :4]).sum() / WORKERS).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_ddp_with_an_unused_parameter_names_it_and_the_option_that_allows_it():
    """PyTorch's DDP reducer stops at the next forward when a parameter got no gradient: the error
    names the parameters and the way out on every rank, and the rank goes down with no gradsync
    thread left running (its watchdog stops even though no closer runs)."""
    for rank, (error, warned, alive, _) in enumerate(run_ranks(train_half_used, WORKERS, "ddp", {})):
        assert error is not None and f"rank {rank}" in error, error
        assert "'unused.weight', 'unused.bias'" in error and "find_unused_parameters=True" in error, error
        assert warned == [] and alive == [], (warned, alive)


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if STRATEGIES[s][2] and STRATEGIES[s][1] == 0])
def test_a_parameter_the_forward_does_not_use_trains_as_in_one_process(strategy):
    """Every exact strategy (``ddp`` told ``find_unused_parameters=True``) synchronizes the gradients
    a step produced and leaves the unused layer as one process does."""
    options = dict(STRATEGIES[strategy][0], **({"find_unused_parameters": True} if strategy == "ddp" else {}))
    want = half_used_reference()
    for error, warned, alive, params in run_ranks(train_half_used, WORKERS, strategy, options):
        assert error is None and warned == [] and alive == [], (error, warned, alive)
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=FP32_TOL[0], atol=FP32_TOL[1], msg=name)
