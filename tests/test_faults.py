"""Bad input and faults: each error names the rank, the tensor and what to do, and none hangs.

Every multi-rank case runs through tests/multirank.py and asserts on the error's text. Time bounds
come from the runtime: a dead peer is named within the heartbeat diagnosis window (2.5 s) after
Gloo notices the closed connection; a hung peer at ``GRADSYNC_TIMEOUT`` (the wait was watched); a
rank that cannot reach rank 0's store after ``max(GRADSYNC_TIMEOUT, runtime.RENDEZVOUS_MIN_S)``.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gradsync
from multirank import run_ranks, run_ranks_expect_failure

# Ranks that should have failed together but fell out of step fail after this many seconds.
FAST_TIMEOUT = {"GRADSYNC_TIMEOUT": "10"}


def mlp(kind: str = "", culprit: bool = False) -> nn.Module:
    """Parameters 0.weight [8, 4], 0.bias [8], 2.weight [2, 8], 2.bias [2]; the culprit's differ by ``kind``."""
    torch.manual_seed(0)
    last = nn.Linear(8, 3 if culprit and kind == "shape" else 2, bias=not (culprit and kind == "fewer"))
    layers = [nn.Linear(4, 8), nn.Tanh(), last] + ([nn.Linear(2, 2)] if culprit and kind == "more" else [])
    model = nn.Sequential(*layers)
    return model.double() if culprit and kind == "dtype" else model


# -- ranks that built different models -------------------------------------------------------------
def distribute_mismatched(cases, culprit: int) -> dict:
    """Each case on the same job: every rank must raise, so the ranks stay in step for the next."""
    rank, out = gradsync.topology().rank, {}
    for strategy, kind in cases:
        model = mlp(kind, culprit=rank == culprit)
        try:
            gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, exit_servers=False)
            out[strategy, kind] = "distribute returned without an error"
        except gradsync.ModelMismatchError as exc:
            out[strategy, kind] = str(exc)
    return out


EXPECTED = {  # kind -> what the message must say (culprit {who})
    "shape": ["parameter '2.weight'", "float32[3, 8] on {who}", "float32[2, 8] on rank 0"],
    "dtype": ["parameter '0.weight'", "float64[8, 4] on {who}", "float32[8, 4] on rank 0"],
    "more": ["rank 0 has 4 parameters", "{who} has 6", "parameter '3.weight' (float32[2, 2]) on {who}"],
    "fewer": ["rank 0 has 4 parameters", "{who} has 3", "parameter '2.bias' (float32[2]) on rank 0"],
}
CASES_2 = [(s, k) for s in ("allreduce", "ps", "ddp") for k in ("shape", "dtype", "more")]


@pytest.fixture(scope="module")
def mismatch_2_ranks():
    return run_ranks(distribute_mismatched, 2, CASES_2, 1, timeout=60, env=FAST_TIMEOUT)


@pytest.mark.parametrize("strategy,kind", CASES_2, ids=[f"{s}-{k}" for s, k in CASES_2])
def test_model_mismatch_raises_on_every_rank(mismatch_2_ranks, strategy, kind):
    messages = [result[strategy, kind] for result in mismatch_2_ranks]
    assert messages[1] == messages[0], "every rank must raise the same error"
    for part in EXPECTED[kind]:
        assert part.format(who="worker 1 (rank 1)") in messages[0]
    assert "Every rank must build the same model" in messages[0]


def test_model_mismatch_on_a_server_at_3_ranks():
    # ps checks every rank, servers included: the server built a model without the last bias.
    results = run_ranks(distribute_mismatched, 3, [("ps", "fewer")], 2, servers=1, timeout=60, env=FAST_TIMEOUT)
    messages = [result["ps", "fewer"] for result in results]
    assert messages[1] == messages[2] == messages[0]
    for part in EXPECTED["fewer"]:
        assert part.format(who="server 0 (rank 2)") in messages[0]


