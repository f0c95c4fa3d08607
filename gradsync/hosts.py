"""Which ranks share a host: found once at ``gradsync.init()``, checked, kept in the :class:`Topology`.

A rank's host is named by the first of these that is set: ``GRADSYNC_HOST`` (``gradsync run --net
--ranks-per-host`` sets it for each emulated host), ``GROUP_RANK`` (the node rank torchrun and
``gradsync run`` set), ``SLURM_NODEID``, else the machine's host name. Every rank writes its
host's name, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` into the rendezvous store; rank 0 reads them
all, numbers the hosts in the order of their lowest rank and writes the layout back (or what is
wrong with it), and every rank reads that one key: ``world_size`` store reads in all, not per rank.

What must hold, or every rank stops with the same :class:`~gradsync.errors.ConfigError` naming the
ranks and hosts: ranks of one host agree on ``LOCAL_WORLD_SIZE`` where it is set, and it equals
the number of ranks that named that host; no two ranks of a host share a ``LOCAL_RANK``.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta

from gradsync.errors import ConfigError
from gradsync.topology import Topology

KEY = "gradsync/hosts/{rank}"
LAYOUT = "gradsync/hosts/layout"
NODE_ENV = ("GRADSYNC_HOST", "GROUP_RANK", "SLURM_NODEID")


def host_name(env=os.environ) -> str:
    """This rank's host, as the environment names it (see the module docstring)."""
    for name in NODE_ENV:
        if env.get(name, "") != "":
            return f"{name}={env[name]}"
    return socket.gethostname()


def layout(entries: list[tuple[str, int, int | None]]) -> tuple[int, ...]:
    """Each rank's host index from ``(host, local_rank, local_world_size or None)`` per rank; hosts
    numbered in the order of their lowest rank. ``ConfigError`` when the entries disagree."""
    index: dict[str, int] = {}
    for host, _, _ in entries:
        index.setdefault(host, len(index))
    members: dict[str, list[int]] = {}
    for rank, (host, _, _) in enumerate(entries):
        members.setdefault(host, []).append(rank)
    for host, ranks in members.items():
        said = {rank: entries[rank][2] for rank in ranks if entries[rank][2] is not None}
        if any(size != len(ranks) for size in said.values()):
            sizes = ", ".join(f"rank {r}: {s}" for r, s in said.items())
            raise ConfigError(f"host {host!r} runs ranks {ranks}, but they were told LOCAL_WORLD_SIZE {sizes}: every "
                              "rank of a host must be started with the number of ranks on that host (check the "
                              "launcher's per-node count, e.g. torchrun --nproc-per-node, on each host)")
        locals_ = [entries[r][1] for r in ranks]
        twice = sorted({lr for lr in locals_ if locals_.count(lr) > 1})
        if twice:
            clash = [r for r in ranks if entries[r][1] in twice]
            raise ConfigError(f"host {host!r}: ranks {clash} share LOCAL_RANK {twice[0]}; each rank of a host needs "
                              "its own local rank (its GPU under NCCL)")
    return tuple(index[host] for host, _, _ in entries)


def exchange(store, topology: Topology, timeout_s: float, env=os.environ) -> Topology:
    """``topology`` with every rank's host (see the module docstring); collective over the store."""
    raw_size = env.get("LOCAL_WORLD_SIZE", "")
    mine = f"{host_name(env)}\t{topology.local_rank}\t{raw_size}"
    store.set(KEY.format(rank=topology.rank), mine)
    if topology.rank == 0:
        entries = []
        for rank in range(topology.world_size):
            host, local, size = store.get(KEY.format(rank=rank)).decode().split("\t")
            entries.append((host, int(local), int(size) if size else None))
        try:
            answer = "ok\t" + ",".join(map(str, layout(entries)))
        except ConfigError as exc:
            answer = f"error\t{exc}"
        store.set(LAYOUT, answer)
    store.wait([LAYOUT], timedelta(seconds=timeout_s))
    kind, text = store.get(LAYOUT).decode().split("\t", 1)
    if kind == "error":
        raise ConfigError(text)
    return dataclasses.replace(topology, host_of=tuple(int(h) for h in text.split(",")))
