"""Parity of every exact strategy with the single-process data-parallel reference.

Each rank trains the workload with the strategy; rank 0's final parameters must equal the
reference (gradsync.bench.workload.reference) within the fp32 tolerance explained in
gradsync.bench.workload.OPTIMIZERS, and every worker must hold the same parameters. The toy model has tied,
frozen, never-used and sometimes-used parameters plus BatchNorm.
"""
import pytest
import torch

import gradsync
from gradsync.bench.workload import Workload, compare, reference, train_step
from multirank import DEVICE, run_ranks

STEPS = 4
CUT = 37
"""Elements in a small slice or partition: it cuts through most of the toy's tensors (2770 elements
in all) and spans its small ones, in about 70 pieces. Smaller pieces take no other path, and each
piece costs an operation a step."""


def train(strategy: str, work: Workload, steps: int, options: dict, close: bool = False):
    topo = gradsync.topology()
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy, exit_servers=False, **options)
    if topo.is_server:
        return None
    frozen_before = model.frozen.weight.clone() if hasattr(model, "frozen") else None
    for step in range(steps):
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)
    opt.flush()  # strategies that overlap the next forward (p3) finish parameters lazily
    if frozen_before is not None:
        assert torch.equal(model.frozen.weight, frozen_before), "a frozen parameter changed"
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    if close:  # before another strategy runs in this job: its streams end, dedicated servers leave
        opt.close()
    return trained


CASES = [  # (strategy, workers, servers, options)
    # Four workers once per strategy, with options that multiply its messages.
    ("allreduce", 1, 0, {}), ("allreduce", 2, 0, {}),
    ("allreduce", 4, 0, {"bucket_mb": 0.001}),  # many tiny buckets
    ("ps", 1, 0, {}), ("ps", 2, 0, {}),
    ("ps", 2, 1, {}),
    ("ps", 2, 0, {"fuse_kb": 0}), ("ps", 2, 1, {"fuse_kb": 0}), ("ps", 4, 2, {"fuse_kb": 1}),
    ("ddp", 1, 0, {"find_unused_parameters": True}), ("ddp", 2, 0, {"find_unused_parameters": True}),
    ("p3", 1, 0, {}), ("p3", 2, 0, {}), ("p3", 4, 2, {}),  # one dedicated server: the Adam case below
    ("p3", 2, 0, {"slice_params": CUT}),  # slices cut through tensors and span several
    ("p3", 4, 0, {"slice_params": 50, "credit_mb": 0.001}),  # one slice in flight at a time
    ("allreduce-priority", 1, 0, {}), ("allreduce-priority", 2, 0, {}),
    ("allreduce-priority", 4, 0, {"partition_params": CUT, "credit_mb": 0.0002}),  # one partition at a time
    ("allreduce-priority", 2, 1, {"partition_params": 50}),  # a server rank present: it only leaves
    ("ps-sliced", 1, 0, {}), ("ps-sliced", 2, 0, {"slice_params": CUT}), ("ps-sliced", 4, 2, {"slice_params": 50}),
    # Compressed strategies with lossless codecs, one case per code path: payloads all-reduced ("none"
    # is summable), decode-merge-encode around the ring and at PS aggregators (top-k keeping every
    # element is lossless but not summable), PS payload sums, and the all-gather baseline.
    ("casync-ring", 2, 0, {"compression": "none"}),
    ("allreduce", 2, 0, {"compression": "none"}), ("ddp", 2, 0, {"find_unused_parameters": True, "compression": "none"}),
    ("casync-ring", 3, 0, {"compression": "topk:ratio=1", "bucket_mb": 0.001}),
    ("casync-ps", 2, 0, {"compression": "none", "bucket_mb": 0.001}),
    ("casync-ps", 3, 0, {"compression": "topk:ratio=1", "partition_mb": 0.0001}),
    ("compressed-allgather", 3, 0, {"compression": "topk:ratio=1"}),
    # Parameter servers whose pushes are encoded (lossless top-k), with a residual per slice or group.
    ("ps", 2, 0, {"compression": "topk:ratio=1", "error_feedback": True}),
    ("p3", 3, 0, {"compression": "topk:ratio=1", "slice_params": CUT, "error_feedback": True}),
    ("p3", 2, 1, {"compression": "topk:ratio=1"}), ("ps-sliced", 2, 0, {"compression": "none"}),
    # hybrid on the toy: its one embedding is tied to the output layer, so it is measured as mixed
    # and all-reduced (tests/test_hybrid.py has the tables that go to servers); a server rank idles.
    ("hybrid", 2, 0, {}), ("hybrid", 2, 1, {}),
]
CASES = [c + ("sgd",) for c in CASES] + [  # Adam: per-parameter state, at 2 workers
    ("allreduce", 2, 0, {}, "adam"), ("ps", 2, 0, {}, "adam"), ("ps", 2, 1, {}, "adam"),
    ("ddp", 2, 0, {"find_unused_parameters": True}, "adam"),
    ("p3", 2, 0, {"slice_params": CUT}, "adam"), ("p3", 2, 1, {}, "adam"),
    ("p3", 2, 0, {"slice_params": CUT, "compression": "topk:ratio=1"}, "adam"),
    ("allreduce-priority", 2, 0, {"partition_params": CUT}, "adam"),
]


