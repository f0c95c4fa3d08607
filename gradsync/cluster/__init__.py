"""An emulated cluster on one machine: shaped links between network namespaces.

- :mod:`gradsync.cluster.netns`: the namespaces, veth pairs, bridge and ``tc tbf`` of one cluster,
  their teardown, and the cleanup of leftovers;
- :mod:`gradsync.cluster.links`: ``--net``'s value, a default link rate and the ranks whose host has another;
- :mod:`gradsync.cluster.netcheck`: measures what the emulated links deliver;
- :mod:`gradsync.cluster.counters`: the packets its links dropped and its hosts' TCP resent.

Running a job's ranks inside a cluster (``gradsync run --net``, ``gradsync bench --net``) is
:func:`gradsync.launch.emulated.launch_emulated`: the launcher uses the cluster, not the reverse.

Emulated *compute* (sleeping layers with real-size tensors) is :mod:`gradsync.emulate`.
"""
from __future__ import annotations

from gradsync.cluster.links import LinkRates, parse_net
from gradsync.cluster.netns import EmulatedCluster, format_rate, leftovers, parse_rate, remove, require_privileges

__all__ = ["EmulatedCluster", "LinkRates", "parse_net", "parse_rate", "format_rate", "leftovers", "remove",
           "require_privileges"]
