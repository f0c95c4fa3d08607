"""The straggler monitor: each worker's pace, the verdict that names who holds the others back and
why, the link probe, and where the verdict shows (bench table, flight summary, the adapt monitor)."""
import time

import pytest

from gradsync import flight, stragglers
from gradsync.bench import report

from multirank import run_ranks


def pace(compute, wait, between=0.001, links=None, sent=0.0):
    return {"compute": compute, "between": between, "wait": wait, "links": links or {}, "sent": sent}


def test_a_balanced_job_names_no_one():
    paces = {r: pace(0.100 + 0.002 * r, 0.020 - 0.002 * r) for r in range(4)}
    assert stragglers.verdict(paces) == []


@pytest.mark.parametrize("factor", [1.1, 1.25, 1.5, 2.0])
def test_the_slow_worker_is_named_for_its_compute(factor):
    # Rank 2 computes longer; the others wait for it at the synchronization point.
    extra = 0.1 * (factor - 1)
    paces = {r: pace(0.1, 0.02 + extra) for r in range(4)}
    paces[2] = pace(0.1 * factor, 0.02)
    [found] = stragglers.verdict(paces)
    assert (found.rank, found.cause) == (2, "compute")
    assert found.ratio == pytest.approx(factor)
    assert found.held_s == pytest.approx(extra)
    assert "rank 2 holds the others back: it computes" in found.describe()


def test_a_10_percent_straggler_is_named_through_noisy_waits():
    # Rank 1 computes 7 % longer; the others' waits, which also hold the all-reduce's own time,
    # read only 40 % of that longer than its wait in this window (measured: ResNet-50, 4 workers).
    paces = {0: pace(0.506, 0.293), 1: pace(0.554, 0.271), 2: pace(0.528, 0.276), 3: pace(0.516, 0.287)}
    assert [(s.rank, s.cause) for s in stragglers.verdict(paces)] == [(1, "compute")]


def test_where_the_job_waits_for_the_network_only_a_real_share_of_the_wait_names_a_worker():
    # ResNet-50, 4 workers at 1 Gbit/s, dilated 2x (measured): a step is mostly a 2.4 s wait for
    # the network. Balanced workers' busy times differ by 10 % and rank 3 waits least, but what the
    # others wait longer (0.07 s) is 2.7 % of their wait: noise, no one is named.
    balanced = {0: pace(0.373, 2.393), 1: pace(0.417, 2.339), 2: pace(0.388, 2.407), 3: pace(0.427, 2.328)}
    assert stragglers.verdict(balanced) == []
    # Rank 1 at 2x compute: the others wait 0.21 s longer, 8.6 % of their wait.
    slowed = {0: pace(0.382, 2.440), 1: pace(0.592, 2.226), 2: pace(0.395, 2.435), 3: pace(0.366, 2.405)}
    assert [(s.rank, s.cause) for s in stragglers.verdict(slowed)] == [(1, "compute")]


def test_the_probe_reads_no_link_faster_than_its_train_arrived():
    bits, gap = 8 << 20, 0.0034  # 1 MB every 3.4 ms: a 2.5 Gbit/s link
    steady = [0.0002 + gap * (i + 1) for i in range(16)]  # and 0.2 ms on the way
    assert stragglers.train_rate(bits, 0.0, steady) == pytest.approx(2.47, rel=0.01)
    # The receiver, short of a core, wakes once for the last six arrivals: the gaps' median
    # collapses, the whole train still took as long.
    bunched = steady[:10] + [steady[-1] + 1e-5 * i for i in range(6)]
    assert stragglers.train_rate(bits, 0.0, bunched) == pytest.approx(2.47, rel=0.01)
    # A burst at line rate for the first messages does not lift the reading either.
    burst = [0.0002 * (i + 1) for i in range(3)] + [0.0006 + gap * (i + 1) for i in range(13)]
    assert stragglers.train_rate(bits, 0.0, burst) == pytest.approx(bits / gap / 1e9, rel=0.01)


def test_no_one_is_named_under_a_strategy_without_a_barrier():
    paces = {r: pace(0.1, 0.05) for r in range(4)}
    paces[1] = pace(0.2, 0.0)
    assert stragglers.verdict(paces)[0].rank == 1
    paces[1]["synchronous"] = False  # pair-averaging: the others do not wait for it
    assert stragglers.verdict(paces) == []


