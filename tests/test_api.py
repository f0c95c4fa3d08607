"""The library API as a user sees it: the wrapped optimizer, init without a launcher, gradient
accumulation, the strategy registry, topology arithmetic and the parameter-server partition."""
import contextlib
import os
import random
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import gradsync
from gradsync.errors import ConfigError
from gradsync.strategies.ps import partition
from gradsync.topology import Topology
from multirank import run_ranks


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(step: int, worker: int, micro: int = 0):
    """Different data for every (step, worker, micro-batch), the same in every process."""
    g = torch.Generator().manual_seed(1000 * step + 10 * worker + micro)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def loss_of(model, step, worker, micro=0):
    x, y = batch(step, worker, micro)
    return nn.functional.mse_loss(model(x), y)


def params_of(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- the wrapped optimizer --------------------------------------------------------------------------
def optimizer_api() -> dict:
    rank = gradsync.topology().rank
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = gradsync.distribute(model, sgd, "allreduce")
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    # A scheduler made before distribute wraps optimizer.step itself; training must still synchronize.
    early_model = mlp()
    early_sgd = torch.optim.SGD(early_model.parameters(), lr=0.1)
    early_scheduler = torch.optim.lr_scheduler.StepLR(early_sgd, step_size=1, gamma=0.5)
    early = gradsync.distribute(early_model, early_sgd, "allreduce")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for m, o, s in ((model, opt, scheduler), (early_model, early, early_scheduler)):
                loss_of(m, step, rank).backward()
                o.step()
                s.step()
                o.zero_grad()
    state = opt.state_dict()
    fresh_model = mlp()
    fresh = gradsync.distribute(fresh_model, torch.optim.SGD(fresh_model.parameters(), lr=1.0, momentum=0.0))
    fresh.load_state_dict(state)
    torch.manual_seed(rank)  # different values on every rank: distribute starts all from rank 0's
    differ = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    gradsync.distribute(differ, torch.optim.SGD(differ.parameters(), lr=0.1))
    torch.manual_seed(0)
    one_bit = nn.Linear(3, 3)  # the same seed, and one element that differs on rank 1
    with torch.no_grad():
        one_bit.bias[1] += 1e-7 * rank
    gradsync.distribute(one_bit, torch.optim.SGD(one_bit.parameters(), lr=0.1))
    # Many tensors in a few messages: mixed dtypes, one alone (larger than a chunk), one
    # non-contiguous, one empty, from rank 1.
    g = torch.Generator().manual_seed(rank)
    many = [torch.randn(5, 3, generator=g), torch.arange(4) * (rank + 1), torch.randn(40, generator=g),
            torch.randn(4, 6, generator=g).t(), torch.empty(0), torch.randn(2, generator=g).double(),
            torch.randn(1, generator=g)]
    gradsync.runtime.current().transport.broadcast_tensors(many, 1, what="many", chunk_bytes=64)
    flat = torch.randn(30, generator=g)  # views one after the other in one buffer: sent as that buffer
    gradsync.runtime.current().transport.broadcast_tensors([flat[:10].view(2, 5), flat[10:]], 1, what="views")
    return {"many": [*many, flat], "same": opt is sgd and early is early_sgd, "started": [differ.state_dict(), one_bit.state_dict()], "is_sgd": isinstance(opt, torch.optim.SGD),
            "lrs": [opt.param_groups[0]["lr"], early.param_groups[0]["lr"]],
            "warnings": [str(w.message) for w in caught], "state": state, "reloaded": fresh.state_dict(),
            "params": params_of(model), "early_params": params_of(early_model)}


@pytest.fixture(scope="module")
def api_results():
    return run_ranks(optimizer_api, 2, timeout=60)


def test_distribute_returns_the_same_optimizer(api_results):
    assert api_results[0]["same"] and api_results[0]["is_sgd"]


def test_distribute_starts_every_rank_from_rank_0s_values(api_results):
    torch.manual_seed(0)
    expected = [nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).state_dict()]
    torch.manual_seed(0)
    expected.append(nn.Linear(3, 3).state_dict())
    for rank, result in enumerate(api_results):
        for want, got in zip(expected, result["started"]):
            assert want.keys() == got.keys()
            assert all(torch.equal(want[k], got[k]) for k in want), rank


