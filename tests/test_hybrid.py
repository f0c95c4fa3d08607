"""The sparse-aware hybrid strategy (Parallax): decisions, exactness, servers, bad input.

Every training test compares rank 0's final parameters with the single-process data-parallel
reference and every worker's with rank 0's.
"""
import os
import re
import time

import pytest
import torch
from torch import nn

import gradsync
from gradsync.bench.workload import Workload, compare, reference, train_step
from gradsync.errors import ConfigError
from gradsync.strategies.hybrid import Layout, SparseHybrid, lazy_update
from multirank import DEVICE, run_ranks, run_ranks_expect_failure

STEPS = 4


def train(work: Workload, steps: int, options: dict):
    """Train ``work`` with hybrid; workers return (parameters, describe(), (host_work(), the bytes
    of their server's partitions), what they sent to whom)."""
    topo = gradsync.topology()
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, "hybrid", exit_servers=False, **options)
    if topo.is_server:
        return None
    transport, sent = opt.strategy.ctx.transport, []
    send = transport.send_async

    def recorded(tensor, dst, tag, **kw):
        sent.append((dst, kw.get("what", "")))
        return send(tensor, dst, tag, **kw)

    transport.send_async = recorded
    for step in range(steps):
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)
    before = len(sent)
    opt.strategy.settle()  # where a count of the steps' bytes ends: no pull of whole partitions
    assert sent[before:] == [], sent[before:]
    server = opt.strategy.server
    owned = sum(p.numel() * p.element_size() for parts in server.parts for _, _, p in parts) if server else 0
    described, work_done = opt.strategy.describe(), (opt.strategy.host_work(), owned)
    opt.close()  # the model is whole after close
    return {name: p.detach().clone() for name, p in model.named_parameters()}, described, work_done, sent


def check(work: Workload, workers: int, servers: int = 0, options: dict | None = None,
          counted: list | None = None, hosts: tuple | None = None) -> str:
    """Train ``work`` and check it against the reference; ``counted`` gets rank 0's
    ``host_work()`` and the bytes of its server's partitions. ``hosts``: each rank's host, named as
    a launcher would (tests/test_parity.py); a host's other workers must send no rows to servers."""
    env = None if hosts is None else [{"GRADSYNC_HOST": f"h{h}", "LOCAL_WORLD_SIZE": str(hosts.count(h))} for h in hosts]
    results = run_ranks(train, workers + servers, work, STEPS, options or {}, servers=servers, env=env)
    first, described, work_done, _ = results[0]
    if hosts is not None:
        for rank in range(workers):
            ops = {what.split(" to ")[0] for _, what in results[rank][3]}
            if hosts.index(hosts[rank]) == rank:  # the host's first worker pushes and pulls its host's rows
                assert {"hybrid push", "hybrid pull"} <= ops, (rank, ops)
            else:  # the others only flush (whole partitions, at close) and say stop
                assert ops == {"hybrid flush", "hybrid stop"}, (rank, ops)
    if counted is not None:
        counted.extend(work_done)
    report = compare(first, reference(work, workers, STEPS), work.tolerance)
    assert report["correct"], (report, described)
    for rank in range(1, workers):
        for name, value in results[rank][0].items():
            torch.testing.assert_close(value, first[name], rtol=0, atol=0, msg=f"rank {rank} {name}")
    return described


@pytest.mark.parametrize("workers,servers,options,hosts", [
    (2, 0, {}, None), (4, 0, {}, None), (2, 1, {}, None), (3, 2, {"partitions": 3}, None),
    (1, 0, {"sparse": ["embedding.weight"]}, None),  # one worker serving itself, no messages
    # hosts of several workers: each host's rows summed and pulled once by its first worker
    (4, 0, {}, (0, 0, 1, 1)), (3, 1, {"partitions": 2}, (0, 0, 1, 2)),  # 2 + 1 workers, a server host
])
def test_language_model_matches_reference(workers, servers, options, hosts):
    counted = []
    described = check(Workload(model="lstm-lm:tiny", batch_size=4, device=DEVICE), workers, servers, options, counted,
                      hosts)
    work_done, owned = counted
    if servers:  # a worker without a server counts no updates
        assert work_done == {}, work_done
    else:  # its own server's updates of its partitions of the table, one a step (Strategy.host_work); the
        # last step's may still wait for another worker's push when rank 0 asks
        calls, nbytes, seconds = work_done["update"]
        assert owned > 0 and calls in (STEPS - 1, STEPS) and nbytes == calls * owned and seconds > 0, work_done
    assert re.search(r"embedding\.weight: sparse \(\d", described), described
    assert "softmax.weight" not in described  # a Linear: never a candidate, always all-reduced
    assert "1 sparse tables" in described
    assert ("host sums: 2 hosts push" in described) == (hosts is not None), described


