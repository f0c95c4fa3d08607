"""Running one node's ranks: spawn, re-emit output with prefixes, stop everything on the first failure.

The job's loop: plan the ranks (:mod:`~gradsync.launch.hosts`), start them
(:mod:`~gradsync.launch.spawn`), forward their output (:mod:`~gradsync.launch.output`), watch for
the first failure and stop every rank (:mod:`~gradsync.launch.watch`).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

from gradsync import flight
from gradsync import store as stores
from gradsync.launch.forkserver import Forks
from gradsync.launch.hosts import DEFAULT_MULTI_HOST_PORT, RankSpec, _port_taken_message, find_free_port, plan_ranks
from gradsync.launch.output import _close, _Output, _pump, _start_pumps
from gradsync.launch.spawn import (_PR_SET_PDEATHSIG, TAIL_LINES, _die_with_parent_hook, _Rank, _rank_envs, _spawn,
                                   fault_handler_env, thread_env, usable_cores)
from gradsync.launch.watch import (_POLL_S, _USR1, _exit_code, _failure_message, _group_exists, _live_groups,
                                   _report_flight, _signal_groups, _stop, _stopped, _trap_signals, _wait_for_failure)

__all__ = [  # the launcher's names, its parts' included, for code that imports them from here
    "TAIL_LINES", "JobResult", "exit_status", "fault_handler_env", "launch_local", "thread_env", "usable_cores",
    "_POLL_S", "_PR_SET_PDEATHSIG", "_USR1", "_Output", "_Rank", "_close", "_die_with_parent_hook", "_exit_code",
    "_failure_message", "_group_exists", "_live_groups", "_pump", "_rank_envs", "_report_flight", "_run",
    "_signal_groups", "_spawn", "_start_pumps", "_stop", "_stopped", "_trap_signals", "_wait_for_failure"]


@dataclass
class JobResult:
    returncode: int
    """0 on success; the failed rank's exit code (128 + signal); 130/143 if interrupted; 2 if the port is taken."""
    failed: RankSpec | None
    """The first rank seen failing, or None."""
    message: str
    """Human-readable failure text for stderr ('' on success)."""


def _run(commands, specs, envs, *, logdir, grace_s, prefix_output, flight_dir=None) -> JobResult:
    out, ranks, forks = _Output(prefix_output), [], Forks(_die_with_parent_hook())
    on_usr1 = (lambda: _report_flight(flight_dir, ranks, "SIGUSR1", out)) if flight_dir else None
    with _trap_signals(usr1=on_usr1 is not None) as caught:
        try:
            try:
                for command, spec, env in zip(commands, specs, envs):
                    ranks.append(_spawn(command, spec, env, logdir, forks))
            except OSError as err:  # no such program, not executable, log not writable
                _stop(ranks, 0)
                spec = specs[len(ranks)]
                return JobResult(127, spec, f"gradsync run: cannot start {spec.label}: {err}")
            for rank in ranks:  # threads only after all forks: preexec_fn and threads mix badly
                _start_pumps(rank, out)
            failed = _wait_for_failure(ranks, caught, on_usr1)
            if failed is not None:
                _report_flight(flight_dir, ranks, f"{failed.spec.label} (rank {failed.spec.rank}) failed", out)
            _stop(ranks, grace_s)  # also on success: no grandchild outlives the job
        finally:
            _signal_groups(ranks, signal.SIGKILL)  # whatever went wrong above, leave nothing behind
            _close(ranks, timeout_s=max(1.0, grace_s))
            forks.close()
    if failed is not None:
        return JobResult(_exit_code(failed.proc.returncode), failed.spec, _failure_message(failed))
    if caught:
        name = signal.Signals(caught[0]).name
        return JobResult(128 + caught[0], None, f"gradsync run: got {name}; stopped all ranks")
    return JobResult(0, None, "")


