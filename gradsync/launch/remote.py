"""One job on the hosts of a registered machine, each host's ranks started over ssh.

:func:`launch_hosts` runs the job's node 0 on this host, which must be the machine's first host
(rank 0 lives there and the caller reads the files it writes), and every other node through the
machine's ssh command. Each node is one ``python -m gradsync.launch.remote`` process: it reads one
JSON object on its standard input (the command, the rank layout, the environment, the files the
ranks read), writes those files where they are missing, runs its node's ranks with
:func:`gradsync.launch.launch_local`, sends back the files asked for as one JSON line, and removes
what it wrote. JSON both ways, no pickle; the job's secret travels inside the ssh channel, never
on a command line.

The first node to fail ends the others (their launchers stop their ranks), and the message names
the node, its host and its last lines of output: a host that ssh cannot reach fails at once instead
of leaving node 0 waiting at the rendezvous.

:func:`launch_elastic_machine` (``gradsync run --elastic --machine NAME``) starts an elastic job's
agent on every host the same way: the JSON object names the agent's flags and its environment
(the secret), and the node process becomes that agent.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex
import subprocess
import sys
import time

from gradsync import store as stores
from gradsync.errors import ConfigError
from gradsync.launch import machines
from gradsync.launch.elastic_hosts import LEAD_ENV
from gradsync.launch.hosts import RankSpec, find_free_port
from gradsync.launch.output import _close, _Output, _start_pumps
from gradsync.launch.processes import JobResult
from gradsync.launch.spawn import _Rank
from gradsync.launch.watch import _exit_code, _stop, _trap_signals, _wait_for_failure

FILES_LINE = "gradsync-remote-files "
"""Prefix of the line a node prints last: the JSON object of the files it sends back."""
PYTHON = "{python}"
"""A word of the command each node replaces by its own interpreter (the machine's ``python``)."""


def launch_hosts(command: list[str], *, machine: dict, np: int, servers: int = 0, env: dict[str, str] | None = None,
                 files: dict[str, str] | None = None, collect: tuple[str, str] | None = None,
                 grace_s: float = 5.0) -> JobResult:
    """Run ``command`` as ranks ``0..np+servers-1`` over ``machine``'s hosts until all end or one fails.

    Args:
        command: what every rank runs; a word ``{python}`` (:data:`PYTHON`) is the host's interpreter.
        machine: a registered machine (:mod:`gradsync.launch.machines`): its hosts with their
            slots, and optionally ``ssh`` (the command before the host name), ``python`` (the
            interpreter on the hosts), ``workdir`` (where it runs) and ``master_addr``.
        files: ``{absolute path: text}`` written on every host that lacks them before its ranks start.
        collect: ``(folder, pattern)``: files the other hosts' ranks wrote there, copied back to
            the same folder here when their node ends (files already here are kept).
    """
    hosts = [(h["host"], h["slots"]) for h in machine["hosts"]]
    if np > sum(slots for _, slots in hosts):
        raise ConfigError(f"{np} workers exceed the {sum(s for _, s in hosts)} slots of the machine's hosts "
                          f"({', '.join(f'{h}:{s}' for h, s in hosts)})")
    machines.require_first_host_here(machine)
    job = {"command": list(command), "np": np, "servers": servers, "hosts": hosts,
           "master_addr": machines.master_addr(machine), "port": find_free_port(),
           "env": {**(env or {}), stores.SECRET_ENV: stores.new_secret()},
           "files": files or {}, "collect": list(collect) if collect else None}
    nodes = [_node_command(machine, k) for k in range(len(hosts))]
    out = _NodeOutput()
    started: list[_Rank] = []
    with _trap_signals() as caught:
        try:
            for k, args in enumerate(nodes):
                spec = RankSpec(k, "node", k, k)
                try:
                    started.append(_start_node(args, {**job, "node_rank": k, "prefix": k > 0}, spec))
                except OSError as err:
                    _stop(started, 0)
                    return JobResult(127, spec, f"gradsync: cannot start node {k} ({hosts[k][0]}): "
                                                f"{shlex.join(args[:1])}: {err.strerror}")
            for node in started:
                _start_pumps(node, out)
            failed = _wait_for_failure(started, caught)
            _stop(started, grace_s)
        finally:
            _close(started, timeout_s=max(1.0, grace_s))
    if collect:
        _write_back(out.files, collect[0])
    if failed is not None:
        code = _exit_code(failed.proc.returncode)
        host = hosts[failed.spec.rank][0]
        return JobResult(code, failed.spec, f"gradsync: node {failed.spec.rank} ({host}) failed with exit "
                                            f"status {code}; its last lines:\n{_last_lines(failed)}")
    if caught:
        return JobResult(128 + caught[0], None, "gradsync: interrupted; stopped every node")
    return JobResult(0, None, "")


def launch_elastic_machine(command: list[str], *, machine: dict, agent_args: list[str], min_np: int | None,
                           standby: int = 0, port: int | None = None, logdir: str | None = None,
                           grace_s: float = 3.0) -> JobResult:
    """An elastic job over ``machine``'s hosts: on each an agent, as if ``gradsync run --elastic
    --nnodes MIN:N --nproc-per-node K --rdzv-endpoint FIRST:PORT`` ran there (docs/launcher.md,
    several machines): this host's (the machine's first) leads and keeps the ``standby`` workers,
    every other host's starts through the machine's ssh. MIN is the hosts ``min_np`` workers fill
    (default every host), so the job starts on them and grows onto the rest as they register.
    ``agent_args``: the agents' further flags (checkpoints). The job's secret travels in each
    agent's standard input, never on a command line. Returns when the lead's agent ends, the
    others given ``grace_s`` + 10 s to end with it. An agent that fails before it joins is named
    with its last lines; the job goes on without its host while the others make MIN, else ends."""
    hosts = machine["hosts"]
    k = hosts[0]["slots"]
    if any(h["slots"] != k for h in hosts):
        raise ConfigError("an elastic job over a machine's hosts runs the same workers on each (torchrun's "
                          "--nproc-per-node); its hosts have " + ", ".join(f"{h['host']}:{h['slots']}" for h in hosts)
                          + " slots: register a machine of equal hosts")
    if min_np is not None and not 1 <= min_np <= k * len(hosts):
        raise ConfigError(f"--min-np {min_np}: the machine's {len(hosts)} hosts hold 1 to {k * len(hosts)} workers")
    machines.require_first_host_here(machine)
    low = len(hosts) if min_np is None else -(-min_np // k)
    addr, port = machines.master_addr(machine), port or find_free_port()
    secret = stores.job_secret() or stores.new_secret()
    common = ["run", "--elastic", "--nnodes", f"{low}:{len(hosts)}", "--nproc-per-node", str(k),
              "--rdzv-endpoint", f"{addr}:{port}", "--grace", f"{grace_s:g}", *agent_args]
    agents: list[_Rank] = []
    out = _AgentOutput()
    with _trap_signals() as caught:
        try:
            for i, host in enumerate(hosts):
                argv = [*common, *(["--standby", str(standby)] if i == 0 and standby else []),
                        *(["--logdir", os.path.join(logdir, f"host-{i}")] if logdir else []), "--", *command]
                spec, args = RankSpec(i, "node", i, i), _node_command(machine, i)
                job = {"agent": argv, "env": {stores.SECRET_ENV: secret, "GRADSYNC_HOST": host["host"],
                                              LEAD_ENV: str(int(i == 0))}}
                try:
                    agents.append(_start_node(args, job, spec))
                except OSError as err:
                    _stop(agents, 0)
                    return JobResult(127, spec, f"gradsync: cannot start the agent of host {i} ({host['host']}): "
                                                f"{shlex.join(args[:1])}: {err.strerror}")
                _start_pumps(agents[-1], out)
            failed, lost = None, []
            while agents[0].proc.poll() is None and not caught:
                # An agent that failed before it joined (ssh could not reach its host, no gradsync
                # there): where the hosts left cannot make the MIN the lead waits for, the job ends
                # now, not at the registration timeout; else it goes on without that host. One
                # that failed after joining is the job's business (its host is dropped).
                for agent in agents[1:]:
                    if agent in lost or agent.proc.poll() in (None, 0):
                        continue
                    for pump in agent.pumps:  # its last lines read, "joined" among them
                        pump.join(2.0)
                    if agent.spec.rank not in out.joined:
                        lost.append(agent)
                        print(_failed_agent(agent, hosts, "; the job goes on without it"
                                            if len(hosts) - len(lost) >= low else ""), file=sys.stderr, flush=True)
                if len(hosts) - len(lost) < low:
                    failed = lost[-1]
                    break
                time.sleep(0.1)
            if failed is None and not caught:
                deadline = time.monotonic() + grace_s + 10
                for agent in agents[1:]:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        agent.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            _stop([a for a in agents if a.proc.poll() is None], grace_s)
            _close(agents, timeout_s=max(1.0, grace_s))
    if failed is not None:
        return JobResult(_exit_code(failed.proc.returncode), failed.spec,
                         f"gradsync run --elastic: {len(lost)} of the machine's {len(hosts)} hosts failed before they "
                         f"joined, and the job needs {low} (--min-np): stopped")
    if caught:
        return JobResult(128 + caught[0], None, "gradsync: interrupted; stopped every host's agent")
    return JobResult(_exit_code(agents[0].proc.returncode), None, "")


def _last_lines(node: _Rank) -> str:
    return "\n".join(f"    {line}" for line in node.tail) or "    (nothing on stderr)"


def _failed_agent(agent: _Rank, hosts: list[dict], then: str) -> str:
    return (f"gradsync run --elastic: the agent of host {agent.spec.rank} ({hosts[agent.spec.rank]['host']}) failed "
            f"with exit status {_exit_code(agent.proc.returncode)} before it joined the job{then}; its last "
            f"lines:\n{_last_lines(agent)}")


def _start_node(args: list[str], job: dict, spec: RankSpec) -> _Rank:
    """Start one node's process (OSError where it cannot start) and hand it ``job`` on its standard input."""
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    with contextlib.suppress(BrokenPipeError):  # it failed already; its exit status says why
        proc.stdin.write(json.dumps(job).encode())
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    return _Rank(spec, proc)


def _node_command(machine: dict, k: int) -> list[str]:
    """Node ``k``'s process: here for node 0, else the machine's ssh command and the host."""
    python = machine.get("python") or sys.executable
    if k == 0:
        return [sys.executable, "-m", "gradsync.launch.remote"]
    remote = shlex.join([python, "-m", "gradsync.launch.remote"])
    if machine.get("workdir"):
        remote = f"cd {shlex.quote(machine['workdir'])} && {remote}"
    return [*(machine.get("ssh") or machines.DEFAULT_SSH), machine["hosts"][k]["host"], remote]


class _NodeOutput(_Output):
    """Node 0's lines as they are, the others' prefixed ``[node K] ``; each node's files line kept."""

    def __init__(self):
        super().__init__(prefix=True)
        self.files: dict[str, str] = {}

    def emit(self, rank: _Rank, line: bytes, is_err: bool) -> None:
        if not is_err and line.startswith(FILES_LINE.encode()):
            with contextlib.suppress(ValueError):
                self.files.update(json.loads(line[len(FILES_LINE):]))
            return
        if rank.spec.rank == 0:
            stream = self.stderr if is_err else self.stdout
            with self.lock, contextlib.suppress(Exception):
                stream.write(line.decode("utf-8", "replace"))
                stream.flush()
            return
        super().emit(rank, line, is_err)


class _AgentOutput(_NodeOutput):
    """The agents' lines (the lead's as they are, the others' prefixed), noting which joined the job."""

    def __init__(self):
        super().__init__()
        self.joined: set[int] = set()

    def emit(self, rank: _Rank, line: bytes, is_err: bool) -> None:
        if b"joined the job at" in line:
            self.joined.add(rank.spec.rank)
        super().emit(rank, line, is_err)


def _write_back(files: dict[str, str], folder: str) -> None:
    for name, text in files.items():
        path = os.path.join(folder, os.path.basename(name))
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(text)


# --- one node (python -m gradsync.launch.remote) ------------------------------------------------

def _write_files(files: dict[str, str]) -> list[str]:
    """Write the files this host lacks; the paths made (folders, then files), to remove afterwards."""
    made: list[str] = []
    for path, text in files.items():
        folder = os.path.dirname(path)
        missing = []
        while folder and not os.path.isdir(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for folder in reversed(missing):
            os.mkdir(folder)
            made.append(folder)
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(text)
            made.append(path)
    return made


def _remove(made: list[str]) -> None:
    for path in reversed(made):
        with contextlib.suppress(OSError):
            if os.path.isdir(path):
                for name in os.listdir(path):  # what this node's ranks wrote there
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(path, name))
                os.rmdir(path)
            else:
                os.remove(path)


def node_main() -> int:
    from gradsync.launch.processes import launch_local

    job = json.loads(sys.stdin.read())
    if "agent" in job:  # an elastic job's agent on this host: it becomes that agent
        argv = [sys.executable if word == PYTHON else word for word in job["agent"]]
        os.execve(sys.executable, [sys.executable, "-m", "gradsync.cli", *argv], {**os.environ, **job["env"]})
    command = [sys.executable if word == PYTHON else word for word in job["command"]]
    made = _write_files(job["files"])
    # The files to send back: none left from an earlier job (they would come back as this one's);
    # those sent are removed (on storage node 0 shares, node 0 writes them back where missing).
    collect = os.path.join(*job["collect"]) if job["collect"] and job["node_rank"] > 0 else None
    for path in glob.glob(collect) if collect else ():
        with contextlib.suppress(OSError):
            os.remove(path)
    try:
        result = launch_local(command, np=job["np"], servers=job["servers"],
                              hosts=[tuple(h) for h in job["hosts"]], node_rank=job["node_rank"],
                              master_addr=job["master_addr"], port=job["port"], env=job["env"],
                              prefix_output=job["prefix"])
        if result.message:
            print(result.message, file=sys.stderr, flush=True)
        if collect:
            found = {}
            for path in sorted(glob.glob(collect)):
                with open(path) as f:
                    found[os.path.basename(path)] = f.read()
            print(FILES_LINE + json.dumps(found), flush=True)
            for name in found:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(job["collect"][0], name))
        return result.returncode
    finally:
        _remove(made)


if __name__ == "__main__":
    from gradsync.fastexit import exit_now

    exit_now(node_main())
