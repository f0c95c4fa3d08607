"""An emulated cluster on one machine: shaped links between network namespaces.

- :mod:`gradsync.cluster.netns`: the namespaces, veth pairs, bridge and ``tc tbf`` of one cluster,
  their teardown, and the cleanup of leftovers;
- :mod:`gradsync.cluster.netcheck`: measures what the emulated links deliver;
- :func:`launch`: run a job's ranks inside a cluster (what ``gradsync run --net`` and
  ``gradsync bench --net`` use).

Emulated *compute* (sleeping layers with real-size tensors) is :mod:`gradsync.emulate`.
"""
from __future__ import annotations

from gradsync.cluster.netns import EmulatedCluster, format_rate, leftovers, parse_rate, remove, require_privileges


def launch(command: list[str], *, np: int, servers: int = 0, rate_bps: float | None,
           delay_ms: float = 0.0, loss: float = 0.0, ranks_per_host: int = 1, **launch_options):
    """Run ``command`` as ``np`` workers and ``servers`` servers, ``ranks_per_host`` ranks per emulated host.

    Ranks fill hosts in rank order (workers first, servers last), and every host's link has
    ``rate_bps`` (None: unshaped), one-way host-to-host ``delay_ms`` and drops ``loss`` (a fraction)
    of its frames. The cluster is removed afterwards, whatever happens.
    Returns the launcher's :class:`~gradsync.launch.JobResult`.
    """
    from gradsync.launch import launch_local

    world = np + servers
    hosts = -(-world // ranks_per_host)
    with EmulatedCluster(hosts, rate_bps, delay_ms, loss) as cluster:
        def placement(spec):
            return cluster.exec_prefix(spec.rank // ranks_per_host), cluster.env()

        return launch_local(command, np=np, servers=servers, master_addr=cluster.address(0),
                            placement=placement, **launch_options)


__all__ = ["EmulatedCluster", "launch", "parse_rate", "format_rate", "leftovers", "remove", "require_privileges"]