def test_many_tensors_broadcast_packed_by_dtype_equal_the_senders(api_results):
    got, sent = api_results[0]["many"], api_results[1]["many"]
    assert [t.shape for t in got] == [t.shape for t in sent] and all(torch.equal(a, b) for a, b in zip(got, sent))
    assert not torch.equal(got[1], torch.arange(4))  # rank 0's own values were replaced


def test_lr_scheduler_made_before_or_after_distribute(api_results):
    first, second = api_results
    assert first["lrs"] == [0.1 * 0.5 ** 3] * 2
    assert not [w for w in first["warnings"] if "lr_scheduler" in w], first["warnings"]
    # Different data on each rank: equal parameters mean the steps were synchronized.
    for key in ("params", "early_params"):
        for name, value in first[key].items():
            torch.testing.assert_close(second[key][name], value, rtol=0, atol=0, msg=f"{key} {name}")


def test_state_dict_round_trips(api_results):
    state, reloaded = api_results[0]["state"], api_results[0]["reloaded"]
    assert reloaded["param_groups"] == state["param_groups"]
    assert reloaded["state"].keys() == state["state"].keys() and len(state["state"]) == 4
    for k, entry in state["state"].items():
        torch.testing.assert_close(reloaded["state"][k]["momentum_buffer"], entry["momentum_buffer"], rtol=0, atol=0)


SOLO = """
import torch, gradsync
topology = gradsync.init()
model = torch.nn.Linear(4, 1)
opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
g = torch.Generator().manual_seed(0)
x = torch.randn(32, 4, generator=g)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
losses = []
for _ in range(30):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward(); opt.step(); opt.zero_grad()
    losses.append(loss.item())
print(topology.world_size, topology.rank, topology.role, opt.strategy.describe(), losses[0] > 10 * losses[-1])
gradsync.shutdown()
print(gradsync.is_initialized())
"""


