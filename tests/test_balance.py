"""Per-worker batch shares (Controller.set_shares, GlobalBatches) and BalanceBatches: shares cover
each sample once, the weighted update equals one process on the whole global batch, and the
policy's shares follow the workers' speeds."""
from __future__ import annotations

import math
import re
import time

import pytest
import torch

from multirank import run_ranks

DIM, DATA, LR = 6, 21, 0.1  # 21 samples, global batch 8: two whole steps and a short one of 5 per epoch


def test_unequal_shares_cover_each_sample_once_per_epoch():
    from gradsync.adapt import GlobalBatches

    data = GlobalBatches(103, seed=2)
    seen, schedule = [], [[3, 5], [1, 0, 7], [2, 2, 2, 2], [9, 1], [0, 4, 4]]
    k = 0
    while not data.epoch_done:
        shares = schedule[k % len(schedule)]
        parts = [data.share(sum(shares), r, len(shares), shares) for r in range(len(shares))]
        assert torch.equal(torch.cat(parts), data.global_batch(sum(shares)))  # consecutive slices, in rank order
        if data.position + sum(shares) <= 103:
            assert [p.numel() for p in parts] == shares
        seen += torch.cat(parts).tolist()
        data.advance(sum(shares))
        k += 1
    assert sorted(seen) == list(range(103))
    # The short last step (103 - 100 = 3 samples of [0, 4, 4]) is split in proportion: [0, 2, 1].
    assert data.sizes(8, 3, [0, 4, 4]) == [0, 0, 0] and GlobalBatches(3).sizes(8, 3, [0, 4, 4]) == [0, 2, 1]


def test_balanced_shares_are_proportional_to_speed_and_sum_to_the_global_batch():
    from gradsync.adapt import balanced_shares
    from gradsync.errors import ConfigError

    assert balanced_shares([1.0, 2.0], 24) == [16, 8]  # twice as fast, twice the samples
    assert balanced_shares([1.0, 1.0, 1.0, 2.0], 32) == [9, 9, 9, 5]  # 9.14 x 3 and 4.57: largest remainder
    assert balanced_shares([1.0, 100.0], 16, min_share=3) == [13, 3]  # 15.8 / 0.16: held at the floor
    assert balanced_shares([0.3, 0.3, 0.3], 10) == [4, 3, 3]  # ties to the lower rank
    for seconds, batch, floor, message in [([1.0, 1.0], 3, 2, "need a global batch of at least 4"),
                                           ([1.0, math.nan], 8, 1, "finite and > 0"),
                                           ([1.0, 0.0], 8, 1, "finite and > 0")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            balanced_shares(seconds, batch, floor)


def test_the_flight_record_times_the_training_threads_waits_once_each():
    from gradsync.flight import FlightRecorder

    rec = FlightRecorder(0, "worker 0")
    start = time.monotonic()
    outer = rec.block(rec.issue("outer", "wait", 0), True)
    time.sleep(0.02)
    inner = rec.block(rec.issue("inner", "all-reduce", 8), True)  # nested: counted once, within the outer
    time.sleep(0.02)
    rec.unblock(inner)
    rec.unblock(outer)
    span, waited = time.monotonic() - start, rec.waited_s
    assert 0.04 <= waited <= span
    watch = rec.block(rec.issue("DDP's all-reduce", "wait", 0), True, timed=False)  # a watchdog's window
    other = rec.block(rec.issue("thread", "recv", 8), False)  # a communication thread's wait
    time.sleep(0.02)
    rec.unblock(other)
    rec.unblock(watch)
    assert rec.waited_s == waited and rec.waiting is None


class FakeController:
    """What BalanceBatches touches between steps, on worker ``rank`` of ``len(seconds)``."""

    def __init__(self, batch_size, workers, rank=0):
        self.step, self.batch_size, self.num_workers, self.rank = 0, batch_size, workers, rank
        self.shares = None

    @property
    def global_batch_size(self):
        return self.batch_size * self.num_workers

    def set_shares(self, shares):
        self.shares = shares


@pytest.mark.parametrize("processes,persistent", [(0, False), (2, False), (2, True)])
def test_ctl_loader_loads_each_steps_part_ahead_and_plans_again_when_the_shares_change(processes, persistent):
    """Controller.loader on worker 1 of 3, driven as Controller.steps drives it (the step's part,
    then the position advanced by the global batch): every batch is the step's part, across new
    shares, a new batch size, a step with no part for this worker and the next epoch; a plan is
    dropped once per change, not per step."""
    from gradsync.adapt.data import GlobalBatches, StepLoader
    from gradsync.errors import ConfigError

    ctl = FakeController(4, 3, rank=1)
    ctl.data = GlobalBatches(60, seed=3)
    ctl.batch_indices = lambda: ctl.data.share(ctl.global_batch_size, ctl.rank, ctl.num_workers, ctl.shares)
    samples = torch.utils.data.TensorDataset(torch.arange(60), torch.arange(60) * 10)
    loader = StepLoader(ctl, samples, num_workers=processes,
                        **({"prefetch_factor": 3, "persistent_workers": persistent} if processes else {}))
    changes = {2: {"shares": [6, 2, 4]}, 5: {"batch_size": 5, "shares": [8, 2, 5]}, 7: {"shares": [9, 0, 6]},
               8: {"shares": [5, 5, 5]}}
    step = 0
    for epoch in range(2):
        ctl.data.next_epoch(epoch)
        while not ctl.data.epoch_done:
            for name, value in changes.get(step, {}).items():
                setattr(ctl, name, value)
            want = ctl.batch_indices().tolist()
            got = next(loader)
            if want:
                assert got[0].tolist() == want and got[1].tolist() == [10 * i for i in want], (step, got, want)
            else:
                assert got is None and step == 7  # no part this step: no batch, and the plan is not used up
            ctl.data.advance(ctl.global_batch_size)
            step += 1
    assert step == 9  # 5 steps of 12 samples, then 4 of 15
    # Plans dropped: at the new shares (step 2), the end of the epoch with the new batch (5), and
    # at the shares after the step without a part (8, whose plan held step 7's part).
    assert loader.restarts == 3, loader.restarts
    for options, message in (({"batch_size": 4}, "drop batch_size"), ({"shuffle": True}, "drop shuffle")):
        with pytest.raises(ConfigError, match=message):
            StepLoader(ctl, samples, **options)
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(60))

    with pytest.raises(ConfigError, match="needs a dataset of indexed samples .* not a Stream"):
        StepLoader(ctl, Stream())
    with pytest.raises(ConfigError, match="the dataset has 44 samples, the controller's dataset_size is 60"):
        StepLoader(ctl, torch.utils.data.TensorDataset(torch.arange(44)))
    ctl.data = None
    with pytest.raises(ConfigError, match="needs Controller"):
        StepLoader(ctl, samples)