def test_one_worker_keeps_everything_dense():
    """At one worker all-reducing costs nothing: the default threshold (N-1)/N sends nothing to servers."""
    described = check(Workload(model="lstm-lm:tiny", batch_size=4), 1)
    assert "0 sparse tables" in described and "embedding.weight: dense" in described


def test_recommendation_model_splits_its_tables():
    """DLRM's 26 tables: the large ones go to the servers, the ones a batch mostly covers stay dense.
    On hosts of 2 and 1 workers: the host sums of many tables come in one order on both workers."""
    described = check(Workload(model="recsys:tiny", batch_size=8, device=DEVICE), 3, hosts=(0, 0, 1))
    decisions = dict(re.findall(r"(tables\.\d+)\.weight: (sparse|dense)", described))
    assert decisions["tables.2"] == "sparse" and decisions["tables.8"] == "dense", described  # 1000 rows vs 3


def test_adagrad_per_row_state_matches_reference():
    """Adagrad leaves rows without gradient alone: the servers update only the rows pushed (float64,
    where the comparison is tight)."""
    work = Workload(model="lstm-lm:tiny", batch_size=4, optimizer="adagrad", dtype="float64")
    assert "lazy server updates" in check(work, 2, 1)


def test_tied_embedding_is_measured_as_mixed_and_stays_dense():
    """The toy's embedding is also its output layer: every row gets gradient, so it is all-reduced."""
    described = check(Workload(model="toy", batch_size=6), 2)
    assert "embed.weight: dense (used outside its lookup)" in described


def _forced_tied():
    work = Workload(model="toy", batch_size=6)
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, "hybrid", sparse=["embed.weight"])
    inputs, target = work.batch(work.spec(), 0, gradsync.topology().rank, 2)
    train_step(model, opt, work.spec(), inputs, target)


def test_forcing_a_tied_embedding_sparse_is_an_error_on_every_rank():
    failures = run_ranks_expect_failure(_forced_tied, 2)
    assert set(failures) == {0, 1}, failures
    for text in failures.values():
        assert "'embed.weight' was named sparse" in text and "Leave it dense" in text


# -- a table alone: no dense parameters (the ps path), SparseAdam, duplicates, bad ids ---------------
class Table(nn.Module):
    def __init__(self, rows=40, width=3, sparse=False):
        super().__init__()
        self.table = nn.Embedding(rows, width, sparse=sparse)

    def forward(self, ids):
        return self.table(ids)


def _table_batch(step: int, worker: int, duplicates: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + worker)
    if duplicates:  # one id many times, and the same id on every worker
        return torch.full((6,), 7)
    return torch.randint(0, 40, (6,), generator=g)


def _table_loss(out: torch.Tensor, step: int) -> torch.Tensor:
    target = torch.linspace(-1, 1, out.shape[-1]) * (step + 1)
    return ((out - target) ** 2).sum(-1).mean()


