"""Hosts of several ranks in the simulator: the two-level schedules' NIC bytes against the ring
over hosts, the flat form's R times a rank's, and one rank per host equal to the flat job. Byte counts are
exact by construction (sums of transfer sizes), up to float rounding: rel=1e-9."""
import pytest

from gradsync.simulate import Network, simulate
from gradsync.simulate.workload import synthetic

MB = 2**20
WORK = synthetic([(1e-3, 2e-3, [4 * MB]), (1e-3, 2e-3, [4 * MB, 2 * MB])])  # 10 MB of parameters
PARAMS = WORK.nbytes


def step_bytes(strategy: str, np: int, per_host: int, **kw) -> dict:
    return simulate(strategy, WORK, np, Network(10e9, ranks_per_host=per_host), steps=4, warmup=2, **kw)


def ring(nbytes: float, peers: int) -> float:
    return 2 * (peers - 1) / peers * nbytes


@pytest.mark.parametrize("hosts", [2, 4])
def test_two_level_allreduce_sends_the_ring_over_hosts_through_each_nic(hosts):
    r = step_bytes("allreduce", 4 * hosts, 4)
    flags = 4 * 3  # allreduce's used flags, 4 bytes a parameter
    assert r["hosts"] == "ring" and r["ranks_per_host"] == 4
    assert r["nic_bytes_per_step"] == pytest.approx(ring(PARAMS + flags, hosts), rel=1e-9)


@pytest.mark.parametrize("strategy", ["ps", "p3", "ps-sliced", "sma", "allreduce-priority"])
def test_every_two_level_schedule_crosses_each_nic_as_a_job_of_its_hosts(strategy):
    """Local aggregation (one push and one pull per host) and the two-level ring move through a
    host's NIC what one rank per host moves in a job of as many workers as hosts."""
    two_level = step_bytes(strategy, 8, 4)
    one_per_host = step_bytes(strategy, 2, 1)
    assert two_level["hosts"] in ("ring", "local")
    assert two_level["nic_bytes_per_step"] == pytest.approx(one_per_host["bytes_per_step"], rel=1e-9)


@pytest.mark.parametrize("strategy", ["ddp", "allreduce", "ps"])
def test_flat_form_puts_what_crosses_hosts_on_the_nic(strategy):
    flat = step_bytes(strategy, 8, 4, flat=True)
    assert flat["hosts"] == "flat"
    alone = step_bytes(strategy, 8, 1)  # the same job, a host per rank: each rank sends the same
    assert flat["bytes_per_step"] == pytest.approx(alone["bytes_per_step"], rel=1e-9)
    # what crosses the NIC: a ring in rank order crosses each host once each way, one rank's ring;
    # ps's pushes and answers cross to the owners on other hosts, 4 of each rank's 7 peers, 4 ranks
    crossing = alone["bytes_per_step"] if strategy != "ps" else 4 * alone["bytes_per_step"] * 4 / 7
    assert flat["nic_bytes_per_step"] == pytest.approx(crossing, rel=1e-9)


def test_ddp_stays_flat_and_allreduce_gains_from_two_levels():
    ddp, allreduce = step_bytes("ddp", 8, 4), step_bytes("allreduce", 8, 4)
    assert ddp["hosts"] == "flat" and allreduce["hosts"] == "ring"
    # ddp's ring over the 8 ranks crosses each NIC once each way; allreduce's rings over 2 hosts
    assert ddp["nic_bytes_per_step"] == pytest.approx(ring(PARAMS, 8), rel=1e-9)
    assert allreduce["nic_bytes_per_step"] == pytest.approx(ring(PARAMS + 12, 2), rel=1e-9)
    assert allreduce["samples_per_s"] > ddp["samples_per_s"]


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "p3", "sma", "casync-ring"])
def test_one_rank_per_host_is_the_flat_job(strategy):
    kw = {"options": {"compression": "fp16"}} if strategy == "casync-ring" else {}
    one, flat = step_bytes(strategy, 4, 1, **kw), step_bytes(strategy, 4, 1, flat=True, **kw)
    assert one["step_s"] == flat["step_s"] and "hosts" not in one


def test_the_intra_host_link_slows_a_two_level_step():
    fast = simulate("allreduce", WORK, 8, Network(10e9, ranks_per_host=4, intra_Bps=None), steps=4, warmup=2)
    slow = simulate("allreduce", WORK, 8, Network(10e9, ranks_per_host=4, intra_Bps=1e9), steps=4, warmup=2)
    # a reduce-scatter and an all-gather inside the host: (R-1)/R of the bytes each, R ranks at once;
    # the bucket's two parts of 5 MB (PIPELINE_BYTES) cross the network while the host's thread sums
    # and gathers the other part, so on the slow link only the in-host hops count, and the fast
    # step's all-reduce across the 2 hosts hides behind them
    inside = 2 * 3 * (PARAMS + 12) / 1e9
    across = ring(PARAMS + 12, 2) / (10e9 / 8)
    assert slow["step_s"] - fast["step_s"] == pytest.approx(inside - across, rel=0.05)


