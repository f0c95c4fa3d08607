"""Optimizer checkpoints under every strategy.

``optimizer.state_dict()`` must hold the whole optimizer state, laid out as torch lays it out,
even where the strategy keeps it spread over workers (co-located ``ps``, ``p3``) or in per-slice
optimizers (``p3``, ``allreduce-priority``): after 2 steps it must equal the single-process
reference optimizer's state, and training resumed from it for 2 more steps must equal the
reference trained for 4.
"""
import pytest
import torch

import gradsync
from gradsync.bench.workload import Workload, compare, reference, train_step
from gradsync.errors import GradsyncError
from multirank import run_ranks
from test_parity import CUT

BEFORE, AFTER = 2, 2


def _train(model, opt, work, steps):
    topo, spec = gradsync.topology(), work.spec()
    for step in steps:
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _snapshot(opt_state):
    """A copy of an optimizer state_dict, as torch.save and torch.load would give (torch's
    load_state_dict keeps ``step`` tensors and Adam then increments them in place)."""
    saved = dict(opt_state)
    saved["state"] = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in entry.items()}
                      for k, entry in opt_state["state"].items()}
    return saved


def save_and_resume(strategy, work, options, load):
    """Train, checkpoint, and resume in a fresh model and optimizer; ``load``: when the resumed
    run loads the optimizer state, ``"before"`` or ``"after"`` gradsync.distribute."""
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy, **options)
    _train(model, opt, work, range(BEFORE))
    opt.consolidate_state_dict()
    saved_opt, saved_model = _snapshot(opt.state_dict()), model.state_dict()
    opt.close()
    model, opt = work.build()
    model.load_state_dict(saved_model)
    if load == "before":
        opt.load_state_dict(_snapshot(saved_opt))
    opt = gradsync.distribute(model, opt, strategy, **options)
    if load == "after":
        opt.load_state_dict(_snapshot(saved_opt))
    _train(model, opt, work, range(BEFORE, BEFORE + AFTER))
    opt.flush()
    return {"state": saved_opt, "params": _params(model)}


def roll_back(strategy, work, options):
    """Checkpoint, take a step, then load the checkpoint into the same live model and optimizer."""
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy, **options)
    _train(model, opt, work, range(BEFORE))
    opt.consolidate_state_dict()
    saved_opt = _snapshot(opt.state_dict())
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, work, [7])  # a step to undo
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    _train(model, opt, work, range(BEFORE, BEFORE + AFTER))
    opt.flush()
    return {"state": saved_opt, "params": _params(model)}


def _check_state(state, ref_opt, tolerance):
    atol, rtol = tolerance
    ref = ref_opt.state_dict()["state"]
    assert state.keys() == ref.keys(), (sorted(state), sorted(ref))
    for k, entry in ref.items():
        assert state[k].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(state[k][key], value, atol=atol, rtol=rtol, msg=f"state[{k}][{key!r}]")


def _check_resumed(results, work, workers):
    ref = reference(work, workers, BEFORE + AFTER)
    for rank in range(workers):
        report = compare(results[rank]["params"], ref, work.tolerance)
        assert report["correct"], (rank, report)


CASES = [  # (strategy, workers, options, when the resumed run loads)
    ("allreduce", 2, {}, "before"), ("ddp", 2, {"find_unused_parameters": True}, "after"),
    ("ps", 2, {}, "before"), ("ps", 2, {}, "after"),  # at one worker the state is whole: nothing to consolidate
    ("p3", 2, {"slice_params": CUT}, "before"), ("p3", 2, {"slice_params": CUT}, "after"),
    ("allreduce-priority", 2, {"partition_params": CUT}, "before"),
    ("allreduce-priority", 2, {"partition_params": CUT}, "after"),
]
CASES = [c + (None,) for c in CASES] + [  # hosts of 2 and 1 workers: the state on the hosts' leaders
    ("p3", 3, {"slice_params": CUT}, "after", (0, 0, 1)),
]


@pytest.mark.parametrize("strategy,workers,options,load,hosts", CASES,
                         ids=[f"{c[0]}-w{c[1]}-load-{c[3]}" + ("-hosts" if c[4] else "") for c in CASES])
def test_state_dict_is_the_reference_state_and_resumes_exactly(strategy, workers, options, load, hosts):
    work = Workload(model="toy", batch_size=6, optimizer="adam")
    env = None if hosts is None else [{"GRADSYNC_HOST": f"h{h}", "LOCAL_WORLD_SIZE": str(hosts.count(h))}
                                      for h in hosts]
    results = run_ranks(save_and_resume, workers, strategy, work, options, load, env=env)
    _, ref_opt = reference(work, workers, BEFORE, with_optimizer=True)
    for rank in range(workers):  # every worker's consolidated state is the whole state
        _check_state(results[rank]["state"]["state"], ref_opt, work.tolerance)
    _check_resumed(results, work, workers)


@pytest.mark.parametrize("optimizer,load", [("adam", "before"), ("adagrad", "after")])
def test_hybrid_gathers_the_tables_state_from_the_workers_servers(optimizer, load):
    """The embedding's state lives in the partitions' optimizers on the workers' servers (Adam:
    whole-partition updates; Adagrad: lazy, per row): consolidated, it is the reference's."""
    work = Workload(model="lstm-lm:tiny", batch_size=4, optimizer=optimizer)
    results = run_ranks(save_and_resume, 2, "hybrid", work, {"sparse": ["embedding.weight"]}, load)
    _, ref_opt = reference(work, 2, BEFORE, with_optimizer=True)
    for rank in range(2):
        _check_state(results[rank]["state"]["state"], ref_opt, work.tolerance)
    _check_resumed(results, work, 2)