def _train_table(optimizer: str, duplicates: bool, steps: int, reference_only: bool = False, workers: int = 2):
    """Train :class:`Table`; the learning rate drops tenfold from the third step (a schedule)."""
    torch.manual_seed(0)
    sparse = optimizer == "sparse_adam"
    model = Table(sparse=sparse)
    opt = (torch.optim.SparseAdam(model.parameters(), lr=0.1) if sparse
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    if reference_only:
        for step in range(steps):
            opt.param_groups[0]["lr"] = 0.1 if step < 2 else 0.01
            opt.zero_grad()
            total = None
            for w in range(workers):
                model.zero_grad()
                _table_loss(model(_table_batch(step, w, duplicates)), step).backward()
                g = model.table.weight.grad
                total = g.clone() if total is None else total + g
            model.table.weight.grad = total / workers
            opt.step()
        return model.table.weight.detach().clone()
    opt = gradsync.distribute(model, opt, "hybrid", sparse=["table.weight"])
    rank = gradsync.topology().rank
    buffers = []  # where the server's dense gradients lie, once the previous steps are applied
    for step in range(steps):
        opt.param_groups[0]["lr"] = 0.1 if step < 2 else 0.01  # the servers follow
        opt.zero_grad()
        _table_loss(model(_table_batch(step, rank, duplicates)), step).backward()  # pulled: step-1 applied
        if step >= 2:
            buffers.append([p.grad.data_ptr() if p.grad is not None else None
                            for parts in opt.strategy.server.parts for _, _, p in parts])
        opt.step()
    described = opt.strategy.describe()
    opt.close()
    kept = all(b == buffers[0] for b in buffers) and None not in buffers[0]
    return model.table.weight.detach().clone(), described, kept


@pytest.mark.parametrize("optimizer,duplicates", [("sgd", False), ("sparse_adam", False), ("sgd", True)])
def test_table_only_model_matches_reference(optimizer, duplicates):
    """No dense parameters: everything through the servers. SparseAdam's reference uses sparse
    gradients (its lazy semantics); momentum SGD's is dense, so the servers update whole partitions."""
    results = run_ranks(_train_table, 2, optimizer, duplicates, 5)
    expected = _train_table(optimizer, duplicates, 5, reference_only=True)
    for weight, described, kept in results:
        torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6)
        # a dense update's gradient buffer is the same from step to step (no fresh pages per step)
        assert kept == (optimizer != "sparse_adam")
    assert "no dense parameters" in results[0][1]
    assert ("lazy" if optimizer == "sparse_adam" else "dense server updates") in results[0][1]


def _bad_ids():
    model = Table()  # one partition per server: rows 1..3 live on rank 0, which then waits for rank 1's push
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "hybrid", sparse=["table.weight"],
                              partitions=1)
    rank = gradsync.topology().rank
    for step in range(3):
        ids = torch.tensor([1, 2, 40 + rank]) if (step == 2 and rank == 1) else torch.tensor([1, 2, 3])
        model(ids).sum().backward()
        opt.step()
        opt.zero_grad()


def test_ids_out_of_range_name_the_rank_and_the_table():
    """Rank 1 stops at its bad lookup; rank 0 names it instead of waiting for the timeout. Rank 0 learns
    it one of two ways, whichever comes first: its server sees rank 1's heartbeat stop while waiting
    for the push, or its own push to rank 1 finds the connection closed once rank 1 has exited."""
    failures = run_ranks_expect_failure(_bad_ids, 2, timeout=60)
    assert set(failures) == {0, 1}, failures
    assert "rank 1: embedding 'table.weight' was given row ids 1..41, outside its 40 rows" in failures[1]
    heartbeat = "whose pushes from worker 1 (rank 1) never came: it stopped responding"
    connection = "hybrid push to rank 1 failed on worker 0 (rank 0): worker 1 (rank 1) stopped responding"
    assert heartbeat in failures[0] or connection in failures[0], failures[0]


class TiedLater(Table):
    """Reads its table outside the lookup from the third step on (as a tied output layer would)."""

    step = 0

    def forward(self, ids):
        out = self.table(ids)
        if TiedLater.step >= 2:
            out = out + self.table.weight.sum()
        return out


def _tied_later():
    model = TiedLater()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "hybrid", sparse=["table.weight"])
    for step in range(4):
        TiedLater.step = step
        model(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_table_read_outside_its_lookup_later_is_an_error_not_lost_updates():
    failures = run_ranks_expect_failure(_tied_later, 2, timeout=60)
    assert failures, "a dense gradient on a server-held table must not pass silently"
    text = "\n".join(failures.values())
    assert "'table.weight' is on hybrid's parameter servers but got a dense gradient" in text
    assert "dense=['table.weight']" in text


def _close_without_steps():
    model = Table()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "hybrid", exit_servers=False)
    if gradsync.topology().is_worker:
        opt.close()
    return "done"


