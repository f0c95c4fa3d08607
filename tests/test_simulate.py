"""The simulator against small cases computed by hand: the event engine's fair sharing, a
2-worker ring, one parameter server, P3 slices under credit, hybrid's row pulls and pushes; and `gradsync simulate` itself."""
import json
import math
import sys

import pytest
import torch

from gradsync.errors import ConfigError
from gradsync.simulate import Host, Network, SimulationError, simulate
from gradsync.simulate.engine import Link, Sim, Stream
from gradsync.simulate.workload import synthetic

FREE_HOST = Host(copy_Bps=1e18, update_Bps=1e18, handoff_s=0.0)  # host work costs nothing: only the wire counts
BYTES_PER_S = 1000.0
NET = Network(rate_bps=8 * BYTES_PER_S, latency_s=0.0)


def finish_times(sim: Sim, transfers) -> list[float]:
    times = [None] * len(transfers)
    for i, (nbytes, uses) in enumerate(transfers):
        sim.transfer(nbytes, uses, lambda i=i: times.__setitem__(i, sim.now))
    sim.run()
    return times


def test_transfers_on_one_link_share_it_and_the_survivor_speeds_up():
    sim, link = Sim(), Link("l", 100.0)
    # 50 B/s each until the first (100 B) ends at 2 s; the second's last 200 B go at 100 B/s.
    assert finish_times(sim, [(100, [(link, 1)]), (300, [(link, 1)])]) == pytest.approx([2.0, 4.0])
    assert link.carried == pytest.approx(400)


def test_a_transfer_too_short_for_the_clock_to_count_still_ends():
    # 40 B at 1e15 B/s, started at t = 1 s: 4e-14 s, below a double's resolution there
    sim, link, ended = Sim(max_events=1000), Link("fast", 1e15), []
    sim.after(1.0, lambda: sim.transfer(40, [(link, 1)], lambda: ended.append(sim.now)))
    sim.run()
    assert ended == [pytest.approx(1.0)]


def test_max_min_fairness_gives_what_a_bottlenecked_flow_leaves_to_the_others():
    sim, shared, narrow = Sim(), Link("shared", 100.0), Link("narrow", 30.0)
    # B is held to 30 B/s by its narrow link, so A gets the 70 left on the shared one.
    a, b = finish_times(sim, [(70, [(shared, 1)]), (30, [(shared, 1), (narrow, 1)])])
    assert (a, b) == pytest.approx((1.0, 1.0))


def test_a_weighted_transfer_stands_for_that_many_flows_on_a_shared_link():
    sim, server_rx, worker_tx = Sim(), Link("server rx", 100.0), Link("worker tx", 1000.0)
    # 4 workers push 100 B each into one server: 25 B/s each, 4 s.
    assert finish_times(sim, [(100, [(worker_tx, 1), (server_rx, 4)])]) == pytest.approx([4.0])


def test_a_transfer_below_full_efficiency_takes_more_of_the_link_but_carries_only_its_bytes():
    sim, link = Sim(), Link("l", 100.0)
    assert finish_times(sim, [(100, [(link, 1)])]) == pytest.approx([1.0])
    # at half efficiency 100 B take 200 B of the link's capacity: 2 s alone
    sim, link, ends = Sim(), Link("l", 100.0), []
    sim.transfer(100, [(link, 1)], lambda: ends.append(("half", sim.now)), efficiency=0.5)
    sim.run()
    assert ends == [("half", pytest.approx(2.0))] and link.carried == pytest.approx(100)
    sim, link = Sim(), Link("l", 100.0)
    times = {}
    sim.transfer(50, [(link, 1)], lambda: times.setdefault("full", sim.now))
    sim.transfer(50, [(link, 1)], lambda: times.setdefault("half", sim.now), efficiency=0.5)
    sim.run()
    # beside a full flow, both move 33.3 B/s of their own bytes (the half one taking 66.7 B/s of
    # the capacity): 50 B each in 1.5 s
    assert times["full"] == pytest.approx(1.5) and times["half"] == pytest.approx(1.5)
    assert link.carried == pytest.approx(100)
    with pytest.raises(SimulationError, match="efficiency must be in"):
        Sim().transfer(1, [(link, 1)], lambda: None, efficiency=0.0)


def test_a_stream_runs_lowest_priority_first_one_at_a_time():
    sim, order = Sim(), []
    stream = Stream(sim, "s")
    stream.run(1.0, lambda: order.append(("first", sim.now)))
    stream.run(1.0, lambda: order.append(("late", sim.now)), priority=5)
    stream.run(1.0, lambda: order.append(("urgent", sim.now)), priority=1)
    sim.run()
    assert order == [("first", 1.0), ("urgent", 2.0), ("late", 3.0)]


def test_the_event_budget_stops_a_simulation_with_a_clear_error():
    sim = Sim(max_events=10)

    def again():
        sim.after(1.0, again)

    sim.after(0.0, again)
    with pytest.raises(SimulationError, match="budget of 10 events"):
        sim.run()