# -- bad options and misuse ------------------------------------------------------------------------
def misuse() -> dict:
    """Each misuse in turn on a 1-rank job: (error type, message), or what happened instead."""
    def attempt(strategy="allreduce", extra_params=(), **options):
        model = mlp()
        opt = torch.optim.SGD(list(model.parameters()) + list(extra_params), lr=0.1)
        gradsync.distribute(model, opt, strategy, exit_servers=False, **options)
        return model, opt

    def twice():
        model, opt = attempt()
        gradsync.distribute(model, opt, "allreduce")

    def on_meta():
        with torch.device("meta"):
            model = mlp()
        gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce", exit_servers=False)

    cases = {
        "optimizer not an optimizer": lambda: gradsync.distribute(mlp(), "sgd", exit_servers=False),
        "model not a module": lambda: gradsync.distribute("model", torch.optim.SGD(mlp().parameters(), lr=0.1)),
        "model on the meta device": on_meta,
        "unknown strategy": lambda: attempt("allreduse"),
        "bucket_mb=0": lambda: attempt(bucket_mb=0),
        "unknown option": lambda: attempt(bucket_megabytes=4),
        "ps mode": lambda: attempt("ps", mode="nope"),
        "ps-async made sync": lambda: attempt("ps-async", mode="sync"),
        "unknown compressed-strategy option": lambda: attempt("casync-ring", bucket_megabytes=4),
        "ddp bucket_mb not a number": lambda: attempt("ddp", bucket_mb="big"),
        "hybrid sparse as one name": lambda: attempt("hybrid", sparse="nope.weight"),
        "ps-async without servers": lambda: attempt("ps-async"),
        "foreign tensor": lambda: attempt(extra_params=[torch.zeros(3, requires_grad=True)]),
        "distributed twice": twice,
    }
    out = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - the test asserts on the type
            out[name] = (type(exc).__name__, str(exc))
    return out


MISUSE = {  # case -> parts of the ConfigError's message
    "optimizer not an optimizer": ["optimizer must be a torch.optim.Optimizer", "got str"],
    "model not a module": ["model must be a torch.nn.Module, got str"],
    "model on the meta device": ["on the meta device", "model.to_empty(device=...)"],
    "unknown strategy": ["unknown strategy 'allreduse'", "valid strategies: allreduce, allreduce-priority, casync-ps, casync-ring, compressed-allgather, ddp, diloco, hybrid, local-sgd, p3, pair-averaging, ps, ps-async, ps-sliced, sma"],
    "bucket_mb=0": ["bucket sizes must be > 0 MB", "bucket_mb=0"],
    "unknown option": ["strategy 'allreduce' has no option 'bucket_megabytes'", "its options: bucket_mb"],
    "ps mode": ["ps mode must be 'sync' or 'async'", "'nope'"],
    "ps-async made sync": ["strategy 'ps-async' has no option 'mode'", "its options: fuse_kb"],
    "unknown compressed-strategy option": ["has no option 'bucket_megabytes'"],
    "ddp bucket_mb not a number": ["ddp bucket_mb must be a number > 0 (MB), got 'big'"],
    "hybrid sparse as one name": ["hybrid: 'nope.weight' is not a trainable parameter"],  # the name, not its letters
    "ps-async without servers": ["needs dedicated server ranks", "--servers 1", "GRADSYNC_NUM_SERVERS"],
    "foreign tensor": ["param_groups[0]['params'][4] (shape [3])", "not a parameter of the model"],
    "distributed twice": ["already passed to gradsync.distribute"],
}


@pytest.fixture(scope="module")
def misuse_results():
    return run_ranks(misuse, 1, timeout=60)[0]


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_config_error(misuse_results, case):
    kind, message = misuse_results[case]
    assert kind == "ConfigError", (kind, message)
    for part in MISUSE[case]:
        assert part in message


# -- a rank that dies or hangs in the middle of training ---------------------------------------------
def train_until_fault(strategy: str, fault: str, options: dict, report: str | None = None):
    """Train 5 steps; in step 3, rank 1 dies (``os._exit``) at ``fault``, hangs, or stops (SIGSTOP,
    while the others compute for 2 s first). A survivor's error is re-raised with the seconds it took
    from the start of step 3; one that the watchdog ends the process with (``ddp``) is written to
    ``report``, with the same seconds."""
    topo = gradsync.topology()
    model = mlp()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy,
                              exit_servers=False, **options)
    if topo.is_server:
        return None
    faulty, current = topo.rank == 1, [0]
    if report is not None:
        from gradsync import watchdog

        end, step_started = watchdog._end_process, [0.0]

        def reported(error):
            seconds = time.monotonic() - step_started[0]
            Path(report).write_text(f"{type(error).__name__}: {error} [{seconds:.2f} s into step 3]")
            end(error)

        watchdog._end_process = reported
    if faulty and fault == "mid-backward":  # layer 0 gets its gradient last: later buckets are sent
        model[0].weight.register_hook(lambda grad: os._exit(1) if current[0] == 3 else None)
    for step in range(5):
        start, current[0] = time.monotonic(), step
        if report is not None:
            step_started[0] = start
        try:
            if faulty and step == 3 and fault == "hang":
                time.sleep(3600)
            if step == 3 and fault == "stop-then-compute":
                if faulty:
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(2.0)  # the survivors' compute: their next operation starts 2 s after the fault
            loss = model(torch.randn(4, 4)).pow(2).mean()
            loss.backward()
            if faulty and step == 3 and fault == "before-step":
                os._exit(1)
            opt.step()
            opt.zero_grad()
        except gradsync.PeerFailureError as exc:
            raise gradsync.PeerFailureError(f"{exc} [{time.monotonic() - start:.2f} s into step 3]") from exc
    return None


