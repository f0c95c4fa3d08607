"""``gradsync run``: start the ranks of one data-parallel job on this machine.

Rank layout, which the rest of gradsync relies on: with ``-np N --servers S`` the job has
``WORLD_SIZE = N + S`` ranks; global ranks ``0..N-1`` are workers and ``N..N+S-1`` parameter
servers. Every rank runs the same command and receives, on top of the launcher's environment:

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (node rank), MASTER_ADDR,
    MASTER_PORT, GRADSYNC_NUM_WORKERS (= N), GRADSYNC_NUM_SERVERS (= S),
    GRADSYNC_ROLE (``worker`` | ``server``), GRADSYNC_ROLE_RANK (index within the role),
    PYTHONUNBUFFERED=1

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
SIGKILL if the launcher dies.

This module must not import torch: the launcher has to start fast.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

DEFAULT_MULTI_HOST_PORT = 29500  # torchrun's default; one agreed port, since hosts cannot search together
TAIL_LINES = 20
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class RankSpec:
    """One process of the job, as placed on this node."""

    rank: int
    """Global rank: workers first, then servers."""
    role: str
    """``worker`` or ``server``."""
    role_rank: int
    """Index within the role: ``server 0`` is global rank ``np``."""
    local_rank: int
    """Index among the ranks of this node (workers first, then servers)."""

    @property
    def label(self) -> str:
        return f"{self.role} {self.role_rank}"


@dataclass
class JobResult:
    returncode: int
    """0 on success; the failed rank's exit code (128 + signal); 130/143 if interrupted; 2 if the port is taken."""
    failed: RankSpec | None
    """The first rank seen failing, or None."""
    message: str
    """Human-readable failure text for stderr ('' on success)."""


# --- hosts and rank placement -------------------------------------------------------------------

def parse_hosts(text: str) -> list[tuple[str, int]]:
    """Parse ``h1:2,h2:2`` (a bare ``host`` means one slot; IPv6 as ``[addr]:N``)."""
    return [_parse_host(item) for item in text.split(",") if item.strip()]


def _parse_host(item: str, slots_text: str | None = None) -> tuple[str, int]:
    host = item.strip()
    if slots_text is None and ":" in host and not host.endswith("]"):
        host, slots_text = host.rsplit(":", 1)
    host = host.strip("[]")
    try:
        slots = 1 if slots_text is None else int(slots_text)
    except ValueError:
        slots = 0
    if not host or slots < 1:
        raise ValueError(f"bad host entry {item!r}: expected HOST:SLOTS with SLOTS >= 1")
    return host, slots


def read_hostfile(path) -> list[tuple[str, int]]:
    """Read a hostfile: one ``host slots=N`` or ``host:N`` (or bare ``host``) per line, ``#`` comments."""
    hosts = []
    with open(path) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) == 2 and words[1].startswith("slots="):
                hosts.append(_parse_host(words[0], words[1][len("slots="):]))
            elif len(words) == 1:
                hosts.append(_parse_host(words[0]))
            else:
                raise ValueError(f"{path}: bad line {line.strip()!r}: expected 'host slots=N' or 'host:N'")
    if not hosts:
        raise ValueError(f"{path}: no hosts")
    return hosts


def plan_ranks(np: int, servers: int, hosts: list[tuple[str, int]], node_rank: int) -> list[RankSpec]:
    """The ranks node ``node_rank`` runs: workers fill hosts in order, servers round-robin."""
    total = sum(slots for _, slots in hosts)
    if np > total:
        raise ValueError(f"-np {np} exceeds the {total} slots of the hosts {_format_hosts(hosts)}")
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"node rank {node_rank} is out of range for {len(hosts)} host(s)")
    first = sum(slots for _, slots in hosts[:node_rank])
    workers = range(first, min(np, first + hosts[node_rank][1]))
    mine = [RankSpec(r, "worker", r, 0) for r in workers]
    mine += [RankSpec(np + s, "server", s, 0) for s in range(servers) if s % len(hosts) == node_rank]
    for local_rank, spec in enumerate(mine):
        spec.local_rank = local_rank
    return mine


def _format_hosts(hosts: list[tuple[str, int]]) -> str:
    return ",".join(f"{host}:{slots}" for host, slots in hosts)


