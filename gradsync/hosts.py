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
import time
from collections.abc import Callable
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


class Abandoned(Exception):
    """:func:`exchange` gave up because its ``abandon`` check said why (a newer elastic generation)."""


def exchange(store, topology: Topology, timeout_s: float, env=os.environ,
             abandon: Callable[[], str | None] | None = None) -> Topology:
    """``topology`` with every rank's host (see the module docstring); collective over the store.

    With ``abandon`` (an elastic generation being formed) the waits poll it, and the ranks give up
    together, with :class:`Abandoned`, once it returns a reason while a rank is still missing (a
    worker listed in this generation went straight to a newer one and will not come): rank 0 gives
    up while it waits for a rank; the others while rank 0 has not come. The first rank to add to
    :data:`DECIDED` writes the layout or the reason, and every rank reads that one answer, so no
    rank goes on into a group that another has given up."""
    raw_size = env.get("LOCAL_WORLD_SIZE", "")
    mine = f"{host_name(env)}\t{topology.local_rank}\t{raw_size}"
    store.set(KEY.format(rank=topology.rank), mine)
    if topology.rank == 0:
        keys = [KEY.format(rank=rank) for rank in range(topology.world_size)]
        why = _wait(store, keys, timeout_s, abandon)
        if why is None:
            entries = []
            for key in keys:
                host, local, size = store.get(key).decode().split("\t")
                entries.append((host, int(local), int(size) if size else None))
            try:
                answer = "ok\t" + ",".join(map(str, layout(entries)))
            except ConfigError as exc:
                answer = f"error\t{exc}"
            _decide(store, answer, abandon)
        else:
            _decide(store, f"abandoned\t{why}", abandon)
    elif abandon is not None:
        first = [KEY.format(rank=0)]
        why = _wait(store, [LAYOUT], timeout_s, lambda: None if store.check(first) else abandon())
        if why is not None:
            _decide(store, f"abandoned\t{why}", abandon)
    _wait(store, [LAYOUT], timeout_s, None)
    kind, text = store.get(LAYOUT).decode().split("\t", 1)
    if kind == "error":
        _all_read(store, topology)
        raise ConfigError(text)
    if kind == "abandoned":
        raise Abandoned(text)
    return dataclasses.replace(topology, host_of=tuple(int(h) for h in text.split(",")))


DECIDED = "gradsync/hosts/decided"
POLL_FIRST_S, POLL_S = 0.001, 0.05
"""An elastic generation's ranks poll for each other from 1 ms, doubling up to 50 ms: the others
are usually milliseconds away (a regroup waits on this), a joiner seconds (the store is spared)."""


READ = "gradsync/hosts/error-read"
READ_WAIT_S = 10.0


def _all_read(store, topology: Topology) -> None:
    """Rank 0 raises a layout error only once every rank has read it (or :data:`READ_WAIT_S` has
    passed): its process may host the store, and were it to exit first, a rank still reading
    would get "Connection reset by peer" instead of the error."""
    count = store.add(READ, 1)
    deadline = time.monotonic() + READ_WAIT_S
    while topology.rank == 0 and count < topology.world_size and time.monotonic() < deadline:
        time.sleep(POLL_S / 5)
        count = store.add(READ, 0)


def _decide(store, answer: str, abandon) -> None:
    """Write ``answer`` as the layout, unless (where ranks may give up) another rank decided first."""
    if abandon is None or store.add(DECIDED, 1) == 1:
        store.set(LAYOUT, answer)


def _wait(store, keys: list[str], timeout_s: float, abandon: Callable[[], str | None] | None) -> str | None:
    """Wait until ``keys`` are all set: None; or ``abandon``'s reason as soon as it gives one."""
    if abandon is None:
        store.wait(keys, timedelta(seconds=timeout_s))
        return None
    deadline, pause = time.monotonic() + timeout_s, POLL_FIRST_S
    while not store.check(keys):
        why = abandon()
        if why:
            return why
        if time.monotonic() > deadline:
            raise TimeoutError(f"wait timeout after {timeout_s:g} s, keys: {', '.join(keys)}")
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)
    return None
