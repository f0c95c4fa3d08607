"""Registered machines: named clusters (``gradsync machine add NAME --hosts hosts.json``).

A hosts file is JSON: ``{"hosts": [{"host": "node1", "slots": 2}, ...]}`` with optional per host
``"gpus"`` and, for the cluster, ``"net"`` (its link rate, e.g. ``"25gbit"``). Adding checks that
the file parses and that every host resolves and answers on its SSH port (``--no-check`` skips
it). The registry is ``machines.json`` next to the results store's default place.
"""
from __future__ import annotations

import json
import os
import socket

from gradsync.errors import ConfigError

LOCAL = {"localhost", "127.0.0.1", "::1"}


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
        known = ", ".join(sorted(machines)) or "none registered (gradsync machine add NAME --hosts FILE)"
        raise ConfigError(f"unknown target {name!r}: neither local, emulated, sim nor a registered machine ({known})")
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
    return {"hosts": out, "net": raw.get("net")}


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