def detect_node_rank(hosts: list[tuple[str, int]]) -> int:
    """Find this machine in ``hosts`` by hostname/FQDN, else by local IP address."""
    names = _local_names()
    matches = [i for i, (host, _) in enumerate(hosts) if host.lower() in names]
    if not matches:
        # Slower path (name resolution), only when no entry is spelled like our hostname.
        matches = [i for i, (host, _) in enumerate(hosts) if _is_local_address(host)]
    if len(matches) == 1:
        return matches[0]
    found = "matches several entries" if matches else "is not in"
    raise ValueError(
        f"this machine ({sorted(names)[0]}) {found} the host list {_format_hosts(hosts)}; "
        "pass --node-rank K (K = this host's position in the list, counting from 0)")


def _local_names() -> set[str]:
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    return names | {name.split(".")[0] for name in names}


def _is_local_address(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:  # only addresses of this machine's interfaces can be bound
                sock.bind((address[0], 0, *address[2:]))
                return True
            except OSError:
                continue
    return False


# --- ports --------------------------------------------------------------------------------------

def find_free_port() -> int:
    """A TCP port free right now on all interfaces (another process may still take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _port_taken_message(port: int, master_addr: str) -> str:
    """'' if the rendezvous store can bind ``port`` here, else a message saying what to do."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR like the store itself, so a port in TIME_WAIT from the last run counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
            return ""
        except OSError as err:
            reason = err.strerror
    return (f"gradsync run: MASTER_PORT {port} is already in use on this machine "
            f"(MASTER_ADDR {master_addr}; binding 0.0.0.0:{port} failed: {reason}). "
            f"Pass another --port, or stop the process holding it (`ss -ltnp 'sport = :{port}'` finds it).")


# --- one running rank ---------------------------------------------------------------------------

@dataclass
class _Rank:
    spec: RankSpec
    proc: subprocess.Popen
    log: object = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    pumps: list = field(default_factory=list)


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
    """SIGTERM every rank's group, SIGKILL whatever is left after ``grace_s``, reap the ranks."""
    _signal_groups(ranks, signal.SIGTERM)
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
def _trap_signals():
    """Record SIGINT/SIGTERM instead of dying, so the launcher can stop its children first."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.signal(sig, lambda signum, _frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _wait_for_failure(ranks: list[_Rank], caught: list[int]) -> _Rank | None:
    """Block until all ranks exit 0 (None), one fails (it), or the launcher is signalled (None)."""
    running = list(ranks)
    while running and not caught:
        for rank in list(running):
            code = rank.proc.poll()
            if code is not None:
                running.remove(rank)
                if code != 0:
                    return rank
        time.sleep(_POLL_S)
    return None


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

def _rank_envs(specs: list[RankSpec], *, np: int, servers: int, node_rank: int, master_addr: str,
               port: int, env: dict[str, str] | None) -> list[dict[str, str]]:
    job = {"WORLD_SIZE": np + servers, "LOCAL_WORLD_SIZE": len(specs), "GROUP_RANK": node_rank,
           "MASTER_ADDR": master_addr, "MASTER_PORT": port, "GRADSYNC_NUM_WORKERS": np,
           "GRADSYNC_NUM_SERVERS": servers, "PYTHONUNBUFFERED": 1}
    envs = []
    for spec in specs:
        rank = {"RANK": spec.rank, "LOCAL_RANK": spec.local_rank,
                "GRADSYNC_ROLE": spec.role, "GRADSYNC_ROLE_RANK": spec.role_rank}
        contract = {key: str(value) for key, value in {**job, **rank}.items()}
        envs.append({**os.environ, **(env or {}), **contract})
    return envs


def _run(command, specs, envs, *, logdir, grace_s, prefix_output) -> JobResult:
    out, ranks = _Output(prefix_output), []
    with _trap_signals() as caught:
        try:
            try:
                for spec, env in zip(specs, envs):
                    ranks.append(_spawn(command, spec, env, logdir))
            except OSError as err:  # no such program, not executable, log not writable
                _stop(ranks, 0)
                spec = specs[len(ranks)]
                return JobResult(127, spec, f"gradsync run: cannot start {spec.label}: {err}")
            for rank in ranks:  # threads only after all forks: preexec_fn and threads mix badly
                _start_pumps(rank, out)
            failed = _wait_for_failure(ranks, caught)
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


def launch_local(command: list[str], *, np: int, servers: int = 0, port: int | None = None,
                 logdir: str | None = None, env: dict[str, str] | None = None,
                 grace_s: float = 3.0, prefix_output: bool = True,
                 hosts=None, node_rank: int = 0, master_addr: str | None = None) -> JobResult:
    """Run this node's ranks of ``command`` until all finish or one fails (see the module docstring).

    Args:
        hosts: ``[(host, slots), ...]`` for a multi-host job, None for one machine.
        port: MASTER_PORT; default a free port on one machine, 29500 on several hosts.
        env: extra variables for the children, on top of ``os.environ``.
        prefix_output: prefix re-emitted lines with ``[worker 3] ``.
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
    envs = _rank_envs(specs, np=np, servers=servers, node_rank=node_rank,
                      master_addr=master_addr, port=port, env=env)
    return _run(command, specs, envs, logdir=logdir, grace_s=grace_s, prefix_output=prefix_output)


# --- command line -------------------------------------------------------------------------------

def _int_in(low: int, high: int | None = None):
    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}" if high
                                             else f"must be >= {low}, got {value}")
        return value
    return parse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run", help="start the workers and servers of a job",
        usage="gradsync run -np N [--servers S] [-H h1:n,h2:n | --hostfile F] [options] -- COMMAND ...",
        description="Start ranks 0..N-1 as workers and N..N+S-1 as parameter servers, all running COMMAND.")
    parser.add_argument("-np", "--num-workers", dest="np", type=_int_in(1), required=True)
    parser.add_argument("--servers", type=_int_in(0), default=0, help="parameter servers (default 0)")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host1:slots,host2:slots (workers fill hosts in order)")
    hosts.add_argument("--hostfile", help="lines of 'host slots=N' or 'host:N'; '#' comments")
    parser.add_argument("--node-rank", type=_int_in(0), help="this host's index in the host list")
    parser.add_argument("--master-addr", help="rendezvous address (default: first host, or 127.0.0.1)")
    parser.add_argument("--port", type=_int_in(1, 65535), help="rendezvous port (default: free port; 29500 on several hosts)")
    parser.add_argument("--logdir", help="also write each rank's unprefixed output to DIR/worker-K.log")
    parser.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs, after --")
    parser.set_defaults(handler=main, run_parser=parser)
    return parser


