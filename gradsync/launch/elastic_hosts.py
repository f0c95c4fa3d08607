"""Elastic jobs over several hosts: one agent per host, one job store on the first.

``gradsync run --elastic --nnodes MIN:MAX --nproc-per-node K --rdzv-endpoint HOST:PORT`` runs on
every host, torchrun's spelling (by hand, from SLURM's ``srun``, or one pod each in a Kubernetes
job). The agent on the host that owns the endpoint's address hosts the job's store there and
decides who is in the job (:class:`gradsync.launch.elastic.Agent`, the *lead*); every other agent
(:class:`HostAgent`) registers its host and its K slots in that store, starts the workers the lead
assigns to it, and reports how they end. Workers of every host follow the same generations as on
one host (:mod:`gradsync.adapt.elastic`): the store is the only thing the hosts share.

The job starts when MIN hosts have registered; a host that registers later is grown into the job
at once (its workers start, the job regroups after the step in which they announce themselves),
up to MAX hosts' workers; ``gradsync resize N`` from any host (``--addr`` the endpoint) shrinks or
grows within the hosts' slots. A host whose beats stop arriving for :data:`HOST_LOST_S` (its link
cut, its agent killed, the machine gone) is dropped: its workers leave the next generation and the
survivors go on from their last commit, as after one worker's death.

Keys, all signed with the job's secret, which every agent must have (``GRADSYNC_JOB_SECRET``): the
lead writes ``elastic/job`` (``MIN_NP MAX_NP``), ``elastic/spawn/<h>`` (the worker ids host ``h``
runs, ``s`` after a standby's), ``elastic/lost/<h>``, ``elastic/done`` and ``elastic/failed``; a
host agent writes ``elastic/host/<h>`` (``K NAME``) and ``elastic/exit/<id>`` (a worker's exit
code), and counts ``elastic/hosts`` (its index) and ``elastic/beat/<h>``, and says ``elastic/bye/<h>`` when it
ends.

When the lead's host dies, the store dies with it: every host agent stops its workers after
:data:`STORE_LOST_S` (``GRADSYNC_STORE_LOST_S``) without an answer. Without ``--checkpoint-dir``
the job ends there, and each agent says so. With ``--checkpoint-dir`` on storage the hosts share,
the job goes on under a new lead (:class:`Lease`): the lead beats in that folder
(``.gradsync-lead``: a count and its endpoint) as it beats nowhere else, so an agent that lost the
store can tell a dead lead (its beat stands still) from its own cut link (the beat goes on: it
stops, as without the folder, rather than start a second job on the same commits). The hosts that
survive agree on the one that registered first (the lowest host index the store gave out; every
agent keeps the others' addresses, ``elastic/addr/<h>``): its agent becomes the lead, on its own
address and the same port, and its workers resume from the newest commit; the others register
with it, as with the first lead, following its beat where they find it there. Each take-over
costs the steps since the newest commit and a process start. ``gradsync run --resume DIR`` on any
host starts a job that ended from the newest commit, with that host as the new lead.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

from gradsync import flight
from gradsync import store as stores
from gradsync.adapt.durable import DIR_ENV, RESUME_ENV
from gradsync.errors import ConfigError, GradsyncError
from gradsync.launch.forkserver import Forks
from gradsync.launch.hosts import RankSpec
from gradsync.launch.output import _Output, _start_pumps
from gradsync.launch.processes import JobResult
from gradsync.launch.spawn import _die_with_parent_hook, _spawn, fault_handler_env
from gradsync.launch.watch import _stop, _trap_signals

BEAT_S = 0.5
"""How often a host agent counts its beat."""
HOST_LOST_S = float(os.environ.get("GRADSYNC_HOST_LOST_S", "5"))
"""The lead drops a host whose beat has not moved for this long (``GRADSYNC_HOST_LOST_S``)."""
READ_GAP_S = 1.0
"""A longer gap between the lead's looks at the beats (it polls every few tens of milliseconds)
is its own delay, not the hosts': it is not counted towards :data:`HOST_LOST_S`."""
STORE_LOST_S = float(os.environ.get("GRADSYNC_STORE_LOST_S", "10"))
"""A host agent stops its workers when the store has not answered for this long (``GRADSYNC_STORE_LOST_S``)."""
CONNECT_S = 60.0
"""How long a host agent tries to reach the store before it gives up."""
POLL_S = 0.05
LEAD_ENV = "GRADSYNC_ELASTIC_LEAD"
"""``1`` or ``0`` in an agent's environment: whether it leads, whatever addresses its host owns
(``gradsync run --elastic --machine`` knows which host is the first; two hosts may both own an
address such as 127.0.0.1)."""
LEASE_FILE = ".gradsync-lead"
"""The lead's beat in the job's ``--checkpoint-dir`` (:class:`Lease`)."""


