"""Running one node's ranks: spawn, re-emit output with prefixes, stop everything on the first failure.

Why one file of this size: spawning, forwarding output, watching exits and stopping the group
share one table of live processes and one poll loop; split, each part would reach into the others.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from gradsync import flight
from gradsync import store as stores
from gradsync.launch.hosts import (DEFAULT_MULTI_HOST_PORT, RankSpec, _port_taken_message, find_free_port,
                                   plan_ranks)

TAIL_LINES = 20
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class JobResult:
    returncode: int
    """0 on success; the failed rank's exit code (128 + signal); 130/143 if interrupted; 2 if the port is taken."""
    failed: RankSpec | None
    """The first rank seen failing, or None."""
    message: str
    """Human-readable failure text for stderr ('' on success)."""


# --- one running rank ---------------------------------------------------------------------------

@dataclass
class _Rank:
    spec: RankSpec
    proc: subprocess.Popen
    log: object = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    pumps: list = field(default_factory=list)
    started: float = field(default_factory=time.time)


class _Output:
    """Re-emits child lines. One lock for both streams and all logs, so lines never interleave."""

    def __init__(self, prefix: bool):
        # Resolved at launch time, so a caller's replaced sys.stdout (pytest capture, a pipe) is honoured.
        self.stdout, self.stderr = sys.stdout, sys.stderr
        self.prefix = prefix
        self.lock = threading.Lock()

    def emit(self, rank: _Rank, line: bytes, is_err: bool) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        text = line.decode("utf-8", "replace")
        if self.prefix:
            text = f"[{rank.spec.label}] {text}"
        stream = self.stderr if is_err else self.stdout
        with self.lock:
            # A failing write (closed pipe, unencodable text) must not stop draining the child's
            # pipe: a child blocked on a full pipe would hang the job.
            with contextlib.suppress(Exception):
                if rank.log is not None:
                    rank.log.write(line)
                    rank.log.flush()
            with contextlib.suppress(Exception):
                stream.write(text)
                stream.flush()


def _pump(pipe, rank: _Rank, is_err: bool, out: _Output) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            if is_err:
                rank.tail.append(line.decode("utf-8", "replace").rstrip("\n"))
            out.emit(rank, line, is_err)


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


def _spawn(command: list[str], spec: RankSpec, env: dict[str, str], logdir: str | None) -> _Rank:
    log = None if logdir is None else open(os.path.join(logdir, f"{spec.role}-{spec.role_rank}.log"), "wb")
    try:
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: one killpg also reaches grandchildren
            preexec_fn=_die_with_parent_hook())
    except BaseException:
        if log is not None:
            log.close()
        raise
    return _Rank(spec, proc, log)


def _start_pumps(rank: _Rank, out: _Output) -> None:
    for pipe, is_err in ((rank.proc.stdout, False), (rank.proc.stderr, True)):
        thread = threading.Thread(target=_pump, args=(pipe, rank, is_err, out), daemon=True)
        thread.start()
        rank.pumps.append(thread)


# --- stopping -----------------------------------------------------------------------------------

def _signal_groups(ranks: list[_Rank], sig: int) -> None:
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rank.proc.pid, sig)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it cannot answer anything."""
    with contextlib.suppress(OSError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    return False


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone is there
    return True


def _live_groups(pgids: set[int]) -> set[int]:
    """The groups in ``pgids`` with a member that is not a zombie (orphaned zombies may never be reaped)."""
    existing = set(filter(_group_exists, pgids))
    if not existing or not os.path.isdir("/proc"):
        return existing
    live = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
            if state != "Z" and int(pgrp) in existing:
                live.add(int(pgrp))
    return live


def _stop(ranks: list[_Rank], grace_s: float) -> None:
    """SIGTERM every rank's group, SIGKILL whatever is left after ``grace_s``, reap the ranks.
    SIGCONT follows the SIGTERM, so a stopped rank (SIGSTOP, Ctrl-Z) ends now, not after the grace."""
    _signal_groups(ranks, signal.SIGTERM)
    _signal_groups(ranks, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for rank in ranks:
            rank.proc.poll()  # reap, so an exited rank's pid stops counting as a group member
        if not _live_groups({rank.proc.pid for rank in ranks}):
            break
        time.sleep(_POLL_S)
    _signal_groups(ranks, signal.SIGKILL)
    for rank in ranks:
        rank.proc.wait()


@contextlib.contextmanager
def _trap_signals(usr1: bool = False):
    """Record SIGINT/SIGTERM instead of dying, so the launcher can stop its children first.
    ``usr1``: SIGUSR1 sets a flag that :func:`_wait_for_failure` turns into the cross-rank
    summary (:mod:`gradsync.flight`) instead of ending the launcher."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.signal(sig, lambda signum, _frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    if usr1:
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda _signum, _frame: _USR1.set())
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


