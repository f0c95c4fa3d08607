"""Whether an emulated run's links dropped or resent anything: tc and TCP counters while it runs.

    sudo python benchmarks/link_counters.py -- gradsync bench --model resnet50 --compute emulated \\
        --np 4 --net 1gbit --dilation 2 --strategies ps --steps 12 --warmup 3 --rounds 1 --check-steps 0

Runs the command and, every second until it ends, reads the counters of the emulated cluster it
created (the ``gsync-*`` namespaces that were not there before it, docs/emulation.md) with
:mod:`gradsync.cluster.counters`: the packets each token bucket dropped (the hosts' uplinks, the
switch's ports) and each host's TCP segments sent, retransmitted and retransmission timeouts. The last reading before the cluster went is printed,
one line per namespace: counts over the whole run, warm-up and setup included.
"""
from __future__ import annotations

import subprocess
import sys
import time

from gradsync.cluster.counters import namespaces, read


def main() -> None:
    if "--" not in sys.argv[1:] or sys.argv[-1] == "--":
        raise SystemExit("usage: sudo python benchmarks/link_counters.py -- COMMAND ... (a command that runs an "
                         "emulated cluster, e.g. gradsync bench --net 1gbit ...)")
    command = sys.argv[sys.argv.index("--") + 1:]
    before = namespaces()
    run = subprocess.Popen(command)
    last: dict = {}
    while run.poll() is None:
        last.update(read(namespaces() - before))
        time.sleep(1.0)
    if not last:
        raise SystemExit("no emulated cluster was seen while the command ran (does it use --net?)")
    for ns, counts in sorted(last.items()):
        print(f"{ns:24s} " + "  ".join(f"{key} {value}" for key, value in counts.items()))
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
