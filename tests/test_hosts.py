"""Which ranks share a host: the layout found at init (gradsync.hosts), its checks, the Topology."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync.errors import ConfigError
from gradsync.hosts import Abandoned, exchange, host_name, layout
from gradsync.topology import Topology
from multirank import run_ranks, run_ranks_expect_failure


def test_hosts_are_numbered_by_their_lowest_rank_and_grouped():
    entries = [("b", 0, 2), ("a", 0, 1), ("b", 1, 2)]
    assert layout(entries) == (0, 1, 0)
    topo = Topology(3, 2, 0, 1, host_of=(0, 1, 0))
    assert topo.hosts == [[0, 2], [1]] and topo.host() == 0 and topo.host_ranks == [0, 2]
    assert topo.shares_hosts  # two hosts, one of two workers
    assert not Topology(4, 0, host_of=(0, 0, 0, 0)).shares_hosts  # one host: nothing crosses a network
    assert not Topology(3, 0, 1, host_of=(0, 1, 1)).shares_hosts  # the server's host holds one worker
    unknown = Topology(3, 1)
    assert unknown.hosts == [[0], [1], [2]] and unknown.host() == 1 and not unknown.shares_hosts


@pytest.mark.parametrize("entries,message", [
    ([("a", 0, 2), ("a", 1, 3)], "host 'a' runs ranks [0, 1], but they were told LOCAL_WORLD_SIZE rank 0: 2, rank 1: 3"),
    ([("a", 0, 2), ("b", 0, 2)], "host 'a' runs ranks [0], but they were told LOCAL_WORLD_SIZE rank 0: 2"),
    ([("a", 0, None), ("a", 0, None)], "host 'a': ranks [0, 1] share LOCAL_RANK 0"),
])
def test_a_layout_the_ranks_disagree_on_is_refused_naming_ranks_and_hosts(entries, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layout(entries)
    with pytest.raises(ConfigError, match="without gaps"):
        Topology(2, 0, host_of=(0, 2))


def test_the_host_is_named_by_the_launchers_variables_first():
    assert host_name({"GRADSYNC_HOST": "emulated host 1", "GROUP_RANK": "0"}) == "GRADSYNC_HOST=emulated host 1"
    assert host_name({"GROUP_RANK": "3", "SLURM_NODEID": "7"}) == "GROUP_RANK=3"
    assert host_name({"SLURM_NODEID": "7"}) == "SLURM_NODEID=7"


def layout_seen():
    return gradsync.topology().host_of


def test_every_rank_learns_the_same_layout_at_init_two_hosts_and_one():
    env = [{"GRADSYNC_HOST": f"h{r // 2}", "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2" if r < 2 else "1"}
           for r in range(3)]
    assert run_ranks(layout_seen, 3, env=env, timeout=60) == [(0, 0, 1)] * 3


def test_ranks_told_different_local_world_sizes_all_fail_at_init():
    env = [{"GRADSYNC_HOST": "h", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3"} for r in range(2)]
    errors = run_ranks_expect_failure(layout_seen, 2, env=env, timeout=60)
    assert sorted(errors) == [0, 1], errors
    for text in errors.values():
        assert "ConfigError: host 'GRADSYNC_HOST=h' runs ranks [0, 1], but they were told LOCAL_WORLD_SIZE" in text, text


def test_rank_0_raises_a_layout_error_once_every_rank_has_read_it():
    # Rank 0's process may host the store: had it raised and exited first, a rank still reading
    # the answer would get "Connection reset by peer" instead of the ConfigError.
    from gradsync.hosts import LAYOUT

    base, events = dist.HashStore(), []

    class RankOneReadsLate:
        def __getattr__(self, name):
            return getattr(base, name)

        def get(self, key):
            if key == LAYOUT and threading.current_thread().name == "rank 1":
                time.sleep(0.3)
                events.append("rank 1 read")
            return base.get(key)

    def one(rank):
        env = {"GRADSYNC_HOST": "h", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3"}
        try:
            exchange(RankOneReadsLate(), Topology(2, rank, 0, rank), 5.0, env=env)
        except ConfigError:
            events.append(f"rank {rank} raised")

    threads = [threading.Thread(target=one, args=(r,), name=f"rank {r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(events) == ["rank 0 raised", "rank 1 raised", "rank 1 read"], events
    assert events.index("rank 1 read") < events.index("rank 0 raised"), events


def exchange_on(store, ranks, world, abandon, env_of=lambda r: {"GRADSYNC_HOST": f"h{r // 2}"}):
    """``exchange`` run by ``ranks`` of ``world`` in threads on one store: each rank's layout or error."""
    out = {}

    def one(rank):
        try:
            out[rank] = exchange(store, Topology(world, rank, 0, rank), 5.0, env=env_of(rank), abandon=abandon).host_of
        except Exception as exc:  # noqa: BLE001 - the test compares what each rank got
            out[rank] = exc
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