_USR1 = threading.Event()


def _wait_for_failure(ranks: list[_Rank], caught: list[int], on_usr1: Callable[[], None] | None = None
                      ) -> _Rank | None:
    """Block until all ranks exit 0 (None), one fails (it), or the launcher is signalled (None)."""
    running = list(ranks)
    while running and not caught:
        if _USR1.is_set() and on_usr1 is not None:
            _USR1.clear()
            on_usr1()
        for rank in list(running):
            code = rank.proc.poll()
            if code is not None:
                running.remove(rank)
                if code != 0:
                    return rank
        time.sleep(_POLL_S)
    return None


def _report_flight(folder: str | None, ranks: list[_Rank], reason: str, out: _Output) -> None:
    """Print where every rank is (each dumps its flight record on request; :mod:`gradsync.flight`)."""
    if folder is None:
        return
    started = min((rank.started for rank in ranks), default=0.0)
    gone = {rank.spec.rank for rank in ranks if rank.proc.poll() is not None or _stopped(rank.proc.pid)}
    lines = flight.report(folder, [rank.spec.rank for rank in ranks], reason, started=started, gone=gone)
    if not lines:
        return
    text = [f"gradsync run: where each rank is ({reason}):"] + [f"    {line}" for line in lines]
    text.append(f"gradsync run: every rank's last operations: {os.path.join(folder, 'flight-summary.json')}")
    with out.lock, contextlib.suppress(Exception):
        out.stderr.write("\n".join(text) + "\n")
        out.stderr.flush()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _failure_message(rank: _Rank) -> str:
    code, spec = rank.proc.returncode, rank.spec
    if code < 0:
        how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
    else:
        how = f"failed with exit code {code}"
    lines = [f"gradsync run: {spec.label} (rank {spec.rank}) {how}"]
    if rank.tail:
        lines.append(f"gradsync run: last {len(rank.tail)} stderr lines of {spec.label}:")
        lines += [f"    {line}" for line in rank.tail]
    else:
        lines.append(f"gradsync run: {spec.label} wrote nothing to stderr")
    return "\n".join(lines)


# --- the job ------------------------------------------------------------------------------------

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


def _run(commands, specs, envs, *, logdir, grace_s, prefix_output, flight_dir=None) -> JobResult:
    out, ranks = _Output(prefix_output), []
    on_usr1 = (lambda: _report_flight(flight_dir, ranks, "SIGUSR1", out)) if flight_dir else None
    with _trap_signals(usr1=on_usr1 is not None) as caught:
        try:
            try:
                for command, spec, env in zip(commands, specs, envs):
                    ranks.append(_spawn(command, spec, env, logdir))
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
    if failed is not None:
        return JobResult(_exit_code(failed.proc.returncode), failed.spec, _failure_message(failed))
    if caught:
        name = signal.Signals(caught[0]).name
        return JobResult(128 + caught[0], None, f"gradsync run: got {name}; stopped all ranks")
    return JobResult(0, None, "")


def _close(ranks: list[_Rank], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for rank in ranks:
        for thread in rank.pumps:  # the pipes are at EOF once the groups are dead
            thread.join(max(0.0, deadline - time.monotonic()))
        if rank.log is not None:
            rank.log.close()


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