def seconds_into_step(message: str) -> float:
    return float(re.search(r"\[([\d.]+) s into step 3\]", message).group(1))


DEATHS = [  # (strategy, options, workers, servers, where rank 1 dies, hosts: 2 x 2 or one rank each)
    ("allreduce", {"bucket_mb": 0.0001}, 2, 0, "mid-backward", 1),
    ("ps", {}, 2, 1, "before-step", 1),
    # diloco synchronizes at steps 2 and 4: rank 1 dies before its 4th, the survivor's sync names it
    ("diloco", {"H": 2}, 2, 0, "before-step", 1),
    # two hosts of two workers: rank 1 dies inside its host's sums (the two-level groups, which
    # ps's host sums use too)
    ("allreduce", {"bucket_mb": 0.0001}, 4, 0, "mid-backward", 2),
]


@pytest.mark.parametrize("strategy,options,workers,servers,fault,per_host", DEATHS,
                         ids=[f"{d[0]}-w{d[2]}-s{d[3]}-{d[4]}" + ("-2x2" if d[5] > 1 else "") for d in DEATHS])
def test_dead_rank_is_named_by_survivors(strategy, options, workers, servers, fault, per_host):
    started = time.monotonic()
    env = None if per_host == 1 else [{"GRADSYNC_HOST": f"h{r // per_host}", "LOCAL_WORLD_SIZE": str(per_host)}
                                      for r in range(workers)]
    errors = run_ranks_expect_failure(train_until_fault, workers + servers, strategy, fault, options,
                                      servers=servers, timeout=60, env=env)
    elapsed = time.monotonic() - started
    assert "exited with code 1" in errors.get(1, ""), errors
    survivors = [r for r in range(workers + servers) if r != 1]
    assert sorted(errors) == sorted(survivors + [1]), f"a survivor did not fail: {errors}"
    for rank in survivors:
        last = errors[rank].strip().splitlines()[-1]
        assert "PeerFailureError" in last and "worker 1 (rank 1)" in last and "stopped responding" in last, last
        if rank < workers:  # workers measure from the start of step 3 (servers serve in a loop)
            assert seconds_into_step(last) < 20, last
    assert elapsed < 40, f"the job took {elapsed:.1f} s to fail"


