"""Run a job's ranks inside an emulated cluster (``gradsync run --net``, ``gradsync bench --net``):
:class:`gradsync.cluster.EmulatedCluster` gives each host a network namespace and a shaped link,
:func:`gradsync.launch.processes.launch_local` starts the ranks, each inside its host's namespace.
An elastic job (``gradsync run --elastic --net``) gets an agent per host instead
(:func:`launch_elastic_emulated`), as it would on real machines."""
from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from types import SimpleNamespace

from gradsync.cluster import EmulatedCluster, LinkRates
from gradsync.launch.processes import launch_local
from gradsync.launch.watch import _stop

SERVER_HOSTS = ("own", "shared")
"""Where dedicated servers go (:func:`placement`): on hosts of their own, or on the workers' hosts."""


def placement(np: int, servers: int = 0, ranks_per_host: int = 1, server_hosts: str = "own") -> list[int]:
    """Each rank's emulated host. Workers fill hosts ``ranks_per_host`` at a time in rank order;
    servers then fill further hosts the same way (``"own"``: after a last host of fewer workers,
    the first servers join it), or join the workers' hosts in turn, server ``j`` on host ``j mod H``
    (``"shared"``)."""
    if server_hosts not in SERVER_HOSTS:
        raise ValueError(f"server_hosts must be one of {', '.join(SERVER_HOSTS)}, got {server_hosts!r}")
    if server_hosts == "own":
        return [rank // ranks_per_host for rank in range(np + servers)]
    worker_hosts = -(-np // ranks_per_host)
    return [rank // ranks_per_host for rank in range(np)] + [j % worker_hosts for j in range(servers)]


def launch_emulated(command: list[str], *, np: int, servers: int = 0, rate_bps: float | None,
           delay_ms: float = 0.0, loss: float = 0.0, ranks_per_host: int = 1, server_hosts: str = "own",
           rank_rates: dict[int, float] | None = None, **launch_options):
    """Run ``command`` as ``np`` workers and ``servers`` servers, ``ranks_per_host`` ranks per emulated
    host, placed by :func:`placement` (``server_hosts``: ``"own"`` or ``"shared"``).

    Every host's link has ``rate_bps`` (None: unshaped), except the host holding a rank that
    ``rank_rates`` names (``{rank: bits/s}``, :class:`~gradsync.cluster.LinkRates`), one-way
    host-to-host ``delay_ms`` and drops ``loss`` (a fraction) of its frames. The cluster is removed
    afterwards, whatever happens. Returns the launcher's :class:`~gradsync.launch.JobResult`.
    """
    hosts = placement(np, servers, ranks_per_host, server_hosts)
    host_rates = LinkRates(rate_bps, rank_rates or {}).per_host(hosts)
    with EmulatedCluster(max(hosts) + 1, rate_bps, delay_ms, loss, host_rates) as cluster:
        def place(spec):
            # Each emulated host is a host of its own to the ranks (gradsync.hosts); LOCAL_RANK stays
            # the rank on the real machine, whose GPUs the ranks share.
            host = hosts[spec.rank]
            local = {"GRADSYNC_HOST": f"emulated host {host}", "LOCAL_WORLD_SIZE": str(hosts.count(host))}
            return cluster.exec_prefix(host), {**cluster.env(), **local}

        return launch_local(command, np=np, servers=servers, master_addr=cluster.address(0),
                            placement=place, **launch_options)


def launch_elastic_emulated(command: list[str], *, hosts: int, nproc: int, min_hosts: int, rate_bps: float | None,
                            delay_ms: float = 0.0, loss: float = 0.0, port: int = 29500, standby: int = 0,
                            logdir: str | None = None, grace_s: float = 3.0) -> int:
    """An elastic job over ``hosts`` emulated hosts of ``nproc`` workers (``gradsync run --elastic --net``):
    on each host an agent, ``gradsync run --elastic --nnodes MIN:HOSTS --nproc-per-node K`` with the
    first host's address as the rendezvous endpoint, as on real machines (:mod:`gradsync.launch.elastic_hosts`);
    the first host's agent leads and keeps the ``standby`` workers. Every agent starts at once, so the
    job grows to every host as they register. Returns the lead's exit code once the other agents have
    ended too (those still running ``grace_s`` + 10 s later are stopped); the cluster is removed
    afterwards, whatever happens."""
    secret = os.environ.get("GRADSYNC_JOB_SECRET") or secrets.token_hex(16)
    with EmulatedCluster(hosts, rate_bps, delay_ms, loss) as cluster:
        agents: list[subprocess.Popen] = []
        try:
            for host in range(hosts):
                argv = [*cluster.exec_prefix(host), sys.executable, "-m", "gradsync.cli", "run", "--elastic",
                        "--nnodes", f"{min_hosts}:{hosts}", "--nproc-per-node", str(nproc),
                        "--rdzv-endpoint", f"{cluster.address(0)}:{port}", "--grace", f"{grace_s:g}"]
                if host == 0 and standby:
                    argv += ["--standby", str(standby)]
                if logdir:
                    argv += ["--logdir", os.path.join(logdir, f"host-{host}")]
                env = {**os.environ, **cluster.env(), "GRADSYNC_HOST": f"emulated host {host}",
                       "GRADSYNC_JOB_SECRET": secret}
                agents.append(subprocess.Popen([*argv, "--", *command], env=env, start_new_session=True))
            code = agents[0].wait()
            deadline = time.monotonic() + grace_s + 10
            for agent in agents[1:]:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            return code
        finally:  # Ctrl-C, or an agent that outlived the lead: its group (its workers) TERM, then KILL
            _stop([SimpleNamespace(proc=agent) for agent in agents if agent.poll() is None], grace_s)