class Lease:
    """The lead's beat on the storage every host shares (the ``--checkpoint-dir``): ``COUNT
    ADDR:PORT`` in :data:`LEASE_FILE`, rewritten whole every :data:`BEAT_S`. Only counts are
    compared, never clocks: hosts' clocks and a file server's need not agree."""

    def __init__(self, folder: str, endpoint: str):
        self.folder, self.endpoint, self.count, self.at, self.failed = folder, endpoint, 0, 0.0, False
        self.path = os.path.join(folder, LEASE_FILE)
        self.deposed: str | None = None  # the endpoint of the lead whose beat replaced this one's

    def beat(self) -> bool:
        """Rewrite the beat (every BEAT_S). False once another lead's beat has replaced this one's:
        the other hosts took this lead for dead (its storage stalled while its link was cut) and
        one of them leads the job now, from the newest commit; this one must stop, not go on
        writing commits beside it. Its first beat replaces whatever an earlier lead left."""
        if self.deposed is not None:
            return False
        if time.monotonic() - self.at < BEAT_S:
            return True
        if self.count:
            found = Lease.read(self.folder)
            if found is not None and found[1] != self.endpoint:
                self.deposed = found[1]
                return False
        self.at, self.count = time.monotonic(), self.count + 1
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(self.folder, exist_ok=True)  # the workers make it too, but may not have yet
            with open(tmp, "w") as f:
                f.write(f"{self.count} {self.endpoint}\n")
            os.replace(tmp, self.path)
        except OSError as exc:  # the job goes on; only a take-over after this lead's death is lost
            if not self.failed:
                self.failed = True
                print(f"gradsync run --elastic: cannot write the lead's beat {self.path} ({exc}): if this host "
                      "dies, the other hosts cannot go on without it", file=sys.stderr, flush=True)
        return True

    def end(self) -> None:
        """The job ended (or was stopped): no beat of this lead's is left for an agent to follow
        (another lead's is kept)."""
        found = Lease.read(self.folder)
        if found is None or found[1] == self.endpoint:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    @staticmethod
    def read(folder: str) -> tuple[int, str] | None:
        """The beat's ``(count, endpoint)``, or None where no lead wrote one."""
        try:
            with open(os.path.join(folder, LEASE_FILE)) as f:
                count, endpoint = f.read().split()
            return int(count), endpoint
        except (OSError, ValueError):
            return None


def local_address(addr: str, port: int) -> str:
    """This host's address on the route to ``addr`` (where the other hosts reach it)."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((addr, port))  # a datagram socket sends nothing: the kernel picks the route
        return sock.getsockname()[0]


# -- the lead's view of the other hosts ---------------------------------------------------------------
@dataclass
class RemoteHost:
    index: int
    slots: int
    name: str
    spawned: list[str] = field(default_factory=list)  # "ID" or "IDs" (a standby), in the order started
    beat: int = -1
    beat_at: float = field(default_factory=time.monotonic)
    lost: bool = False


class RemoteHosts:
    """What the lead knows of the hosts that registered: their slots, the workers it started there,
    their beats and the exit codes their agents reported."""

    def __init__(self, store, keep):
        self.store, self.keep = store, keep  # keep(key, value): a key the lead publishes and keeps true
        self.hosts: dict[int, RemoteHost] = {}
        self.alive: dict[int, int] = {}  # worker id -> host index, until its exit is known
        self.seen = 1  # host indices below this were looked at (0 is the lead's)
        self.read_at = time.monotonic()  # the lead's last look at the beats

    def arrivals(self) -> list[RemoteHost]:
        """Hosts that registered since the last call."""
        new = []
        count = self.store.add("elastic/hosts", 0)
        while self.seen < count:
            key = f"elastic/host/{self.seen}"
            try:
                raw = self.store.get(key).decode() if self.store.check([key]) else None
            except stores.UnsignedValueError:
                raw = None
            if raw is None:
                break  # it counted itself and has not written its slots yet: next poll
            slots, _, name = raw.partition(" ")
            host = RemoteHost(self.seen, int(slots), name)
            self.hosts[host.index] = host
            new.append(host)
            self.seen += 1
        return new

    def usable(self) -> list[RemoteHost]:
        return [h for h in sorted(self.hosts.values(), key=lambda h: h.index) if not h.lost]

    def load(self, host: RemoteHost) -> int:
        return sum(1 for h in self.alive.values() if h == host.index)

    def start(self, host: RemoteHost, wid: int, standby: bool) -> None:
        host.spawned.append(f"{wid}{'s' if standby else ''}")
        self.alive[wid] = host.index
        self.keep(f"elastic/spawn/{host.index}", ",".join(host.spawned))

    def exits(self) -> list[tuple[int, int | None]]:
        """Workers that ended since the last call: ``(id, exit code)``, None for a lost host's."""
        ended: list[tuple[int, int | None]] = []
        now = time.monotonic()
        # Time the lead could not look (its store stalled, its loop held up) does not count against
        # a host: the beats it would have seen then may be stuck in the same stall.
        held = now - self.read_at - READ_GAP_S
        if held > 0:
            for host in self.hosts.values():
                host.beat_at += held
        for host in self.usable():
            beat = self.store.add(f"elastic/beat/{host.index}", 0)
            if beat != host.beat:
                host.beat, host.beat_at = beat, now
            elif now - host.beat_at > HOST_LOST_S:
                host.lost = True
                self.keep(f"elastic/lost/{host.index}", "1")
                ended += [(wid, None) for wid, h in list(self.alive.items()) if h == host.index]
        for wid, h in list(self.alive.items()):
            if self.hosts[h].lost:
                continue
            key = f"elastic/exit/{wid}"
            try:
                raw = self.store.get(key).decode() if self.store.check([key]) else None
            except stores.UnsignedValueError:
                raw = None
            if raw is not None and raw.lstrip("-").isdigit():
                ended.append((wid, int(raw)))
        for wid, _ in ended:
            self.alive.pop(wid, None)
        self.read_at = time.monotonic()
        return ended