def test_init_without_environment_is_a_one_process_job():
    env = {k: os.environ[k] for k in ("PATH", "HOME", "SYSTEMROOT") if k in os.environ}  # no RANK, MASTER_*
    done = subprocess.run([sys.executable, "-c", SOLO], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["1 0 worker allreduce(bucket_mb=25, buckets=1) True", "False"]


# -- gradient accumulation ------------------------------------------------------------------------
STEPS, MICRO = 2, 3


def accumulate(strategy: str) -> dict:
    """Each step: MICRO - 1 backward passes under no_sync, the last one synchronized."""
    rank = gradsync.topology().rank
    model = mlp()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    for step in range(STEPS):
        for micro in range(MICRO):
            with opt.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                loss_of(model, step, rank, micro).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


def accumulation_reference(workers: int) -> dict:
    """One process: sum the gradients of every worker's micro-batches, divide by the workers."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        for worker in range(workers):
            for micro in range(MICRO):
                loss_of(model, step, worker, micro).backward()
        for p in model.parameters():
            p.grad /= workers
        opt.step()
        opt.zero_grad()
    return params_of(model)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_gradient_accumulation_matches_reference(strategy):
    results = run_ranks(accumulate, 2, strategy, timeout=60)
    reference = accumulation_reference(2)
    for name, value in reference.items():
        # The distributed sum adds the two workers' accumulated gradients, the reference adds six
        # micro-batch gradients in a row: the same numbers rounded in another order, a few fp32 ulps
        # per step (measured 1.5e-8 after 2 steps). Losing the last micro-batch of each worker
        # moves parameters by 6e-2, so 1e-6 + 1e-5 |p| leaves margins of a hundred on both sides.
        torch.testing.assert_close(results[0][name], value, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(results[1][name], results[0][name], atol=0, rtol=0, msg=name)


def backward_twice(strategy: str, options: dict):
    rank = gradsync.topology().rank
    model = mlp()
    gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, **options)
    loss_of(model, 0, rank).backward()
    try:
        loss_of(model, 0, rank, micro=1).backward()
    except gradsync.GradsyncError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("strategy,options", [("ps", {})])
def test_second_backward_without_no_sync_raises(strategy, options):
    """Where gradients leave during backward (a second backward under allreduce re-synchronizes, as
    DDP does: tests/test_user_loop.py)."""
    for kind, message in run_ranks(backward_twice, 2, strategy, options, timeout=60, env={"GRADSYNC_TIMEOUT": "10"}):
        assert kind == "GradsyncError", (kind, message)
        assert "received a second gradient after" in message and "with optimizer.no_sync()" in message, message


# -- the strategy registry ------------------------------------------------------------------------
def small_buckets(**options) -> gradsync.strategies.Strategy:
    return gradsync.strategies.AllReduce(bucket_mb=0.0001, **options)


def use_registered() -> dict:
    rank = gradsync.topology().rank
    gradsync.register("mine", small_buckets)
    model = mlp()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "mine", rebuild_buckets=False)
    for step in range(2):
        loss_of(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
    return {"names": gradsync.strategies.names(), "strategy": opt.strategy.describe(), "params": params_of(model)}


def test_registered_strategy_is_usable_by_name():
    first, second = run_ranks(use_registered, 2, timeout=60)
    assert "mine" in first["names"] and {"allreduce", "ps", "ddp"} <= set(first["names"])
    assert first["strategy"].startswith("allreduce(bucket_mb=0.0001, "), first["strategy"]
    for name, value in first["params"].items():  # trained on different data, synchronized
        torch.testing.assert_close(second["params"][name], value, rtol=0, atol=0)


# -- the public namespace --------------------------------------------------------------------------
TOP_LEVEL = {"init", "shutdown", "is_initialized", "distribute", "topology", "device", "sampler", "register",
             "GradsyncError", "ConfigError", "GradientEditedError", "ModelMismatchError", "PeerFailureError",
             "PeerProtocolError"}
RENAMED = {  # old top-level name -> (where it lives now, its name there)
    "Strategy": "Strategy", "AllReduce": "AllReduce", "PriorityAllReduce": "PriorityAllReduce",
    "ParameterServer": "ParameterServer", "P3": "P3", "CaSyncRing": "CaSyncRing", "CaSyncPS": "CaSyncPS",
    "CompressedAllGather": "CompressedAllGather", "PairAveraging": "PairAveraging", "DDP": "TorchDDP",
    "SMA": "ModelAveraging", "Hybrid": "SparseHybrid", "STRATEGIES": "STRATEGIES", "strategy_names": "names"}


def test_the_top_level_is_the_training_scripts_api():
    assert set(gradsync.__all__) == TOP_LEVEL
    assert all(getattr(gradsync, name) is not None for name in TOP_LEVEL)
    assert callable(gradsync.topology) and callable(gradsync.distribute)  # functions, not their modules
    assert gradsync.register is gradsync.strategies.register


def test_every_registered_name_has_its_class_under_gradsync_strategies():
    classes = gradsync.strategies.STRATEGIES
    assert gradsync.strategies.names() == sorted(classes)
    for name, cls in classes.items():
        assert isinstance(cls, type), name  # every built-in strategy is a class of its own
        assert getattr(gradsync.strategies, cls.__name__) is cls, name
        assert issubclass(cls, gradsync.strategies.Strategy)


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_an_old_top_level_name_warns_and_still_works(old, new):
    with pytest.warns(DeprecationWarning, match=rf"gradsync\.{old} is deprecated; use gradsync\.strategies\.{new}$"):
        value = getattr(gradsync, old)
    assert value is getattr(gradsync.strategies, new)
    assert old not in gradsync.__all__


@pytest.mark.parametrize("old,new", [("DDP", "TorchDDP"), ("SMA", "ModelAveraging"), ("Hybrid", "SparseHybrid"),
                                     ("strategy_names", "names")])
def test_an_old_name_in_gradsync_strategies_warns_and_still_works(old, new):
    with pytest.warns(DeprecationWarning, match=rf"use gradsync\.strategies\.{new}$"):
        value = getattr(gradsync.strategies, old)
    assert value is getattr(gradsync.strategies, new)


def test_old_names_still_import_and_build_strategies():
    with pytest.warns(DeprecationWarning, match="gradsync.strategies.ModelAveraging"):
        from gradsync import SMA
    assert SMA(alpha=0.5).alpha == 0.5
    with pytest.warns(DeprecationWarning):
        assert gradsync.strategy_names() == gradsync.strategies.names()
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        gradsync.Nope


# -- topology and partition (no processes) -----------------------------------------------------------
def test_topology_roles_and_role_ranks():
    roles = [Topology(5, r, num_servers=2) for r in range(5)]
    assert [t.role for t in roles] == ["worker"] * 3 + ["server"] * 2
    assert [t.role_rank for t in roles] == [0, 1, 2, 0, 1]
    assert roles[0].worker_ranks == [0, 1, 2] and roles[0].server_ranks == [3, 4]
    assert [roles[0].describe(r) for r in (2, 3)] == ["worker 2 (rank 2)", "server 0 (rank 3)"]
    for world in range(1, 7):  # at any size, the roles split the ranks in two
        for servers in range(world):
            t = Topology(world, 0, num_servers=servers)
            assert t.num_workers + len(t.server_ranks) == world and t.num_workers >= 1
            assert t.worker_ranks + t.server_ranks == list(range(world))


@pytest.mark.parametrize("world,rank,servers,message", [
    (0, 0, 0, "world size must be >= 1"),
    (2, 2, 0, "rank 2 is outside the world of 2 ranks"),
    (2, -1, 0, "rank -1 is outside"),
    (2, 0, 2, "leaves no worker"),
    (2, 0, -1, "servers"),
])
def test_topology_rejects_invalid_sizes(world, rank, servers, message):
    with pytest.raises(ConfigError, match=message):
        Topology(world, rank, num_servers=servers)


def test_ps_partition_is_balanced():
    rng = random.Random(0)
    cases = [[1000, 10, 800, 10, 600, 300, 5, 1, 400]] + [
        [rng.randint(1, 10**6) for _ in range(rng.randint(3, 40))] for _ in range(50)]
    for sizes in cases:
        for servers in ([0], [2, 3], [4, 5, 6]):
            owner = partition(sizes, servers)
            largest = sorted(range(len(sizes)), key=lambda i: -sizes[i])[:len(servers)]
            assert sorted(owner[i] for i in largest) == sorted(servers)[:len(largest)]
            loads = [sum(s for s, o in zip(sizes, owner) if o == server) for server in servers]
            assert max(loads) - min(loads) <= max(sizes), (sizes, servers, loads)


def test_import_does_not_load_torch():
    code = "import sys, gradsync, gradsync.launch; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_backend_is_chosen_by_argument_or_environment_and_checked(monkeypatch):
    from gradsync.runtime import _backend

    monkeypatch.setenv("GRADSYNC_BACKEND", "gloo")
    assert _backend(None) == "gloo"
    assert _backend("gloo") == "gloo"
    monkeypatch.setenv("GRADSYNC_BACKEND", "mpi")
    with pytest.raises(ConfigError, match="GRADSYNC_BACKEND='mpi': gradsync runs on 'gloo' or 'nccl'"):
        _backend(None)
    monkeypatch.delenv("GRADSYNC_BACKEND")
    assert _backend(None) == ("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="backend='nccl' but this process sees no CUDA device"):
            _backend("nccl")


def test_nccl_refuses_a_host_with_fewer_gpus_than_ranks(monkeypatch):
    # NCCL itself fails later ("Duplicate GPU detected") when two ranks share a GPU.
    from gradsync.runtime import _nccl_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert _nccl_device(Topology(1, 0, 0, 0)) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank in (0, 1):  # every rank says so, the one that has a GPU too
        with pytest.raises(ConfigError, match=r"this host runs 2 ranks and has 1 GPU\. Start at most 1 ranks per "
                                              r"host, or use Gloo \(GRADSYNC_BACKEND=gloo"):
            _nccl_device(Topology(2, rank, 1, rank))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # a launcher that does not say: a rank past the GPUs
    with pytest.raises(ConfigError, match=r"server 0 \(rank 1\), local rank 1: NCCL needs a GPU for every rank"):
        _nccl_device(Topology(2, 1, 1, 1))


@pytest.mark.parametrize("name", ["ps-async", "hybrid", "pair-averaging"])
def test_a_strategy_on_a_backend_it_does_not_run_on_is_refused(monkeypatch, name):
    # Their servers receive from whichever peer sends first; NCCL has no such receive.
    from types import SimpleNamespace

    from gradsync import runtime
    from gradsync.checks import check_backend
    from gradsync.strategies import resolve

    monkeypatch.setattr(runtime, "current", lambda: SimpleNamespace(topology=SimpleNamespace(rank=3)))
    strategy = resolve(name)
    check_backend(strategy, SimpleNamespace(device=torch.device("cpu")))  # Gloo: fine
    with pytest.raises(ConfigError, match=rf"rank 3: strategy '{name}' runs on Gloo only .* NCCL cannot\); "
                                          r"start the job with GRADSYNC_BACKEND=gloo"):
        check_backend(strategy, SimpleNamespace(device=torch.device("cuda", 0)))
    check_backend(resolve("ps"), SimpleNamespace(device=torch.device("cuda", 0)))  # runs on both
