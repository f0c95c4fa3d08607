"""Hosts of several ranks in the simulator: the two-level schedules' NIC bytes against the ring
over hosts, the flat form's R times a rank's, and one rank per host as before. Byte counts are
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


@pytest.mark.parametrize("strategy", ["ps", "sma", "allreduce-priority"])
def test_every_two_level_schedule_crosses_each_nic_as_a_job_of_its_hosts(strategy):
    """Local aggregation (one push and one pull per host) and the two-level ring move through a
    host's NIC what one rank per host moves in a job of as many workers as hosts."""
    two_level = step_bytes(strategy, 8, 4)
    one_per_host = step_bytes(strategy, 2, 1)
    assert two_level["hosts"] in ("ring", "local")
    assert two_level["nic_bytes_per_step"] == pytest.approx(one_per_host["bytes_per_step"], rel=1e-9)


@pytest.mark.parametrize("strategy", ["ddp", "allreduce", "ps"])
def test_flat_form_puts_every_ranks_traffic_on_the_nic(strategy):
    flat = step_bytes(strategy, 8, 4, flat=True)
    assert flat["hosts"] == "flat"
    assert flat["nic_bytes_per_step"] == pytest.approx(4 * flat["bytes_per_step"], rel=1e-9)
    alone = step_bytes(strategy, 8, 1)  # the same job, a host per rank: each rank sends the same
    assert flat["bytes_per_step"] == pytest.approx(alone["bytes_per_step"], rel=1e-9)


def test_ddp_stays_flat_and_allreduce_gains_from_two_levels():
    ddp, allreduce = step_bytes("ddp", 8, 4), step_bytes("allreduce", 8, 4)
    assert ddp["hosts"] == "flat" and allreduce["hosts"] == "ring"
    assert allreduce["nic_bytes_per_step"] < ddp["nic_bytes_per_step"] / 3


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "p3", "sma", "casync-ring"])
def test_one_rank_per_host_is_the_flat_job(strategy):
    kw = {"options": {"compression": "fp16"}} if strategy == "casync-ring" else {}
    one, flat = step_bytes(strategy, 4, 1, **kw), step_bytes(strategy, 4, 1, flat=True, **kw)
    assert one["step_s"] == flat["step_s"] and "hosts" not in one


def test_the_intra_host_link_slows_a_two_level_step():
    fast = simulate("allreduce", WORK, 8, Network(10e9, ranks_per_host=4, intra_Bps=None), steps=4, warmup=2)
    slow = simulate("allreduce", WORK, 8, Network(10e9, ranks_per_host=4, intra_Bps=1e9), steps=4, warmup=2)
    # a reduce-scatter and an all-gather inside the host: (R-1)/R of the bytes each, R ranks at once
    inside = 2 * 3 * (PARAMS + 12) / 1e9
    assert slow["step_s"] - fast["step_s"] == pytest.approx(inside, rel=0.05)
