"""Where gradsync's stores listen: one address, never every interface (they take no credentials);
and a store client that a silent server cannot hold for ever."""
import os
import socket

import pytest

from gradsync import store as stores
from gradsync.errors import ConfigError


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    if len(addr) == 8:
                        found.append(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1]))
                    else:
                        raw = bytes.fromhex(addr)
                        found.append(socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_a_store_listens_on_the_address_it_was_given_only():
    server = stores.serve("127.0.0.1", 0, None, 10)
    assert listening_addresses(server.port) == ["127.0.0.1"]
    server.set("k", "v")
    assert server.get("k") == b"v"


def test_the_bind_address_can_be_chosen(monkeypatch):
    assert stores.bind_address("10.1.2.3") == "10.1.2.3"
    monkeypatch.setenv(stores.BIND_ENV, "0.0.0.0")
    assert stores.bind_address("10.1.2.3") == "0.0.0.0"


def test_an_address_that_is_not_this_hosts_is_a_clear_error():
    with pytest.raises(ConfigError, match="is not an address of this host"):
        stores.listen("192.0.2.1", 0)  # TEST-NET-1: never assigned to a host


def test_a_port_in_use_is_a_clear_error():
    held = stores.listen("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="the port is in use"):
            stores.listen("127.0.0.1", held.getsockname()[1])
    finally:
        held.close()


def _client(port: int):
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))


def test_signed_values_round_trip_and_an_outsiders_write_is_refused_naming_the_key():
    server = stores.serve("127.0.0.1", 0, None, 5)
    job = stores.signed(_client(server.port), "a" * 64, prefix="job/")
    outsider = _client(server.port)
    job.set("gen", "3")
    assert job.get("gen") == b"3" and job.check(["gen"]) and not job.check(["other"])
    assert outsider.get("job/gen").endswith(b"3") and outsider.get("job/gen") != b"3"  # stored with its signature
    outsider.set("job/gen", "7")
    with pytest.raises(stores.UnsignedValueError, match="'job/gen' that is not signed with the job's secret"):
        job.get("gen")
    other_job = stores.signed(_client(server.port), "b" * 64, prefix="job/")  # another secret, same key
    other_job.set("gen", "9")
    with pytest.raises(stores.UnsignedValueError):
        job.get("gen")
    job.set("gen", "4")
    outsider.set("job/copy", outsider.get("job/gen"))  # a signed value replayed under another key
    with pytest.raises(stores.UnsignedValueError, match="job/copy"):
        job.get("copy")
    assert job.add("count", 2) == 2 and job.get("gen") == b"4"


def test_a_process_group_forms_on_a_signed_store_and_its_keys_are_signed():
    import torch
    import torch.distributed as dist

    from datetime import timedelta

    server = stores.serve("127.0.0.1", 0, None, 5)
    store = stores.signed(_client(server.port), "c" * 64)
    # A Gloo group of its own (not the default one, which another test in this process may hold).
    group = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    t = torch.ones(2)
    group.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0]
    outsider = _client(server.port)
    keys = outsider.list_keys()
    written = [k for k in keys if outsider.get(k) not in (b"", b"0", b"1")]
    assert written, keys  # the rendezvous wrote values (addresses), each with a 32-byte signature
    for key in written:
        with pytest.raises(stores.UnsignedValueError):
            stores.signed(_client(server.port), "d" * 64).get(key)
        assert len(stores.signed(_client(server.port), "c" * 64).get(key)) == len(outsider.get(key)) - 32


def test_the_secret_file_is_private_and_a_missing_one_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSYNC_STATE_DIR", str(tmp_path))
    path = stores.secret_file(1234)
    stores.write_secret(path, "s3cret")
    assert os.stat(path).st_mode & 0o777 == 0o600 and stores.read_secret(path) == "s3cret"
    stores.write_secret(path, "again")  # a stale file of a job that died on that port is replaced
    assert stores.read_secret(path) == "again"
    with pytest.raises(ConfigError, match="cannot read the job's secret"):
        stores.read_secret(str(tmp_path / "missing"))


def test_a_silent_store_is_reported_within_its_deadline_not_waited_for_for_ever():
    import threading
    import time

    class Store:  # answers until the link goes silent, as a TCPStore whose peer's link was cut
        silent = threading.Event()

        def add(self, key, amount):
            if self.silent.is_set():
                threading.Event().wait()  # never answered
            return amount

        def check(self, keys):
            raise RuntimeError("connection reset")

    client = stores.Answered(Store(), 0.2, "the job's store at 10.0.0.1:29400")
    assert client.add("beat", 3) == 3
    with pytest.raises(RuntimeError, match="connection reset"):  # the store's own errors pass through
        client.check(["beat"])
    Store.silent.set()
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"10.0.0.1:29400 did not answer a call \(add\) within 0.2 s"):
        client.add("beat", 1)
    assert time.monotonic() - began < 2
    with pytest.raises(TimeoutError, match="stopped answering"):  # and every later call, at once
        client.add("beat", 1)