def test_a_slow_worker_nobody_waits_for_is_not_named():
    # Longer compute, but the others do not wait longer (an asynchronous strategy, or overlap).
    paces = {r: pace(0.1, 0.02) for r in range(4)}
    paces[1] = pace(0.15, 0.02)
    assert stragglers.verdict(paces) == []
    # It is slower all the same: named as such, its time hidden.
    [found] = stragglers.slower(paces)
    assert (found.rank, found.cause, found.hidden, found.held_s) == (1, "compute", True, 0.0)
    assert found.describe() == ("rank 1 computes 1.50x as long as the others but does not hold them back: "
                                "its extra time hides behind communication (they do not wait for it)")


def test_a_slower_worker_hidden_behind_the_network_is_named_as_such():
    # ResNet-50, 4 workers at 1 Gbit/s, dilated 2x, worker 1 at 1.25x (one round, measured): it
    # reads 1.15x busier, and the others wait 47 ms longer than it does, 2 % of their 2.4 s wait.
    # It holds no one back, and it is slower.
    slowed = {0: pace(0.283, 2.348), 1: pace(0.327, 2.328), 2: pace(0.293, 2.375), 3: pace(0.277, 2.387)}
    assert stragglers.verdict(slowed) == []
    [found] = stragglers.slower(slowed)
    assert (found.rank, found.cause, found.hidden) == (1, "compute", True)
    assert found.ratio == pytest.approx(0.327 / 0.283, rel=1e-3) and found.held_s == pytest.approx(0.047, abs=1e-3)
    assert "(they wait 47 ms a step for it)" in found.describe()
    # The same cluster balanced (the round of 40 whose busiest worker read most, 1.06x): no one slower.
    balanced = {0: pace(0.279, 2.364), 1: pace(0.271, 2.375, between=0.0), 2: pace(0.293, 2.379, between=0.0),
                3: pace(0.276, 2.385, between=0.0)}
    assert stragglers.slower(balanced) == []
    # A worker the verdict names is not named again as hidden; no barrier, nothing.
    held = {r: pace(0.1, 0.05) for r in range(3)}
    held[1] = pace(0.2, 0.0)
    assert stragglers.slower(held) == [] and stragglers.verdict(held)[0].rank == 1
    slowed[1]["synchronous"] = False
    assert stragglers.slower(slowed) == []
    # Over a job's first steps a median strays: no reading until every worker's pace holds enough.
    slowed[1]["synchronous"] = True
    slowed[2]["steps"] = stragglers.SETTLED - 1
    assert stragglers.slower(slowed) == []
    slowed[2]["steps"] = stragglers.SETTLED
    assert [s.rank for s in stragglers.slower(slowed)] == [1]


def test_time_between_steps_is_its_own_cause():
    paces = {r: pace(0.1, 0.05, between=0.001) for r in range(3)}
    paces[0] = pace(0.1, 0.01, between=0.041)  # a slow data loader
    [found] = stragglers.verdict(paces)
    assert (found.rank, found.cause) == (0, "between steps")
    assert "between steps" in found.describe()


def ring(n, slow=None, rate=10.0, slow_rate=5.0):
    """Probe readings as every worker keeps them: the rate from each ring neighbour to it."""
    links = {r: {} for r in range(n)}
    for dst in range(n):
        for src in ((dst - 1) % n, (dst + 1) % n):
            links[dst][str(src)] = slow_rate if slow in (src, dst) else rate
    return links


def test_a_slow_link_is_named_when_the_job_waits():
    # 50 MB a step: 40 ms at 10 Gbit/s, 80 ms at 5: the slow link accounts for the 50 ms wait.
    links = ring(4, slow=3)
    paces = {r: pace(0.1, 0.05, links=links[r], sent=50e6) for r in range(4)}
    [found] = stragglers.verdict(paces)
    assert (found.rank, found.cause, found.ratio) == (3, "link", 2.0)
    assert "its link" in found.describe()
    # Its neighbours' steps lengthen too (their sends wait on the slow link): still its link.
    paces[2] = pace(0.115, 0.035, links=links[2], sent=50e6)
    [found] = stragglers.verdict(paces)
    assert (found.rank, found.cause) == (3, "link")
    # A job that hardly waits is not held back by its links, slow or not.
    quiet = {r: pace(0.1, 0.001, links=links[r], sent=50e6) for r in range(4)}
    assert stragglers.verdict(quiet) == []
    # Equal links: no one.
    even = ring(4)
    assert stragglers.verdict({r: pace(0.1, 0.05, links=even[r], sent=50e6) for r in range(4)}) == []
    # A slow reading on a link that carries 50 kB a step (40 us at 10 Gbit/s) explains no 50 ms wait:
    # the worker that arrives last is named for its compute instead.
    light = {r: pace(0.1, 0.05, links=links[r], sent=50e3) for r in range(4)}
    light[1] = pace(0.15, 0.0, links=links[1], sent=50e3)
    assert [(s.rank, s.cause) for s in stragglers.verdict(light)] == [(1, "compute")]