def train_cases(cases, work: Workload, steps: int):
    """Train each ``(strategy, options)`` in turn in one job, from the same start."""
    return [train(strategy, work, steps, options, close=True) for strategy, options in cases]


def _group(cases):
    """The cases by job: ``(workers, servers, optimizer) -> [(strategy, options)]``."""
    groups: dict[tuple, list] = {}
    for strategy, workers, servers, options, optimizer in cases:
        groups.setdefault((workers, servers, optimizer), []).append((strategy, options))
    return groups


JOBS = _group(CASES)


@pytest.mark.parametrize("job", list(JOBS), ids=[f"w{w}-s{s}-{o}" for w, s, o in JOBS])
def test_matches_single_process_reference(job):
    """One job per size and optimizer trains each of its strategies in turn (each closed before
    the next, as a strategy switch does); every one must give the reference on rank 0 and the
    same parameters on every worker."""
    workers, servers, optimizer = job
    cases = JOBS[job]
    work = Workload(model="toy", batch_size=6, optimizer=optimizer, device=DEVICE)
    results = run_ranks(train_cases, workers + servers, cases, work, STEPS, servers=servers, timeout=240)
    ref = reference(work, workers, STEPS)
    for c, case in enumerate(cases):
        first = results[0][c]
        report = compare(first, ref, work.tolerance)
        assert report["correct"], (case, report)
        for rank in range(1, workers):
            for name, value in results[rank][c].items():
                torch.testing.assert_close(value, first[name], rtol=0, atol=0, msg=f"{case} rank {rank} {name}")


def pull_order_job():
    from gradsync import flight

    train("ps", Workload("toy"), 2, {"fuse_kb": 0})
    ops = [(r["what"], r["op"], r["step"]) for r in flight.current().snapshot()["records"] if r["step"] == 2]
    receives = [i for i, (what, op, _) in enumerate(ops) if what.startswith("pull of") and op == "receive"]
    answers = [i for i, (what, op, _) in enumerate(ops) if what.startswith("pull of") and op == "send"]
    return receives, answers


def test_co_located_ps_posts_its_pull_receives_before_its_answers():
    # Gloo halves each direction of a pair's large exchange when both sides send first
    # (docs/mechanisms.md): every receive of a step's pulls is posted before the first answer.
    for receives, answers in run_ranks(pull_order_job, 2):
        assert receives and answers
        assert max(receives) < min(answers)


HOST_STRATEGIES = [("allreduce", {}), ("allreduce", {"bucket_mb": 0.001}), ("allreduce", {"hosts": "flat"}),
                   ("allreduce-priority", {"partition_params": CUT}), ("ps", {}),
                   # Compressed, lossless: shards summed in the host, exchanged across hosts by their owners.
                   ("casync-ring", {"compression": "topk:ratio=1"}),
                   ("casync-ps", {"compression": "topk:ratio=1", "partition_mb": 0.0001}),
                   ("compressed-allgather", {"compression": "topk:ratio=1"}),
                   # Sliced servers: slices summed by each host's leader, which alone pushes and forwards answers.
                   ("p3", {"slice_params": CUT}), ("ps-sliced", {"slice_params": CUT}),
                   # the toy's one table is tied (dense); tests/test_hybrid.py has tables on hosts
                   ("hybrid", {}),
                   # Encoded pushes: the host sums exactly, its leader encodes the host's sum.
                   ("ps", {"compression": "topk:ratio=1"}), ("p3", {"slice_params": CUT, "compression": "topk:ratio=1"})]
