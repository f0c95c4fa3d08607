"""``gradsync run --elastic``: the agent that decides who is in a job while it runs.

It hosts the job's key-value store (a ``torch.distributed.TCPStore`` on ``--port``), starts the
workers with stable ids (``GRADSYNC_ELASTIC_ID``; their output is prefixed ``[worker ID]``) and
publishes *generations*: lists of worker ids (keys in :mod:`gradsync.adapt.elastic`). It acts on:

- a size request (``gradsync resize N``, or a policy calling ``ctl.resize(N)``), clamped to
  ``--min-np``..``--max-np``: to grow, it admits standbys (below) and starts any further workers,
  and publishes the next generation (old members first, in order, then the new ones) once every
  new one has announced itself; to shrink, it publishes the first N members at once, and the
  others leave training and exit;
- a worker that dies (exits non-zero or by a signal): the next generation leaves it out, and the
  survivors restore their last commit and go on; below ``--min-np`` the job fails.

*Standbys* (``--standby K``) are workers started ahead of need: Python up, torch imported, the
script run up to ``gradsync.init()``, where they announce themselves and wait (without a deadline)
to be listed. A grow admits them first, so it costs the regroup and the state hand-over rather than
a process's start; each admitted standby is replaced in the background, :data:`REPLACE_AFTER_S`
later. A standby that fails
while waiting is reported and not replaced (the next grow starts workers as without standbys).

The job ends when every member has exited successfully; its exit code is then 0. Standbys still
waiting then exit (``elastic/done``; the agent ends any that do not within ``--grace``).

Where each worker is (:mod:`gradsync.flight`): on ``SIGUSR1``, and when the job fails, the agent
prints the cross-rank summary of the current generation and writes ``flight-summary.json`` into
``--logdir`` (else a temporary folder it names).

The store listens on loopback only, and every value in it is signed with the job's secret
(:mod:`gradsync.store`), which the agent draws at start, passes to its workers and keeps in a 0600
file (``~/.gradsync/jobs/elastic-PORT.key``) for ``gradsync resize``. A resize request without a
valid signature is refused and logged; a generation overwritten from outside is written back.

Over several hosts (``--nnodes MIN:MAX``, :mod:`gradsync.launch.elastic_hosts`) this agent is the
*lead*: its store listens on the rendezvous address, the secret is the one every host's agent was
given, and workers start on any host with a free slot (this one first); hosts that register grow
the job, hosts that go quiet leave it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta

from gradsync import flight
from gradsync import store as stores
from gradsync.errors import ConfigError, GradsyncError
from gradsync.adapt.durable import DIR_ENV
from gradsync.launch.elastic_hosts import (BEAT_S, CONNECT_S, HOST_LOST_S, Lease, NextLead, RemoteHost, RemoteHosts,
                                          launch_host)
from gradsync.launch.forkserver import Forks
from gradsync.launch.hosts import RankSpec
from gradsync.launch.output import _Output, _start_pumps
from gradsync.launch.processes import JobResult
from gradsync.launch.spawn import _die_with_parent_hook, _spawn, fault_handler_env
from gradsync.launch.watch import _USR1, _exit_code, _stop, _trap_signals

POLL_S = 0.02
STANDBY_ENV = "GRADSYNC_ELASTIC_STANDBY"
"""``1`` in a standby's environment: it waits to be admitted without a deadline."""
REPLACE_AFTER_S = float(os.environ.get("GRADSYNC_STANDBY_REPLACE_S", "5"))
"""Admitted standbys are replaced this long after the grow (``GRADSYNC_STANDBY_REPLACE_S``): a
process starting (importing torch, building the model) would take the cores the regroup and the
state hand-over need."""
REQUEST_BODY_S = 5.0
"""How long a request number may go without its size before it is refused."""


