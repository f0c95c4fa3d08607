"""What an emulated cluster's links carried, dropped or resent: its device, ``tc`` and TCP counters.

Each host's uplink and each switch port is a token bucket (``tc tbf``, docs/emulation.md) that
drops what overflows it, and each host's TCP resends what was lost. :func:`read` gives, per
namespace, the packets its qdiscs dropped and (on a host) its TCP segments sent, retransmitted and
retransmission timeouts, counted since the cluster was made; ``benchmarks/link_counters.py`` reads
them while a command runs. :func:`link_bytes` gives the bytes a host's link has sent and received,
from the device counters of the host's ``eth0`` (``gradsync bench`` reads them around its measured
steps).
"""
from __future__ import annotations

import re
import subprocess

from gradsync.cluster.netns import IFNAME, PREFIX
from gradsync.errors import ConfigError

TCP = ("OutSegs", "RetransSegs", "TCPTimeouts")
"""The TCP counters :func:`tcp_counters` keeps."""


def tc_drops(text: str) -> int:
    """Packets dropped, summed over the qdiscs of ``tc -s qdisc show`` output."""
    return sum(int(n) for n in re.findall(r"\(dropped (\d+),", text))


def tcp_counters(text: str) -> dict[str, int]:
    """:data:`TCP` from the header and value line pairs of /proc/net/snmp and /proc/net/netstat."""
    found = {}
    lines = text.splitlines()
    for head, values in zip(lines[::2], lines[1::2]):
        for key, value in zip(head.split()[1:], values.split()[1:]):
            if key in TCP:
                found[key] = int(value)
    return found


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True).stdout


def namespaces() -> set[str]:
    """The emulated clusters' network namespaces there now (every cluster's, live or left over)."""
    return {ns for ns in _out("ip", "netns", "list").split() if ns.startswith(PREFIX)}


def read(names: set[str]) -> dict[str, dict[str, int]]:
    """Per namespace of ``names``: ``dropped`` (its qdiscs'), and on a host its :data:`TCP` counters."""
    found = {}
    for ns in names:
        counts = {"dropped": tc_drops(_out("tc", "-n", ns, "-s", "qdisc", "show"))}
        if not ns.endswith("-sw"):
            counts.update(tcp_counters(_out("ip", "netns", "exec", ns, "cat", "/proc/net/snmp", "/proc/net/netstat")))
        found[ns] = counts
    return found


def dev_bytes(text: str, device: str = IFNAME) -> tuple[int, int]:
    """``(tx, rx)`` bytes of ``device`` from ``/proc/net/dev`` text (``ConfigError`` if it is not there)."""
    for line in text.splitlines():
        name, colon, fields = line.partition(":")
        if colon and name.strip() == device:
            values = fields.split()
            return int(values[8]), int(values[0])  # receive: bytes first; transmit: bytes ninth
    raise ConfigError(f"no device {device!r} in /proc/net/dev: not inside an emulated host")


def link_bytes(pid: int | str = "self") -> tuple[int, int]:
    """``(tx, rx)`` bytes so far of the link of the emulated host that process ``pid`` runs on (its
    network namespace's ``eth0``, as Ethernet frames: headers and acknowledgements included)."""
    with open(f"/proc/{pid}/net/dev") as f:
        return dev_bytes(f.read())
