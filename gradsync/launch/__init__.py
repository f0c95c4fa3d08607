"""``gradsync run``: start the ranks of one data-parallel job on this machine.

Rank layout, which the rest of gradsync relies on: with ``-np N --servers S`` the job has
``WORLD_SIZE = N + S`` ranks; global ranks ``0..N-1`` are workers and ``N..N+S-1`` parameter
servers. Every rank runs the same command and receives, on top of the launcher's environment:

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (node rank), MASTER_ADDR,
    MASTER_PORT, GRADSYNC_NUM_WORKERS (= N), GRADSYNC_NUM_SERVERS (= S),
    GRADSYNC_ROLE (``worker`` | ``server``), GRADSYNC_ROLE_RANK (index within the role),
    PYTHONUNBUFFERED=1, PYTHONFAULTHANDLER=1 (unless set),
    GRADSYNC_SLOW (with ``--slow``: the workers whose emulated compute takes longer, gradsync.emulate.slow)

On several hosts the same command runs on each; each launcher starts only its node's ranks.
Workers fill the hosts' slots in order, servers go round-robin over the hosts (see
:func:`plan_ranks`). Servers do not use slots.

Output: each child line is re-emitted whole, prefixed ``[worker 3] `` / ``[server 0] `` (role
rank), stdout to stdout and stderr to stderr; ``logdir`` adds one unprefixed file per rank.
Children read stdin from /dev/null.

Failure: when a rank exits non-zero or dies by a signal, every rank's process group gets SIGTERM,
then SIGKILL after ``grace_s``; the job's exit code is the failed rank's (128 + signal number for
a signal). SIGINT/SIGTERM to the launcher stop the job the same way (exit 130/143). Children run
in their own session (so grandchildren are stopped too, also after a successful job) and get
SIGKILL if the launcher dies. A rank that runs a training script with this Python is forked from a
process that imported torch once (:mod:`gradsync.launch.forkserver`); others start with exec.

This module must not import torch: the launcher has to start fast.
"""
from gradsync.launch.cli import add_parser, main
from gradsync.launch.hosts import (DEFAULT_MULTI_HOST_PORT, RankSpec, detect_node_rank, find_free_port,
                                   parse_hosts, plan_ranks, read_hostfile)
from gradsync.launch.processes import TAIL_LINES, JobResult, launch_local

__all__ = ["RankSpec", "JobResult", "parse_hosts", "read_hostfile", "plan_ranks", "detect_node_rank",
           "find_free_port", "launch_local", "add_parser", "main", "DEFAULT_MULTI_HOST_PORT", "TAIL_LINES"]
