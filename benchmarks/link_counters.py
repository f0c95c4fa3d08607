"""Whether an emulated run's links dropped or resent anything: tc and TCP counters while it runs.

    sudo python benchmarks/link_counters.py -- gradsync bench --model resnet50 --compute emulated \\
        --np 4 --net 1gbit --dilation 2 --strategies ps --steps 12 --warmup 3 --rounds 1 --check-steps 0

Runs the command and, every second until it ends, reads the counters of the emulated cluster it
created (the ``gsync-*`` namespaces that were not there before it, docs/emulation.md): the packets each token
bucket dropped (the hosts' uplinks, the switch's ports) and each host's TCP segments sent,
retransmitted and retransmission timeouts. The last reading before the cluster went is printed,
one line per namespace: counts over the whole run, warm-up and setup included.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

TCP = ("OutSegs", "RetransSegs", "TCPTimeouts")


def tc_drops(text: str) -> int:
    """Packets dropped, summed over the qdiscs of ``tc -s qdisc show`` output."""
    return sum(int(n) for n in re.findall(r"\(dropped (\d+),", text))


def tcp_counters(text: str) -> dict:
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


def clusters() -> set[str]:
    """The emulated clusters' namespaces there now."""
    return {ns for ns in _out("ip", "netns", "list").split() if ns.startswith("gsync-")}


def read(names: set[str]) -> dict:
    found = {}
    for ns in names:
        counts = {"dropped": tc_drops(_out("tc", "-n", ns, "-s", "qdisc", "show"))}
        if not ns.endswith("-sw"):
            counts.update(tcp_counters(_out("ip", "netns", "exec", ns, "cat", "/proc/net/snmp", "/proc/net/netstat")))
        found[ns] = counts
    return found


def main() -> None:
    if "--" not in sys.argv[1:] or sys.argv[-1] == "--":
        raise SystemExit("usage: sudo python benchmarks/link_counters.py -- COMMAND ... (a command that runs an "
                         "emulated cluster, e.g. gradsync bench --net 1gbit ...)")
    command = sys.argv[sys.argv.index("--") + 1:]
    before = clusters()
    run = subprocess.Popen(command)
    last: dict = {}
    while run.poll() is None:
        last.update(read(clusters() - before))
        time.sleep(1.0)
    if not last:
        raise SystemExit("no emulated cluster was seen while the command ran (does it use --net?)")
    for ns, counts in sorted(last.items()):
        print(f"{ns:24s} " + "  ".join(f"{key} {value}" for key, value in counts.items()))
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