class TableNet(nn.Module):
    """A table whose steps touch few rows (``hybrid`` serves it from its row servers) and an MLP."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(1000, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, ids):
        return self.mlp(self.emb(ids).mean(1))


SLOW_STEP, STUCK_STEP = 2, 5


def stuck_in_user_code(strategy: str):
    """Worker 2 takes one slow step (0.5x the timeout) in its own code at step ``SLOW_STEP``, then
    sleeps there for 3x the timeout at step ``STUCK_STEP`` (a stuck data loader), after writing
    when into the store. A rank's error is re-raised with the seconds since the hang."""
    topo, rt = gradsync.topology(), gradsync.runtime.current()
    model = TableNet()

    def after_the_hang(exc: BaseException) -> gradsync.PeerFailureError:
        hung = float(rt.store.get("stuck at")) if rt.store.check(["stuck at"]) else float("nan")
        return gradsync.PeerFailureError(f"{exc} [{time.time() - hung:.2f} s after the hang]")

    try:
        opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, exit_servers=False)
        if topo.is_server:
            return None
        for step in range(STUCK_STEP + 3):
            if topo.rank == 2 and step == SLOW_STEP:
                time.sleep(rt.timeout_s / 2)
            if topo.rank == 2 and step == STUCK_STEP:
                rt.store.set("stuck at", repr(time.time()))
                time.sleep(3 * rt.timeout_s)
            model(torch.randint(0, 1000, (4, 3))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.close()  # pair-averaging: no barrier in training; its goodbye waits for every worker
    except gradsync.PeerFailureError as exc:
        raise after_the_hang(exc) from exc
    except RuntimeError as exc:  # ddp: Gloo's error out of PyTorch's reducer, explained as the excepthook does
        raise after_the_hang(rt.explain("DDP's all-reduce", exc)) from exc
    return None


STUCK = [  # (strategy, servers): one per family of waits (a compression thread's: casync-ring, below)
    ("allreduce", 0),  # a collective on the training thread (ddp's reducer waits alike: its stopped peer, below)
    ("ps-async", 1),  # a server's receive from any worker
    ("ps", 1),  # a dedicated server's wait for every worker's header (the workers wait for its answers)
    ("p3", 0),  # the training thread waits for slices; keep-alives keep the links busy
    ("hybrid", 0),  # row servers on every worker's threads
    ("pair-averaging", 0),  # no barrier while training: the goodbye at the end waits
]


@pytest.mark.alone  # asserts the seconds to the error
@pytest.mark.parametrize("strategy,servers", STUCK, ids=[s for s, _ in STUCK])
def test_a_rank_stuck_in_its_own_code_is_named_within_the_timeout(strategy, servers):
    """The stuck rank's heartbeat and its strategy's threads stay alive: what counts is that its
    training thread has been outside every gradsync operation. The waiting ranks fail within the
    timeout (2 s) of the hang plus 2 s, naming it; its slow step of 1 s before is not flagged."""
    timeout = 2
    waiting = [r for r in range(3 + servers) if r != 2] if strategy != "ps-async" else [3]
    errors = run_ranks_expect_failure(stuck_in_user_code, 3 + servers, strategy, servers=servers, timeout=60,
                                      env={"GRADSYNC_TIMEOUT": str(timeout)}, wait_for=waiting)
    for rank in waiting:
        assert rank in errors, f"rank {rank} did not fail: {errors}"
        last = errors[rank].strip().splitlines()[-1]
        assert "PeerFailureError" in last and "worker 2 (rank 2) is alive but has not reached this operation" in last, last
        assert f"at step {STUCK_STEP + 1}" in last and "its own code" in last, last
        seconds = float(re.search(r"\[([\d.]+) s after the hang\]", last).group(1))
        assert timeout - 1 <= seconds <= timeout + 2, last


@pytest.mark.alone  # asserts the seconds to the error
@pytest.mark.parametrize("strategy", ["ps", "casync-ring", "ddp"])
def test_a_peer_stopped_before_the_next_operation_is_named_within_the_timeout_of_the_fault(strategy, tmp_path):
    """Gloo's timeout counts from an operation's start; the survivors' next one starts 2 s after
    rank 1 stopped. The error still comes within the timeout (4 s) of the fault: nothing completed
    for 4 s and the heartbeat watch saw rank 1 stand still. ``ps`` waits in a receive (its waiter
    thread), ``casync-ring``'s training thread for its communication thread, which is blocked in a
    receive (``runtime.check_progress``), ``ddp`` in PyTorch's reducer, which no exception reaches:
    the watchdog ends the process. (A collective of gradsync's own on the training thread, as
    ``allreduce`` waits, is the stuck-rank test's and the watch's unit test's.)"""
    report = tmp_path / "watchdog.txt" if strategy == "ddp" else None
    errors = run_ranks_expect_failure(train_until_fault, 2, strategy, "stop-then-compute", {},
                                      None if report is None else str(report), timeout=40,
                                      env={"GRADSYNC_TIMEOUT": "4"}, wait_for=[0])
    if report is None:
        last = errors[0].strip().splitlines()[-1]
    else:  # the watchdog ended the process: no report, the error is in ``report``
        assert "exited with code 1 without reporting" in errors[0], errors[0]
        last = report.read_text()
        assert "DDP's all-reduce" in last, last
    assert "PeerFailureError" in last and "worker 1 (rank 1) stopped responding" in last, last
    assert "nothing completed for" in last, last  # its next operation (ps: a receive) starts after the fault
    if strategy == "casync-ring":
        assert "wait for the compressed buckets" in last, last
    assert seconds_into_step(last) <= 4.5, last  # 6 s when an operation started after the fault waits out its timeout


def stop_the_store_host_at_start():
    """Rank 0, which serves the store, stops right after every rank joined; rank 1 computes for 2 s,
    then distributes (its first operation, the model check): the error is re-raised with its seconds.
    Rank 0 waits for rank 1's word that its gradsync.init() returned: stopped earlier, it would
    leave rank 1 in the rendezvous, which waits for a late store host far longer (RENDEZVOUS_MIN_S)."""
    store = gradsync.runtime.current().store
    if gradsync.topology().rank == 0:
        store.wait(["rank 1 joined"])
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        store.set("rank 1 joined", "1")
    start = time.monotonic()
    time.sleep(2.0)
    model = mlp()
    try:
        gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce")
    except gradsync.PeerFailureError as exc:
        raise gradsync.PeerFailureError(f"{exc} [{time.monotonic() - start:.2f} s into step 3]") from exc
    raise AssertionError(f"distribute returned {time.monotonic() - start:.2f} s in, with the store host stopped")


@pytest.mark.alone  # asserts the seconds to the error
def test_a_store_host_stopped_at_start_is_named_within_the_timeout_of_the_fault():
    """Rank 0 serves the rendezvous store: stopped before the others' heartbeats saw it beat, it
    leaves the watch nothing to see; the store's silence is the sign instead."""
    errors = run_ranks_expect_failure(stop_the_store_host_at_start, 2, timeout=40,
                                      env={"GRADSYNC_TIMEOUT": "4"}, wait_for=[1])
    assert 1 in errors, "rank 1 reported no error within 40 s"
    last = errors[1].strip().splitlines()[-1]
    assert "PeerFailureError" in last and "rank 0, which hosts the rendezvous store, is unreachable" in last, last
    assert seconds_into_step(last) <= 4.5, last


def paused_together(strategies: list[str]) -> dict:
    """Each strategy in turn: every worker pauses 1.5x the timeout between two steps (an evaluation),
    and training goes on. Returns per strategy the parameters and the pings sent meanwhile."""
    topo, rt = gradsync.topology(), gradsync.runtime.current()
    out = {}
    for strategy in strategies:
        model = TableNet()
        opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, exit_servers=False)
        if topo.is_server:
            continue  # distribute returned when the workers closed
        for step in range(4):
            if step == 2:
                time.sleep(1.5 * rt.timeout_s)
            ids = torch.randint(0, 1000, (4, 3), generator=torch.Generator().manual_seed(10 * step + topo.rank))
            model(ids).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        keepalive = getattr(opt._gradsync.strategy, "keepalive", None)
        out[strategy] = {"params": [p.detach().clone() for p in model.parameters()],
                         "pings": keepalive.pings if keepalive is not None else 0}
        opt.close()
    return out