def test_balance_batches_follows_the_speeds_it_gathers():
    from gradsync.adapt import BalanceBatches

    class Gathered(BalanceBatches):  # the all-reduce replaced by the readings of every worker
        def gather(self, ctl, mine):
            return list(speeds)

    policy, ctl = Gathered(every=4, tolerance=0.1), FakeController(8, 2)
    speeds = [1e-3, 2e-3]  # seconds per sample: worker 1 is twice as slow
    policy.readings = [1e-3]
    policy._decide(ctl)
    assert ctl.shares == [11, 5]
    speeds = [1e-3, 1.5e-3]  # [10, 6]: the slowest worker's 12 ms become 10 ms, 17 % less
    ctl.shares = [8, 8]
    policy._decide(ctl)
    assert ctl.shares == [10, 6]
    policy.tolerance, ctl.shares = 0.2, [8, 8]
    policy._decide(ctl)
    assert ctl.shares == [8, 8]  # within tolerance: kept
    speeds = [1e-3, math.nan]  # a worker without a reading (it just joined): no decision
    policy._decide(ctl)
    assert ctl.shares == [8, 8] and [s for s, _ in policy.history] == [0, 0]
    assert BalanceBatches().state() == {"history": []}


def shares_job(plan, steps_balanced):
    """Each strategy of ``plan`` trains a fresh float64 model through a Controller with unequal shares
    (and one step where worker 0 has none); then allreduce under BalanceBatches with worker 1 sleeping
    three times longer per sample. Returns each run's parameters and global batches, and the errors."""
    import gradsync
    from gradsync.adapt import BalanceBatches, Controller
    from gradsync.errors import ConfigError

    rank = gradsync.topology().rank
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(DATA, DIM, generator=gen, dtype=torch.float64), torch.randn(DATA, generator=gen, dtype=torch.float64)
    runs = {}
    for name, options, micro in plan:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(DIM, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
        opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), name, **options)
        ctl = Controller(opt, batch_size=4, dataset_size=DATA)
        batches = []
        for epoch in ctl.epochs(2):
            for step in ctl.steps():
                if step == 1:
                    ctl.set_shares([0, 8])  # from step 2 on, worker 0 has nothing
                elif step == 2:
                    ctl.set_shares([3, 5])
                batches.append(ctl.data.global_batch(ctl.global_batch_size).tolist())
                idx = ctl.batch_indices()
                parts = [idx[:len(idx) // 2], idx[len(idx) // 2:]] if micro else [idx]
                for k, part in enumerate(parts):
                    if not len(part) and name != "ddp":
                        continue  # no samples: no backward (ddp's reducer needs one: the weight 0 zeroes it)
                    loss = 0.5 * (model(x[part]).squeeze(1) - y[part]).pow(2).mean() * max(len(part), 1) / max(len(idx), 1)
                    if k + 1 < len(parts):
                        with opt.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                opt.step()
                opt.zero_grad()
        opt.flush()
        runs[name] = ([p.detach().clone() for p in model.parameters()], batches)
        opt.close()

    errors = []
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1).double()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=LR), "allreduce")
    # A long epoch (indices taken modulo the 21 samples), so the 12 steps never reach its end.
    ctl = Controller(opt, [BalanceBatches(every=3, warmup=1)], batch_size=8, dataset_size=10_000)
    for bad in ([8, 7], [9, -1], [16], [8.0, 8]):
        try:
            ctl.set_shares(bad)
        except ConfigError as exc:
            errors.append(str(exc))
    for bad in (-1.0, math.inf):
        try:
            opt.set_grad_weight(bad)
        except ConfigError as exc:
            errors.append(str(exc))
    try:
        Controller(opt, batch_size=8, commit_every=0)
    except ConfigError as exc:
        errors.append(str(exc))
    batches = []
    with ctl.train():
        for _ in ctl.epochs(1):
            for step in ctl.steps(steps_balanced):
                batches.append(ctl.data.global_batch(ctl.global_batch_size).tolist())
                idx = ctl.batch_indices()
                time.sleep((0.004 if rank else 0.0015) * len(idx))
                (0.5 * (model(x[idx % DATA]).squeeze(1) - y[idx % DATA]).pow(2).mean()).backward()
                opt.step()
                opt.zero_grad()
    balanced = ([p.detach().clone() for p in model.parameters()], batches, ctl.policies[0].history)
    fixed = Controller(opt, batch_size=4)
    fixed.set_shares([3, 5])
    try:  # a loop of fixed batches (a DataLoader's) that never asks for its share: stopped, not wrong
        for _ in fixed.steps(1):
            (0.5 * (model(x[:4]).squeeze(1) - y[:4]).pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
    except ConfigError as exc:
        errors.append(str(exc))
    assert fixed.share() == ((0, 3) if rank == 0 else (3, 5))
    try:
        ctl.switch_strategy("sma")
    except ConfigError as exc:
        errors.append(str(exc))
    opt.close()
    return runs, balanced, errors


def reference(batches, x, y, model, momentum):
    """One process: each step's gradient over its whole global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for idx in batches:
        idx = torch.tensor(idx) % DATA
        (0.5 * (model(x[idx]).squeeze(1) - y[idx]).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def test_unequal_shares_train_exactly_as_one_process_and_balance_batches_follows_speed():
    plan = [("allreduce", {}, True), ("ps", {}, True), ("p3", {}, False), ("ddp", {}, False)]
    results = run_ranks(shares_job, 2, plan, 12, timeout=120)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(DATA, DIM, generator=gen, dtype=torch.float64), torch.randn(DATA, generator=gen, dtype=torch.float64)
    for name, *_ in plan:
        params, batches = results[0][0][name]
        assert [len(b) for b in batches] == [8, 8, 5] * 2  # the epoch's short last step included
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(DIM, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
        ref = reference(batches, x, y, model, momentum=0.9)
        for rank in range(2):  # float64; the weighted mean adds the same terms in another order: rounding only
            for got, want in zip(results[rank][0][name][0], ref):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"{name}, rank {rank}")

    (params, batches, history), (_, _, history1), errors = results[0][1], results[1][1], results[0][2]
    assert history == history1 and history, history  # every worker decided alike, at least once
    assert history[-1][1][0] > 1.5 * history[-1][1][1], history  # worker 1 takes 2.7x as long per sample
    torch.manual_seed(0)
    for got, want in zip(params, reference(batches, x, y, torch.nn.Linear(DIM, 1).double(), momentum=0.0)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    expected = ["must sum to the global batch 16", "2 integers >= 0", "2 integers >= 0", "2 integers >= 0",
                "finite number >= 0", "finite number >= 0", "commit_every must be an integer >= 1",
                "worker 0: step 0 split the global batch into unequal shares [3, 5]",
                "does not average gradients over workers"]
    assert len(errors) == len(expected) and all(e in err for e, err in zip(expected, errors)), errors
    assert "the training loop did not ask for its part" in errors[-2]
