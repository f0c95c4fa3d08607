"""Where gradsync's stores listen: one address, never every interface (they take no credentials)."""
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