@pytest.mark.parametrize("strategies,servers", [(["hybrid", "pair-averaging"], 0), (["ps", "ps-async"], 1)],
                         ids=["colocated", "dedicated"])
def test_a_pause_of_every_worker_longer_than_the_timeout_is_no_fault(strategies, servers):
    """Servers that wait for the next request (hybrid's rows, pair-averaging's models, dedicated
    parameter servers) are pinged while their workers pause: without, Gloo's receive timed out and
    broke the job at the first evaluation longer than GRADSYNC_TIMEOUT."""
    results = run_ranks(paused_together, 2 + servers, strategies, servers=servers, timeout=90,
                        env={"GRADSYNC_TIMEOUT": "2"})
    for strategy in strategies:
        workers = [results[r][strategy] for r in range(2)]
        assert all(w["pings"] > 0 for w in workers), (strategy, workers)
        if strategy in ("hybrid", "ps"):  # synchronous: every worker holds the same model
            for a, b in zip(workers[0]["params"], workers[1]["params"]):
                assert torch.equal(a, b), strategy


def test_a_server_names_a_worker_the_others_left_behind_not_a_pause_of_all():
    """Absences: with pings, a server's wait outlives its workers; it names a worker only when its
    last request is the timeout old and another worker has gone on to a later step."""
    from gradsync.strategies.keepalive import Absences

    absences = Absences([0, 1, 2], timeout_s=0.0)
    for worker in (0, 1, 2):
        absences.request(worker, 5)
    assert absences.behind([0, 1, 2]) == []  # every worker paused after step 5: an evaluation
    absences.request(0, 6)
    absences.request(1, 6)
    assert absences.behind([0, 1, 2]) == [2]
    slower = Absences([0, 1], timeout_s=60.0)
    slower.request(0, 6)
    slower.request(1, 5)
    assert slower.behind([1]) == []  # behind by a step for less than the timeout: merely slower


def test_who_is_behind_is_read_from_the_heartbeats():
    """Only a worker outside every gradsync operation for half the timeout is named; a rank waiting
    with the others, one computing a normal step, one whose training thread is not known (a loop
    off the main thread) and a server are not, and with nobody behind it is "no peer died"."""
    from types import SimpleNamespace

    from gradsync.runtime import Runtime
    from gradsync.topology import Topology

    positions = {1: (6, True, 9.0), 2: (6, False, 9.5), 3: (6, False, 1.0), 4: (1, None, 60.0), 5: (1, False, 60.0)}
    heartbeat = SimpleNamespace(positions=lambda: positions, silent_ranks=lambda fresh: [], left=lambda ranks: [])
    rt = Runtime(Topology(6, 0, 1), None, 10.0, heartbeat)  # rank 5 is the server
    assert rt.behind() == [(2, 6, 9.5)]
    message = str(rt.explain("all-reduce of bucket 0", TimeoutError("Timed out waiting 9700ms")))
    assert "worker 2 (rank 2) is alive but has not reached this operation" in message, message
    assert "for 9.5 s at step 6" in message and "GRADSYNC_TIMEOUT" in message, message
    positions[2] = (6, True, 9.5)
    message = str(rt.explain("all-reduce of bucket 0", TimeoutError("Timed out waiting 9700ms")))
    assert "no peer died; the operation did not complete within 10 s" in message, message