def test_dedicated_servers_leave_when_workers_close_before_any_step():
    assert run_ranks(_close_without_steps, 3, servers=1, timeout=60) == ["done"] * 3


def _train_slowly(steps: int, die_at: int | None = None):
    """Workers step every second; worker 1 dies (no report, no goodbye) at step ``die_at``."""
    model = Table()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "hybrid",
                              sparse=["table.weight"], exit_servers=False)
    topo = gradsync.topology()
    if topo.is_server:
        return "done"
    for step in range(steps):
        if step == die_at and topo.rank == 1:
            os._exit(3)
        model(torch.tensor([1, 2, 3 + topo.rank])).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(1.0)
    opt.close()
    return "done"


def test_dedicated_servers_serve_for_longer_than_the_timeout():
    """GRADSYNC_TIMEOUT bounds a wait for a message, not a server's life: training outlasts it."""
    assert run_ranks(_train_slowly, 3, 4, servers=1, timeout=90, env={"GRADSYNC_TIMEOUT": "2"}) == ["done"] * 3


def test_a_dedicated_server_names_the_worker_that_died():
    failures = run_ranks_expect_failure(_train_slowly, 3, 6, 1, servers=1, timeout=90, wait_for=[2])
    assert "stop from worker 1 (rank 1) never came: it stopped responding" in failures.get(2, ""), failures


def _switching(work: Workload, plan: list):
    topo, spec = gradsync.topology(), work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, plan[0][0], **plan[0][2])
    step = 0
    for k, (strategy, steps, options) in enumerate(plan):
        if k:
            opt.switch_strategy(strategy, **options)
        for _ in range(steps):
            inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
            train_step(model, opt, spec, inputs, target)
            step += 1
    opt.flush()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_switching_to_and_from_hybrid_keeps_the_tables_optimizer_state():
    """Momentum built under all-reduce goes to the servers' partitions, and back again; composed
    strategies (a codec on hybrid's dense part, on ps's and p3's pushes, on allreduce) are switched to
    like any other, and with lossless codecs (top-k keeping every element) stay exact."""
    work = Workload(model="lstm-lm:tiny", batch_size=4)
    lossless = {"compression": "topk:ratio=1"}
    plan = [("allreduce", 2, {}), ("hybrid", 2, lossless), ("ps", 1, lossless), ("hybrid", 2, {}),
            ("p3", 1, {**lossless, "error_feedback": True}), ("allreduce", 1, {"compression": "none"})]
    results = run_ranks(_switching, 2, work, plan, timeout=120)
    ref = reference(work, 2, sum(steps for _, steps, _ in plan))
    for rank, params in enumerate(results):
        report = compare(params, ref, work.tolerance)
        assert report["correct"], (rank, report)


def _load_with_lr_zero():
    model = Table()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "hybrid",
                              sparse=["table.weight"])
    rank = gradsync.topology().rank

    def step():
        model(torch.tensor([1, 2, 3 + rank])).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    opt.consolidate_state_dict()
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.0
    opt.load_state_dict(saved)
    before = model.state_dict()["table.weight"].clone()  # state_dict() brings every row up to date
    step()
    opt.flush()
    return torch.equal(before, model.table.weight.detach())


def test_servers_follow_the_lr_of_a_loaded_checkpoint():
    """torch's load_state_dict makes new parameter groups: the servers must read the lr from them
    (lr 0 with momentum left in the state: nothing may move)."""
    assert run_ranks(_load_with_lr_zero, 2) == [True, True]


# -- pieces ------------------------------------------------------------------------------------------
def test_layout_cuts_contiguous_ranges_round_robin():
    layout = Layout.make([10, 3], 4, [0, 1])
    assert layout.bounds[0].tolist() == [0, 2, 5, 7, 10]
    assert layout.owner[0].tolist() == [0, 1, 0, 1]
    assert layout.owner[1].tolist() == [1, 0, 1]  # fewer rows than partitions; table 1 starts on server 1
    assert layout.ranges(0, 1) == [(2, 5), (7, 10)]
    where = layout.split(0, torch.tensor([0, 3, 9]))
    assert where[0].tolist() == [0] and where[1].tolist() == [1, 2]


