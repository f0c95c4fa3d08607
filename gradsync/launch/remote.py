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
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex
import subprocess
import sys

from gradsync import store as stores
from gradsync.errors import ConfigError
from gradsync.launch import machines
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
                    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, start_new_session=True)
                except OSError as err:
                    _stop(started, 0)
                    return JobResult(127, spec, f"gradsync: cannot start node {k} ({hosts[k][0]}): "
                                                f"{shlex.join(args[:1])}: {err.strerror}")
                with contextlib.suppress(BrokenPipeError):  # it failed already; its exit status says why
                    proc.stdin.write(json.dumps({**job, "node_rank": k, "prefix": k > 0}).encode())
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
                started.append(_Rank(spec, proc))
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
        lines = "\n".join(f"    {line}" for line in failed.tail) or "    (nothing on stderr)"
        return JobResult(code, failed.spec, f"gradsync: node {failed.spec.rank} ({host}) failed with exit "
                                            f"status {code}; its last lines:\n{lines}")
    if caught:
        return JobResult(128 + caught[0], None, "gradsync: interrupted; stopped every node")
    return JobResult(0, None, "")


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
    command = [sys.executable if word == PYTHON else word for word in job["command"]]
    made = _write_files(job["files"])
    try:
        result = launch_local(command, np=job["np"], servers=job["servers"],
                              hosts=[tuple(h) for h in job["hosts"]], node_rank=job["node_rank"],
                              master_addr=job["master_addr"], port=job["port"], env=job["env"],
                              prefix_output=job["prefix"])
        if result.message:
            print(result.message, file=sys.stderr, flush=True)
        if job["collect"] and job["node_rank"] > 0:
            folder, pattern = job["collect"]
            found = {}
            for path in sorted(glob.glob(os.path.join(folder, pattern))):
                with open(path) as f:
                    found[os.path.basename(path)] = f.read()
            print(FILES_LINE + json.dumps(found), flush=True)
        return result.returncode
    finally:
        _remove(made)


if __name__ == "__main__":
    from gradsync.fastexit import exit_now

    exit_now(node_main())