def test_the_watchdog_acts_only_inside_a_window(monkeypatch):
    """Outside a window (an evaluation, a checkpoint, the end of training) an overdue rank is left
    alone; inside one the watchdog ends the process with the error."""
    from types import SimpleNamespace

    from gradsync import runtime, watchdog

    error = gradsync.PeerFailureError("rank 1 stopped responding")
    transport = SimpleNamespace(progress=0.0, until_overdue=lambda: 0.0)
    monkeypatch.setattr(runtime, "_RUNTIME", SimpleNamespace(transport=transport, overdue=lambda what: error,
                                                             peer_lost=None))
    ended = []
    monkeypatch.setattr(watchdog, "_end_process", ended.append)
    monkeypatch.setattr(watchdog, "IDLE_S", 0.01)
    dog = watchdog.Watchdog("a test's wait")
    dog.enter()
    dog.leave()
    time.sleep(0.3)
    assert ended == []
    dog.enter()
    deadline = time.monotonic() + 5
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.close()
    assert ended and ended[0] is error


def test_the_launchers_notice_leaves_a_call_inside_pytorch_to_fail_on_its_own(monkeypatch):
    """In an elastic job the launcher's word that a member is gone ends gradsync's own waits at once.
    A watchdog's window (DDP's reducer) is left to fail on its own, as it does when the lost
    member's connections reset, and the process is ended only once nothing completed for the whole
    timeout: a survivor ended at the notice would leave its job a member short."""
    from types import SimpleNamespace

    from gradsync import runtime, watchdog
    from gradsync.transport import REPORT_S

    error = gradsync.PeerFailureError("DDP's all-reduce failed on worker 2: the elastic launcher lost a member")
    left = [5.0]  # seconds until the timeout, less REPORT_S, since the last completed operation
    transport = SimpleNamespace(progress=0.0, until_overdue=lambda: left[0])
    monkeypatch.setattr(runtime, "_RUNTIME", SimpleNamespace(transport=transport, overdue=lambda what: error,
                                                             peer_lost="the elastic launcher lost a member"))
    ended = []
    monkeypatch.setattr(watchdog, "_end_process", ended.append)
    dog = watchdog.Watchdog("DDP's all-reduce")
    dog.enter()
    for seconds_left in (5.0, 0.0, -REPORT_S + 0.05):  # before the deadline, at it, within REPORT_S after
        left[0] = seconds_left
        dog._wake.set()  # look again now
        time.sleep(0.3)
        assert ended == [], seconds_left
    left[0] = -REPORT_S - 0.05  # the whole timeout has passed: PyTorch's call did not fail on its own
    dog._wake.set()
    deadline = time.monotonic() + 5
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.close()
    assert ended and ended[0] is error


class _Clock:
    """A fake ``time`` for :class:`gradsync.heartbeat.Heartbeat`: sleeping advances it; the live peer
    (rank 2) beats once a second of it, rank 1 is stopped."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds

    def counts(self):
        return {1: 5, 2: 7 + int(self.now + 1e-9)}


def _heartbeat(monkeypatch):
    import threading

    from gradsync import heartbeat as module

    clock = _Clock()
    monkeypatch.setattr(module, "time", clock)
    heartbeat = module.Heartbeat.__new__(module.Heartbeat)  # no store: the counts come from the clock
    heartbeat._lock, heartbeat._seen, heartbeat.answered = threading.Lock(), {}, float("inf")
    heartbeat.beats = clock.counts
    return heartbeat, clock


@pytest.mark.parametrize("watched_beats,waited", [(3, 0.0), (0, 2.5), (1, 1.5)])
def test_a_watched_silent_peer_is_named_at_the_timeout(monkeypatch, watched_beats, waited):
    """A wait near the timeout is watched (the heartbeat thread reads the peers' counters each
    beat), so at the timeout the stopped rank, and the live one, are known at once; unwatched, the
    stopped one after a whole silence window; watched briefly, after the rest of it."""
    heartbeat, clock = _heartbeat(monkeypatch)
    for _ in range(watched_beats):
        heartbeat._watch()
        clock.now += 1.0
    start = clock.now
    assert heartbeat.silent_ranks(window_s=2.5) == [1]
    assert clock.now - start == pytest.approx(waited, abs=0.11)


def test_a_communication_error_raised_inside_pytorch_is_explained_before_its_traceback(monkeypatch, capsys):
    """DDP's reducer (or a script's own collective) raises Gloo's error straight into the user's
    code; gradsync's excepthook names the silent peer first, then hands over to the usual hook."""
    from types import SimpleNamespace

    from gradsync import runtime

    def explain(what, exc):
        return gradsync.PeerFailureError(f"{what} failed on worker 0 (rank 0): worker 1 (rank 1) stopped "
                                         f"responding. Original error: {exc}")

    shown = []
    monkeypatch.setattr(runtime, "_RUNTIME", SimpleNamespace(explain=explain))
    monkeypatch.setattr(runtime, "_PREVIOUS_HOOK", lambda kind, value, tb: shown.append(value))
    gloo = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    runtime._explain_uncaught(RuntimeError, gloo, None)
    assert capsys.readouterr().err.strip() == ("gradsync: a collective inside PyTorch (DDP's all-reduce, or the "
                                               "script's own) failed on worker 0 (rank 0): worker 1 (rank 1) "
                                               "stopped responding")
    other = ValueError("a bug in the script")
    runtime._explain_uncaught(ValueError, other, None)
    assert capsys.readouterr().err == "" and shown == [gloo, other]