def test_pace_counts_compute_between_and_wait():
    p = stragglers.Pace(window=1, warmup=0)  # the last step alone
    waited = 0.0
    p.end_step(waited, sent=1000)  # the first step ends: nothing to measure yet
    assert p.as_dict() is None and p.line() == ""
    time.sleep(0.02)  # between steps
    p.forward(waited)
    time.sleep(0.05)  # computing, and waiting 20 ms of it in gradsync operations
    waited += 0.02  # (counted by the flight recorder)
    p.end_step(waited, sent=3000)
    got = p.as_dict()
    assert got["sent"] == 2000
    assert got["between"] == pytest.approx(0.02, abs=0.01)
    assert got["wait"] == pytest.approx(0.02)
    assert got["compute"] == pytest.approx(0.03, abs=0.01)
    p.links = {1: 9.5}
    back = stragglers.parse(p.line().split())
    assert back.pop("links") == {"1": 9.5} and back.pop("synchronous") is True
    assert back.pop("steps") == got["steps"] == 1  # the window's steps: a median over few strays
    assert back == pytest.approx({k: got[k] for k in ("compute", "between", "wait", "sent")}, abs=1e-6)
    assert stragglers.parse(["x", "1", "2", "-"]) is None


def test_pace_is_the_median_of_its_window(monkeypatch):
    # A balanced worker on a shared host: every fifth step strays 40 % long. Its pace stays at its
    # usual step (a 10 % straggler's stands out against it); a change of pace shows once half the
    # window has turned over.
    clock = [0.0]
    monkeypatch.setattr(stragglers.time, "perf_counter", lambda: clock[0])
    p = stragglers.Pace(window=20, warmup=0)
    p.end_step(0.0)
    for step in range(40):
        p.forward(0.0)
        clock[0] += 0.14 if step % 5 == 4 else 0.10
        p.end_step(0.0, sent=1000 * (step + 1))
    assert p.compute == pytest.approx(0.10) and p.sent == 1000
    for _ in range(5):
        p.forward(0.0)
        clock[0] += 0.11
        p.end_step(0.0)
    assert p.compute == pytest.approx(0.10)
    for _ in range(6):
        p.forward(0.0)
        clock[0] += 0.11
        p.end_step(0.0)
    assert p.compute == pytest.approx(0.11)


def test_a_workers_first_steps_are_not_in_its_pace(monkeypatch):
    # A process that just started or joined: its first steps take twice as long (caches, the
    # allocator, lazy initialisation). They are left out; the pace is its usual step.
    clock = [0.0]
    monkeypatch.setattr(stragglers.time, "perf_counter", lambda: clock[0])
    p = stragglers.Pace()
    p.end_step(0.0)
    for step in range(stragglers.WARMUP_STEPS + 2):
        p.forward(0.0)
        clock[0] += 0.2 if step < stragglers.WARMUP_STEPS else 0.1
        p.end_step(0.0)
        assert (p.as_dict() is None) == (step < stragglers.WARMUP_STEPS), step
    assert p.compute == pytest.approx(0.1)


def test_bench_reports_the_verdict_of_most_rounds():
    rounds = [[[1, "compute", 1.5, 0.01]], [[1, "compute", 1.4, 0.01]], []]
    got = report.straggler_verdict(rounds)
    assert got["straggler_rounds"] == "2/3" and got["stragglers"][0]["rank"] == 1
    assert report.slow_column(got) == "1 compute"
    assert report.slow_column(report.straggler_verdict([[]])) == "-"
    hidden = report.straggler_verdict([[], []], [[[1, "compute", 1.15, 0.05]], [[1, "compute", 1.2, 0.04]]])
    assert (hidden["named"], hidden["hidden"], hidden["hidden_share"], hidden["hidden_rounds"]) == ("-", "1 compute", 1.0, "2/2")
    assert report.slow_column(hidden) == "(1 compute)"
    short = report.straggler_verdict([[]], [])  # rounds too short for the slower reading: none read
    assert (short["hidden"], short["hidden_rounds"], short["hidden_share"]) == ("-", "0/0", 0.0)


