"""Starting one rank: its process (in a process group of its own, killed with the launcher) and its environment.

Every rank gets the launcher's environment, the caller's extra variables and the job's contract
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``GRADSYNC_ROLE`` ...; see :mod:`gradsync.launch`), and
``OMP_NUM_THREADS`` / ``PYTHONFAULTHANDLER`` unless the user set them.
"""
from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from gradsync.launch.forkserver import ForkedProcess, Forks
from gradsync.launch.hosts import RankSpec

TAIL_LINES = 20
"""The last stderr lines of a rank kept for the failure message."""
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class _Rank:
    spec: RankSpec
    proc: subprocess.Popen | ForkedProcess
    log: object = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    pumps: list = field(default_factory=list)
    started: float = field(default_factory=time.time)


def _die_with_parent_hook():
    """A ``preexec_fn`` giving the child SIGKILL when the launcher dies (Linux only; else None)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child must not load libraries
    except OSError:
        return None
    launcher = os.getpid()

    def hook():
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return hook


def _spawn(command: list[str], spec: RankSpec, env: dict[str, str], logdir: str | None,
           forks: Forks | None = None) -> _Rank:
    """Start one rank: forked by the job's forkserver (``forks``) where it can be, else with ``exec``."""
    log = None if logdir is None else open(os.path.join(logdir, f"{spec.role}-{spec.role_rank}.log"), "wb")
    try:
        proc = None if forks is None else forks.start(command, env)
        proc = proc or subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: one killpg also reaches grandchildren
            preexec_fn=_die_with_parent_hook())
    except BaseException:
        if log is not None:
            log.close()
        raise
    return _Rank(spec, proc, log)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def thread_env(local_ranks: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """``OMP_NUM_THREADS`` = cores / local ranks, unless the user set it: each rank's torch would
    otherwise start one thread per core, and ranks sharing a machine oversubscribe it (torchrun
    sets it too). Empty when already set."""
    if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in (env or {}):
        return {}
    return {"OMP_NUM_THREADS": str(max(1, usable_cores() // max(1, local_ranks)))}


def fault_handler_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``PYTHONFAULTHANDLER=1``, unless the user set it (even empty): a rank that a fatal signal ends
    (a C++ abort, a segfault) then prints every Python thread's stack, which the failure report
    shows. Empty when already set."""
    if "PYTHONFAULTHANDLER" in os.environ or "PYTHONFAULTHANDLER" in (env or {}):
        return {}
    return {"PYTHONFAULTHANDLER": "1"}


def _rank_envs(specs: list[RankSpec], *, np: int, servers: int, node_rank: int, master_addr: str,
               port: int, env: dict[str, str] | None) -> list[dict[str, str]]:
    job = {"WORLD_SIZE": np + servers, "LOCAL_WORLD_SIZE": len(specs), "GROUP_RANK": node_rank,
           "MASTER_ADDR": master_addr, "MASTER_PORT": port, "GRADSYNC_NUM_WORKERS": np,
           "GRADSYNC_NUM_SERVERS": servers, "PYTHONUNBUFFERED": 1}
    fault = fault_handler_env(env)
    envs = []
    for spec in specs:
        rank = {"RANK": spec.rank, "LOCAL_RANK": spec.local_rank,
                "GRADSYNC_ROLE": spec.role, "GRADSYNC_ROLE_RANK": spec.role_rank}
        contract = {key: str(value) for key, value in {**job, **rank}.items()}
        envs.append({**os.environ, **(env or {}), **fault, **contract})
    return envs