EXIT_AFTER_FAILURE = """
import sys, threading, time
from types import SimpleNamespace
from gradsync import flight, runtime

recorder = flight.FlightRecorder(0, "worker 0 (rank 0)")
flight.install(recorder)
closed = []

def failing_close():
    raise RuntimeError("the strategy's goodbye failed")

runtime._RUNTIME = SimpleNamespace(closers=[lambda: closed.append("first"), failing_close],
                                   transport=SimpleNamespace(failure=RuntimeError("peer lost"), waiter=None), hosts_store=False,
                                   heartbeat=None, responder=None, owns_group=False, store_lost=False)
blocked = threading.Event()

def receive():  # a communication thread blocked in the broken group, as when a peer's link is down
    recorder.block(recorder.issue("message from rank 1", "recv", 8, peer=1), main=False)
    blocked.set()
    time.sleep(60)

threading.Thread(target=receive, daemon=True).start()
blocked.wait()
sys.stdout.write("unflushed output " + ("blocked" if sys.argv[1] == "blocked" else ""))
if sys.argv[1] != "blocked":
    recorder.blocked.clear()
try:
    runtime._shutdown_at_exit()
except RuntimeError as exc:
    print(f"; raised: {exc}; closed: {closed}")
"""


@pytest.mark.parametrize("case", ["blocked", "not-blocked"])
def test_after_a_peer_failure_a_rank_with_a_blocked_thread_exits_with_status_1(case):
    """A thread blocked in a torch call on a broken group must not return into a finalizing
    interpreter (SIGABRT): the rank exits with status 1 after flushing its output. Every closer
    runs although one raised; without a blocked thread the error is raised and exit is normal."""
    done = subprocess.run([sys.executable, "-c", EXIT_AFTER_FAILURE, case], capture_output=True, text=True,
                          timeout=60)
    if case == "blocked":
        assert done.returncode == 1 and done.stdout == "unflushed output blocked", (done.stdout, done.stderr)
        assert "gradsync: while shutting down: RuntimeError: the strategy's goodbye failed" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == ("unflushed output ; raised: the strategy's goodbye failed; "
                                       "closed: ['first']"), done.stdout