def test_the_flight_summary_names_the_straggler():
    dumps = {r: {"label": f"worker {r} (rank {r})", "time": 1.0, "step": 5, "waiting": None, "records": [],
                 "pace": pace(0.1, 0.05)} for r in range(3)}
    dumps[1]["pace"] = pace(0.2, 0.0)
    lines = flight.summarize(dumps, [0, 1, 2])
    assert lines[-1].startswith("rank 1 holds the others back: it computes 2.00x")


def train_with_a_slow_rank(slow_rank, factor, strategy):
    import os

    import torch

    import gradsync
    from gradsync import runtime

    os.environ["GRADSYNC_STRAGGLERS"] = "1"
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01), strategy, exit_servers=False)
    if gradsync.topology().is_server:
        return None
    me = gradsync.topology().rank
    for _ in range(stragglers.PROBE_FIRST + 4):
        loss = model(torch.randn(4, 32)).sum()
        time.sleep(0.02 * (factor if me == slow_rank else 1.0))  # "compute"
        loss.backward()
        opt.step()
        opt.zero_grad()
    recorder = flight.current()
    found = stragglers.verdict(stragglers.gather(runtime.current().transport, gradsync.topology(), recorder.pace))
    return [(s.rank, s.cause) for s in found], sorted(recorder.pace.links)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_job_names_its_slow_rank(strategy):
    # Three workers (ps: and a server); worker 1 computes 2x as long. Every worker's pace, gathered,
    # names it; the link probe ran at the same step on every worker and timed both neighbours.
    servers = 1 if strategy == "ps" else 0
    results = run_ranks(train_with_a_slow_rank, 3 + servers, 1, 2.0, strategy, servers=servers)
    for rank in range(3):
        found, peers = results[rank]
        assert found == [(1, "compute")], (rank, found)
        assert peers == [r for r in range(3) if r != rank]


def test_the_adapt_monitor_reports_worker_0s_verdict():
    from gradsync.adapt import Stragglers

    stragglers.reset()
    assert Stragglers().values()["straggler_rank"] == -1.0
    paces = {r: pace(0.1, 0.05) for r in range(3)}
    paces[2] = pace(0.2, 0.0)
    for _ in range(stragglers.CONFIRM):  # a verdict holds a few beats before it is reported
        stragglers.observe(paces)
    values = Stragglers().values()
    assert values["straggler_rank"] == 2.0 and values["straggler_cause"] == 1.0
    assert values["straggler_ratio"] == pytest.approx(2.0) and values["straggler_held_ms"] == pytest.approx(50.0)
    assert values["slower_rank"] == -1.0
    stragglers.reset()


def test_worker_0_prints_a_hidden_slower_worker_once_it_holds(capsys, monkeypatch):
    from gradsync.adapt import Stragglers

    monkeypatch.setenv(stragglers.ENV, "1")
    stragglers.reset()
    paces = {r: pace(0.1, 0.02) for r in range(4)}
    paces[3] = pace(0.13, 0.02)  # 1.3x busier; no one waits for it
    for _ in range(stragglers.CONFIRM_HIDDEN - 1):
        stragglers.observe(paces)
    assert stragglers.latest_hidden() == [] and capsys.readouterr().err == ""
    stragglers.observe(paces)
    assert [(s.rank, s.hidden) for s in stragglers.latest_hidden()] == [(3, True)] and stragglers.latest() == []
    assert capsys.readouterr().err.startswith("gradsync: rank 3 computes 1.30x as long as the others but does not hold")
    values = Stragglers().values()
    assert (values["straggler_rank"], values["slower_rank"]) == (-1.0, 3.0)
    assert values["slower_ratio"] == pytest.approx(1.3)
    stragglers.observe(paces)  # said once while it holds
    assert capsys.readouterr().err == ""
    # A new round (or generation) starts the workers' windows anew: their first steps change nothing.
    young = {r: {**pace(0.1, 0.02), "steps": 2} for r in range(4)}
    young[0] = {**pace(0.2, 0.0), "steps": 2}
    for _ in range(stragglers.CONFIRM_HIDDEN):
        stragglers.observe(young)
    assert capsys.readouterr().err == "" and [s.rank for s in stragglers.latest_hidden()] == [3]
    balanced = {r: pace(0.1, 0.02) for r in range(4)}
    for _ in range(stragglers.CONFIRM_HIDDEN):
        stragglers.observe(balanced)
    assert capsys.readouterr().err == "gradsync: no rank is slower than the others any longer\n"
    stragglers.reset()
