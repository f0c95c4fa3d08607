"""Where ranks go: host lists, the rank plan of a node, and the rendezvous port."""
from __future__ import annotations

import socket
from dataclasses import dataclass

DEFAULT_MULTI_HOST_PORT = 29500  # torchrun's default; one agreed port, since hosts cannot search together


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