@pytest.mark.parametrize("strategy,options,model", [
    ("p3", {"slice_params": CUT}, "toy"), ("allreduce-priority", {"partition_params": CUT}, "toy"),
    ("hybrid", {"sparse": ["embedding.weight"]}, "lstm-lm:tiny")])
def test_loading_into_a_running_strategy_rolls_back(strategy, options, model):
    work = Workload(model=model, batch_size=6, optimizer="adam")
    results = run_ranks(roll_back, 2, strategy, work, options)
    _check_resumed(results, work, 2)


def resume_from_plain_torch(strategy, work, saved_model, saved_opt):
    """Every rank, servers included, loads a plain PyTorch checkpoint before distribute."""
    model, opt = work.build()
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False)
    if gradsync.topology().is_server:
        return None
    _train(model, opt, work, range(BEFORE, BEFORE + AFTER))
    opt.flush()
    with pytest.raises(GradsyncError, match="dedicated servers"):
        opt.state_dict()
    return {"params": _params(model)}


@pytest.mark.parametrize("strategy,model", [("ps", "toy"), ("p3", "toy"), ("hybrid", "lstm-lm:tiny")])
def test_dedicated_servers_resume_from_a_plain_torch_checkpoint(strategy, model):
    work = Workload(model=model, batch_size=6, optimizer="adam")
    ref_model, ref_opt = reference(work, 2, BEFORE, with_optimizer=True)
    results = run_ranks(resume_from_plain_torch, 3, strategy, work, ref_model.state_dict(), ref_opt.state_dict(),
                        servers=1)
    _check_resumed(results, work, 2)


def state_dict_without_consolidating(strategy):
    work = Workload(model="toy", batch_size=6, optimizer="adam")
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy)
    _train(model, opt, work, range(1))
    try:
        opt.state_dict()
    except GradsyncError as exc:
        message = str(exc)
    else:
        message = None
    opt.consolidate_state_dict()
    complete = len(opt.state_dict()["state"])
    return message, complete


@pytest.mark.parametrize("strategy", ["ps", "p3"])
def test_state_spread_over_workers_needs_consolidating_first(strategy):
    results = run_ranks(state_dict_without_consolidating, 2, strategy)
    for rank, (message, complete) in enumerate(results):
        assert message is not None and f"rank {rank}" in message and "consolidate_state_dict()" in message
        assert complete > 0


def test_state_of_sparse_only_optimizers_with_plain_number_entries():
    """SparseAdam steps only sparse gradients and counts steps in a Python int: both checkpoint."""
    from gradsync.strategies.optstate import StateLayout, cut, gather

    table = torch.nn.Parameter(torch.zeros(4, 3))
    opt = torch.optim.SparseAdam([table], lr=0.1)
    table.grad = torch.ones(4, 3).to_sparse()
    opt.step()
    layout = StateLayout(torch.optim.SparseAdam, opt, [table])
    assert layout.of(0) == {"step": "number", "exp_avg": "tensor", "exp_avg_sq": "tensor"}
    whole = opt.state[table]
    pieces = [(0, 0, 6, cut(layout, whole, 0, 0, 6)), (0, 6, 6, cut(layout, whole, 0, 6, 6))]
    state = gather(layout, pieces)[0]
    assert state["step"] == 1 and type(state["step"]) is int
    torch.testing.assert_close(state["exp_avg"], whole["exp_avg"], rtol=0, atol=0)


def save_and_load_through_dedicated_servers(strategy):
    """Workers gather the state the dedicated server holds, then load it into a fresh job after
    distribute: the server takes it over (state and hyperparameters)."""
    work = Workload(model="toy", batch_size=6, optimizer="adam")
    server = gradsync.topology().is_server
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False)
    saved_opt = saved_model = None
    if not server:
        _train(model, opt, work, range(BEFORE))
        if strategy != "ps":
            with pytest.raises(GradsyncError, match=f"dedicated servers of '{strategy}' and cannot be gathered"):
                opt.consolidate_state_dict()
            return None
        with pytest.raises(GradsyncError, match="the dedicated servers hold the optimizer state"):
            opt.state_dict()  # not gathered yet
        opt.consolidate_state_dict()
        saved_opt, saved_model = _snapshot(opt.state_dict()), model.state_dict()
        opt.close()
    elif strategy != "ps":
        return None
    model, opt = work.build()
    for group in opt.param_groups:
        group["lr"] = 1.0  # taken over from the checkpoint, on the server too
    if not server:
        model.load_state_dict(saved_model)
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False)
    if server:
        return None
    opt.load_state_dict(_snapshot(saved_opt))
    _train(model, opt, work, range(BEFORE, BEFORE + AFTER))
    opt.flush()
    return {"state": saved_opt, "params": _params(model)}


def test_dedicated_servers_hand_their_state_over_for_a_checkpoint_and_take_one_back():
    work = Workload(model="toy", batch_size=6, optimizer="adam")
    results = run_ranks(save_and_load_through_dedicated_servers, 3, "ps", servers=1)
    _, ref_opt = reference(work, 2, BEFORE, with_optimizer=True)
    for rank in range(2):
        _check_state(results[rank]["state"]["state"], ref_opt, work.tolerance)
    _check_resumed(results, work, 2)


def test_strategies_whose_servers_keep_their_state_refuse_to_gather_it():
    run_ranks(save_and_load_through_dedicated_servers, 3, "p3", servers=1)
