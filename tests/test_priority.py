"""The priority strategies' parts on their own (slicing, the priority sender) and bad input.

Parity of ``p3``, ``ps-sliced`` and ``allreduce-priority`` with the single-process reference is in
test_parity.py.
"""
import threading
import time

import pytest
import torch
from torch import nn

import gradsync
from gradsync.bench.workload import Workload, compare, reference, train_step
from gradsync.errors import ConfigError
from gradsync.strategies import P3, PriorityAllReduce, resolve
from gradsync.strategies.scheduler import PrioritySender
from gradsync.strategies.slicing import SlicePlan
from multirank import run_ranks


# -- slicing ---------------------------------------------------------------------------------------
def test_slices_follow_the_order_cut_through_tensors_and_cover_everything():
    params = [torch.zeros(5), torch.zeros(2, 3), torch.zeros(1)]
    plan = SlicePlan(params, order=[2, 0, 1], slice_params=4, servers=[7, 9])
    covered = {i: [0] * p.numel() for i, p in enumerate(params)}
    for sl in plan.slices:
        assert sl.numel <= 4
        offset = 0
        for seg in sl.segments:
            assert seg.offset == offset  # segments lie end to end
            offset += seg.length
            for e in range(seg.start, seg.start + seg.length):
                covered[seg.param][e] += 1
    assert all(c == [1] * len(c) for c in covered.values())  # every element exactly once
    assert [s.segments[0].param for s in plan.slices] == [2, 0, 1]  # forward order: parameter 2 first
    assert [s.owner for s in plan.slices] == [7, 9, 7]  # round-robin over the servers
    assert plan.of_param[0] == [0, 1] and plan.slices_of([1]) == [1, 2]
    assert plan.slice_numel == 4 and plan.max_segments == 2


# -- the priority sender ---------------------------------------------------------------------------
class _Handle:
    def __init__(self, gate):
        self.gate = gate

    def wait(self, background=False):
        self.gate.wait(5)


class _Transport:
    """Records the order of sends; the first send stays in flight until ``release`` is set."""

    def __init__(self):
        self.sent, self.release = [], threading.Event()

    def send_async(self, tensor, dst, tag, what="", counted=True):
        self.sent.append(what)
        done = threading.Event()
        done.set()
        return _Handle(self.release if len(self.sent) == 1 else done)


def test_a_ready_high_priority_message_overtakes_queued_ones():
    transport = _Transport()
    sender = PrioritySender(transport, credit_bytes=16)  # one 16-byte message in flight
    sender.put(5, torch.zeros(4), 1, 0, what="a")
    while not transport.sent:  # "a" is on the wire and holds all the credit
        threading.Event().wait(0.01)
    for name, priority in [("b", 3), ("c", 4), ("urgent", 0)]:
        sender.put(priority, torch.zeros(4), 1, 0, what=name)
    transport.release.set()
    sender.drain()
    sender.close()
    assert transport.sent == ["a", "urgent", "b", "c"]


class _OneSlowPeer:
    """Sends to rank 1 complete only once ``release`` is set (its receiver is busy); others at once."""

    def __init__(self):
        self.sent, self.release, self.done = [], threading.Event(), threading.Event()
        self.done.set()

    def send_async(self, tensor, dst, tag, what="", counted=True):
        self.sent.append(what)
        return _Handle(self.release if dst == 1 else self.done)


def test_a_busy_receiver_does_not_hold_back_the_credit_of_other_peers():
    """A Gloo send completes once the receiver posts its receive: credit must come back per peer."""
    transport = _OneSlowPeer()
    sender = PrioritySender(transport, credit_bytes=32)  # two 16-byte messages in flight
    sender.put(0, torch.zeros(4), 1, 0, what="to the busy peer")
    for k in range(5):
        sender.put(k + 1, torch.zeros(4), 2, 0, what=f"to rank 2, {k}")
    deadline = time.monotonic() + 2  # well inside the 5 s a handle waits for its release
    while len(transport.sent) < 6 and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    try:
        assert transport.sent == ["to the busy peer"] + [f"to rank 2, {k}" for k in range(5)]
    finally:
        transport.release.set()
        sender.close()


def test_without_credit_messages_leave_in_the_order_put():
    transport = _Transport()
    transport.release.set()
    sender = PrioritySender(transport, credit_bytes=None)
    for name in "xyz":
        sender.put(0.0, torch.zeros(1), 1, 0, what=name)
    sender.drain()
    sender.close()
    assert transport.sent == ["x", "y", "z"]


def test_p3_sends_an_older_steps_messages_before_a_newer_steps():
    """P3's key is (step, forward position): a worker's next-step push of the first layer must
    not overtake the answers of the last layer another worker still waits for in this step."""
    from gradsync.strategies.p3 import P3
    p3 = P3()
    p3.prio = [0.0, 1.0, 2.0]  # three slices in forward order
    transport = _Transport()
    sender = PrioritySender(transport, credit_bytes=16)
    sender.put(p3._send_priority(0, 7), torch.zeros(4), 1, 0, what="in flight")
    while not transport.sent:
        threading.Event().wait(0.01)
    for name, k, step in [("next step, first layer", 0, 8), ("this step, last layer", 2, 7),
                          ("this step, middle layer", 1, 7)]:
        sender.put(p3._send_priority(k, step), torch.zeros(4), 1, 0, what=name)
    transport.release.set()
    sender.drain()
    sender.close()
    assert transport.sent == ["in flight", "this step, middle layer", "this step, last layer", "next step, first layer"]


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,options,message", [
    ("p3", {"slice_params": 0}, "slice_params must be an integer >= 1"),
    ("p3", {"slice_params": 2.5}, "slice_params must be an integer >= 1"),
    ("p3", {"credit_mb": 0}, "credit_mb must be > 0"),
    ("p3", {"priority": "first"}, "priority must be True"),
    ("allreduce-priority", {"partition_params": 0}, "partition_params must be an integer >= 1"),
    ("allreduce-priority", {"credit_mb": -1}, "credit_mb must be > 0"),
])
def test_bad_options_are_config_errors(strategy, options, message):
    with pytest.raises(ConfigError, match=message):
        resolve(strategy, **options)