class Agent:
    def __init__(self, command: list[str], np: int, min_np: int, max_np: int, port: int | None,
                 logdir: str | None, grace_s: float, standby: int = 0, addr: str = "127.0.0.1",
                 nproc: int | None = None, min_hosts: int = 1):
        """``nproc``: slots on each host of a job over several hosts (None: one host, this one, and
        no limit but ``max_np``); ``min_hosts`` of them must register before the job starts."""
        self.command, self.min_np, self.max_np, self.grace_s, self.logdir = command, min_np, max_np, grace_s, logdir
        # One host: on loopback only (the store takes requests from anyone who can reach it,
        # gradsync.store); several: on the rendezvous address, the hosts' trusted network.
        self.addr, self.nproc = addr, nproc
        if nproc is not None and not stores.job_secret():
            raise ConfigError(f"an elastic job over several hosts needs the job's secret on every host: set "
                              f"{stores.SECRET_ENV} to the same value for every agent (for instance python -c "
                              "'import secrets; print(secrets.token_hex(16))')")
        # The port is bound first and the store (which imports torch) served after this host's
        # workers started: they import torch meanwhile, and their connections wait in the backlog.
        sock = stores.listen(addr, port or 0)
        self.port = sock.getsockname()[1]
        self.secret = stores.job_secret() or stores.new_secret()
        self.secret_path = stores.secret_file(self.port)
        stores.write_secret(self.secret_path, self.secret)
        self.published: dict[str, str] = {}  # what the agent wrote and keeps true
        self.bodyless: dict[int, float] = {}  # request number -> when first seen without its size
        self.out = _Output(prefix=True)
        self.procs: dict[int, object] = {}  # id -> _Rank
        self.members: list[int] = []
        self.pending: list[int] = []  # started, not yet in a generation
        self.to_start = 0  # a grow's workers whose slots are still held by workers that left (exiting)
        self.standby: list[int] = []  # started ahead of need, waiting to be admitted by a grow
        self.gen = -1
        self.next_id = 0
        self.seq = 0
        self.unanswered: list[int] = []  # requests answered when the new workers have joined
        self.failed: list[str] = []
        self.requested_at: float | None = None
        self.standby_target = standby
        self.replace_at = 0.0  # standbys are not started before (REPLACE_AFTER_S after a grow admitted some)
        if logdir is not None:
            os.makedirs(logdir, exist_ok=True)
        self.flight_dir = os.path.abspath(logdir if logdir is not None else tempfile.mkdtemp(prefix="gradsync-flight-"))
        self.remote = None
        self.forks = Forks(_die_with_parent_hook())
        if nproc is None:
            for _ in range(np):
                self._start_worker()
        try:
            self._server = stores.serve(addr, self.port, None, 30, sock=sock)
            self.store = self._connect()
        except BaseException:
            for rank in self.procs.values():
                rank.proc.kill()
            self.forks.close()
            with contextlib.suppress(OSError):
                os.unlink(self.secret_path)
            raise
        self.lease = None
        if nproc is not None:
            folder = os.environ.get(DIR_ENV)  # the hosts' shared --checkpoint-dir: the lead beats there
            self.lease = Lease(folder, f"{addr}:{self.port}") if folder else None
            self.remote = RemoteHosts(self.store, self._keep)
            self._keep("elastic/job", f"{min_np} {max_np} {standby}")  # a next lead keeps the standbys too
            self.store.add("elastic/hosts", 1)  # host 0: this one
            self._gather_hosts(min_hosts)
            for _ in range(np):
                self._start_worker()
        self.members, self.pending = list(self.pending), []
        self._publish("start")
        self._top_up_standbys()

    def _gather_hosts(self, count: int) -> None:
        """Wait until ``count`` hosts (this one included) have registered."""
        deadline = time.monotonic() + 5 * CONNECT_S
        while len(self.remote.hosts) + 1 < count:
            if self.lease is not None:
                self.lease.beat()
            for host in self.remote.arrivals():
                self._say(f"host {host.index} ({host.name}) registered with {host.slots} slots")
            if time.monotonic() > deadline:
                self._server = None
                raise GradsyncError(f"only {len(self.remote.hosts) + 1} of --nnodes' {count} hosts registered "
                                    f"within {5 * CONNECT_S:g} s at {self.addr}:{self.port}")
            time.sleep(POLL_S)

    def _capacity(self) -> int:
        """Workers the job can hold: ``max_np`` on one host; the usable hosts' slots on several."""
        if self.remote is None:
            return self.max_np
        return min(self.max_np, self.nproc + sum(h.slots for h in self.remote.usable()))

    def _place(self) -> RemoteHost | None | bool:
        """Where the next worker starts: this host (None), a registered host, or nowhere (False)."""
        if self.remote is None or len(self.procs) < self.nproc:
            return None
        for host in self.remote.usable():
            if self.remote.load(host) < host.slots:
                return host
        return False

    def _top_up_standbys(self) -> None:
        if time.monotonic() < self.replace_at:
            return
        while not self.to_start and len(self.standby) < self.standby_target and self._place() is not False:
            self._start_worker(standby=True)

    def _connect(self):
        """The agent's own client of its store: the store closes a connection that sent a request it
        could not parse (an ``add`` to a key holding text), so the agent can open another."""
        import torch.distributed as dist

        return stores.signed(dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=30),
                                           wait_for_workers=False), self.secret)

    def _start_worker(self, standby: bool = False, host: RemoteHost | None | bool = True) -> None:
        """Start worker ``next_id`` (a standby, or pending until it announces itself) where
        :meth:`_place` says, or on ``host``."""
        host = self._place() if host is True else host
        if host is False:
            raise GradsyncError("no host has a free slot")  # callers check the capacity first
        wid = self.next_id
        self.next_id += 1
        if host is not None:
            self.remote.start(host, wid, standby)
            (self.standby if standby else self.pending).append(wid)
            return
        env = {**os.environ, "GRADSYNC_ELASTIC": "1", "GRADSYNC_ELASTIC_ID": str(wid), "MASTER_ADDR": self.addr,
               "MASTER_PORT": str(self.port), stores.SECRET_ENV: self.secret, flight.DIR_ENV: self.flight_dir, "GRADSYNC_MIN_NP": str(self.min_np), "GRADSYNC_MAX_NP": str(self.max_np),
               "PYTHONUNBUFFERED": "1", **fault_handler_env()}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GRADSYNC_NUM_SERVERS", STANDBY_ENV):
            env.pop(key, None)
        if standby:
            env[STANDBY_ENV] = "1"
        rank = _spawn(list(self.command), RankSpec(wid, "worker", wid, wid), env, self.logdir, self.forks)
        _start_pumps(rank, self.out)
        self.procs[wid] = rank
        (self.standby if standby else self.pending).append(wid)

    def _publish(self, why: str, lost: list[int] = ()) -> None:
        """The next generation: its members, and the members of the last one that are ``lost``
        (failed or unreachable: the survivors end their waits on them at once)."""
        self.gen += 1
        if lost:
            self._keep(f"elastic/dropped/{self.gen}", json.dumps({"ids": list(lost), "why": why}))
        self._keep(f"elastic/members/{self.gen}", ",".join(map(str, self.members)))
        self._keep("elastic/gen", str(self.gen))
        self._say(f"generation {self.gen}: {len(self.members)} workers {self.members} ({why})")

    def _keep(self, key: str, value: str) -> None:
        self.store.set(key, value)
        self.published = {k: v for k, v in self.published.items() if not k.startswith("elastic/members/")
                          or k == f"elastic/members/{self.gen}"}
        self.published[key] = value

    def _signed(self, key: str) -> str | None:
        """``key``'s value if present and signed with the job's secret; None otherwise."""
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except stores.UnsignedValueError:
            return None

    def _repair(self) -> None:
        """Write back any published key that a process outside the job overwrote."""
        for key, value in self.published.items():
            if self._signed(key) != value:
                self._say(f"{key} was overwritten from outside the job (not signed with its secret); restored")
                self.store.set(key, value)

    def _say(self, text: str) -> None:
        print(f"gradsync run --elastic: {text}", file=sys.stderr, flush=True)

    def _where(self, reason: str, members: list[int]) -> None:
        """Print where each worker of generation ``members`` is (its rank there is its place in it)."""
        gone = {i for i, wid in enumerate(members) if wid not in self.procs or self.procs[wid].proc.poll() is not None}
        started = min((rank.started for rank in self.procs.values()), default=0.0)
        lines = flight.report(self.flight_dir, list(range(len(members))), reason, started=started, gone=gone)
        if lines:
            self._say(f"where each worker is ({reason}; generation {self.gen}: ranks 0.. are workers {members}):\n"
                      + "\n".join(f"    {line}" for line in lines)
                      + f"\ngradsync run --elastic: every rank's last operations: "
                        f"{os.path.join(self.flight_dir, 'flight-summary.json')}")

    def _fail(self, message: str, code: int, members: list[int] | None = None) -> JobResult:
        self._where(message, self.members if members is None else members)
        self.store.set("elastic/failed", message)
        _stop(list(self.procs.values()), self.grace_s)
        return JobResult(code, None, f"gradsync run --elastic: {message}")

    def _answer(self, seq: int, text: str) -> None:
        self.store.set(f"elastic/answer/{seq}", text)

    def _handle_requests(self) -> None:
        try:
            last = self.store.add("elastic/request_seq", 0)
        except Exception:  # noqa: BLE001 - a value written over the counter: not a request
            self._say(f"ignored a malformed resize request (elastic/request_seq is not a counter); reset to {self.seq}")
            self.store = self._connect()
            self.store.inner.set("elastic/request_seq", str(self.seq))  # a counter holds plain digits
            return
        self.bodyless.update({seq: time.monotonic() for seq in range(self.seq + 1, last + 1)})
        self.seq = max(self.seq, last)
        for seq, since in sorted(self.bodyless.items()):  # in order: the latest valid request wins
            key = f"elastic/request/{seq}"
            if not self.store.check([key]):
                if time.monotonic() - since > REQUEST_BODY_S:
                    del self.bodyless[seq]
                    self._say(f"resize request {seq} refused: no size arrived within {REQUEST_BODY_S:g} s")
                    self._answer(seq, "refused: the request carried no size")
                continue
            del self.bodyless[seq]
            try:
                raw = self.store.get(key).decode(errors="replace")
            except stores.UnsignedValueError:
                self._say(f"resize request {seq} refused: not signed with the job's secret (from outside the job)")
                self._answer(seq, "refused: the request is not signed with the job's secret "
                                  f"(gradsync resize reads it from {self.secret_path})")
                continue
            self._resize(seq, raw)

    def _resize(self, seq: int, raw: str) -> None:
        try:
            size = int(raw)
        except ValueError:
            size = -1
        if not self.min_np <= size <= self.max_np:
            why = f"refused: {raw!r} is outside --min-np {self.min_np} .. --max-np {self.max_np}"
            self._say(f"resize request {seq} {why}")
            self._answer(seq, why)
            return
        if size > self._capacity():
            why = (f"refused: {size} workers need more slots than the {len(self.remote.usable()) + 1} hosts have "
                   f"({self._capacity()}); start another host's agent")
            self._say(f"resize request {seq} {why}")
            self._answer(seq, why)
            return
        have = len(self.members) + len(self.pending) + self.to_start
        if size > have:
            admitted, self.standby = self.standby[:size - have], self.standby[size - have:]
            self.pending += admitted
            started = size - have - len(admitted)
            self.to_start += started
            self._start_deferred()
            self._say(f"for a resize to {size}: " + ", ".join(
                part for part in (f"admitting standbys {admitted}" if admitted else "",
                                  f"starting {started} workers" if started else "") if part))
            if admitted:  # replaced once the regroup is over: the next grow finds standbys again
                self.replace_at = time.monotonic() + REPLACE_AFTER_S
        elif size < len(self.members):
            leaving = self.members[size:]
            self.members = self.members[:size]
            self._publish(f"resize to {size}; workers {leaving} leave")
        if self.pending or self.to_start:
            self.unanswered.append(seq)
        else:
            self._answer(seq, str(self.gen))

    def _start_deferred(self) -> None:
        """Start a grow's workers as slots free: right after a shrink, the workers that left may
        still hold their host's slots while they exit."""
        while self.to_start and self._place() is not False:
            self._start_worker()
            self.to_start -= 1

    def _check_pending(self) -> None:
        self._start_deferred()
        if self.pending and not self.to_start and all(self._signed(f"elastic/ready/{w}") is not None for w in self.pending):
            joined, self.pending = self.pending, []
            self.members += joined
            self._publish(f"workers {joined} joined")
            for seq in self.unanswered:
                self._answer(seq, str(self.gen))
            self.unanswered = []

    def _live(self) -> set[int]:
        return set(self.procs) | (set(self.remote.alive) if self.remote is not None else set())

    def _dismiss_standbys(self) -> None:
        """The job is over: standbys still waiting exit (``elastic/done``), or are ended after the grace."""
        self.store.set("elastic/done", "1")
        local = [w for w in self.standby if w in self.procs]
        starting = [w for w in local if self._signed(f"elastic/ready/{w}") is None]
        if starting:  # still importing, before gradsync.init(): nothing of theirs to end cleanly
            self._say(f"the job ended before a grow needed standby workers {starting}, still starting: ended")
            _stop([self.procs[w] for w in starting], self.grace_s)
            local = [w for w in local if w not in starting]
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(self.procs[w].proc.poll() is None for w in local):
            time.sleep(POLL_S)
        _stop([self.procs[w] for w in local], self.grace_s)
        for wid in self.standby:
            self.procs.pop(wid, None)
            if self.remote is not None:
                self.remote.alive.pop(wid, None)  # their hosts' agents end them
        self.standby = []

    def _farewell(self) -> None:
        """Before the store closes with this agent: give the other hosts' agents a few beats to read
        ``elastic/done`` or ``elastic/failed`` (each says goodbye), so none mistakes the end for a
        lost store."""
        if self.remote is None:
            return
        deadline = time.monotonic() + 4 * BEAT_S
        hosts = self.remote.usable()
        while time.monotonic() < deadline and not all(self.store.check([f"elastic/bye/{h.index}"]) for h in hosts):
            time.sleep(POLL_S)

    def run(self) -> JobResult:
        try:
            return self._loop()
        finally:
            with contextlib.suppress(Exception):
                self._farewell()
            if self.lease is not None:
                self.lease.end()
            self.forks.close()
            with contextlib.suppress(OSError):
                os.unlink(self.secret_path)
            if self.logdir is None and not os.path.exists(os.path.join(self.flight_dir, "flight-summary.json")):
                shutil.rmtree(self.flight_dir, ignore_errors=True)

    def _ended(self) -> list[tuple[int, int | None]]:
        """Workers that ended since the last call, here and on the other hosts: ``(id, exit code)``,
        None for the workers of a host that was lost."""
        ended = []
        for wid, rank in list(self.procs.items()):
            code = rank.proc.poll()
            if code is not None:
                del self.procs[wid]
                ended.append((wid, code))
        if self.remote is not None:
            for host in self.remote.arrivals():
                self._host_joined(host)
            lost_before = {h.index for h in self.remote.hosts.values() if h.lost}
            ended += self.remote.exits()
            for host in self.remote.hosts.values():
                if host.lost and host.index not in lost_before:
                    self._say(f"host {host.index} ({host.name}) is lost: no beat for its agent reached the store "
                              f"for {HOST_LOST_S:g} s; its workers leave the job")
        return ended

    def _host_joined(self, host: RemoteHost) -> None:
        """A host registered while the job runs: its workers join, up to ``max_np``; free slots
        hold standbys."""
        grow = min(host.slots, self.max_np - len(self.members) - len(self.pending))
        self._say(f"host {host.index} ({host.name}) registered with {host.slots} slots"
                  + (f"; starting {grow} workers there" if grow > 0 else "; the job has --max-np workers already"))
        for _ in range(max(0, grow)):
            self._start_worker(host=host)
        self._top_up_standbys()

    def _loop(self) -> JobResult:
        with _trap_signals(usr1=True) as caught:
            while not caught:
                if _USR1.is_set():
                    _USR1.clear()
                    self._where("SIGUSR1", self.members)
                if self.lease is not None and not self.lease.beat():
                    return self._fail(f"the lead at {self.lease.deposed} beats in {self.lease.folder} now: the other "
                                      "hosts took this one for dead (its beat stood still there) and went on from "
                                      "the newest commit; this host's workers are stopped", 1)
                self._handle_requests()
                self._repair()
                self._check_pending()
                generation, gone = list(self.members), []
                for wid, code in self._ended():
                    how = "its host was lost" if code is None else f"exit code {_exit_code(code)}"
                    if wid in self.standby:
                        self.standby.remove(wid)
                        if code != 0:
                            self.standby_target -= 1
                            self._say(f"standby worker {wid} failed while waiting ({how}); not replaced")
                        continue
                    if code == 0:
                        continue  # a worker that left, or one finishing before the others
                    self.failed.append(f"worker {wid} ({how})")
                    if wid in self.pending:
                        self.pending.remove(wid)
                        self._say(f"worker {wid} failed while starting ({how}); not added")
                        if not self.pending and not self.to_start:  # nobody left to wait for: answer now
                            for seq in self.unanswered:
                                self._answer(seq, f"refused: the new workers failed to start (worker {wid}: {how})")
                            self.unanswered = []
                        continue
                    if wid in self.members:
                        self.members.remove(wid)
                        gone.append((wid, code))
                if gone:
                    if len(self.members) < self.min_np:
                        failed = ", ".join(f"worker {w} failed ({'its host was lost' if c is None else f'exit code {_exit_code(c)}'})"
                                           for w, c in gone)
                        last = next((_exit_code(c) for _, c in reversed(gone) if c is not None), 1)
                        return self._fail(f"{failed} and {len(self.members)} workers are left, fewer than --min-np "
                                          f"{self.min_np}", last, generation)
                    self._publish("; ".join(f"worker {w} failed: its host was lost" if c is None else
                                            f"worker {w} failed with exit code {_exit_code(c)}" for w, c in gone)
                                  + ("; continuing without it" if len(gone) == 1 else "; continuing without them"),
                                  lost=[w for w, _ in gone])
                    self._top_up_standbys()
                self._top_up_standbys()  # slots that workers leaving after a shrink freed
                live = self._live()
                if live and live <= set(self.standby):
                    self._dismiss_standbys()
                if not self._live():
                    self.store.set("elastic/done", "1")
                    if self.failed:
                        self._say(f"done; failed during the job, and the others went on without them: "
                                  f"{', '.join(self.failed)}")
                    return JobResult(0, None, "")
                time.sleep(POLL_S)
        return self._fail("interrupted", 130 if caught and caught[0] == 2 else 143)


