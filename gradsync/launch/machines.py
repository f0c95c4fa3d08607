"""Registered machines: named clusters (``gradsync machine add NAME --hosts hosts.json``).

A hosts file is JSON: ``{"hosts": [{"host": "node1", "slots": 2}, ...]}`` with optional per host
``"gpus"`` and, for the cluster: ``"net"`` (its link rate, e.g. ``"25gbit"``), ``"ssh"`` (the
command before a host's name, default ``ssh -o BatchMode=yes``), ``"python"`` (the interpreter on
the hosts, default this one's path), ``"workdir"`` (where it runs there) and ``"master_addr"``
(the first host's address as the others reach it, default its name). Adding checks that the file
parses and that every host resolves and answers on its SSH port (``--no-check`` skips it). The
registry is ``machines.json`` next to the results store's default place. Jobs on a machine of
several hosts start from its first host (:mod:`gradsync.launch.remote`).
"""
from __future__ import annotations

import json
import os
import socket

from gradsync.errors import ConfigError

LOCAL = {"localhost", "127.0.0.1", "::1"}
DEFAULT_SSH = ["ssh", "-o", "BatchMode=yes"]


def registry_path() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "gradsync", "machines.json")


def load_all() -> dict[str, dict]:
    path = registry_path()
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: the machine registry does not parse ({exc}); fix or remove it") from None


def get(name: str) -> dict:
    machines = load_all()
    if name not in machines:
        known = ", ".join(sorted(machines)) or "none yet: gradsync machine add NAME --hosts FILE"
        raise ConfigError(f"no registered machine {name!r} (registered: {known})")
    return machines[name]


def parse_hosts(path: str) -> dict:
    """The machine a hosts file describes; an error names the file and what is wrong."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as exc:
        raise ConfigError(f"hosts file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"hosts file {path} is not JSON: {exc}") from None
    hosts = raw.get("hosts") if isinstance(raw, dict) else None
    if not isinstance(hosts, list) or not hosts:
        raise ConfigError(f'hosts file {path}: expected {{"hosts": [{{"host": "node1", "slots": 2}}, ...]}}')
    out = []
    for i, entry in enumerate(hosts):
        if not isinstance(entry, dict) or not isinstance(entry.get("host"), str) or not entry["host"]:
            raise ConfigError(f"hosts file {path}: host {i + 1} needs a \"host\" name")
        slots = entry.get("slots", 1)
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ConfigError(f"hosts file {path}: host {entry['host']!r} has slots={slots!r}; a positive integer")
        out.append({"host": entry["host"], "slots": slots, "gpus": int(entry.get("gpus", 0))})
    machine = {"hosts": out, "net": raw.get("net")}
    if machine["net"] is not None:
        from gradsync.cluster import parse_rate

        try:
            parse_rate(str(machine["net"]))
        except ConfigError as exc:
            raise ConfigError(f"hosts file {path}: net: {exc}") from None
    ssh = raw.get("ssh")
    if ssh is not None:
        if not isinstance(ssh, list) or not ssh or not all(isinstance(w, str) and w for w in ssh):
            raise ConfigError(f'hosts file {path}: "ssh" is the command before a host\'s name, as a list of '
                              f'words (e.g. ["ssh", "-p", "2222"]), got {ssh!r}')
        machine["ssh"] = ssh
    for key in ("python", "workdir", "master_addr"):
        value = raw.get(key)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"hosts file {path}: {key!r} must be a non-empty string, got {value!r}")
            machine[key] = value
    return machine


def unreachable(hosts: list[dict], port: int = 22, timeout_s: float = 3.0) -> list[str]:
    """The hosts that do not resolve or do not accept a connection on ``port``, each with why."""
    bad = []
    for h in hosts:
        if h["host"] in LOCAL:
            continue
        try:
            with socket.create_connection((h["host"], port), timeout=timeout_s):
                pass
        except OSError as exc:
            bad.append(f"{h['host']} ({exc.strerror or exc})")
    return bad


def add(name: str, hosts_file: str, *, check: bool = True) -> dict:
    if not name or name in ("local", "emulated", "sim") or not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"machine name {name!r}: letters, digits, - and _, and not local, emulated or sim")
    machine = parse_hosts(hosts_file)
    if check:
        bad = unreachable(machine["hosts"])
        if bad:
            raise ConfigError(f"hosts that do not answer on port 22: {', '.join(bad)} (check the names, or pass "
                              "--no-check to register them anyway)")
    machines = load_all()
    machines[name] = machine
    path = registry_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(machines, f, indent=1)
    os.replace(tmp, path)
    return machine


def is_this_host(machine: dict) -> bool:
    names = LOCAL | {socket.gethostname()}
    return len(machine["hosts"]) == 1 and machine["hosts"][0]["host"] in names


def master_addr(machine: dict) -> str:
    """The rendezvous address: ``master_addr``, else the first host's name, which the others must reach."""
    if machine.get("master_addr"):
        return machine["master_addr"]
    first = machine["hosts"][0]["host"]
    if len(machine["hosts"]) > 1 and first in LOCAL:
        raise ConfigError(f"the machine's first host is {first!r}, which its other hosts cannot reach: name it as "
                          'they reach it, or add "master_addr" to the hosts file')
    return first


def require_first_host_here(machine: dict) -> None:
    """A job on ``machine`` starts on its first host (rank 0 writes its files there)."""
    from gradsync.launch.hosts import _is_local_address, _local_names

    first = machine["hosts"][0]["host"]
    if first in LOCAL or first.lower() in _local_names() or _is_local_address(first):
        return
    raise ConfigError(f"a job on this machine starts from its first host, {first!r}; this is "
                      f"{socket.gethostname()!r}: run the command there")