def _one_rank(strategy, optimizer_class=torch.optim.SGD, steps=1):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = gradsync.distribute(model, optimizer_class(model.parameters(), lr=0.1), strategy)
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _standalone(fn):
    gradsync.init()
    try:
        return fn()
    finally:
        gradsync.shutdown()


def test_credit_smaller_than_one_slice_is_a_clear_error():
    with pytest.raises(ConfigError, match="less than one slice"):
        _standalone(lambda: _one_rank(P3(slice_params=100, credit_mb=0.0001)))
    with pytest.raises(ConfigError, match="less than one partition"):
        _standalone(lambda: _one_rank(PriorityAllReduce(partition_params=100, credit_mb=0.0001)))


def test_a_priority_function_must_return_numbers():
    with pytest.raises(ConfigError, match=r"returned 'soon' for parameter '0.weight'"):
        _standalone(lambda: _one_rank(P3(priority=lambda name, position: "soon")))


def test_a_non_elementwise_optimizer_is_refused():
    with pytest.raises(ConfigError, match="LBFGS is not known to be one"):
        _standalone(lambda: _one_rank("p3", torch.optim.LBFGS))


def test_a_custom_priority_function_still_trains_exactly():
    """Reverse priority (the last layer first): a different order, the same model."""
    def run():
        torch.manual_seed(0)
        model, opt = _one_rank(P3(priority=lambda name, position: -position, slice_params=5), steps=3)
        return {n: p.detach().clone() for n, p in model.state_dict().items()}

    def plain():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()

    got, want = _standalone(run), plain()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)


# -- parameters in flight are finished before anyone reads them ----------------------------------------
def _state_dict_right_after_step(work: Workload, steps: int):
    topo = gradsync.topology()
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, "p3", exit_servers=False, slice_params=64)
    for step in range(steps):
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)
    return {n: t.clone() for n, t in model.state_dict().items()}  # no flush: the state_dict hook does it


def test_state_dict_after_step_holds_the_updated_parameters():
    work = Workload(model="toy", batch_size=6)
    results = run_ranks(_state_dict_right_after_step, 2, work, 3)
    ref = reference(work, 2, 3)
    params = {n: results[0][n] for n, _ in ref.named_parameters()}
    report = compare(params, ref, work.tolerance)
    assert report["correct"], report


@pytest.mark.parametrize("name", ["p3", "allreduce-priority"])
def test_every_tuning_probe_fits_its_credit(name):
    """Coordinate descent combines each value of one knob with the other's current best: every
    combination must be valid (credit >= one fp32 slice or partition plus its small header)."""
    from gradsync.strategies import STRATEGIES

    space = STRATEGIES[name].tune_space
    size = space["slice_params" if name == "p3" else "partition_params"]
    assert min(space["credit_mb"]) * 2**20 >= 1.01 * 4 * max(size)


# -- the script's own collectives while partitions are in flight ---------------------------------------
def _script_allreduces_between_steps(work: Workload, steps: int):
    import torch.distributed as dist

    topo = gradsync.topology()
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, "allreduce-priority", partition_params=9, credit_mb=0.0001)
    sums = []
    for step in range(steps):
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)  # returns with partitions still being all-reduced
        logged = torch.full((5,), float(topo.rank + 1))
        dist.all_reduce(logged)  # the default group, as a script logging its loss would
        sums.append(logged.tolist())
    opt.flush()
    return sums, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_scripts_own_allreduce_never_meets_a_partition():
    work = Workload(model="toy", batch_size=6)
    results = run_ranks(_script_allreduces_between_steps, 2, work, 4)
    for sums, _ in results:
        assert sums == [[3.0] * 5] * 4  # 1 + 2, never mixed with a partition's values
    report = compare(results[0][1], reference(work, 2, 4), work.tolerance)
    assert report["correct"], report


# -- a pause between steps (evaluation, a checkpoint) longer than the transport timeout -----------------
def _train_with_a_pause(work: Workload, strategy: str, steps: int, pause_s: float):
    import time

    topo = gradsync.topology()
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy)
    for step in range(steps):
        if step == steps // 2:
            time.sleep(pause_s)  # receives stay posted meanwhile: keep-alives must hold them
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)
    opt.flush()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["p3", "allreduce-priority"])
def test_a_pause_longer_than_the_timeout_between_steps_is_fine(strategy):
    work = Workload(model="toy", batch_size=6)
    results = run_ranks(_train_with_a_pause, 2, work, strategy, 4, 3.5, env={"GRADSYNC_TIMEOUT": "2"}, timeout=60)
    report = compare(results[0], reference(work, 2, 4), work.tolerance)
    assert report["correct"], report