def test_an_elastic_rank_must_join_through_gradsync_init():
    """The runtime takes the elastic join from the layer above it (gradsync.adapt.elastic, which
    gradsync.init() imports in an elastic job); initialising the runtime directly says what to do."""
    code = ("import os\nos.environ['GRADSYNC_ELASTIC'] = '1'\nfrom gradsync import errors, runtime\n"
            "try:\n    runtime.init()\nexcept errors.ConfigError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "call gradsync.init() first" in done.stdout, (done.stdout, done.stderr)


# -- the rendezvous port is taken ------------------------------------------------------------------
INIT_RANK = """
import time, gradsync, gradsync.runtime
gradsync.runtime.RENDEZVOUS_MIN_S = 0  # wait GRADSYNC_TIMEOUT for rank 0's store, not the 60 s floor
start = time.monotonic()
try:
    gradsync.init()
except gradsync.GradsyncError as exc:
    print(f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}")
    raise SystemExit(3)
"""


def test_port_in_use_fails_every_rank_in_bounded_time():
    with socket.socket() as holder:  # another program listening on MASTER_PORT
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GRADSYNC_TIMEOUT="3")
        ranks = [subprocess.Popen([sys.executable, "-c", INIT_RANK], env=dict(env, RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        try:
            outputs = [rank.communicate(timeout=45)[0] for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
    assert [rank.returncode for rank in ranks] == [3, 3], outputs
    assert outputs[0].startswith("ConfigError"), outputs[0]
    assert f"rank 0 cannot listen on 127.0.0.1:{port}: the port is in use" in outputs[0]
    assert "MASTER_PORT" in outputs[0] and "gradsync run --port" in outputs[0]
    assert outputs[1].startswith("GradsyncError after 3.0 s"), outputs[1]
    assert "worker 1 (rank 1) got no answer from the rendezvous store" in outputs[1]
    assert "rank 0 is not running" in outputs[1]


# -- workers that run different numbers of steps ---------------------------------------------------
def uneven_steps(steps_by_rank: dict, strategy: str = "ps"):
    topo = gradsync.topology()
    model = mlp()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, exit_servers=False)
    for _ in range(steps_by_rank.get(topo.rank, 0)):
        model(torch.randn(4, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_workers_out_of_step_with_a_server():
    started = time.monotonic()
    errors = run_ranks_expect_failure(uneven_steps, 3, {0: 3, 1: 2}, servers=1, timeout=40)
    elapsed = time.monotonic() - started
    last = errors[2].strip().splitlines()[-1]
    assert last.startswith("gradsync.errors.GradsyncError: workers are out of step"), last
    assert "worker 0 (rank 0): starting step 3" in last and "worker 1 (rank 1): stopped after 2 steps" in last
    assert "same number of optimizer steps" in last
    assert "server 0 (rank 2) stopped responding" in errors[0], errors[0]  # worker 0 waited for its pull
    assert elapsed < 20, f"the job took {elapsed:.1f} s to end"


@pytest.mark.parametrize("strategy,steps,late", [
    ("p3", {0: 3, 1: 2}, 0),  # rank 0's third push goes to a server (rank 1) that has stopped
    ("allreduce-priority", {0: 2, 1: 3}, 1),  # rank 0, which schedules, stops first
])
def test_overlapping_strategies_raise_instead_of_hanging_when_out_of_step(strategy, steps, late):
    started = time.monotonic()
    errors = run_ranks_expect_failure(uneven_steps, 2, steps, strategy, timeout=40, wait_for=[late])
    assert time.monotonic() - started < 30
    last = errors[late].strip().splitlines()[-1]
    early = 1 - late
    assert last.startswith("gradsync.errors.GradsyncError: workers are out of step"), last
    assert f"worker {early} (rank {early}) stopped after 2 steps while worker {late} (rank {late}) has taken 3" in last


def test_an_operation_that_cannot_start_on_a_broken_pair_names_the_peer(monkeypatch):
    """Gloo closes a pair whose receive timed out; a send issued on it afterwards fails at once,
    before any wait. That failure is explained as a failed wait is (the rank is marked failed, so
    it exits with status 1 instead of aborting with threads blocked), while a bad argument stays
    torch's own error."""
    from types import SimpleNamespace

    from gradsync import transport as module
    from gradsync.topology import Topology

    def send(tensors, dst, tag):
        raise RuntimeError("Application timeout caused pair closure")

    def recv(tensors, src, tag):
        raise RuntimeError("Tensors must be contiguous")

    world = SimpleNamespace(send=send, recv=recv)
    monkeypatch.setattr(module, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=world)))
    explained = []

    def explain(what, exc):
        explained.append(what)
        return gradsync.PeerFailureError(f"{what} failed: rank 1 stopped responding. Original error: {exc}")

    tr = module.Transport(Topology(world_size=2, rank=0, num_servers=0), None, torch.device("cpu"), explain)
    with pytest.raises(gradsync.PeerFailureError, match="pair closure"):
        tr.send_async(torch.zeros(2), 1, 0, what="slice 3 to rank 1")
    assert explained == ["slice 3 to rank 1"]
    with pytest.raises(RuntimeError, match="contiguous") as raised:
        tr.recv_async(torch.zeros(2), 1, 0, what="rows from rank 1")
    assert not isinstance(raised.value, gradsync.PeerFailureError) and explained == ["slice 3 to rank 1"]


def test_a_channel_takes_world_ranks_and_refuses_a_receive_from_any_rank(monkeypatch):
    """A channel (Transport.channel) is a group of the workers: messages name world ranks, mapped to
    the channel's own; a receive from whichever rank sends first exists on the world group only."""
    from types import SimpleNamespace

    from gradsync import transport as module
    from gradsync.topology import Topology

    calls = []
    channel = SimpleNamespace(send=lambda t, dst, tag: calls.append(("send", dst)) or "work",
                              recv=lambda t, src, tag: calls.append(("recv", src)) or "work")
    ranks = {2: 7}  # a made-up answer of the group: world rank 2 is its rank 7
    monkeypatch.setattr(module, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=None),
                                                        get_group_rank=lambda group, rank: ranks[rank]))
    tr = module.Transport(Topology(world_size=3, rank=0, num_servers=0), None, torch.device("cpu"), None)
    tr.send_async(torch.zeros(2), 2, 0, channel=channel)
    tr.recv_async(torch.zeros(2), 2, 0, channel=channel)
    assert calls == [("send", 7), ("recv", 7)]
    with pytest.raises(ValueError, match="any rank goes on the world group"):
        tr.recv_async(torch.zeros(2), None, 0, channel=channel)