def test_a_two_worker_ring_moves_half_the_bucket_each_way_twice():
    # One 1000-byte parameter, no compute: each step all-reduces 1000 B plus one 4-byte used
    # flag; each worker sends 2 (N-1)/N of it = 1004 B at 1000 B/s.
    work = synthetic([(0.0, 0.0, [1000])])
    record = simulate("allreduce", work, 2, NET, host=FREE_HOST, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(1.004)
    latency = Network(rate_bps=8 * BYTES_PER_S, latency_s=0.01)  # 2 (N-1) messages in a ring
    assert simulate("allreduce", work, 2, latency, host=FREE_HOST, steps=4, warmup=1)["step_s"] == pytest.approx(1.024)


def test_one_dedicated_server_takes_every_push_then_answers_every_pull():
    # 4 workers, one 1000-byte tensor (one group): 4 pushes of 1004 B (values and a flag) into the
    # server's link, then 4 answers of 1000 B out of it, each at 1000 B/s shared by 4.
    work = synthetic([(0.0, 0.0, [1000])])
    record = simulate("ps", work, 4, NET, host=FREE_HOST, servers=1, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(4.016 + 4.0)


def test_co_located_servers_are_as_slow_as_the_owner_of_the_largest_share():
    # 3 workers, tensors of 3000 and 1000 B: the partition puts the first on worker 0 and the
    # second on worker 1 (worker 2 serves nothing). Worker 0's link takes the other two workers'
    # pushes of 3004 B (values and a flag) at once: 6.008 s at 1000 B/s; then it answers both
    # with 3000 B each: 6 s. Averaged over the hosts the same bytes would take 5.34 s.
    work = synthetic([(0.0, 0.0, [3000, 1000])])
    record = simulate("ps", work, 3, NET, host=FREE_HOST, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(6.008 + 6.0)


def test_co_located_servers_move_their_all_to_all_at_the_meshs_share_of_the_link():
    # the 3-worker case above at a mesh efficiency of 0.8: each phase takes 1.25x, the bytes the same
    work = synthetic([(0.0, 0.0, [3000, 1000])])
    meshed = Network(rate_bps=8 * BYTES_PER_S, latency_s=0.0, mesh=0.8)
    record = simulate("ps", work, 3, meshed, host=FREE_HOST, steps=4, warmup=1)
    fair = simulate("ps", work, 3, NET, host=FREE_HOST, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx((6.008 + 6.0) / 0.8)
    assert record["bytes_per_step"] == pytest.approx(fair["bytes_per_step"])
    # two workers exchange one flow each way: no mesh; a ring never is one
    two = synthetic([(0.0, 0.0, [1000])])
    for strategy in ("ps", "allreduce"):
        assert simulate(strategy, two, 2, meshed, host=FREE_HOST, steps=4, warmup=1)["step_s"] == pytest.approx(
            simulate(strategy, two, 2, NET, host=FREE_HOST, steps=4, warmup=1)["step_s"])
    assert simulate("allreduce", work, 3, meshed, host=FREE_HOST, steps=4, warmup=1)["step_s"] == pytest.approx(
        simulate("allreduce", work, 3, NET, host=FREE_HOST, steps=4, warmup=1)["step_s"])
    with pytest.raises(ConfigError, match=r"mesh efficiency must be in \(0, 1\], got 1.5"):
        simulate("ps", work, 3, Network(rate_bps=8e3, mesh=1.5), host=FREE_HOST)


def test_the_replay_takes_the_mesh_measured_for_a_runs_hosts_at_its_real_link_rate():
    from gradsync.simulate import hostmodel

    measured = {"4": {"250000000": 0.9, "1000000000": 0.95}, "3": {"1000000000": 0.97}}
    assert hostmodel._mesh(measured, 4, 2.5e8) == 0.9
    assert hostmodel._mesh(measured, 8, 1.2e9) == 0.95  # the largest count measured up to 8, the nearest rate
    assert hostmodel._mesh(measured, 3, 1e8) == 0.97
    assert hostmodel._mesh(measured, 2, 1e9) == 1.0 and hostmodel._mesh(None, 4, 1e9) == 1.0
    matrix = {"latency_s": 1e-4, "host_rates": {"mesh": measured}}
    net = hostmodel.record_network(matrix, {"np": 4, "net_bps": 1e9, "dilation": 4.0})  # 250 Mbit/s for real
    assert (net.rate_bps, net.latency_s, net.mesh) == (1e9, 1e-4, 0.9)
    assert hostmodel.record_network(matrix, {"np": 4, "net_bps": 1e10, "dilation": 10.0}).mesh == 0.95


def test_p3_sends_lowest_forward_position_first_under_credit():
    # Three layers of 1000 B, slices of 250 elements: slice k is layer k. Co-located on 2 workers,
    # each message is 16 + (250 + 1) * 4 = 1020 B, half of which crosses this worker's link
    # (0.51 s). The credit holds one message, so messages go one at a time. Backward makes all
    # three gradients at once, in reverse: push 2 goes first (nothing is in flight), then push 0
    # overtakes push 1; answer 2, queued first, waits for answers 0 and 1.
    work = synthetic([(0.0, 0.0, [1000])] * 3)
    options = {"slice_params": 250, "credit_mb": 1020 / 2**20}
    record = simulate("p3", work, 2, NET, host=FREE_HOST, options=options, steps=6, warmup=2, trace=True)
    assert record["step_s"] == pytest.approx(6 * 0.51)
    last = [(what, start, end) for lane, what, start, end in record["timeline"] if lane == "network"][-6:]
    assert [w for w, _, _ in last] == ["push 2", "push 0", "push 1", "answer 0", "answer 1", "answer 2"]
    assert [round(end - last[0][1], 3) for _, _, end in last] == [0.51, 1.02, 1.53, 2.04, 2.55, 3.06]
    unlimited = simulate("p3", work, 2, NET, host=FREE_HOST, options={**options, "credit_mb": 1.0}, steps=6,
                         warmup=2)  # all pushes at once, then all answers: the same bytes, no order
    assert unlimited["step_s"] == pytest.approx(6 * 0.51)


def test_slice_messages_cost_their_python_threads_one_end_at_a_time():
    # ps-sliced, one slice (250 elements), 2 co-located workers, a free wire and host, 1 s a message end:
    # by symmetry a worker sends half the pushes and takes half of them in, then sends and takes
    # half the answers: 4 ends of 0.5 s in a row under the interpreter lock, 2 s a step.
    work = synthetic([(0.0, 0.0, [1000])])
    host = Host(copy_Bps=1e18, update_Bps=1e18, handoff_s=0.0, message_s=1.0)
    free = Network(rate_bps=None, latency_s=0.0)
    record = simulate("ps-sliced", work, 2, free, host=host, options={"slice_params": 250}, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(4 * 0.5)
    assert simulate("ps-sliced", work, 2, free, host=FREE_HOST, options={"slice_params": 250},
                    steps=4, warmup=1)["step_s"] == pytest.approx(0.0)


def test_a_slice_message_waits_for_a_receive_its_receiver_has_posted(monkeypatch):
    # ps-sliced, 2 workers, 1 dedicated server, one layer of 3000 B: 3 slices of 250 elements, each
    # message 16 + (250 + 1) * 4 = 1020 B; both workers push into the server's link at once, so
    # this worker's push moves at 500 B/s (2.04 s), as does each answer. An update takes 1 s.
    # With one receive posted per peer a push goes only once the previous one is handled (its
    # slice updated): push 0 [0, 2.04], update [2.04, 3.04], push 1 [3.04, 5.08], update
    # [5.08, 6.08], push 2 [6.08, 8.12], update [8.12, 9.12], answer 2 [9.12, 11.16].
    import gradsync.strategies.p3 as p3

    work = synthetic([(0.0, 0.0, [3000])])
    host = Host(copy_Bps=1e18, update_Bps=1000.0, handoff_s=0.0)
    monkeypatch.setattr(p3.wire, "POSTED", 1)
    one = simulate("ps-sliced", work, 2, NET, host=host, servers=1, options={"slice_params": 250}, steps=4, warmup=1)
    assert one["step_s"] == pytest.approx(11.16)
    monkeypatch.setattr(p3.wire, "POSTED", 3)  # all three pushes leave at once and share the link until 6.12 s
    three = simulate("ps-sliced", work, 2, NET, host=host, servers=1, options={"slice_params": 250}, steps=4,
                     warmup=1, trace=True)
    pushes = [(start, end) for lane, what, start, end in three["timeline"] if what.startswith("push")][-3:]
    assert [round(end - start, 3) for start, end in pushes] == [6.12] * 3


def test_sma_hides_its_parameter_all_reduce_behind_the_whole_step():
    # 2 workers, 1000 B of parameters: the all-reduce launched before forward moves 1000 B (1 s).
    # With 2 s of compute it is hidden; with 0.5 s the step waits for it.
    slow, fast = synthetic([(1.0, 1.0, [1000])]), synthetic([(0.25, 0.25, [1000])])
    assert simulate("sma", slow, 2, NET, host=FREE_HOST, steps=4, warmup=1)["step_s"] == pytest.approx(2.0)
    assert simulate("sma", fast, 2, NET, host=FREE_HOST, steps=4, warmup=1)["step_s"] == pytest.approx(1.0)


def test_pair_averaging_simulates_every_worker_and_answers_pulls_one_at_a_time():
    """Every worker at its own pace; the step is the slowest worker's. A 1000 B model, a free host
    and wire latency, so one model takes 1 s through a link."""
    work = synthetic([(0.0, 0.0, [1000])])
    # 2 workers pull from each other at once: each model goes its own way at the link's rate (its
    # receive's notice on a channel that carries no model that way), 1 s.
    blocking = {"overlap": False}  # the pull at the step, waited for
    assert simulate("pair-averaging", work, 2, NET, host=FREE_HOST, options=blocking, steps=4,
                    warmup=1)["step_s"] == pytest.approx(1.0)
    # At random, the strategy's own generators pick the peers; seed 12 on 3 workers: 0 <- 1, 1 <- 2,
    # 2 <- 0 at the first step, a cycle: every link carries one model, nothing crosses (1 s).
    once, drawn = dict(steps=1, warmup=0), {"peers": "random", **blocking}
    assert simulate("pair-averaging", work, 3, NET, host=FREE_HOST, options={"seed": 12, **drawn}, **once)["step_s"] == \
        pytest.approx(1.0)
    # Seed 66 on 4 workers: workers 0 and 1 pull from 3, 2 from 1, 3 from 2. Worker 3's server
    # answers one, then the other: the second waits for the first (2 s).
    assert simulate("pair-averaging", work, 4, NET, host=FREE_HOST, options={"seed": 66, **drawn}, **once)["step_s"] == \
        pytest.approx(2.0)
    # In turn (the default), the first step's pulls are i <- i+1: each worker answers one (1 s).
    assert simulate("pair-averaging", work, 4, NET, host=FREE_HOST, options=blocking, **once)["step_s"] == \
        pytest.approx(1.0)


def test_pair_averaging_receives_the_pulled_model_while_the_next_step_computes():
    """KungFu's form: the pull is sent at the end of a step and the model arrives during the next
    step's computation. 2 workers pull from each other; a 1000 B model takes 1 s through a link.
    Behind 2.5 s of compute it is hidden (waited for at the step: 3.5 s); behind 0.5 s it is not
    entirely, and the step is the 1 s exchange (1.5 s waited for)."""
    model = [1000]
    hidden = synthetic([(1.25, 1.25, model)])
    assert simulate("pair-averaging", hidden, 2, NET, host=FREE_HOST, steps=6, warmup=2)["step_s"] == pytest.approx(2.5)
    assert simulate("pair-averaging", hidden, 2, NET, host=FREE_HOST, options={"overlap": False}, steps=6,
                    warmup=2)["step_s"] == pytest.approx(3.5)
    exposed = synthetic([(0.25, 0.25, model)])
    assert simulate("pair-averaging", exposed, 2, NET, host=FREE_HOST, steps=6, warmup=2)["step_s"] == pytest.approx(1.0)
    assert simulate("pair-averaging", exposed, 2, NET, host=FREE_HOST, options={"overlap": False}, steps=6,
                    warmup=2)["step_s"] == pytest.approx(1.5)


def test_a_pair_averaging_request_goes_beside_the_models_and_a_refresh_waits_for_no_answer():
    """Answers travel on a channel of their own, so a pull request never queues behind a model its
    sender's server is sending the same peer, and the snapshot is double-buffered, so a worker's
    refresh never waits for an answer. Seed 19 on 3 workers (at random) picks 0 <- 2, 1 <- 0,
    2 <- 0, then 0 <- 1, 1 <- 0, 2 <- 0; 0.5 s of compute, a 1000 B model takes 1 s through a
    link, requests that arrive at once are answered in rank order."""
    work = synthetic([(0.25, 0.25, [1000])])
    # Step 1: worker 2 answers 0 over [0.5, 1.5]; worker 0 answers 1 over [0.5, 1.5], then 2 over
    # [1.5, 2.5]; 0 refreshes at 1.5 without waiting, and 2 has 0's model at 2.5: 2.5 s.
    # Step 2: 0 asks 1 at 2.0 and 1 answers at once, over [2.0, 3.0] (a request behind the model on
    # 0's pair with 1 would arrive at 3.5); 1 asks 0 at 2.0, answered over [2.5, 3.5] after 2's:
    # 1's step 1.5 -> 3.5; 2 asks 0 at 3.0, answered over [3.5, 4.5]: 2.5 -> 4.5. Steps of 2.5 and
    # 2 s, median 2.25 (2.75 with requests behind models and refreshes waiting for answers).
    assert simulate("pair-averaging", work, 3, NET, host=FREE_HOST,
                    options={"seed": 19, "overlap": False, "peers": "random"}, steps=2,
                    warmup=0)["step_s"] == pytest.approx(2.25)


def test_an_asynchronous_server_serves_workers_one_at_a_time():
    # 2 workers, one server, 1000 B: a service is the push (1 s) and the pull (1 s). Alone a
    # worker would take 1 s of compute + 2 s; the server serves both workers, 4 s per round.
    work = synthetic([(0.5, 0.5, [1000])])
    record = simulate("ps-async", work, 2, NET, host=FREE_HOST, servers=1, steps=6, warmup=2)
    assert record["step_s"] == pytest.approx(4.0)
    with pytest.raises(Exception, match="needs dedicated servers"):
        simulate("ps-async", work, 2, NET, host=FREE_HOST, steps=4, warmup=1)


@pytest.fixture
def quarter_codec(monkeypatch):
    """onebit as a compressor with given costs: wire ratio 1/4, encode and decode as set."""
    from gradsync.simulate import compressed
    from gradsync.strategies.costmodel import Linear

    def use(encode_s_per_byte=0.0, decode_s_per_byte=0.0):
        monkeypatch.setitem(compressed._CODECS, ("onebit", ()),
                            (Linear(0.0, encode_s_per_byte), Linear(0.0, decode_s_per_byte), 0.25))
    use()
    return use


def test_compressors_are_timed_in_a_child_with_the_ranks_allocator(monkeypatch):
    # As a rank meets them: in this process a decode's fresh output above glibc's mmap ceiling is
    # fresh pages every call, which a rank (freed blocks kept) never pays.
    from gradsync.bench.cli import EMULATED_ALLOCATOR
    from gradsync.simulate import compressed

    monkeypatch.delitem(compressed._CODECS, ("onebit", ()), raising=False)
    seen = {}
    real_run = compressed.subprocess.run

    def run(argv, env, **kwargs):
        seen.update(env)
        return real_run(argv, env=env, **kwargs)

    monkeypatch.setattr(compressed.subprocess, "run", run)
    cost = compressed.codec_cost("onebit", {}, 1.0)
    assert all(seen[k] == v for k, v in EMULATED_ALLOCATOR.items()) and seen["THP_MEM_ALLOC_ENABLE"] == "1"
    assert abs(cost.ratio - 1 / 32) < 1e-3 and cost.encode(32 << 20) > 0 and cost.decode(32 << 20) > 0
    monkeypatch.setattr(compressed.subprocess, "run", lambda *a, **k: real_run(
        [sys.executable, "-c", "raise SystemExit('no such compressor here')"], capture_output=True, text=True))
    compressed._CODECS.pop(("onebit", ()))
    with pytest.raises(RuntimeError, match="measuring compressor 'onebit' failed in a child process: no such"):
        compressed.codec_cost("onebit", {}, 1.0)


def test_compressed_strategies_move_their_patterns_bytes(quarter_codec):
    # One 1000 B bucket at ratio 1/4, then one 4-byte used flag all-reduced (2 (N-1)/N of 4 B).
    work = synthetic([(0.0, 0.0, [1000])])
    flags = {2: 0.004, 4: 0.006}
    cases = [("casync-ring", 2, {}, 0.25),  # 2 (N-1) hops of 1000/N/4 B
             ("casync-ring", 4, {}, 0.375),
             ("compressed-allgather", 2, {}, 0.25),  # N-1 payloads of 250 B
             ("compressed-allgather", 4, {}, 0.75),
             ("casync-ps", 4, {}, 1.5),  # under 4 MB: one aggregator, 3 x 250 B in, then out
             ("casync-ps", 4, {"partition_mb": 1e-4}, 0.375)]  # 4 partitions: 3 x 62.5 B each way
    for strategy, np, options, wire_s in cases:
        record = simulate(strategy, work, np, NET, host=FREE_HOST, options=options, steps=4, warmup=1)
        assert record["step_s"] == pytest.approx(wire_s + flags[np]), (strategy, np, options)


def test_compressed_all_gather_encodes_once_and_decodes_every_payload(quarter_codec):
    quarter_codec(encode_s_per_byte=1e-3, decode_s_per_byte=1e-3)
    work = synthetic([(0.0, 0.0, [1000])])
    # encode 1000 B (1 s), 250 B on the wire (0.25 s), decode 2 payloads (2 s), flags (0.004 s)
    record = simulate("compressed-allgather", work, 2, NET, host=FREE_HOST, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(3.254)


def test_compressed_strategies_pay_the_copies_and_message_ends_of_their_code(quarter_codec):
    # Codecs free, copies at 1000 B/s, 0.1 s per message end, one 1000 B bucket, 2 workers. Every
    # strategy: pack the bucket (1 s), divide and check it (2 s); the used flags at the end (0.004 s).
    host = Host(copy_Bps=1000.0, update_Bps=1e18, handoff_s=0.0, message_s=0.1)
    work = synthetic([(0.0, 0.0, [1000])])
    before, flags = 3.0, 0.004
    # ring, chunks of 500 B: encode (framing 125 B: 0.125 s); hop 1: 125 B (0.125 s), a send and a
    # receive of a header and a body (0.4 s), add (0.5), encode (0.125), the final chunk decoded into
    # the bucket (0.5); hop 2: 0.125 + 0.4, the peer's chunk decoded into the bucket (0.5)
    ring = 0.125 + (0.125 + 0.4 + 0.5 + 0.125 + 0.5) + (0.125 + 0.4 + 0.5)
    # ps, two partitions of 500 B: push one (framing 0.125, wire 0.125); the aggregator copies its
    # own (0.5), adds the decoded push (0.5), encodes (0.125), decodes the sum into its bucket (0.5);
    # 4 ends per exchange (0.4); the answer (0.125 wire, 0.4 ends) decoded into the bucket (0.5)
    ps = 0.125 + (0.125 + 0.4 + 0.5 + 0.5 + 0.125 + 0.5) + (0.125 + 0.4 + 0.5)
    # all-gather: encode (framing 250 B: 0.25), 250 B in (0.25), the two all-gathers issued and the
    # peer's header and body taken (0.4), a zeroed sum (0.5), two payloads decoded and added (2),
    # the sum copied into the bucket (1)
    gather = 0.25 + 0.25 + 0.4 + 0.5 + 2.0 + 1.0
    for strategy, options, expected in [("casync-ring", {}, ring), ("casync-ps", {"partition_mb": 1e-4}, ps),
                                        ("compressed-allgather", {}, gather)]:
        record = simulate(strategy, work, 2, NET, host=host, options=options, steps=4, warmup=1)
        assert record["step_s"] == pytest.approx(before + expected + flags), strategy
    # Hosts whose work varies (jitter 0.5): the work before each message or collective takes the
    # slower of the two workers' (1 + 0.5 * 0.5642 = 1.282x): the all-gather's encode (0.25 s), the
    # ring's first encode and the work after each hop (0.125, 1.125, 0.5 s).
    slower = 1 + 0.5 * 0.5641895835
    shaky = Host(copy_Bps=1000.0, update_Bps=1e18, handoff_s=0.0, message_s=0.1, jitter=0.5)
    record = simulate("compressed-allgather", work, 2, NET, host=shaky, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(before + gather + 0.25 * (slower - 1) + flags, rel=1e-6)
    record = simulate("casync-ring", work, 2, NET, host=shaky, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(before + ring + (0.125 + 1.125 + 0.5) * (slower - 1) + flags, rel=1e-6)


def _with_table(read: float):
    """Layer 0: a table of 100 rows of 40 B (10 read by default); layer 1: a dense 1000 B tensor."""
    from gradsync.simulate.workload import Table

    work = synthetic([(0.0, 0.0, [4000]), (0.0, 0.0, [1000])])
    work.tables = {"layer0.p0": Table(rows=100, row_bytes=40, read=read)}
    return work


def test_hybrid_pulls_before_the_lookup_and_pushes_rows_beside_the_dense_all_reduce():
    # 2 workers, co-located row servers: half of every row message stays home. The pull sends 10
    # ids (80 B, 40 B cross: 0.04 s) and gets 10 rows back (400 B, 200 B cross: 0.2 s). Backward:
    # the dense bucket's ring (1000 B + a 4 B flag: 1004 B each way) and the push (400 B of rows
    # + 80 B of ids, 240 B cross) share the link until the push is done (0.48 s at 500 B/s each);
    # the ring's last 764 B go alone (0.764 s).
    record = simulate("hybrid", _with_table(10), 2, NET, host=FREE_HOST, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(0.24 + 0.48 + 0.764)
    # One dedicated server: every byte crosses, and the server's side carries both workers'.
    # Pull: 80 B at 500 B/s, 400 B at 500 B/s (0.96 s). Push: 480 B at 500 B/s (server side),
    # the ring the other 500 B/s of the worker's link meanwhile, then its last 524 B alone.
    dedicated = simulate("hybrid", _with_table(10), 2, NET, host=FREE_HOST, servers=1, steps=4, warmup=1)
    assert dedicated["step_s"] == pytest.approx(0.96 + 0.96 + 0.524)


def test_hybrid_lays_rows_out_as_the_strategy_does_and_the_busiest_nic_paces_the_exchange():
    # The case above, but the reads fall where the model's own batches put them (Table.samples).
    # partitions=1 per server: rows 0-49 on server 0, 50-99 on server 1 (Layout.make). All 10 ids
    # read are below 50, so server 0 holds every one: worker 1 sends it all its rows and server 0
    # sends worker 1 all of them back, twice the bytes an even spread crosses. Pull: 80 B of ids
    # (0.08 s), 400 B of rows (0.4 s); push: 480 B beside the ring (0.96 s at 500 B/s), the ring's
    # last 524 B alone. Ids spread over both halves: auto takes the fewest partitions that spread
    # them evenly (2), and the step is the even spread's (0.24 + 0.48 + 0.764 s).
    work = _with_table(10)
    table = work.tables["layer0.p0"]
    table.samples = (torch.arange(10),)
    assert table.server_shares(0, 2, 2) == [1.0, 0.0] and table.server_shares(1, 2, 2) == [0.0, 1.0]
    hot = simulate("hybrid", work, 2, NET, host=FREE_HOST, options={"partitions": 1}, steps=4, warmup=1)
    assert hot["step_s"] == pytest.approx(0.48 + 0.96 + 0.524)
    assert hot["plan"].endswith("100% on the busiest of 2 servers; 2 partitions per table")
    table.samples = (torch.arange(0, 100, 10),)
    even = simulate("hybrid", work, 2, NET, host=FREE_HOST, steps=4, warmup=1)
    assert even["step_s"] == pytest.approx(0.24 + 0.48 + 0.764) and even["plan"].endswith("; 2 partitions per table")
    # One dedicated server holds every row whatever the layout: the case above's 2.444 s
    assert simulate("hybrid", work, 2, NET, host=FREE_HOST, servers=1, steps=4,
                    warmup=1)["step_s"] == pytest.approx(0.96 + 0.96 + 0.524)


def test_a_tables_reads_fall_on_the_servers_of_the_strategys_layout():
    from gradsync.models import get_model
    from gradsync.simulate.workload import Table, _tables

    table = Table(rows=8, row_bytes=4, read=5, samples=(torch.tensor([0, 1, 2, 3, 4]),))
    assert table.server_shares(0, 2, 2) == [0.8, 0.2]  # rows 0-3 on server 0, 4-7 on server 1
    assert table.server_shares(1, 2, 2) == [0.2, 0.8]  # table 1's first range goes to server 1
    assert table.server_shares(0, 8, 2) == [0.6, 0.4]  # one row a partition, taken in turn
    assert Table(rows=8, row_bytes=4, read=5).server_shares(0, 2, 4) == [0.25] * 4  # no samples: even
    # The language model's word ids follow a Zipf law: the first of 4 ranges holds most reads,
    # more partitions spread them (the model's own batches, as hybrid's probes see them)
    spec = get_model("lstm-lm:cpu")
    classes = _tables(spec, spec.build_meta(), 32)["softmax.classes.weight"]  # as load() counts them
    few, many = max(classes.server_shares(1, 4, 4)), max(classes.server_shares(1, 64, 4))
    assert sum(classes.server_shares(1, 4, 4)) == pytest.approx(1.0) and few > 0.7 and 0.25 < many < few


def test_the_last_of_several_hosts_waits_for_the_spread_only_where_their_own_parts_are_alike():
    from gradsync.simulate.worker import expected_last

    assert expected_last([1.0, 1.0], 2.0) == pytest.approx(1.0 + 2.0 / math.sqrt(math.pi), rel=1e-5)
    assert expected_last([0.0, 100.0, 3.0], 1.0) == pytest.approx(100.0, rel=1e-6)  # one far ahead
    assert expected_last([2.0, 5.0], 0.0) == 5.0
    assert expected_last([0.001, 10.001], 0.0002) == pytest.approx(10.001, abs=1e-6)  # far apart, narrow
    from gradsync.simulate.worker import Worker

    host = Host(copy_Bps=1e18, update_Bps=1e18, handoff_s=0.0, jitter=0.5)
    wk = Worker(Sim(), _with_table(10), 4, NET, host)
    assert wk.last_of(2.0, [0.0] * 4) == pytest.approx(2.0 * wk.slowest_of(4), rel=1e-5)  # alike: the slowest
    assert wk.last_of(2.0, [30.0, 0.0, 0.0, 0.0]) == pytest.approx(2.0, rel=1e-4)  # the others end long before


def test_a_hybrid_record_is_replayed_with_the_partitions_its_probes_chose():
    from gradsync.simulate.validate import run_options

    described = "hybrid(3 sparse tables on co-located on 4 workers, 4 partitions per table (measured 4: 904 ms))"
    assert run_options({"strategy": "hybrid", "np": 4, "describe": described}) == ("hybrid", {"partitions": 1})
    assert run_options({"strategy": "hybrid", "np": 4, "servers": 2,
                        "describe": "hybrid(..., 16 partitions per table)"}) == ("hybrid", {"partitions": 8})
    assert run_options({"strategy": "hybrid", "np": 4, "describe": "hybrid(..., 7 partitions per table)"}) == (
        "hybrid", {"partitions": 2})  # the probes' fit chose a count between multiples: the nearer
    assert run_options({"strategy": "hybrid", "np": 2, "describe": "hybrid(dense only)"}) == ("hybrid", {})
    assert run_options({"strategy": "casync-ps+topk:ratio=0.01", "np": 2, "describe": "8 partitions per table"}) == (
        "casync-ps", {"compression": "topk:ratio=0.01"})


def _two_tables():
    """Layers 0 and 1: a table of 100 rows of 40 B each (10 read), layer 0 computing 1 s forward;
    layer 2: a dense 1000 B tensor."""
    from gradsync.simulate.workload import Table

    work = synthetic([(1.0, 0.0, [4000]), (0.0, 0.0, [4000]), (0.0, 0.0, [1000])])
    work.tables = {"layer0.p0": Table(rows=100, row_bytes=40, read=10),
                   "layer1.p0": Table(rows=100, row_bytes=40, read=10)}
    return work


def test_hybrid_servers_apply_every_table_before_answering_the_next_pull():
    # Only the optimizer costs (1000 B/s) and only forward layer 0 takes time (1 s); the wire is
    # free. Two tables of 100 rows x 40 B on two co-located servers: each server updates 2000 B of
    # each table (2 s each). Its pushes all in at t, a server applies both tables (t+4) and only
    # then answers; the pull of table 0 goes, layer 0 computes (t+5), the rest is instant, and the
    # pushes are in again: 5 s a step (a server that answered each table as applied would give 4).
    work = _two_tables()
    host = Host(copy_Bps=1e18, update_Bps=1000.0, handoff_s=0.0)
    record = simulate("hybrid", work, 2, Network(rate_bps=8e15, latency_s=0.0), host=host, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(5.0)
    # A 3 s batch made before each step (gradsync bench's loop; outside the step's time): the
    # dense optimizer (1 s) and the batch after it cover the servers' 4 s update, and the step is
    # the 1 s layer and the 1 s optimizer. allreduce's step (its tables' gradients and the whole
    # update on the worker, 10 s) is the same with or without it.
    batched = Host(copy_Bps=1e18, update_Bps=1000.0, handoff_s=0.0, batch_s=3.0)
    net = Network(rate_bps=8e15, latency_s=0.0)
    assert simulate("hybrid", work, 2, net, host=batched, steps=5, warmup=2)["step_s"] == pytest.approx(2.0)
    assert simulate("allreduce", work, 2, net, host=batched, steps=5, warmup=2)["step_s"] == pytest.approx(
        simulate("allreduce", work, 2, net, host=host, steps=5, warmup=2)["step_s"])
    # pair-averaging simulates every worker: each makes its batch and times its step after it, so
    # batches alike on every worker leave its step as it was
    averaging = synthetic([(0.5, 0.5, [1000]), (0.0, 0.0, [1000])])
    slow = Network(rate_bps=8e4, latency_s=0.0)
    times = [simulate("pair-averaging", averaging, 3, slow, host=h, steps=6, warmup=2)["step_s"] for h in (host, batched)]
    assert times[1] == pytest.approx(times[0]) and times[0] > 1.0
    # Updates that vary from step to step (jitter 0.5): the pull waits for the slower of the two
    # servers, E[max of 2 standard normals] = 1/sqrt(pi) standard deviations above the mean:
    # 4 s * (1 + 0.5 / sqrt(pi)) of updates, then the 1 s layer.
    host.jitter = 0.5
    record = simulate("hybrid", work, 2, Network(rate_bps=8e15, latency_s=0.0), host=host, steps=4, warmup=1)
    assert record["step_s"] == pytest.approx(4.0 * (1 + 0.5 / math.sqrt(math.pi)) + 1.0, rel=1e-4)


def test_hybrid_servers_loop_wakes_for_each_receive_and_runs_the_update_that_a_push_completes():
    # The case above with a free optimizer of the rows' tables' sizes but a thread's wakeup of 1 s
    # (Host.handoff_s). The server's receive loop takes a pull's header and ids, each once woken
    # (2 s), the worker wakes for the rows (1 s); layer 0 computes (1 s), then table 1's pull (2 +
    # 1 s). The pushes of both tables, a header, ids and rows each, take the loop 3 + 3 s, and the
    # second completes the step: the loop runs both tables' updates (4 s) and only then takes the
    # next step's first request, which the worker sent once its step's sends were taken. 17 s a step.
    work = _two_tables()
    host = Host(copy_Bps=1e18, update_Bps=1000.0, handoff_s=1.0)
    record = simulate("hybrid", work, 2, Network(rate_bps=8e15, latency_s=0.0), host=host, steps=5, warmup=2)
    assert record["step_s"] == pytest.approx(2 + 1 + 1 + 2 + 1 + 3 + 3 + 4)


def test_hybrid_servers_take_the_other_workers_messages_while_the_workers_own_are_in_flight():
    # One table (100 rows of 40 B, 10 read), 3 co-located workers, a wire of 100 B/s, free host
    # work but a thread's wakeup of 1 s. A server hears from the 2 other workers. The ranks do not
    # run in step: the simulated worker is the last, and each server's loop takes the other
    # client's messages (a wake per receive) from when the worker sends its own. Pull: the other's
    # header and ids (2 s) while its ids cross (80 B, 2/3 of them leave the host: 0.533 s), then its
    # own (2 s), the rows back (266.7 B, 2.667 s) and the worker's wake (1 s): 7.667 s. Push: the
    # other's three receives (3 s) while its 480 B cross (320 B: 3.2 s), then its own three (3 s):
    # 6.2 s. A loop that took both clients' messages once the worker's arrived would give 8.2 + 9.2 s.
    from gradsync.simulate.workload import Table

    work = synthetic([(0.0, 0.0, [4000])])
    work.tables = {"layer0.p0": Table(rows=100, row_bytes=40, read=10)}
    host = Host(copy_Bps=1e18, update_Bps=1e18, handoff_s=1.0)
    record = simulate("hybrid", work, 3, Network(rate_bps=800.0, latency_s=0.0), host=host, steps=6, warmup=2)
    assert record["step_s"] == pytest.approx((2 + 2 + 8 / 3 + 1) + (3.2 + 3))
    # One worker with its table named sparse: its own server holds every row, nothing to take
    alone = simulate("hybrid", work, 1, Network(rate_bps=800.0, latency_s=0.0), host=host,
                     options={"sparse": ["layer0.p0"]}, steps=4, warmup=1)
    assert alone["step_s"] == pytest.approx(0.0)


def test_the_slowest_of_n_is_the_mean_plus_the_expected_maximum_of_n_normals():
    from gradsync.simulate.worker import expected_max_normal

    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    assert [round(expected_max_normal(n), 4) for n in (4, 8, 16)] == [1.0294, 1.4236, 1.7660]  # tabulated


def test_hybrid_messages_cost_their_python_threads_one_end_at_a_time():
    # One table, 2 co-located workers, a free wire and host, 1 s a message end (Host.message_s),
    # as the strategy's code sends them. Pull: the worker sends a header and the ids to the other
    # server (2 s), that server takes them (2 s) and sends the rows (1 s), the worker takes them
    # (1 s). Push: header, ids and rows sent (3 s) and taken (3 s). The next pull waits for the
    # push to be applied: 12 s a step, all under one interpreter lock per process.
    host = Host(copy_Bps=1e18, update_Bps=1e18, handoff_s=0.0, message_s=1.0)
    free = Network(rate_bps=None, latency_s=0.0)
    assert simulate("hybrid", _with_table(10), 2, free, host=host, steps=4, warmup=1)["step_s"] == pytest.approx(12.0)
    # One dedicated server hears from both workers on its own interpreter: a pull is 2 + 4 + 2 + 1
    # ends, a push 3 + 6: 18 s a step.
    assert simulate("hybrid", _with_table(10), 2, free, host=host, servers=1, steps=4,
                    warmup=1)["step_s"] == pytest.approx(18.0)
    assert simulate("hybrid", _with_table(10), 2, free, host=FREE_HOST, steps=4, warmup=1)["step_s"] == pytest.approx(0.0)


def test_hybrid_keeps_a_table_most_of_which_a_step_reads_dense_as_the_strategy_decides():
    # 60 of 100 rows read by each of 2 workers: above (N-1)/N = 0.5, so the table is all-reduced
    # like the rest, and hybrid is allreduce; sparse_threshold=0.7 sends it to the servers.
    work = _with_table(60)
    dense = simulate("hybrid", work, 2, NET, host=FREE_HOST, steps=4, warmup=1)
    assert dense["step_s"] == pytest.approx(simulate("allreduce", work, 2, NET, host=FREE_HOST, steps=4, warmup=1)["step_s"])
    assert dense["plan"] == ""  # no row servers to describe (advise: "the same as allreduce")
    served = simulate("hybrid", work, 2, NET, host=FREE_HOST, options={"sparse_threshold": 0.7}, steps=4, warmup=1)
    assert served["step_s"] != pytest.approx(dense["step_s"])
    assert served["bytes_per_step"] < dense["bytes_per_step"]
    assert (served["dense_bytes"], dense["dense_bytes"]) == (1000, 5000)  # what its buckets hold (advise's memory)
    # The bound's traffic: the dense ring (1000 B each way) and the rows out and back, half of
    # which stay home (60 rows x 40 B = 2400 B: 1200 B cross each way).
    assert served["min_bytes_per_host"] == 1000 + 2 * 1200
    with pytest.raises(ConfigError, match="'nope' is not a trainable parameter"):
        simulate("hybrid", work, 2, NET, host=FREE_HOST, options={"dense": ["nope"]})
    with pytest.raises(ConfigError, match="'layer1.p0' cannot go to the servers"):
        simulate("hybrid", work, 2, NET, host=FREE_HOST, options={"sparse": ["layer1.p0"]})


def test_a_credit_below_one_message_is_refused_as_by_p3_itself():
    from gradsync.errors import ConfigError

    work = synthetic([(0.0, 0.0, [1000])])
    with pytest.raises(ConfigError, match="credit_mb=.* is less than one message"):
        simulate("p3", work, 2, NET, options={"slice_params": 250, "credit_mb": 100 / 2**20})
    for name in ("p3", "ps"):  # not timed as if uncompressed
        with pytest.raises(ConfigError, match=f"does not model {name} with compression="):
            simulate(name, work, 2, NET, options={"compression": "int8"})


def test_a_compute_profile_is_named_as_bench_names_it_or_without_its_prefix():
    from gradsync.simulate import load

    plain, benchs = load("resnet50", 32, "flops:15tflops"), load("resnet50", 32, "emulated:flops:15tflops")
    assert benchs.compute_s == pytest.approx(plain.compute_s) and benchs.nbytes == plain.nbytes
    assert load("resnet50", 32, "emulated").compute_s == pytest.approx(load("resnet50", 32).compute_s)
    assert plain.compute_s != pytest.approx(load("resnet50", 32).compute_s)  # flops:15tflops is not the shipped V100 profile


def test_simulate_prints_records_and_rejects_bad_input(tmp_path, cli):
    out = tmp_path / "new" / "r.json"  # its folder is made
    code, _, err = cli("simulate", "--model", "resnet50", "--strategies", "allreduce,p3", "--np", "4,16",
                       "--net", "1gbit", "--json", str(out))
    assert code == 0, err
    records = json.loads(out.read_text())
    assert [(r["strategy"], r["np"]) for r in records] == [("allreduce", 4), ("p3", 4), ("allreduce", 16), ("p3", 16)]
    for r in records:  # communication-bound at 1 Gbit/s: near, never above, the bound
        assert 0.5 < r["samples_per_s"] / r["bound_samples_per_s"] <= 1.0 + 1e-9
    slow = tmp_path / "slow.json"  # 1 ms of Python a message end: ps-sliced slows, allreduce does not
    code, _, err = cli("simulate", "--model", "resnet50", "--strategies", "allreduce,ps-sliced", "--np", "4",
                       "--net", "1gbit", "--message-us", "1000", "--json", str(slow))
    assert code == 0, err
    fast = {r["strategy"]: r for r in records if r["np"] == 4}
    slowed = {r["strategy"]: r for r in json.loads(slow.read_text())}
    # 512 slices, 4 ends each, 3 in 4 of them this worker's: 1536 ms a step under the lock
    assert slowed["ps-sliced"]["step_s"] >= 512 * 4 * 0.75 * 1e-3
    assert slowed["allreduce"]["step_s"] == pytest.approx(fast["allreduce"]["step_s"])
    code, out, err = cli("simulate", "--model", "lstm-lm", "--strategies", "hybrid", "--np", "4", "--net", "10gbit")
    assert code == 0 and "hybrid" in out, err  # its bound comes from the rows it reads
    trace = tmp_path / "pairs.json"  # every worker simulated: a process per rank, each with its tracks
    code, _, err = cli("simulate", "--model", "resnet50", "--strategies", "pair-averaging", "--np", "3", "--net", "1gbit",
                       "--trace", str(trace))
    assert code == 0, err
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"simulated worker {r}" for r in range(3)}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {(0, "accelerator"), (0, "host"), (1, "host"), (2, "host"), (1, "server thread")} <= {
        (pid, name) for (pid, _), name in tracks.items()}
    assert all((e["pid"], e["tid"]) in tracks for e in events if e["ph"] != "M")
    for args, message in ((["--np", "0"], "--np must be >= 1"), (["--net=-1gbit"], "bad link rate"),
                          (["--strategies", "nope"], "no simulator model for nope"),
                          (["--model", "resnet50:tiny"], "no shipped compute profile"),
                          (["--message-us=-5"], "--message-us must be >= 0, got -5"),
                          (["--shared-cores=-2"], "--shared-cores must be >= 0, got -2"),
                          (["--busy-wake-us=-1"], "--busy-wake-us must be >= 0, got -1"),
                          (["--host-jitter=-0.1"], "--host-jitter must be >= 0, got -0.1"),
                          (["--mesh", "0"], "--mesh must be in (0, 1], got 0"),
                          (["--net-cpu-ns=-1"], "--net-cpu-ns must be >= 0, got -1"),
                          (["--model", "nope"], "unknown model 'nope'; valid models:"),
                          (["--servers=-1"], "--servers must be >= 0, got -1"),
                          (["--gpus-per-host", "0"], "--gpus-per-host must be >= 1, got 0"),
                          (["--intra-gbps", "0"], "--intra-gbps must be > 0, got 0")):
        code, _, err = cli("simulate", *args)
        assert code == 2 and message in err, err
    for args, message in ((["--model", "nope", "--np", "4", "--net", "1gbit"], "unknown model 'nope'"),
                          (["--model", "resnet50", "--np", "0", "--net", "1gbit"], "--np must be >= 1, got 0"),
                          (["--model", "resnet50", "--np", "4", "--net", "1gbit", "--mesh", "1.2"],
                           "--mesh must be in (0, 1], got 1.2")):
        code, _, err = cli("advise", *args)
        assert code == 2 and message in err, err


def test_validation_counts_errors_and_orders_and_leaves_out_cpu_bound_cells():
    from gradsync.simulate.validate import summary

    def cell(strategy, measured, simulated, cpu_bound=False, np=2):
        return {"model": "m", "np": np, "net_bps": 1e9, "servers": 0, "strategy": strategy, "measured": measured,
                "simulated": simulated, "error": simulated / measured - 1, "cpu_bound": cpu_bound}

    cells = [cell("a", 100, 104), cell("b", 110, 99),  # b measured faster by 10 %, simulated slower: disagree
             cell("a", 100, 90, np=4), cell("b", 102, 95, np=4),  # within 3 % measured: a tie, agrees
             cell("c", 100, 300, cpu_bound=True, np=4)]  # measured this machine's CPU: not counted
    result = summary(cells)
    assert result["cells_counted"] == 4 and result["groups"] == 2 and result["ranked_alike"] == 2
    # the predicted best: a at 2 workers (measured 100 < 0.95 * 110: bad advice), b at 4 (the measured best)
    assert result["advice_good"] == 1
    assert result["median_abs_error"] == pytest.approx((1 - 95 / 102 + 0.1) / 2)  # of 0.04, 0.069, 0.1, 0.1
    assert result["max_abs_error"] == pytest.approx(0.1)
    # signed: +0.04, -0.1, -0.1, -0.069: one cell fast, the median of the middle two negative
    assert result["fast_cells"] == 1
    assert result["median_error"] == pytest.approx((-0.1 + 95 / 102 - 1) / 2)


def test_a_run_that_shows_no_update_rate_meets_what_its_group_met(tmp_path):
    # allreduce's update shows the memory its run met; sma's step is more than the update, so its
    # cell takes the group's (the median of those shown), not the probes around the group.
    from gradsync.simulate import load
    from gradsync.simulate.validate import replay

    nbytes = load("resnet50", 32, None).nbytes

    def matrix(optimizer_s):
        rec = {"model": "resnet50", "batch_size": 32, "np": 2, "net_bps": 1e9, "samples_per_s": 100.0,
               "steps": 4, "warmup": 1, "compute": "emulated", "host_cpu_busy": 0.3}
        probes = {"processes": 2, "copy_Bps": 1.0, "update_Bps": 1.0}
        group = {"command": "gradsync bench ...", "host_rates": {"concurrent": probes},
                 "records": [{**rec, "strategy": "allreduce", **({"optimizer_s": optimizer_s} if optimizer_s else {})},
                             {**rec, "strategy": "sma"}]}
        path = tmp_path / f"m{optimizer_s}.json"
        path.write_text(json.dumps({"cores": 2, "host_rates": {"copy_Bps": 1e9, "update_Bps": 1e9}, "groups": [group]}))
        result = replay(str(path), steps=4, warmup=1)
        assert [c["memory_from"] for c in result["cells"]] == (["run", "group"] if optimizer_s else ["probes"] * 2)
        return {c["strategy"]: c["simulated"] for c in result["cells"]}

    probed, slow = matrix(None), matrix(4 * nbytes / 1e9)  # the update met a quarter of 1 GB/s
    assert slow["allreduce"] < probed["allreduce"] and slow["sma"] < probed["sma"]
    assert matrix(nbytes / 1e9) == pytest.approx(probed)  # met the probes' rate: the same cells


def test_a_recorded_run_meets_the_host_rates_its_ranks_had():
    from gradsync.simulate.hostmodel import host_of, memory_met

    rates = {"copy_Bps": 8e9, "update_Bps": 2e9, "message_s": 1e-3,
             "concurrent": {"processes": 2, "copy_Bps": 0.9, "update_Bps": 0.8}}
    # 4 ranks on 2 cores, dilation 10: half a core each, every time divided by 10, both cores at once
    host = host_of({"np": 4, "dilation": 10.0}, rates, cores=2)
    assert host.copy_Bps == pytest.approx(8e9 * 0.9 * 10 / 2) and host.update_Bps == pytest.approx(2e9 * 0.8 * 10 / 2)
    assert host.message_s == pytest.approx(1e-3 / 10)  # on a core of its own: Worker.burst_sharing shares it
    after = host_of({"np": 2}, {**rates, "concurrent_after": {"processes": 2, "copy_Bps": 0.5, "update_Bps": 0.6}}, cores=2)
    assert after.copy_Bps == pytest.approx(8e9 * 0.7) and after.update_Bps == pytest.approx(2e9 * 0.7)  # the mean of both
    alone = host_of({"np": 1}, rates, cores=2)  # one rank: no other core at work beside it
    assert alone.copy_Bps == pytest.approx(8e9) and alone.update_Bps == pytest.approx(2e9)
    assert host.busy_wake_s is None and host.cores == 2  # not measured: every wake is a handoff
    assert host.batch_s == 0.0 and host_of({"np": 4, "batch_s": 0.02}, rates, cores=2).batch_s == 0.02  # as its run made them
    for bad in (-0.01, "1"):
        with pytest.raises(ConfigError, match=r"'ddp' \(4 workers\): batch_s must be a time >= 0"):
            host_of({"np": 4, "strategy": "ddp", "batch_s": bad}, rates, cores=2)
    woken = host_of({"np": 4, "dilation": 10.0}, {**rates, "busy_wake_s": 3e-3}, cores=2)
    assert woken.busy_wake_s == pytest.approx(3e-4)  # the scheduler's wait, divided by the dilation
    jittery = {**rates, "jitter": {"2": 0.15, "4": 0.35}}  # measured with 2 and with 4 ranks
    assert [host_of({"np": n}, jittery, cores=2).jitter for n in (1, 2, 3, 4, 8)] == [0.0, 0.15, 0.15, 0.35, 0.35]
    # A run whose own optimizer.step() shows the memory rate it met: 4 ranks updating 1 GB at once
    # in 2 s of undilated time met 0.5 GB/s, a rank's half of 2 cores times a fraction of the lone
    # 2 GB/s / dilation 10: 0.5e9 * 2 / (10 * 2e9) = 0.05. Copies, updates and codecs move by it.
    ran = {"np": 4, "dilation": 10.0, "optimizer_s": 2.0}
    memory = memory_met(ran, rates, cores=2, update_bytes=1e9)
    assert memory == pytest.approx(0.05) and memory_met({"np": 4}, rates, 2, 1e9) is None
    for bad in (0, -1.0, "2"):
        with pytest.raises(ConfigError, match=r"'ddp' \(4 workers\): optimizer_s must be a time > 0"):
            memory_met({"np": 4, "strategy": "ddp", "optimizer_s": bad}, rates, 2, 1e9)
    met = host_of(ran, rates, cores=2, memory=memory)
    assert met.update_Bps == pytest.approx(1e9 / 2.0) and met.copy_Bps == pytest.approx(8e9 * 0.05 * 10 / 2)
    assert met.codec_speed == pytest.approx(0.05 * 10 / 2)
    probed = host_of(ran, rates, cores=2)  # none met: the probe
    assert probed.update_Bps == pytest.approx(host.update_Bps) and probed.copy_Bps == pytest.approx(host.copy_Bps)


def test_a_hybrid_run_that_counts_its_servers_updates_is_replayed_at_the_memory_rate_they_met():
    from gradsync.simulate.validate import group_hosts, updates_met
    from gradsync.simulate.workload import Table

    rates = {"copy_Bps": 8e9, "update_Bps": 2e9, "concurrent": {"processes": 2, "copy_Bps": 0.9, "update_Bps": 0.8}}
    # 4 ranks on 2 cores, dilation 4: rank 0's server updated 400 MB of partitions a step in 0.25 s
    # (undilated). At the lone rates a rank's half of the cores takes 400 MB x (1.5 / 8 GB/s + 1 /
    # 2 GB/s) x 2 / 4 = 0.1375 s: the run met 0.55 of them.
    ran = {"np": 4, "dilation": 4.0, "strategy": "hybrid", "host_work": {"update": {"calls": 2, "bytes": 4e8, "seconds": 0.25}}}
    assert updates_met(ran, rates, cores=2) == pytest.approx(4e8 * (1.5 / 8e9 + 1 / 2e9) * 2 / 4 / 0.25)
    assert updates_met({"np": 4, "strategy": "hybrid"}, rates, cores=2) is None  # recorded before it was counted
    for bad in ({"calls": 2, "bytes": 4e8, "seconds": 0.0}, {"calls": 2}, 7):
        with pytest.raises(ConfigError, match=r"'hybrid' \(4 workers\): host_work update must have bytes and seconds > 0"):
            updates_met({**ran, "host_work": {"update": bad}}, rates, cores=2)
    # the replay's host for such a record: its copies and updates at that fraction, from the run
    work = synthetic([(0.0, 0.0, [4000]), (0.0, 0.0, [1000])])
    work.tables = {"layer0.p0": Table(rows=100, row_bytes=40, read=10)}
    (host, source), = group_hosts([ran], [work], rates, cores=2)
    fraction = updates_met(ran, rates, cores=2)
    assert source == "run" and host.update_Bps == pytest.approx(2e9 * fraction * 4 / 2)
    assert host.copy_Bps == pytest.approx(8e9 * fraction * 4 / 2)
    (probed, source), = group_hosts([{**ran, "host_work": {}}], [work], rates, cores=2)
    assert source == "probes" and probed.update_Bps == pytest.approx(2e9 * 0.8 * 4 / 2)


def test_a_compressed_run_that_counts_its_codecs_is_replayed_at_the_speeds_they_met(monkeypatch, tmp_path):
    from gradsync.simulate import compressed
    from gradsync.simulate.hostmodel import codec_speeds, host_of

    rates = {"copy_Bps": 8e9, "update_Bps": 2e9, "concurrent": {"processes": 2, "copy_Bps": 0.5, "update_Bps": 0.5}}
    lines = {"onebit": [1e-4, 5e-10, 2e-4, 1e-10, 1 / 32]}  # encode a + b x bytes, decode a + b x bytes, ratio
    # per measured step: 10 encodes of 100 MB in 25 ms, 20 decodes of 200 MB in 40 ms (undilated)
    work = {"encode": {"calls": 10, "bytes": 1e8, "seconds": 0.025}, "decode": {"calls": 20, "bytes": 2e8, "seconds": 0.04}}
    ran = {"np": 4, "dilation": 4.0, "strategy": "casync-ring", "host_work": work}
    encode, decode = codec_speeds(ran, lines)
    assert encode == pytest.approx((10 * 1e-4 + 1e8 * 5e-10) / 0.025) and decode == pytest.approx((20 * 2e-4 + 2e8 * 1e-10) / 0.04)
    host = host_of(ran, rates, cores=2, codecs=lines)
    assert (host.codec_speed, host.decode_speed) == pytest.approx((encode, decode))
    # a compressor named in the label is looked up by its own line; none counted or no line: the copies' fraction
    assert codec_speeds({**ran, "strategy": "casync-ring+topk:ratio=0.01"}, lines) is None
    assert codec_speeds({"np": 4, "strategy": "casync-ring"}, lines) is None
    plain = host_of({"np": 4, "dilation": 4.0, "strategy": "casync-ring"}, rates, cores=2, codecs=lines)
    assert plain.codec_speed == pytest.approx(0.5 * 4 / 2) and plain.decode_speed is None
    with pytest.raises(ConfigError, match=r"'casync-ring' \(4 workers\): host_work decode must have calls and seconds > 0"):
        codec_speeds({**ran, "host_work": {**work, "decode": {"calls": 20, "bytes": 2e8, "seconds": 0.0}}}, lines)
    with pytest.raises(ConfigError, match=r"host_work encode must have calls and seconds > 0"):
        codec_speeds({**ran, "host_work": {**work, "encode": {"calls": 10}}}, lines)
    # the replay says how many cells ran their compressor so
    from gradsync.simulate.validate import replay, report

    rec = {"model": "resnet50", "batch_size": 32, "np": 2, "net_bps": 1e9, "samples_per_s": 300.0, "steps": 4,
           "warmup": 1, "compute": "emulated", "dilation": 2.0, "strategy": "casync-ring", "host_work": work}
    matrix = {"cores": 2, "host_rates": rates, "codecs": lines,
              "groups": [{"command": "gradsync bench ...", "records": [rec, {**rec, "strategy": "compressed-allgather",
                                                                           "host_work": None}]}]}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(matrix))
    result = replay(str(path), steps=4, warmup=1)
    assert [c["codecs_met"] for c in result["cells"]] == [True, False] and result["codecs_met"] == 1
    assert "cells whose compressor ran at the speeds its run's encodes and decodes met: 1" in report(result)
    # the simulator scales each line by its own speed
    line = compressed.costmodel.Linear
    monkeypatch.setitem(compressed._CODECS, ("onebit", ()), (line(1e-4, 5e-10), line(2e-4, 1e-10), 1 / 32))
    cost = compressed.codec_cost("onebit", {}, encode, decode)
    assert cost.encode(1e8) == pytest.approx((1e-4 + 5e-10 * 1e8) / encode) and cost.decode(1e8) == pytest.approx((2e-4 + 1e-10 * 1e8) / decode)


def test_only_strategies_that_synchronize_in_backward_read_the_memory_rate_from_their_update():
    # Their optimizer.step() is the user's update alone; the others' step pulls, averages or waits.
    from gradsync.simulate import SIMULATED, build

    local = {name for name in SIMULATED if build(name, servers=1).updates_locally}
    assert local == {"allreduce", "ddp", "casync-ring", "casync-ps", "compressed-allgather"}


def test_a_woken_thread_waits_for_a_core_as_often_as_every_core_is_busy():
    """``Worker.wake_s``: where the ranks share cores, a thread woken while all are busy waits
    ``busy_wake_s``; the chance is each rank's share of time at work, ranks at random. Computed by
    hand: 2 ranks, this one's host busy 1 s of the first 2 (u = 1/2)."""
    from gradsync.simulate.worker import Worker

    def wake(cores: int, ranks: int = 2) -> float:
        sim = Sim()
        host = Host(handoff_s=0.001, busy_wake_s=0.101, cores=cores)
        worker = Worker(sim, synthetic([(0.1, 0.1, [1000])], batch_size=1), ranks, NET, host)
        worker.host.run(1.0)
        sim.after(2.0, lambda: None)
        sim.run()
        return worker.wake_s()

    assert wake(cores=2) == pytest.approx(0.001 + 0.25 * 0.1)  # both ranks busy: 1/2 * 1/2
    assert wake(cores=1) == pytest.approx(0.001 + 0.75 * 0.1)  # either of them: 1 - 1/2 * 1/2
    assert wake(cores=2, ranks=3) == pytest.approx(0.001 + 0.5 * 0.1)  # two of three: 3/8 + 1/8
    assert wake(cores=4) == pytest.approx(0.001)  # more cores than ranks: always a free one
    assert wake(cores=0) == pytest.approx(0.001)  # cores to spare (a real cluster's hosts)


def test_a_message_end_runs_beside_the_other_ranks_busy_at_the_time():
    """``Worker.burst_sharing``: a message end on shared cores runs beside the other ranks busy at
    that moment, each with this rank's share of time at work. Computed by hand: this rank's host
    busy 1 s of the first 2 (u = 1/2)."""
    from gradsync.simulate.worker import Worker

    def run(cores: int, ranks: int, message_s: float = 0.0):
        sim = Sim()
        worker = Worker(sim, synthetic([(0.1, 0.1, [1000])], batch_size=1), ranks, NET,
                        Host(cores=cores, message_s=message_s))
        worker.host.run(1.0)
        sim.after(2.0, lambda: None)
        sim.run()
        return sim, worker

    # 4 ranks on 2 cores: of the 3 others, 0 or 1 busy (1/8 + 3/8) leave a core; 2 (3/8) share two
    # cores among three, 3 (1/8) among four
    assert run(2, 4)[1].burst_sharing() == pytest.approx(1 / 8 + 3 / 8 + 3 / 8 * 1.5 + 1 / 8 * 2)
    assert run(1, 2)[1].burst_sharing() == pytest.approx(1 / 2 + 1 / 2 * 2)  # the other busy half the time
    assert run(2, 2)[1].burst_sharing() == 1.0 and run(0, 8)[1].burst_sharing() == 1.0  # a core each, or to spare
    sim, worker = run(2, 4, message_s=0.01)  # 10 ends handled on the interpreter: 0.1 s, shared as above
    start, ended = sim.now, []
    worker.message_ends(worker.cpu_stream("interpreter"), 10, lambda: ended.append(sim.now))
    sim.run()
    assert ended[0] - start == pytest.approx(0.1 * (1 / 8 + 3 / 8 + 3 / 8 * 1.5 + 1 / 8 * 2))


def test_a_message_end_shares_the_cores_with_the_networks_load_too():
    """``Worker.network_load``: every worker sends what the simulated one sent and receives as
    much, each byte end at ``net_cpu_s``; over the time so far that is a load of cores that a
    message end shares them with (``burst_sharing``), also where each rank has a core."""
    from gradsync.simulate.worker import Worker

    def loaded(cores: int, ranks: int, servers: int = 0):
        sim = Sim()
        worker = Worker(sim, synthetic([(0.1, 0.1, [1000])], batch_size=1), ranks, NET,
                        Host(cores=cores, net_cpu_s=1e-3), servers=servers)
        worker.host.run(1.0)  # busy 1 s of 2 (u = 1/2)
        worker.message(250, [(worker.tx, 1)], lambda: None)  # 250 B sent at 1000 B/s
        sim.after(2.0, lambda: None)
        sim.run()
        return worker

    worker = loaded(2, 2)
    # 2 workers x 250 B x 2 ends x 1 ms over 2 s: 0.5 of a core; the other rank busy half the time
    assert worker.network_load() == pytest.approx(0.5)
    assert worker.burst_sharing() == pytest.approx(1 / 2 * 1.0 + 1 / 2 * (1 + 1 + 0.5) / 2)
    assert loaded(2, 2, servers=1).network_load() == pytest.approx(1.0)  # the server's ends too
    assert loaded(0, 2).network_load() == 0.0 and loaded(0, 2).burst_sharing() == 1.0  # cores to spare
    # the replay takes the CPU per byte measured nearest a run's real link rate, over its dilation
    from gradsync.simulate import hostmodel

    rates = {"copy_Bps": 1e9, "update_Bps": 1e9, "net_cpu_s": {"250000000": 2e-9, "1000000000": 1e-9}}
    host = hostmodel.host_of({"np": 4, "net_bps": 1e9, "dilation": 4.0}, rates, 2)
    assert host.net_cpu_s == pytest.approx(2e-9 / 4)
    assert hostmodel.host_of({"np": 4, "net_bps": 1e10, "dilation": 10.0}, rates, 2).net_cpu_s == pytest.approx(1e-10)
    assert hostmodel.host_of({"np": 4, "net_bps": 1e9}, {"copy_Bps": 1e9, "update_Bps": 1e9}, 2).net_cpu_s == 0.0
    # measured on a machine that copies at half the speed of the one that recorded the run: half the CPU
    faster = {**rates, "net_cpu_copy_Bps": {"250000000": 0.5e9, "1000000000": 2e9}}
    assert hostmodel.host_of({"np": 4, "net_bps": 1e9, "dilation": 4.0}, faster, 2).net_cpu_s == pytest.approx(1e-9 / 4)


def test_a_handoff_that_waited_out_the_switch_interval_is_not_the_idle_handoff(monkeypatch):
    # Half the handoffs lost the interpreter lock to the running thread (5 ms and more): the median
    # of all would be one of those; the idle handoff is the median of the others.
    from gradsync.simulate import calibration

    fast, slow = [50e-6, 60e-6, 70e-6, 80e-6], [0.016, 0.02, 0.025, 0.029, 0.03]
    monkeypatch.setattr(calibration, "handoff_latencies", lambda repeats: slow + fast)
    assert calibration.measure_handoff() == pytest.approx(65e-6)
    monkeypatch.setattr(calibration, "handoff_latencies", lambda repeats: slow)  # none won: the median of all
    assert calibration.measure_handoff() == pytest.approx(0.025)


def test_calibration_measures_a_thread_handoff_and_starts_on_a_common_clock():
    """``calibrate(start_at=..., seconds=...)``: processes started apart measure their rates over
    the same seconds (measure_concurrency's processes overlap), and a thread handoff comes with them."""
    import time

    from gradsync.simulate.validate import calibrate, measure_handoff

    assert 0 < measure_handoff(repeats=5) < 0.05
    from gradsync.simulate.validate import measure_busy_wake

    assert 0 < measure_busy_wake(repeats=5) < 0.5  # with every core busy: milliseconds, not seconds
    began = time.time()
    start_at = began + 0.3
    rates = calibrate(numel=1 << 12, start_at=start_at, seconds=0.02, handoff_repeats=5)
    assert time.time() - start_at >= 2 * 0.02  # it waited for the start, then measured each rate for its seconds
    assert rates["copy_Bps"] > 0 and rates["update_Bps"] > 0 and 0 < rates["handoff_s"] < 0.05


def test_shipped_matrix_covers_every_strategy_with_its_commands_and_rates():
    """The validation matrix as shipped: at least 60 cells, every simulated strategy measured, each
    group with the command that made it and the host rates it is replayed with; a group with slice
    messages or compressors carries their costs as measured with it."""
    from gradsync.simulate import SIMULATED
    from gradsync.simulate.validate import MATRIX, options_of

    with open(MATRIX) as f:
        matrix = json.load(f)
    records = [(g, r) for g in matrix["groups"] for r in g["records"]]
    assert len(records) >= 60
    assert {options_of(r["strategy"])[0] for _, r in records} == set(SIMULATED)
    for group, _ in records:
        assert group["command"].startswith("gradsync bench ") and "--compute emulated" in group["command"]
        rates = {**matrix["host_rates"], **group.get("host_rates", {})}
        assert rates["copy_Bps"] > 0 and rates["update_Bps"] > 0 and rates["message_s"] > 0
        assert 0 < rates["handoff_s"] < 1e-3  # measured (validate.measure_handoff): tens of microseconds
        assert 1e-4 < rates["busy_wake_s"] < 0.05  # with every core busy (validate.measure_busy_wake): ms
        assert all(0 < cv < 1 for cv in rates["jitter"].values())  # hybrid's server updates, traced
        # the network's measured share for an all-to-all and CPU per byte (benchmarks/regenerate/mesh_exchange.py)
        assert all(0 < m <= 1.2 for by_rate in rates["mesh"].values() for m in by_rate.values())
        assert set(rates["mesh_command"]) == set(rates["mesh"])
        assert all(1e-10 < c < 1e-8 for c in rates["net_cpu_s"].values())
        together = rates["concurrent"]  # the rates' fraction with every core at it
        assert together["processes"] == matrix["cores"] and 0 < together["update_Bps"] <= 1
    for spec, costs in {**matrix["codecs"], **{k: v for g in matrix["groups"] for k, v in g.get("codecs", {}).items()}}.items():
        assert len(costs) == 5 and 0 < costs[4] <= 1, spec  # encode and decode lines, the wire ratio


def test_traced_slice_downlink_bins_a_runs_received_slices_by_their_time_into_the_step(tmp_path):
    """gradsync.simulate.traced's ``link``, whose figures docs/mechanisms.md quotes, on a trace made by
    hand: two workers at dilation 2, one warm-up step and one measured step each (1.0 and 1.2 s
    of wall time), the slices they received and their backward() starts."""
    from gradsync.simulate import traced


    def span(pid, name, start, dur, **args):
        return {"ph": "X", "pid": pid, "tid": 0, "name": name, "ts": start * 1e6, "dur": dur * 1e6, "args": args}

    events = [span(0, "p3 step 0", 0.0, 1.0), span(0, "p3 step 1", 1.0, 1.0),
              span(1, "p3 step 0", 0.0, 1.0), span(1, "p3 step 1", 1.05, 1.2),
              span(0, "backward()", 1.8, 0.1), span(1, "backward()", 2.0, 0.1),
              span(0, "push slice 3 (w) from rank 1", 1.0, 0.1, bytes=200_000),  # 0.05 s into the step (emulated)
              span(0, "pull slice 4 (w) from rank 1", 1.2, 0.3, bytes=200_000),  # 0.25 s in
              span(1, "push slice 5 (w) from rank 0", 1.1, 0.1, bytes=200_000),  # 0.075 s in
              span(1, "push slice 6 (w) from rank 0", 0.5, 0.1, bytes=200_000)]  # in the warm-up step
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    bins, step_s, per_step, spread = traced.slice_downlink(str(path), "p3", 2.0, 1, 0.1)
    assert step_s == pytest.approx(0.55)  # the median of 0.5 and 0.6 emulated seconds
    assert per_step == pytest.approx(300_000)  # the median of 400 and 200 KB: the warm-up's slice left out
    assert bins[(0, "push")] == pytest.approx(200_000)  # per step, over the two workers' steps: one push each
    assert bins[(1, "push")] == 0 and bins[(2, "pull")] == pytest.approx(100_000)
    assert max(j for j, _ in bins) == 5  # up to the longer step's 0.6 s
    assert spread == pytest.approx([0.1])  # backward() began 0.2 s of wall time apart


def test_traced_ps_phases_times_a_runs_phases_from_each_step_start(tmp_path):
    """gradsync.simulate.traced's ``phases``, whose figures docs/mechanisms.md quotes, on a trace made by hand:
    two co-located ps workers at dilation 2, one warm-up step and one measured step each."""
    from gradsync.simulate import traced

    def span(pid, name, start, dur):
        return {"ph": "X", "pid": pid, "tid": 0, "name": name, "ts": start * 1e6, "dur": dur * 1e6}

    def mark(pid, ph, name, at):
        return {"ph": ph, "pid": pid, "tid": 3, "name": name, "id": 1, "ts": at * 1e6}

    events = [span(0, "ps step 0", 0.0, 1.0), span(1, "ps step 0", 0.0, 1.0),
              span(0, "ps step 1", 1.0, 1.0), span(1, "ps step 1", 1.1, 1.1),
              span(0, "backward()", 1.05, 0.1), span(1, "backward()", 1.15, 0.1),
              mark(0, "e", "push of 'w' from rank 1", 0.5),  # in the warm-up step
              mark(0, "e", "push of 'w' from rank 1", 1.6), mark(0, "e", "push of 'b' from rank 1", 1.7),
              mark(1, "e", "push of 'v' from rank 0", 1.8), mark(1, "e", "push of 'v' to rank 0", 1.9),  # a send
              mark(0, "b", "pull of 'v' from rank 1", 1.75), mark(0, "b", "pull of 'v' from rank 1", 1.72),
              mark(1, "b", "pull of 'w' from rank 0", 1.84)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    phases, spread = traced.ps_phases(str(path), 2.0, 1)
    assert phases == pytest.approx({"backward ends": 0.075, "pushes of its share in": 0.35,
                                    "answers begin": 0.365, "step ends": 0.525})
    assert spread == {"steps begin apart": pytest.approx([0.05]), "answers begin apart": pytest.approx([0.06]),
                      "last answer to the step's last end": pytest.approx([0.18])}
    model, _ = traced.simulated_ps_phases("resnet50", 2, 1e9, 6, 3)
    times = [model[phase] for phase in traced.PHASES]
    assert 0 < times[0] < times[1] <= times[2] < times[3]  # the model's phases come in the step's order


def test_traced_ps_phases_refuses_a_trace_without_ps_steps_by_name(tmp_path):
    from gradsync.simulate import traced

    path = tmp_path / "p3.json"  # a trace of another strategy
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 0, "tid": 0, "name": "p3 step 0", "ts": 0,
                                                 "dur": 1e6}]}))
    with pytest.raises(ConfigError, match=r"p3\.json: no traced ps steps after 3 warm-up steps"):
        traced.ps_phases(str(path), 2.0, 3)


def test_a_traced_simulation_gives_its_step_ends():
    work = synthetic([(0.1, 0.1, [100]), (0.1, 0.1, [100])])
    record = simulate("allreduce", work, 2, NET, host=FREE_HOST, steps=4, warmup=1, trace=True)
    ends = record["step_ends"]
    assert len(ends) == 4 and ends == sorted(ends)
    assert [b - a for a, b in zip(ends, ends[1:])] == pytest.approx([record["step_s"]] * 3)


def test_the_matrixs_cells_of_hosts_of_several_workers_are_replayed_host_aware(tmp_path):
    """A record of ``gradsync bench --ranks-per-host R`` is replayed on hosts of R ranks, linked by
    the loopback's rate, each label in the form it ran: ``STRATEGY:flat`` flat, the others as
    ``HOSTS`` says (two-level ``allreduce``, ``ps`` summing its host at the step, ``ddp`` flat)."""
    from gradsync.simulate import HOSTS, validate

    with open(validate.MATRIX) as f:
        matrix = json.load(f)
    hosted = [g for g in matrix["groups"] if any(r.get("ranks_per_host", 1) > 1 for r in g["records"])]
    assert hosted and all(f"--ranks-per-host {g['records'][0]['ranks_per_host']}" in g["command"] for g in hosted)
    labels = {r["strategy"] for g in hosted for r in g["records"]}
    assert {"allreduce", "allreduce:flat", "ps", "ps:flat", "ddp"} <= labels
    alone = tmp_path / "matrix.json"  # those groups alone: a few seconds
    alone.write_text(json.dumps({**matrix, "groups": hosted}))
    cells = validate.replay(str(alone), steps=4, warmup=2)["cells"]
    for c in cells:
        name, _ = validate.options_of(c["strategy"])
        assert c["ranks_per_host"] > 1
        assert c["hosts"] == ("flat" if validate.flat_of(c["strategy"]) else HOSTS.get(name, "flat")), c["strategy"]
    rec = hosted[0]["records"][0]
    net = validate.record_network(matrix, rec)
    assert net.ranks_per_host == rec["ranks_per_host"] and 0 < net.intra_Bps < 1e11
    # its cell is found by its workers per host, apart from the one-rank-per-host cell of that shape
    shape = (rec["model"], rec["np"], rec["net_bps"], rec["strategy"])
    assert hosted[0]["command"] in validate.cell_host(*shape, ranks_per_host=rec["ranks_per_host"])[2]
    assert hosted[0]["command"] not in validate.cell_host(*shape)[2]


def test_a_records_host_is_the_one_the_replay_simulates_it_on(tmp_path):
    from gradsync.simulate import validate

    with open(validate.MATRIX) as f:
        matrix = json.load(f)
    group = next(g for g in reversed(matrix["groups"]) if any(r["strategy"] == "allreduce" and r.get("ranks_per_host", 1) == 1
                                                             for r in g["records"]))
    rec = next(r for r in group["records"] if r["strategy"] == "allreduce")
    host, work = validate.record_host(matrix, group, rec)
    steps = rec["warmup"] + rec["steps"] // rec.get("rounds", 1)
    mine = simulate("allreduce", work, rec["np"], validate.record_network(matrix, rec), host=host,
                    steps=max(steps, 8), warmup=max(rec["warmup"], 3))
    alone = tmp_path / "matrix.json"  # that group alone: the whole replay takes half a minute
    alone.write_text(json.dumps({**matrix, "groups": [group]}))
    replayed = next(c for c in validate.replay(str(alone))["cells"] if c["strategy"] == "allreduce")
    assert mine["samples_per_s"] == pytest.approx(replayed["simulated"])
    # and by its cell: the latest record of allreduce in that shape is this one
    host_of_cell, _, source = validate.cell_host(rec["model"], rec["np"], rec["net_bps"], "allreduce")
    assert host_of_cell == host and group["command"] in source
    assert "default host" in validate.cell_host("resnet50", 3, 1e9, "allreduce")[2]  # no such record
    assert validate.cell_network(rec["model"], rec["np"], rec["net_bps"], "allreduce") == validate.record_network(matrix, rec)
    assert validate.cell_network("resnet50", 3, 1e9, "allreduce").mesh == 1.0


def test_validate_writes_the_cells_as_a_markdown_page_with_the_command_that_regenerates_it(tmp_path, cli):
    rec = {"model": "resnet50", "batch_size": 32, "np": 2, "net_bps": 1e9, "samples_per_s": 70.0, "steps": 4,
           "warmup": 1, "compute": "emulated", "dilation": 2.0, "host_cpu_busy": 0.3}
    command = "gradsync bench --model resnet50 --compute emulated --np 2 --net 1gbit --strategies allreduce,ps"
    matrix = {"cores": 2, "host_rates": {"copy_Bps": 5e9, "update_Bps": 2e9},
              "groups": [{"command": command, "records": [{**rec, "strategy": "allreduce"},
                                                          {**rec, "strategy": "ps", "host_cpu_busy": 0.95}]}]}
    path, page = tmp_path / "m.json", tmp_path / "docs" / "page.md"
    path.write_text(json.dumps(matrix))
    code, out, err = cli("simulate", "--validate", str(path), "--markdown", str(page))
    assert code in (0, 1) and "markdown: " in out, err
    text = page.read_text()
    assert text.startswith("# Simulator validation") and f"--validate {path} --markdown {page}" in text.splitlines()[2]
    assert "### resnet50, 2 workers, 1 Gbit/s" in text and command in text
    assert "| `allreduce` | 70.0 |" in text and "(not counted: CPU-bound)" in text and "1 of 2 cells counted" in text
    code, _, err = cli("simulate", "--markdown", str(page))
    assert code == 2 and "--markdown needs --validate" in err