@pytest.mark.parametrize("missing", [1, 0])
def test_ranks_give_up_a_generation_together_once_a_newer_one_exists_and_a_rank_is_missing(missing):
    # Rank `missing` of four never comes (it went to the newer generation): rank 0 gives up while
    # it waits for it, or, where rank 0 is the one missing, the others give up; every rank that
    # came gets the same Abandoned, within a few polls of the newer generation, not at the timeout.
    newer = threading.Event()
    threading.Timer(0.3, newer.set).start()
    start = time.monotonic()
    out = exchange_on(dist.HashStore(), [r for r in range(4) if r != missing], 4,
                      lambda: "generation 2 replaced it" if newer.is_set() else None)
    assert time.monotonic() - start < 3
    assert all(isinstance(v, Abandoned) and "generation 2" in str(v) for v in out.values()), out


def test_a_generation_whose_ranks_all_came_forms_even_if_a_newer_one_exists():
    # The newer generation appears once every rank has written its host: they form this one.
    store = dist.HashStore()
    came = [f"gradsync/hosts/{r}" for r in range(4)]
    out = exchange_on(store, range(4), 4, lambda: "generation 2 replaced it" if store.check(came) else None)
    assert out == {r: (0, 0, 1, 1) for r in range(4)}


def test_after_a_failed_two_level_operation_the_queued_ones_fail_without_communicating():
    # Each would block on the groups the failure broke until their timeout (a thread the job's end
    # then waits for): they fail at once, naming the first failure. The first fails in its `then`
    # (a host of one: nothing to gather); the host group is then no group at all, so an operation
    # that tried to communicate would fail differently.
    from gradsync.transport.twolevel import TwoLevel, _Done

    two = TwoLevel(Topology(4, 0, 0, 0), None, [0], 2, {})

    def lost(*_):
        raise RuntimeError("Connection reset by peer")

    first, second = _Done(), _Done()
    two._run(("all-gather-bytes", (torch.zeros(2, dtype=torch.uint8), (0, 0, 0), 8, "test"), first, None, lost))
    assert str(first.error) == "Connection reset by peer"
    two.local = object()
    two._run(("reduce", torch.zeros(2), second, None, None))
    assert "not run, an earlier two-level operation on these groups failed: Connection reset by peer" in str(
        second.error), second.error


def test_what_follows_a_host_sum_reads_the_sum_where_the_tensor_lives(monkeypatch):
    # Under Gloo with the model on a GPU the host's sum lands in a host-memory copy of the tensor;
    # the push that follows it on the communication thread (a parameter server's host leader) must
    # read the sum there, not the tensor from before the sum (a silently wrong model on GPUs).
    from gradsync.transport import Transport
    from gradsync.transport.twolevel import _Done

    class Host:  # a host group whose other worker contributes ones
        def submit(self, op, tensor, on_done=None, then=None):
            done = _Done()
            tensor.add_(1)
            if then is not None:
                then()
            done.event.set()
            return done

    transport = Transport(Topology(world_size=2, rank=0, num_servers=0), None, torch.device("cpu"))
    monkeypatch.setattr(transport, "staged", lambda tensor: tensor.clone())  # a copy, as for a GPU tensor
    transport.two_level = Host()
    grad, pushed = torch.full((3,), 2.0), []
    transport.host_reduce_async(grad, what="host sum", then=lambda: pushed.append(grad.clone())).wait()
    assert pushed[0].tolist() == [3.0, 3.0, 3.0] and grad.tolist() == [3.0, 3.0, 3.0]
    total = torch.full((3,), 2.0)  # without a follower the sum lands at the wait
    transport.host_allreduce(total, what="host sum")
    assert total.tolist() == [3.0, 3.0, 3.0]


def test_two_level_shards_are_owned_once_per_host_even_on_uneven_hosts():
    from gradsync.transport import TwoLevel

    hosts, shards, owners = TwoLevel.plan(Topology(6, 0, 1, host_of=(0, 0, 1, 1, 2, 2)))
    assert hosts == [[0, 1], [2, 3], [4]] and shards == 2  # the server (rank 5) takes no part
    assert owners == [[0, 2, 4], [1, 3, 4]]  # a host of one worker owns every shard
    hosts, shards, owners = TwoLevel.plan(Topology(5, 0, host_of=(0, 0, 0, 1, 1)))
    assert shards == 3 and owners == [[0, 3], [1, 4], [2, 3]]