UNEVEN_HOST_STRATEGIES = [HOST_STRATEGIES[i] for i in (0, 4, 6, 7, 8, 9, 12)]
"""Hosts of unequal size (2+1): the strategies whose shards, partitions or slices follow the hosts."""
RELAYED = ("p3", "ps-sliced")
"""Strategies whose host sums travel as point-to-point messages to the host's leader, not as
two-level collectives."""


def train_each(cases, work: Workload, steps: int):
    from gradsync import flight

    out = []
    for strategy, options in cases:
        trained = train(strategy, work, steps, options, close=True)
        records = flight.current().records
        two_level = [r.op for r in records if r.group == "two-level"]
        sent_to = sorted({r.peer for r in records if r.op == "send" and r.peer is not None})
        out.append((trained, two_level, sent_to))
        flight.current().records.clear()
    return out


@pytest.mark.parametrize("hosts,servers,cases", [
    ((0, 0, 1, 1), 0, HOST_STRATEGIES), ((0, 0, 1), 0, UNEVEN_HOST_STRATEGIES),
    # a dedicated server serves one model, on a host of its own
    ((0, 0, 1, 1, 2), 1, [("ps", {"fuse_kb": 1}), ("p3", {"slice_params": 50})]),
], ids=["2x2", "2+1", "2x2-and-a-server-host"])
def test_strategies_on_hosts_of_several_workers_match_the_reference(hosts, servers, cases):
    # Ranks named onto hosts as a launcher would (gradsync.hosts): the topology-aware strategies
    # take their two-level paths (all-reduces across hosts by shard owners, parameter servers fed
    # by each host's sum), which must still give the reference and one model on every worker.
    workers = len(hosts) - servers
    env = [{"GRADSYNC_HOST": f"h{h}", "LOCAL_WORLD_SIZE": str(hosts.count(h))} for h in hosts]
    work = Workload(model="toy", batch_size=6, device=DEVICE)
    results = run_ranks(train_each, len(hosts), cases, work, STEPS, env=env, servers=servers)
    ref = reference(work, workers, STEPS)
    leader = {r: hosts.index(hosts[r]) for r in range(workers)}
    for c, case in enumerate(cases):
        if case[0] not in RELAYED or case[1].get("hosts") == "flat":
            continue
        # Only the leaders cross hosts: a host's other workers send to their leader alone, and no
        # rank sends to another host's workers.
        for rank in range(len(hosts)):
            sent_to = results[rank][c][2]
            assert sent_to, (case, rank, "sent nothing")
            if rank < workers and leader[rank] != rank:
                assert sent_to == [leader[rank]], (case, rank, sent_to)
            assert all(leader[p] == p or hosts[p] == hosts[rank] for p in sent_to if p < workers), (case, rank, sent_to)
    for case, (first, two_level, _) in zip(cases, results[0]):
        if case[1].get("hosts") == "flat":  # asked for the flat form: nothing goes through the host groups
            assert not two_level, (case, two_level)
        elif case[0] not in RELAYED:
            assert len(two_level) >= STEPS, (case, "no two-level all-reduce was issued")
        if case[0] in ("casync-ring", "casync-ps", "compressed-allgather"):  # sums inside the host, shards across
            assert two_level.count("reduce-scatter") >= STEPS, (case, two_level)
        report = compare(first, ref, work.tolerance)
        assert report["correct"], (case, report)
    for rank in range(1, workers):
        for case, (first, *_), (mine, *_) in zip(cases, results[0], results[rank]):
            for name, value in mine.items():
                torch.testing.assert_close(value, first[name], rtol=0, atol=0, msg=f"{case} rank {rank} {name}")