# -- the agent of every other host ---------------------------------------------------------------------
@dataclass
class NextLead:
    """What an agent whose lead died does next (:func:`gradsync.launch.elastic.run_host`): lead the
    job itself at ``addr:port`` (``lead``), or register with the agent that leads there."""
    addr: str
    port: int
    lead: bool
    min_np: int
    max_np: int
    standby: int = 0  # the lost lead's --standby: a new lead keeps as many


class HostAgent:
    """One host of a multi-host elastic job, not the lead: registers, starts what the lead assigns,
    reports exits, beats; ends when the job ends, fails, drops this host, or its store is gone."""

    def __init__(self, command: list[str], addr: str, port: int, nproc: int, logdir: str | None, grace_s: float):
        self.command, self.addr, self.port, self.nproc, self.logdir, self.grace_s = command, addr, port, nproc, logdir, grace_s
        self.name = os.environ.get("GRADSYNC_HOST") or socket.gethostname()
        self.secret = stores.job_secret()
        if not self.secret:
            raise ConfigError(f"host {self.name}: an elastic job over several hosts needs the job's secret on every "
                              f"host: set {stores.SECRET_ENV} to the same value for every agent (for instance "
                              "python -c 'import secrets; print(secrets.token_hex(16))', shared as SLURM or "
                              "Kubernetes shares a secret)")
        self.store = self._connect()
        try:
            job = self._read("elastic/job", wait_s=CONNECT_S)
        except stores.UnsignedValueError:
            raise ConfigError(f"host {self.name}: the elastic job at {addr}:{port} has another secret than "
                              f"this agent's {stores.SECRET_ENV}: give every host the same one") from None
        if job is None:
            raise GradsyncError(f"host {self.name}: {addr}:{port} answers, but no elastic job has started there "
                                f"within {CONNECT_S:g} s (is --rdzv-endpoint the lead's?)")
        self.min_np, self.max_np, self.standby = ([int(x) for x in job.split()] + [0])[:3]
        self.index = self.store.add("elastic/hosts", 1) - 1
        self.store.set(f"elastic/addr/{self.index}", local_address(addr, port))
        self.store.set(f"elastic/host/{self.index}", f"{nproc} {self.name}")
        # With a shared --checkpoint-dir the job outlives its lead: every agent keeps the other
        # hosts' addresses, to agree on the next lead without the store (Lease).
        self.folder = os.environ.get(DIR_ENV) or None
        self.peers: dict[int, str] = {}  # host index -> address, host 0 (the lead) excluded
        self.dropped: set[int] = set()  # hosts the lead dropped
        self.peers_at = 0.0
        self.out = _Output(prefix=True)
        self.procs: dict[int, object] = {}
        self.forks = Forks(_die_with_parent_hook())
        self.started: set[int] = set()
        self.flight_dir = tempfile.mkdtemp(prefix="gradsync-flight-")
        self.answered = time.monotonic()
        self._say(f"host {self.index} ({self.name}) joined the job at {addr}:{port} with {nproc} slots")

    def _connect(self):
        import torch.distributed as dist

        deadline = time.monotonic() + CONNECT_S
        while True:
            try:  # every call answered within STORE_LOST_S, or the store is lost (a cut link is silent)
                left = min(10.0, max(0.5, deadline - time.monotonic()))  # a connection's tries end by the deadline
                client = dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=left),
                                       wait_for_workers=False)
                client.set_timeout(timedelta(seconds=10))
                store = stores.signed(client, self.secret)
                return stores.Answered(store, STORE_LOST_S, f"the job's store at {self.addr}:{self.port}")
            except Exception as exc:  # noqa: BLE001 - TCPStore raises plain RuntimeErrors
                if time.monotonic() > deadline:
                    raise GradsyncError(f"host {self.name}: cannot reach the elastic job's store at {self.addr}:"
                                        f"{self.port} within {CONNECT_S:g} s ({exc}); is the lead's agent running, "
                                        "and is that its address?") from None
                time.sleep(0.5)

    def _read(self, key: str, wait_s: float = 0.0) -> str | None:
        deadline = time.monotonic() + wait_s
        while True:
            if self.store.check([key]):
                return self.store.get(key).decode()
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def _signed(self, key: str) -> str | None:
        try:
            return self._read(key)
        except stores.UnsignedValueError:
            return None

    def _say(self, text: str) -> None:
        print(f"gradsync run --elastic: {text}", file=sys.stderr, flush=True)

    def _start(self, wid: int, standby: bool) -> None:
        env = {**os.environ, "GRADSYNC_ELASTIC": "1", "GRADSYNC_ELASTIC_ID": str(wid), "MASTER_ADDR": self.addr,
               "MASTER_PORT": str(self.port), stores.SECRET_ENV: self.secret, flight.DIR_ENV: self.flight_dir,
               "GRADSYNC_MIN_NP": str(self.min_np), "GRADSYNC_MAX_NP": str(self.max_np), "PYTHONUNBUFFERED": "1",
               **fault_handler_env()}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GRADSYNC_NUM_SERVERS", "GRADSYNC_ELASTIC_STANDBY"):
            env.pop(key, None)
        if standby:
            env["GRADSYNC_ELASTIC_STANDBY"] = "1"
        rank = _spawn(list(self.command), RankSpec(wid, "worker", wid, wid), env, self.logdir, self.forks)
        _start_pumps(rank, self.out)
        self.procs[wid] = rank
        self.started.add(wid)

    def run(self) -> JobResult | NextLead:
        beat_at = 0.0
        with _trap_signals() as caught:
            while not caught:
                try:
                    if time.monotonic() - beat_at >= BEAT_S:
                        self.store.add(f"elastic/beat/{self.index}", 1)
                        beat_at = time.monotonic()
                    result = self._step()
                    self.answered = time.monotonic()
                except Exception as exc:  # noqa: BLE001 - the store's host died or is cut off
                    if time.monotonic() - self.answered > STORE_LOST_S:
                        why = (f"the job's store at {self.addr}:{self.port} has not answered for {STORE_LOST_S:g} s "
                               f"({str(exc).splitlines()[0][:120]})")
                        if self.folder is not None:
                            return self._take_over(why)
                        return self._end(1, f"{why}: its host is gone, and the job with it (with --checkpoint-dir "
                                            "on storage every host shares, the job goes on under another host's "
                                            "agent from the newest commit)")
                    result = None
                if result is not None:
                    return result
                time.sleep(POLL_S)
        return self._end(130 if caught and caught[0] == 2 else 143, "interrupted")

    def _take_over(self, why: str) -> JobResult | NextLead:
        """The store is gone and the commits are on shared storage: stop this host's workers, then
        go on under the next lead (the module docstring), or stop where the lead still beats."""
        lost = f"{self.addr}:{self.port}"
        self._say(f"host {self.index}: {why}; stopping this host's workers, reading the lead's beat in {self.folder}")
        _stop(list(self.procs.values()), self.grace_s)
        self.procs.clear()
        self.forks.close()
        shutil.rmtree(self.flight_dir, ignore_errors=True)
        beat = Lease.read(self.folder)
        if beat is not None and beat[1] == lost:  # the lost lead's: does it stand still?
            time.sleep(3 * BEAT_S)
            again = Lease.read(self.folder)
            beat = None if again == beat else (again or beat)
            if beat is not None and beat[1] == lost:
                return JobResult(1, None, f"gradsync run --elastic: host {self.index}: {why}, but the lead at {lost} "
                                          f"still beats in {self.folder}: this host is cut off from it (its "
                                          "workers are stopped; the job goes on without it)")
        elif beat is None:
            return JobResult(1, None, f"gradsync run --elastic: host {self.index}: {why}, and no lead beats in "
                                      f"{self.folder}, so a dead lead cannot be told from a cut link: this host's "
                                      "workers are stopped (was every agent given the same --checkpoint-dir?)")
        os.environ[RESUME_ENV] = "1"  # every next worker of this agent starts from the newest commit
        if beat is not None:  # another host leads already
            addr, _, port = beat[1].rpartition(":")
            self._say(f"host {self.index}: the job goes on under the lead at {beat[1]}")
            return NextLead(addr, int(port), False, self.min_np, self.max_np, self.standby)
        alive = sorted([i for i in self.peers if i not in self.dropped] + [self.index])
        if alive[0] != self.index:
            addr = self.peers[alive[0]]
            self._say(f"host {self.index}: the lead's beat stands still; the job goes on under host {alive[0]} "
                      f"({addr}:{self.port})")
            return NextLead(addr, self.port, False, self.min_np, self.max_np, self.standby)
        me = local_address(self.addr, self.port)
        self._say(f"host {self.index}: the lead's beat stands still; this host leads the job now, at {me}:{self.port}, "
                  f"from the newest commit in {self.folder}")
        return NextLead(me, self.port, True, self.min_np, self.max_np, self.standby)

    def _refresh_peers(self) -> None:
        """The other hosts' addresses and which of them the lead dropped (every second)."""
        if self.folder is None or time.monotonic() - self.peers_at < 1.0:
            return
        self.peers_at = time.monotonic()
        count = self.store.add("elastic/hosts", 0)
        for index in range(1, count):
            if index != self.index and index not in self.peers:
                addr = self._signed(f"elastic/addr/{index}")
                if addr is not None:
                    self.peers[index] = addr
        self.dropped |= {i for i in self.peers if self._signed(f"elastic/lost/{i}") is not None}

    def _step(self) -> JobResult | None:
        self._refresh_peers()
        if self._signed("elastic/done") is not None:
            return self._end(0, "", grace=True)
        failed = self._signed("elastic/failed")
        if failed is not None:
            return self._end(1, f"the job failed: {failed}")
        if self._signed(f"elastic/lost/{self.index}") is not None:
            return self._end(1, f"the job dropped host {self.index} ({self.name}): its beats stopped reaching the "
                                f"store for {HOST_LOST_S:g} s; its workers are stopped")
        spawn = self._signed(f"elastic/spawn/{self.index}") or ""
        for entry in filter(None, spawn.split(",")):
            wid = int(entry.rstrip("s"))
            if wid not in self.started:
                self._start(wid, entry.endswith("s"))
        for wid, rank in list(self.procs.items()):
            code = rank.proc.poll()
            if code is not None:
                del self.procs[wid]
                self.store.set(f"elastic/exit/{wid}", str(code))
        return None

    def _end(self, code: int, message: str, grace: bool = False) -> JobResult:
        """Say goodbye to the lead, stop this host's workers (after the grace when the job ended
        well: standbys leave on their own) and end."""
        with contextlib.suppress(Exception):  # a store that is gone hears no goodbye
            self.store.set(f"elastic/bye/{self.index}", "1")
        if grace:  # standbys still starting (before gradsync.init()) have nothing to end cleanly
            with contextlib.suppress(Exception):
                _stop([r for wid, r in self.procs.items() if self._signed(f"elastic/ready/{wid}") is None],
                      self.grace_s)
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and any(r.proc.poll() is None for r in self.procs.values()):
                time.sleep(POLL_S)
        _stop(list(self.procs.values()), self.grace_s)
        self.forks.close()
        shutil.rmtree(self.flight_dir, ignore_errors=True)
        return JobResult(code, None, f"gradsync run --elastic: host {self.index}: {message}" if message else "")


def launch_host(command: list[str], *, addr: str, port: int, nproc: int, logdir: str | None = None,
                grace_s: float = 3.0) -> JobResult | NextLead:
    """``gradsync run --elastic --nnodes MIN:MAX`` on a host that is not the rendezvous endpoint's,
    until the job ends or its lead dies (then :class:`NextLead`)."""
    try:
        agent = HostAgent(command, addr, port, nproc, logdir, grace_s)
    except GradsyncError as exc:
        return JobResult(2 if isinstance(exc, ConfigError) else 1, None, f"gradsync run --elastic: {exc}")
    return agent.run()
