"""Receivers check what a peer sends before they allocate or index anything for it.

A peer that runs another version, a corrupted message or a hostile process on the job's ports
must end in a :class:`PeerProtocolError` that names the peer, never in a huge allocation, an
out-of-range index or a read of memory nobody wrote.
"""
from types import SimpleNamespace

import pytest
import torch

import gradsync
from gradsync import runtime
from gradsync.compress import build, parse_spec
from gradsync.compress.base import from_bytes, message_problem, to_bytes
from gradsync.errors import PeerProtocolError
from gradsync.strategies import hybrid, p3, ps
from gradsync.transport import payload_limit
from multirank import run_ranks

TAG = 4242


def oversized_header_then_receive() -> str:
    """Rank 1 announces a message of 2^40 bytes; rank 0 must refuse it without allocating."""
    transport = runtime.current().transport
    if gradsync.topology().rank == 1:
        transport.send_async(torch.tensor([1 << 40, 0, -1, -1]), 0, TAG).wait()
        return ""
    try:
        transport.recv_bytes(1, TAG, limit=payload_limit(1000), what="compressed bucket 0 from rank 1")
    except PeerProtocolError as exc:
        return str(exc)
    return "accepted"


def oversized_allgather() -> str:
    """Rank 1 claims a 2^40-byte message in the all-gather's length round."""
    import torch.distributed as dist

    transport = runtime.current().transport
    if gradsync.topology().rank == 1:
        fake = torch.tensor([1 << 40, 0, 0, 0])
        dist.all_gather([torch.empty_like(fake) for _ in range(2)], fake)
        return ""
    try:
        transport.allgather_bytes(torch.zeros(10, dtype=torch.uint8), limit=payload_limit(10),
                                  what="compressed bucket 3")
    except PeerProtocolError as exc:
        return str(exc)
    return "accepted"


def test_a_length_beyond_what_the_peer_may_send_is_refused_naming_it():
    message = run_ranks(oversized_header_then_receive, 2, timeout=60)[0]
    assert "rank 1 sent compressed bucket 0 from rank 1 with a length of 1099511627776 bytes" in message, message
    assert f"at most {payload_limit(1000)} expected" in message


def test_an_all_gather_length_beyond_the_limit_is_refused_naming_the_rank():
    message = run_ranks(oversized_allgather, 2, timeout=60)[0]
    assert message.startswith("rank 1 sent compressed bucket 3 with a length of 1099511627776 bytes"), message


def test_every_codec_payload_fits_the_limit_and_parses():
    grad = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    for spec in ["fp16", "onebit", "topk:ratio=1", "randomk:ratio=0.5", "dgc", "qsgd", "terngrad", "powersgd"]:
        name, options = parse_spec(spec)
        payload, _ = build(name, **options).compress(grad.reshape(50, 100) if name == "powersgd" else grad)
        message = to_bytes(payload)
        assert message.numel() <= payload_limit(grad.numel()), spec
        assert message_problem(message) is None, spec


@pytest.mark.parametrize("corrupt,expected", [
    (lambda m: m[:5], "a 5-byte payload"),
    (lambda m: torch.cat([torch.tensor([1000], dtype=torch.int64).view(torch.uint8), m[8:]]), "1000 parts"),
    (lambda m: m[:-4], "add up to"),
    (lambda m: torch.cat([m, torch.zeros(8, dtype=torch.uint8)]), "add up to"),
    (lambda m: torch.cat([m[:16], torch.tensor([99], dtype=torch.int64).view(torch.uint8), m[24:]]), "dtype code 99"),
    (lambda m: torch.cat([m[:8], torch.tensor([-7], dtype=torch.int64).view(torch.uint8), m[16:]]), "-7 elements"),
])
def test_a_malformed_payload_is_named_before_any_part_is_read(corrupt, expected):
    good = to_bytes([torch.randn(10), torch.arange(4)])
    assert message_problem(good) is None
    bad = corrupt(good.clone())
    assert expected in message_problem(bad)
    with pytest.raises(ValueError, match="malformed compressed message"):
        from_bytes(bad)


def test_parameter_server_headers_outside_step_and_stop_are_refused():
    ps._check_header(torch.tensor([ps.OP_STEP, 3]), 2)
    ps._check_header(torch.tensor([ps.OP_STOP, 0]), 2)
    for op, step in [(7, 3), (ps.OP_STEP, -1)]:
        with pytest.raises(PeerProtocolError, match=f"rank 2 sent a parameter-server step header with operation {op}"):
            ps._check_header(torch.tensor([op, step]), 2)


def test_hybrid_requests_are_checked_against_the_tables_and_partitions():
    server = SimpleNamespace(row_counts=[100], parts=[[(0, 50, None)]])
    check_header = lambda op, table, n: hybrid.RowServer._check_header(server, 3, op, table, n)  # noqa: E731
    check_ids = lambda ids, owned: hybrid.RowServer._check_ids(server, 3, 0, torch.tensor(ids), owned)  # noqa: E731
    check_header(hybrid.OP_PULL, 0, 100)
    check_header(hybrid.OP_STOP, 99, 1 << 50)  # a stop carries nothing else
    check_ids([0, 49], owned=True)
    check_ids([99], owned=False)
    for args, match in [((42, 0, 1), "operation 42"), ((hybrid.OP_PUSH, 1, 1), "table 1 \\(there are 1\\)"),
                        ((hybrid.OP_PUSH, 0, 1 << 40), "1099511627776 row ids \\(it has 100 rows\\)"),
                        ((hybrid.OP_PULL, 0, -1), "-1 row ids")]:
        with pytest.raises(PeerProtocolError, match=f"rank 3 sent .*{match}"):
            check_header(*args)
    with pytest.raises(PeerProtocolError, match="row 100, outside 0..99"):
        check_ids([5, 100], owned=False)
    with pytest.raises(PeerProtocolError, match="row 60, outside this server's partitions"):
        check_ids([5, 60], owned=True)


def test_p3_messages_must_name_a_slice_the_right_rank_owns():
    plan = SimpleNamespace(slices=[SimpleNamespace(owner=0), SimpleNamespace(owner=1)])
    me = SimpleNamespace(plan=plan, me=0, followers=[], relay=None)
    check = lambda peer, kind, k, step=0: p3.P3._check_header(me, peer, kind, k, step)  # noqa: E731
    check(1, p3.PUSH, 0)    # a push of a slice this rank serves
    check(1, p3.ANSWER, 1)  # an answer with a slice the peer serves
    check(1, p3.STOP, 0, 5)
    for args in [(1, p3.PUSH, 1), (1, p3.ANSWER, 0), (1, p3.PUSH, 7), (1, 9, 0), (1, p3.PUSH, 0, -2)]:
        with pytest.raises(PeerProtocolError, match="rank 1 sent a P3 message"):
            check(*args)
    # Inside a host: a leader takes its workers' pushes of any slice; a worker its leader's answers.
    leader = SimpleNamespace(plan=plan, me=0, followers=[2], relay=None)
    p3.P3._check_header(leader, 2, p3.PUSH, 1, 0)
    worker = SimpleNamespace(plan=plan, me=2, followers=[], relay=0)
    p3.P3._check_header(worker, 0, p3.ANSWER, 1, 0)
    for who, args in [(leader, (1, p3.PUSH, 1, 0)), (leader, (2, p3.ANSWER, 1, 0)), (worker, (0, p3.PUSH, 0, 0)),
                      (leader, (2, p3.PUSH, 7, 0))]:
        with pytest.raises(PeerProtocolError, match="sent a P3 message"):
            p3.P3._check_header(who, *args)
