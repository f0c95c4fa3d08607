"""Frameworks: Lightning's Trainer with GradsyncStrategy (both Lightning packages), and a model
that is already DDP.

Lightning runs in each rank of the multi-rank helper (LOCAL_RANK in the environment makes it use
the processes it finds instead of launching its own). The reference is one process that averages
the two workers' gradients of the batches Lightning's DistributedSampler gives them.
"""
import importlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import gradsync
from multirank import run_ranks, run_ranks_expect_failure

pl = pytest.importorskip("pytorch_lightning")

WORKERS, BATCH, LR, SAMPLES = 2, 4, 0.1, 32


def data():
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 5, generator=g), torch.randn(SAMPLES, 2, generator=g))


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def module_of(lightning):
    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, _index):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    return Module()


def fit(strategy: str, options: dict, clip: float | None, package: str = "pytorch_lightning"):
    from gradsync.integrations.lightning import strategy_class

    lightning = importlib.import_module(package)
    module = module_of(lightning)
    calls = []  # the module's own forward pre-hooks (gradsync's among them) run for each training_step
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    GradsyncStrategy = strategy_class(package)
    trainer = lightning.Trainer(accelerator="cpu", devices=WORKERS, strategy=GradsyncStrategy(strategy, options=options),
                         max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=clip, use_distributed_sampler=False)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, sampler=gradsync.sampler(data(), shuffle=False))
    trainer.fit(module, loader)
    return {"forward calls": len(calls), **{n: p.detach().clone() for n, p in module.net.named_parameters()}}


def train_on_means(steps, clip: float | None = None):
    """One process: for each step's list of worker batches, the mean gradient, then the update."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for worker_batches in steps:
        total = [torch.zeros_like(p) for p in model.parameters()]
        for x, y in worker_batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            for t, p in zip(total, model.parameters()):
                t.add_(p.grad)
        for t, p in zip(total, model.parameters()):
            p.grad = t / WORKERS
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def reference(clip: float | None):
    """gradsync.sampler without shuffling: worker ``w`` reads samples ``w, w + n, ...``."""
    dataset = data()
    shards = [list(range(w, SAMPLES, WORKERS)) for w in range(WORKERS)]
    per_epoch = [[dataset[shard[step * BATCH:(step + 1) * BATCH]] for shard in shards]
                 for step in range(len(shards[0]) // BATCH)]
    return train_on_means(per_epoch * 2, clip)


@pytest.mark.parametrize("strategy,options,clip,package", [
    ("allreduce", {}, None, "pytorch_lightning"), ("p3", {"slice_params": 30}, None, "pytorch_lightning"),
    ("allreduce", {}, 0.05, "pytorch_lightning"), ("p3", {"slice_params": 30}, None, "lightning.pytorch")])
def test_lightning_trains_the_reference_model(strategy, options, clip, package):
    pytest.importorskip(package)
    results = run_ranks(fit, WORKERS, strategy, options, clip, package, timeout=240)
    ref = reference(clip)
    steps = 2 * SAMPLES // (WORKERS * BATCH)
    assert [r["forward calls"] for r in results] == [steps] * WORKERS, "training_step bypassed the module's hooks"
    for rank in range(WORKERS):
        for name, value in ref.items():
            # fp32 sums in another order, SGD with momentum: the workload's tolerance (see
            # gradsync.bench.workload.OPTIMIZERS); a missed or unaveraged gradient moves ~lr.
            torch.testing.assert_close(results[rank][name], value, atol=1e-5, rtol=1e-4, msg=f"rank {rank} {name}")


def test_lightning_clipping_under_p3_is_a_clear_error():
    errors = run_ranks_expect_failure(fit, WORKERS, "p3", {}, 0.05, timeout=240)
    assert sorted(errors) == [0, 1], errors
    assert all("GradientEditedError" in text and "clip_grad_norm" in text for text in errors.values()), errors


@pytest.mark.parametrize("imported, trainer_package, built_on", [
    ("lightning", "lightning.pytorch", "GradsyncStrategyLightning"),
    ("pytorch_lightning", "pytorch_lightning", "GradsyncStrategyPL")])
def test_gradsync_strategy_is_built_on_the_lightning_the_program_imported(imported, trainer_package, built_on):
    """Each Lightning's Trainer takes only its own strategies: the program that imported
    ``lightning`` gets one built on ``lightning.pytorch``, the one that imported ``pytorch_lightning``
    one built on that."""
    pytest.importorskip(imported)
    code = (f"import {imported} as L\n"
            "from gradsync.integrations.lightning import GradsyncStrategy\n"
            "s = GradsyncStrategy('allreduce')\n"
            f"from {trainer_package}.strategies import Strategy\n"
            "assert isinstance(s, Strategy) and L.Trainer, type(s).__mro__\n"
            "print(type(s).__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == [built_on], proc.stdout + proc.stderr


def test_an_unknown_strategy_fails_at_construction():
    from gradsync.integrations.lightning import GradsyncStrategy

    with pytest.raises(gradsync.ConfigError, match="unknown strategy 'nope'"):
        GradsyncStrategy("nope")


def test_ddp_inside_lightning_is_refused():
    from gradsync.integrations.lightning import GradsyncStrategy

    with pytest.raises(gradsync.ConfigError, match="Lightning's own"):
        GradsyncStrategy("ddp")


# -- a model already wrapped in DDP ---------------------------------------------------------------------
def distribute_ddp_model():
    model = nn.parallel.DistributedDataParallel(net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce")
    return [str(w.message) for w in caught]


def test_a_model_already_in_ddp_gets_a_warning():
    for messages in run_ranks(distribute_ddp_model, 2, timeout=60):
        assert any("already wrapped in DistributedDataParallel" in m for m in messages), messages


# -- Accelerate: it starts the processes and shards the data; gradsync synchronizes -------------------
def accelerate_recipe(strategy: str):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # adopts (or starts) the process group from the environment
    gradsync.init()
    model = net().to(accelerator.device)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), strategy)
    loader = accelerator.prepare(torch.utils.data.DataLoader(data(), batch_size=BATCH))  # not the model
    for _epoch in range(2):
        for x, y in loader:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    opt.flush()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def accelerate_reference():
    """Accelerate hands worker ``w`` the loader's batches ``w, w + n, ...``."""
    dataset = data()
    batches = [list(range(b * BATCH, (b + 1) * BATCH)) for b in range(SAMPLES // BATCH)]
    per_epoch = [[dataset[batches[step * WORKERS + w]] for w in range(WORKERS)]
                 for step in range(len(batches) // WORKERS)]
    return train_on_means(per_epoch * 2)


@pytest.mark.parametrize("strategy", ["allreduce", "p3"])
def test_the_accelerate_recipe_trains_the_reference_model(strategy):
    pytest.importorskip("accelerate")
    results = run_ranks(accelerate_recipe, WORKERS, strategy, timeout=240)
    ref = accelerate_reference()
    for rank in range(WORKERS):
        for name, value in ref.items():
            torch.testing.assert_close(results[rank][name], value, atol=1e-5, rtol=1e-4, msg=f"rank {rank} {name}")