def _hosts_and_node_rank(args, parser) -> tuple[list[tuple[str, int]] | None, int]:
    if args.hosts is None and args.hostfile is None:
        if args.node_rank:
            parser.error("--node-rank needs -H or --hostfile")
        return None, 0
    try:
        hosts = parse_hosts(args.hosts) if args.hosts is not None else read_hostfile(args.hostfile)
        if not hosts:
            raise ValueError("-H lists no hosts")
        node_rank = args.node_rank
        if node_rank is None:
            node_rank = 0 if len(hosts) == 1 else detect_node_rank(hosts)
        plan_ranks(args.np, args.servers, hosts, node_rank)  # checks -np against the slots
    except (OSError, ValueError) as err:
        parser.error(str(err))
    return hosts, node_rank


def main(args: argparse.Namespace) -> int:
    parser = args.run_parser
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("missing the command to run, e.g. gradsync run -np 2 -- python train.py")
    hosts, node_rank = _hosts_and_node_rank(args, parser)
    result = launch_local(command, np=args.np, servers=args.servers, port=args.port,
                          logdir=args.logdir, grace_s=args.grace, hosts=hosts,
                          node_rank=node_rank, master_addr=args.master_addr)
    if result.message:
        print(result.message, file=sys.stderr, flush=True)
    return result.returncode


if __name__ == "__main__":
    # `python -m gradsync.launch ARGS` == `gradsync run ARGS`, without importing the other subcommands.
    _parser = argparse.ArgumentParser(prog="gradsync")
    add_parser(_parser.add_subparsers(dest="command_name", required=True))
    _args = _parser.parse_args(["run", *sys.argv[1:]])
    sys.exit(main(_args))