def launch_elastic(command: list[str], *, np: int, min_np: int, max_np: int, port: int | None = None,
                   logdir: str | None = None, grace_s: float = 3.0, standby: int = 0, addr: str = "127.0.0.1",
                   nproc: int | None = None, min_hosts: int = 1) -> JobResult:
    """Run an elastic job's lead agent: this host's workers, the store, the decisions (see
    :class:`Agent` for ``addr``, ``nproc`` and ``min_hosts``, the job over several hosts)."""
    if not 1 <= min_np <= np <= max_np:
        return JobResult(2, None, f"gradsync run --elastic: need 1 <= --min-np ({min_np}) <= -np ({np}) "
                                  f"<= --max-np ({max_np})")
    try:
        agent = Agent(command, np, min_np, max_np, port, logdir, grace_s, standby, addr, nproc, min_hosts)
    except ConfigError:
        raise
    except GradsyncError as exc:
        return JobResult(1, None, f"gradsync run --elastic: {exc}")
    where = f"{addr}:{agent.port}"
    agent._say(f"store on {where}; resize with: gradsync resize N --port {agent.port}"
               + (f" --addr {addr}" if nproc is not None else ""))
    return agent.run()


def run_host(command: list[str], *, addr: str, port: int, nproc: int, logdir: str | None = None,
             grace_s: float = 3.0) -> JobResult:
    """The agent of a host that is not the lead's, for the job's whole life: when the lead dies
    (gradsync.launch.elastic_hosts, the take-over), it registers with the next lead or becomes it."""
    result = launch_host(command, addr=addr, port=port, nproc=nproc, logdir=logdir, grace_s=grace_s)
    while isinstance(result, NextLead):
        if result.lead:
            return launch_elastic(command, np=result.min_np, min_np=result.min_np, max_np=result.max_np,
                                  port=result.port, logdir=logdir, grace_s=grace_s, standby=result.standby,
                                  addr=result.addr, nproc=nproc, min_hosts=-(-result.min_np // nproc))
        result = launch_host(command, addr=result.addr, port=result.port, nproc=nproc, logdir=logdir, grace_s=grace_s)
    return result


def resize(size: int, port: int, addr: str = "127.0.0.1", timeout_s: float = 120.0,
           secret_file: str | None = None) -> int:
    """``gradsync resize N``: ask a running elastic job for N workers and wait for its answer.
    Returns the generation that has N workers; raises :class:`GradsyncError` when the job refuses
    (the reason), does not answer within ``timeout_s``, or the store is no elastic job's. The
    request is signed with the job's secret: ``GRADSYNC_JOB_SECRET``, else ``secret_file``, else the
    file the job on ``port`` wrote (:func:`gradsync.store.secret_file`)."""
    import torch.distributed as dist

    from gradsync.adapt.elastic import answer, request_size

    secret = stores.job_secret() or stores.read_secret(secret_file or stores.secret_file(port))
    store = stores.signed(dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10),
                                        wait_for_workers=False), secret)
    if not store.check(["elastic/gen"]):
        raise GradsyncError(f"the store at {addr}:{port} is no elastic job's (it has no generation); "
                            "is this the port `gradsync run --elastic` printed?")
    try:
        reply = answer(store, request_size(store, size), timeout_s)
    except stores.UnsignedValueError:
        raise GradsyncError(f"the job at {addr}:{port} answered with another secret than ours: the secret "
                            "file is not this job's (is the port right?)") from None
    if isinstance(reply, str):
        raise GradsyncError(f"the job refused: {reply.removeprefix('refused: ')}")
    return reply
