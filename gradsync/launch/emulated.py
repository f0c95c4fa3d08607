"""Run a job's ranks inside an emulated cluster (``gradsync run --net``, ``gradsync bench --net``):
:class:`gradsync.cluster.EmulatedCluster` gives each host a network namespace and a shaped link,
:func:`gradsync.launch.processes.launch_local` starts the ranks, each inside its host's namespace."""
from __future__ import annotations

from gradsync.cluster import EmulatedCluster
from gradsync.launch.processes import launch_local


def launch_emulated(command: list[str], *, np: int, servers: int = 0, rate_bps: float | None,
           delay_ms: float = 0.0, loss: float = 0.0, ranks_per_host: int = 1, **launch_options):
    """Run ``command`` as ``np`` workers and ``servers`` servers, ``ranks_per_host`` ranks per emulated host.

    Ranks fill hosts in rank order (workers first, servers last), and every host's link has
    ``rate_bps`` (None: unshaped), one-way host-to-host ``delay_ms`` and drops ``loss`` (a fraction)
    of its frames. The cluster is removed afterwards, whatever happens.
    Returns the launcher's :class:`~gradsync.launch.JobResult`.
    """
    world = np + servers
    hosts = -(-world // ranks_per_host)
    with EmulatedCluster(hosts, rate_bps, delay_ms, loss) as cluster:
        def placement(spec):
            # Each emulated host is a host of its own to the ranks (gradsync.hosts); LOCAL_RANK stays
            # the rank on the real machine, whose GPUs the ranks share.
            host = spec.rank // ranks_per_host
            local = {"GRADSYNC_HOST": f"emulated host {host}",
                     "LOCAL_WORLD_SIZE": str(min(ranks_per_host, world - host * ranks_per_host))}
            return cluster.exec_prefix(host), {**cluster.env(), **local}

        return launch_local(command, np=np, servers=servers, master_addr=cluster.address(0),
                            placement=placement, **launch_options)