def two_level_sums(sizes):
    from gradsync import runtime

    transport, rank = runtime.current().transport, gradsync.topology().rank
    out = []
    for size in sizes:  # integers in float64: every order of summing gives the same bits
        x = torch.arange(size, dtype=torch.float64) * (rank + 1)
        transport.allreduce_async(x, group=transport.two_level, what="test sum").wait()
        out.append(x)
    # All in flight at once, a host sum among them: the all-reduces' step 3 runs on its own thread
    # and group while the next ones (and the host sum) go on, in one order on every rank.
    streamed = [torch.arange(size, dtype=torch.float64) * (rank + 1) for size in sizes * 2]
    handles = [transport.allreduce_async(x, group=transport.two_level, what="test sum") for x in streamed[:4]]
    host = torch.ones(3, dtype=torch.float64)
    handles.append(transport._two_level(transport.two_level, "host-all-reduce", host, "test host sum"))
    handles += [transport.allreduce_async(x, group=transport.two_level, what="test sum") for x in streamed[4:]]
    for handle in handles:
        handle.wait()
    return out, streamed, host


@pytest.mark.parametrize("hosts", [(0, 0, 1, 1), (0, 0, 1)], ids=["2x2", "2+1"])
def test_the_two_level_all_reduce_sums_exactly_in_one_part_and_in_a_pipeline_of_parts(hosts):
    from gradsync.transport.twolevel import PIPELINE_BYTES

    sizes = [1, 5, 4099, 3 * PIPELINE_BYTES // 8 + 7]  # the last: three parts of a pipeline, padded
    env = [{"GRADSYNC_HOST": f"h{h}", "LOCAL_WORLD_SIZE": str(hosts.count(h))} for h in hosts]
    total = sum(range(1, len(hosts) + 1))
    for rank, (sums, streamed, host) in enumerate(run_ranks(two_level_sums, len(hosts), sizes, env=env, timeout=60)):
        for x, size in zip(sums + streamed, sizes * 3):
            assert torch.equal(x, torch.arange(size, dtype=torch.float64) * total), size
        assert host.tolist() == [hosts.count(hosts[rank])] * 3


def test_a_failed_part_of_a_two_level_all_reduce_fails_it_and_the_operations_after_it():
    # Step 2 of the first part fails (a peer lost): the all-reduce's waiters get that error, not a
    # hang, and an operation queued after it fails at once without communicating.
    from datetime import timedelta

    from gradsync.transport.twolevel import TwoLevel

    class Lost:
        def wait(self):
            raise RuntimeError("Connection reset by peer")

    two = TwoLevel(Topology(4, 0, 0, 0), None, [0], 1, {})
    two._cross_async = lambda parts: [Lost()]
    failed = two.submit("all-reduce", torch.zeros(5))
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        failed.wait(timedelta(seconds=10))
    two.local = object()  # an operation that tried to communicate would fail differently
    after = two.submit("reduce", torch.zeros(2))
    with pytest.raises(RuntimeError, match="not run, an earlier two-level operation on these groups failed"):
        after.wait(timedelta(seconds=10))
    two.close()


def test_the_next_two_level_all_reduce_enters_the_host_while_the_last_one_is_gathered():
    # A stream of small buffers (allreduce-priority's partitions) keeps the NIC busy only if the
    # next buffer's step 1 need not wait for the previous buffer's step 3: here step 3 of the first
    # can finish only once step 1 of the second has begun.
    import threading
    from datetime import timedelta

    from gradsync.transport.twolevel import TwoLevel

    two = TwoLevel(Topology(4, 0, 0, 0), None, [0], 1, {})
    second_entered, overlapped, scattered = threading.Event(), [], []

    def scatter(padded):
        scattered.append(padded)
        if len(scattered) == 2:
            second_entered.set()

    def gather(padded, group):
        if not overlapped:
            overlapped.append(second_entered.wait(5))

    two._scatter, two._gather, two._cross_async = scatter, gather, lambda parts: []
    first, second = two.submit("all-reduce", torch.zeros(4)), two.submit("all-reduce", torch.zeros(4))
    first.wait(timedelta(seconds=10))
    second.wait(timedelta(seconds=10))
    two.close()
    assert overlapped == [True]