def test_a_two_level_all_reduce_crosses_hosts_in_parts_while_the_host_sums_the_next():
    from gradsync.simulate.engine import Sim
    from gradsync.simulate.worker import Host, Worker

    def ends(nbytes: float, intra: float) -> float:
        sim = Sim()
        wk = Worker(sim, WORK, 4, Network(8e9, ranks_per_host=2, intra_Bps=intra, latency_s=0.0), Host(), hosts="ring")
        wk.ring(nbytes, lambda: None)
        return sim.run()

    # 16 MB in 4 parts of 4 MB; a part's in-host hop takes 2 ms (2 MB from each of 2 ranks over 2 GB/s),
    # its ring over the 2 hosts 4 ms (4 MB at 1 GB/s): scatter 0, then the network's 4 parts back
    # to back (the host's thread sums the next part and gathers the previous one meanwhile), the
    # last part's gather
    part, hop, cross = 4 * MB, 4 * MB / 2e9, 4 * MB / 1e9
    assert ends(4 * part, 2e9) == pytest.approx(hop + 4 * cross + hop, rel=1e-9)
    assert ends(part / 2, None) == pytest.approx(cross / 2, rel=1e-9)  # one part under PIPELINE_BYTES


def test_ps_sums_each_layer_in_its_host_during_backward_and_shares_the_pulls_at_the_step():
    """As ps's code does on hosts of several workers: each layer's gradients are reduced inside the
    host once ready and pushed on during backward; after the pulls, one broadcast of the parameters
    inside the host."""
    r = simulate("ps", WORK, 8, Network(10e9, ranks_per_host=4), steps=3, warmup=1, trace=True)
    first = r["step_ends"][0]
    spans = [s for s in r["timeline"] if s[3] <= first]
    backward_end = max(end for lane, what, _, end in spans if what.startswith("backward"))
    inside = [s for s in spans if s[0] == "intra-host"]
    reduces = [s for s in inside if s[1].startswith("reduce layer")]
    assert len(reduces) == len(WORK.layers) and min(s[2] for s in reduces) < backward_end
    network = [start for lane, _, start, _ in spans if lane == "network"]
    assert network and min(network) < backward_end
    assert inside[-1][1] == "parameters broadcast in host"
    assert inside[-1][2] >= max(end for lane, _, _, end in spans if lane == "network")

def _with_table(read: float):
    """A 400 kB dense layer, a 4 MB one, and a table of 1000 rows of 400 B with ``read`` rows a step."""
    from gradsync.simulate.workload import Table

    work = synthetic([(1e-3, 2e-3, [400_000]), (1e-3, 2e-3, [4 * MB])])
    work.tables = {"layer0.p0": Table(rows=1000, row_bytes=400, read=read)}
    return work


def test_hybrid_crosses_each_nic_with_its_hosts_rows_once():
    """As hybrid's code does on hosts of several workers: the dense part takes the two-level ring, and
    each host's first rank pushes and pulls the union of its ranks' rows (no samples: 4 ranks read 4
    times the rows), what one rank per host reading those rows sends."""
    hosted = simulate("hybrid", _with_table(10), 8, Network(10e9, ranks_per_host=4), steps=4, warmup=2)
    one_per_host = simulate("hybrid", _with_table(40), 2, Network(10e9), steps=4, warmup=2)
    assert hosted["hosts"] == "ring" and "summed and pulled once" in hosted["plan"]
    assert hosted["nic_bytes_per_step"] == pytest.approx(one_per_host["bytes_per_step"], rel=1e-9)
    assert hosted["min_bytes_per_host"] == pytest.approx(one_per_host["min_bytes_per_host"], rel=1e-9)
    flat = simulate("hybrid", _with_table(10), 8, Network(10e9, ranks_per_host=4), steps=4, warmup=2, flat=True)
    assert flat["nic_bytes_per_step"] > hosted["nic_bytes_per_step"]


def test_a_hosts_rows_are_the_union_of_its_ranks_batches():
    import torch

    from gradsync.simulate.workload import Table

    table = Table(rows=10, row_bytes=4, read=4, samples=(torch.tensor([0, 1, 2, 3]), torch.tensor([2, 3, 4, 5])))
    assert table.host_read(1) == 4 and table.host_read(2) == 6  # the two batches share rows 2 and 3
    assert table.host_read(3) == 8  # past the samples, each batch adds what the last one did
    assert table.host_read(9) == 10  # at most every row
    assert Table(rows=100, row_bytes=4, read=5).host_read(4) == 20  # no samples: no rows shared