def exit_status(command_name: str, start: Callable[[], JobResult]) -> int:
    """Start a job with ``start`` for ``gradsync COMMAND_NAME`` and return its exit status, having
    said on stderr why when it is not 0: the launcher's refusal (a ``ConfigError``) or its summary
    of the failed ranks."""
    from gradsync.errors import ConfigError

    try:
        result = start()
    except ConfigError as exc:
        print(f"gradsync {command_name}: {exc}", file=sys.stderr)
        return 1
    if result.returncode:
        print(result.message, file=sys.stderr)
    return result.returncode


def launch_local(command: list[str], *, np: int, servers: int = 0, port: int | None = None,
                 logdir: str | None = None, env: dict[str, str] | None = None,
                 grace_s: float = 3.0, prefix_output: bool = True,
                 hosts=None, node_rank: int = 0, master_addr: str | None = None,
                 placement: Callable[[RankSpec], tuple[list[str], dict[str, str]]] | None = None,
                 say_threads: bool = False) -> JobResult:
    """Run this node's ranks of ``command`` until all finish or one fails (see the module docstring).

    Args:
        hosts: ``[(host, slots), ...]`` for a multi-host job, None for one machine.
        port: MASTER_PORT; default a free port on one machine, 29500 on several hosts.
        env: extra variables for the children, on top of ``os.environ``.
        placement: per rank, a command prefix and extra variables (e.g. ``ip netns exec HOST``
            and ``GLOO_SOCKET_IFNAME`` for an emulated cluster, :mod:`gradsync.cluster`).
        prefix_output: prefix re-emitted lines with ``[worker 3] ``.
        say_threads: print a line when the launcher sets ``OMP_NUM_THREADS`` (see :func:`thread_env`).
    Returns the job's result; the failure message is not printed (the CLI prints it).
    """
    several = hosts is not None and len(hosts) > 1
    hosts = hosts or [("127.0.0.1", np)]
    master_addr = master_addr or hosts[0][0]
    specs = plan_ranks(np, servers, hosts, node_rank)
    if port is None and not several:
        port = find_free_port()
    else:
        port = DEFAULT_MULTI_HOST_PORT if port is None else port
        taken = _port_taken_message(port, master_addr) if node_rank == 0 else ""
        if taken:
            return JobResult(2, None, taken)
    if not specs:
        print(f"gradsync run: node {node_rank} has no ranks to run", file=sys.stderr, flush=True)
        return JobResult(0, None, "")
    if logdir is not None:
        os.makedirs(logdir, exist_ok=True)
    threads = thread_env(len(specs), env)
    if threads and say_threads:
        print(f"gradsync run: OMP_NUM_THREADS={threads['OMP_NUM_THREADS']} for each of {len(specs)} local rank{'s' if len(specs) > 1 else ''} "
              f"({usable_cores()} cores); set OMP_NUM_THREADS to choose", file=sys.stderr, flush=True)
    env = {**threads, **(env or {})}
    if not (env.get(stores.SECRET_ENV) or stores.job_secret()):
        if several:  # each node's launcher would draw another: the user gives every node the same one
            print(f"gradsync run: the job's store is unauthenticated; set {stores.SECRET_ENV} to the same random "
                  "value on every node to sign its keys", file=sys.stderr, flush=True)
        else:
            env[stores.SECRET_ENV] = stores.new_secret()
    # Where ranks dump their flight records (gradsync.flight): next to the logs, else a folder
    # that is removed again unless a summary was written into it.
    flight_dir = logdir if logdir is not None else tempfile.mkdtemp(prefix="gradsync-flight-")
    env[flight.DIR_ENV] = os.path.abspath(flight_dir)
    envs = _rank_envs(specs, np=np, servers=servers, node_rank=node_rank,
                      master_addr=master_addr, port=port, env=env)
    commands = [list(command) for _ in specs]
    if placement is not None:
        for k, spec in enumerate(specs):
            prefix, extra = placement(spec)
            commands[k] = [*prefix, *command]
            envs[k].update(extra)
    try:
        return _run(commands, specs, envs, logdir=logdir, grace_s=grace_s, prefix_output=prefix_output,
                    flight_dir=flight_dir)
    finally:
        if logdir is None and not os.path.exists(os.path.join(flight_dir, "flight-summary.json")):
            shutil.rmtree(flight_dir, ignore_errors=True)