def test_partition_count_comes_from_parallax_cost_model():
    b, a, c = 8.0, 0.05, 1.0
    probes = {n: b / n + a * (n - 1) + c for n in (2, 4, 8, 16, 32)}
    assert SparseHybrid._fit(probes) == 13  # argmin of b/n + a(n-1): sqrt(b/a) = 12.6
    assert SparseHybrid._fit({2: 1.0, 4: 0.5}) == 4  # fewer than 3 probes: the fastest
    noise = {4: 0.305, 8: 0.363, 16: 0.351, 32: 0.320, 64: 0.313}  # measured once: no trend to fit
    assert SparseHybrid._fit(noise) == 4


def test_which_optimizers_update_lazily():
    assert lazy_update(torch.optim.SparseAdam, {})
    assert lazy_update(torch.optim.Adagrad, {"weight_decay": 0})
    assert not lazy_update(torch.optim.Adagrad, {"weight_decay": 1e-4})
    assert lazy_update(torch.optim.SGD, {"momentum": 0, "weight_decay": 0})
    assert not lazy_update(torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0})
    assert not lazy_update(torch.optim.Adam, {})


@pytest.mark.parametrize("options,message", [
    ({"partitions": 0}, "partitions must be 'auto' or an int >= 1"),
    ({"sparse_threshold": 2}, "sparse_threshold must be in [0, 1]"),
    ({"sparse": ["a"], "dense": ["a"]}, "named both sparse and dense"),
])
def test_bad_options(options, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SparseHybrid(**options)


def _attach(options):
    model = nn.Sequential(nn.Embedding(10, 2), nn.Linear(2, 2))
    gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "hybrid", **options)


@pytest.mark.parametrize("options,message", [
    ({"sparse": ["1.weight"]}, "'1.weight' cannot go to the servers: it is not the weight of an nn.Embedding"),
    ({"dense": ["nope"]}, "'nope' is not a trainable parameter of the model"),
])
def test_bad_table_names(options, message):
    failures = run_ranks_expect_failure(_attach, 1, options, timeout=60)
    assert message in failures[0]


def test_emulated_tables_get_gradient_on_the_rows_read_only():
    from gradsync.emulate.model import emulated_spec

    spec = emulated_spec("recsys:tiny", 8, "flops:10tflops", dilation=0.0)
    model = spec.build()
    inputs, target = spec.batch(8, 0)
    spec.loss(model(*inputs), target).backward()
    for k in range(26):
        grad = dict(model.named_parameters())[f"tables.{k}.weight"].grad
        rows = set((grad != 0).any(1).nonzero().view(-1).tolist())
        assert rows == set(inputs[1][:, k].tolist()), k
    with pytest.raises(IndexError, match="tables.0 has"):
        model(inputs[0], inputs[1] + 5000)


def test_cpu_sized_language_model_has_lm1b_rows():
    from gradsync.models import get_model

    spec = get_model("lstm-lm:cpu")
    with torch.device("meta"):
        model = spec.build()
    assert model.embedding.num_embeddings == model.softmax.classes.num_embeddings == 793_471
    assert sum(p.numel() for p in model.parameters()) == 102_656_767
    (tokens, targets, negatives), _ = spec.batch(2, 0)
    assert negatives.numel() == 8192 and negatives.unique().numel() == 8192


def test_elastic_jobs_refuse_only_state_that_stays_on_dedicated_servers():
    """hybrid with tables on the workers' own servers is elastic (tests/test_elastic.py); where
    dedicated servers keep the state out of the workers' reach, commits cannot hold it."""
    from gradsync.adapt.policy import Controller

    class OnServers:
        name, state_location, moves_server_state = "hybrid", "servers", False

    with pytest.raises(ConfigError, match="keeps it on its dedicated servers, out of their reach"):
        Controller._check_elastic(OnServers())
    Controller._check_elastic(type("CoLocated", (OnServers,), {"state_location": "workers"})())
