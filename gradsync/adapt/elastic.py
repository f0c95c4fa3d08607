"""Elastic training, the worker's side: membership, regrouping, state hand-over (KungFu, Horovod elastic).

``gradsync run --elastic`` (:mod:`gradsync.launch.elastic`) hosts a key-value store and decides
who is in the job; workers follow. The job moves through *generations*; generation ``g`` is a list
of worker ids (``elastic/members/g``), and worker ``members[i]`` is rank ``i`` of that generation's
process group (created on the store under the prefix ``elastic/g/``, so generations never mix).

- A worker started by the launcher goes on with the script past ``gradsync.init()`` (:func:`join`);
  where it first needs the job (``distribute``, the topology, the rank) it announces itself
  (``elastic/ready/<id>``) and waits until a generation lists it, so a grow's workers are
  admitted once their model is built. A standby (``--standby``) announces itself at ``init()``
  and waits where it first needs the job, without a deadline, until a grow admits it. Either
  exits (0) when the job ends before it joined (``elastic/done``).
- Between steps, the :class:`~gradsync.adapt.Controller` asks (:meth:`Membership.agree`) whether a
  newer generation exists: one all-reduce (max) of one integer, so all workers switch after the
  same step. Then every worker closes its strategy, leaves the old group, and the members of the
  new one form it; a worker not listed leaves training (``ctl.detached``).
- In the new group the survivors repeat what a starting worker does in ``distribute`` (model
  check, parameter broadcast, strategy attach), then the source rank broadcasts the optimizer
  state, step, epoch, data position, batch size and learning rates (:func:`share_state`; a JSON
  header as ``uint8`` and raw tensors: no pickle).
- When a worker dies, a collective fails on the survivors; each restores its last *commit* (taken
  after every step), waits for the launcher's next generation, and the survivor with the newest
  commit becomes the source: no committed step is lost.

Store keys (all strings): ``elastic/gen``, ``elastic/members/<g>``, ``elastic/ready/<id>``,
``elastic/request/<n>`` (a size asked for; ``n`` from the counter ``elastic/request_seq``),
``elastic/answer/<n>``, ``elastic/dropped/<g>`` (members of the previous generation that died or
were lost, and why), ``elastic/failed`` (why the launcher gave up), ``elastic/done`` (the job
ended: standbys exit). Values are signed with the
job's secret (:mod:`gradsync.store`); a worker ignores a generation whose signature is wrong (the
launcher restores it), so a hostile write cannot steer or stop the job.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync import hosts, runtime
from gradsync import store as stores
from gradsync.errors import ConfigError, GradsyncError
from gradsync.topology import Topology

HOST_ENV = {name: os.environ[name] for name in hosts.NODE_ENV if name in os.environ}
"""What names this worker's host (a member's number of workers on its host changes with the
generations, so ``LOCAL_WORLD_SIZE`` is not part of it; the stable worker id is its local rank)."""
POLL_S = 0.02
WATCH_S = 0.2
"""While a worker trains, how often it reads whether the launcher lost a member of its generation."""
WATCH_TIMEOUT_S = 2.0
"""The longest one of those reads may block (a store host that is gone)."""


def _client(addr: str, port: int, timeout_s: float, prefix: str = ""):
    """A connection to the launcher's store; its values are signed with the job's secret."""
    return stores.signed(dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                       wait_for_workers=False), stores.job_secret(), prefix)


def request_size(store, size: int) -> int:
    """Ask the launcher for ``size`` workers (what ``gradsync resize`` and ``ctl.resize`` do). Returns
    the request's number; the launcher answers under ``elastic/answer/<number>``: the generation that
    has the new size, or ``refused: why``. ``store`` signs the request with the job's secret; the
    launcher refuses one that is not signed."""
    seq = store.add("elastic/request_seq", 1)
    store.set(f"elastic/request/{seq}", str(size))
    return seq


def answer(store, seq: int, timeout_s: float) -> int | str:
    """The launcher's answer to request ``seq``: a generation, or the reason it refused."""
    try:
        store.wait([f"elastic/answer/{seq}"], timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - TCPStore raises plain RuntimeErrors
        raise GradsyncError(f"the elastic launcher did not answer resize request {seq} within {timeout_s:g} s") from exc
    text = store.get(f"elastic/answer/{seq}").decode()
    return int(text) if text.lstrip("-").isdigit() else text


class Membership:
    """This worker's view of the elastic job: its id, its generation and that generation's members."""

    def __init__(self, store, addr: str, port: int, wid: int, backend: str, timeout_s: float):
        self.store, self.addr, self.port, self.id = store, addr, port, wid
        self.backend, self.timeout_s = backend, timeout_s
        self.gen, self.members = -1, []
        self.fresh = True  # this process has not trained in any generation yet
        self.any_new = self.needs_state = False
        self._warned: set[str] = set()

    def _read(self, key: str) -> str | None:
        """A value the launcher wrote, or None when absent or not signed by it (a hostile write,
        which the launcher repairs: callers poll again)."""
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except stores.UnsignedValueError as exc:
            if key not in self._warned:
                self._warned.add(key)
                print(f"gradsync: elastic worker {self.id}: {exc}", flush=True)
            return None

    def latest(self) -> int:
        raw = self._read("elastic/gen")
        return int(raw) if raw is not None and raw.isdigit() else -1

    def _newer(self, gen: int) -> str | None:
        """Why to stop forming generation ``gen``: the launcher published a newer one (a worker
        listed in ``gen`` may have gone straight there and never come), or the job ended."""
        newest = self.latest()
        if newest > gen:
            return f"generation {newest} replaced it"
        return "the job ended" if self.done() else None

    def done(self) -> bool:
        """The job ended (``elastic/done``): every member finished."""
        return self._read("elastic/done") is not None

    def exit_if_done(self) -> None:
        """A worker still joining when the job ends (it became ready after the others' last step)
        has nothing to do: it says so and the process exits 0."""
        if self.done():
            print(f"gradsync: elastic worker {self.id}: the job ended before this worker joined it", flush=True)
            raise SystemExit(0)

    def members_of(self, gen: int) -> list[int]:
        deadline = time.monotonic() + self.timeout_s
        while (raw := self._read(f"elastic/members/{gen}")) is None:
            if time.monotonic() > deadline:
                raise GradsyncError(f"elastic worker {self.id}: generation {gen}'s member list is missing or not "
                                    f"signed by the launcher after {self.timeout_s:g} s")
            time.sleep(POLL_S)
        return [int(x) for x in raw.split(",") if x]

    def _failed(self) -> str | None:
        return self._read("elastic/failed")

    def wait_for(self, newer_than: int, timeout_s: float) -> int:
        """The first generation after ``newer_than``, waiting for the launcher at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            gen = self.latest()
            if gen > newer_than:
                return gen
            failed = self._failed()
            if failed:
                raise GradsyncError(f"elastic worker {self.id}: the launcher ended the job: {failed}")
            if time.monotonic() > deadline:
                raise GradsyncError(f"elastic worker {self.id}: no new generation from the launcher within "
                                    f"{timeout_s:g} s after generation {newer_than}")
            time.sleep(POLL_S)

    def enter(self, gen: int, *, needs_state: bool = False) -> bool:
        """Form generation ``gen``'s process group; False when this worker is not in it (detached).

        If the group cannot form (a listed worker died meanwhile), the launcher's next generation
        (waited for up to the timeout) is tried instead. Once formed, the members agree in one all-reduce
        whether anyone is new and whether anyone ``needs_state`` (restored after a failure): every
        worker then takes the same path through the model broadcast and the state hand-over."""
        while True:
            members = self.members_of(gen)
            if self.id not in members:
                self.gen, self.members = gen, members
                return False
            topo = Topology(len(members), members.index(self.id), 0, self.id)  # local rank: stable per process
            prefix = f"elastic/{gen}/"
            try:
                store = _client(self.addr, self.port, self.timeout_s, prefix)
                # Which members share a host, anew each generation (hosts join and leave): where a
                # host runs several, the strategies aggregate inside it as in a fixed job.
                topo = hosts.exchange(store, topo, self.timeout_s, env=HOST_ENV, abandon=lambda g=gen: self._newer(g))
                rt = runtime.start(topo, store, backend=self.backend, timeout_s=self.timeout_s,
                                   heartbeat_at=(self.addr, self.port), heartbeat_prefix=prefix)
                flags = torch.tensor([float(self.gen < 0), float(needs_state or self.gen < 0)])
                rt.transport.allreduce(flags, op="max", what="elastic: who is new")
            except Exception as exc:  # noqa: BLE001 - Gloo and the store raise plain RuntimeErrors
                runtime.leave()
                if self.gen < 0:
                    self.exit_if_done()
                try:  # a member died meanwhile: the launcher leaves it out of the next generation
                    gen = self.wait_for(gen, self.timeout_s)
                    continue
                except GradsyncError:
                    pass
                raise GradsyncError(f"elastic worker {self.id}: generation {gen} ({members}) could not form its "
                                    f"process group and the launcher published no newer one within "
                                    f"{self.timeout_s:g} s: {exc}") from exc
            self.fresh = self.gen < 0
            self.gen, self.members = gen, members
            self.any_new, self.needs_state = bool(flags[0]), bool(flags[1])
            rt.elastic = self
            self._watch_for_lost(rt)
            return True

    def _watch_for_lost(self, rt) -> None:
        """Until this generation's group is left: read the launcher's newest generation every
        :data:`WATCH_S` (a connection of its own); when one names members of this generation as
        lost (``elastic/dropped/<g>``: dead, or their host unreachable), every wait of this worker ends
        at its next check (``Runtime.peer_lost``) instead of at the timeout, and it regroups."""
        stop, gen, members = threading.Event(), self.gen, set(self.members)
        rt.transport.check_every_s = WATCH_S

        def watch() -> None:
            try:
                client = _client(self.addr, self.port, WATCH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - no watch: waits end at the timeout, as without one
                return
            seen = gen
            while not stop.wait(WATCH_S):
                with contextlib.suppress(Exception):  # a slow store or a hostile write: read again later
                    newest = int(client.get("elastic/gen").decode())
                    for g in range(seen + 1, newest + 1):
                        if client.check([f"elastic/dropped/{g}"]):
                            lost = json.loads(client.get(f"elastic/dropped/{g}").decode())
                            if members & set(lost["ids"]):
                                rt.peer_lost = (f"the elastic launcher lost a member of generation {gen}: "
                                                f"{lost['why']} (generation {g})")
                                return
                    seen = max(seen, newest)

        thread = threading.Thread(target=watch, name="gradsync-elastic-watch", daemon=True)
        thread.start()

        def end() -> None:  # a read under way takes milliseconds (at most WATCH_TIMEOUT_S)
            stop.set()
            thread.join(WATCH_TIMEOUT_S + WATCH_S)

        runtime.on_stop(end)

    def agree(self) -> int:
        """The newest generation any worker has seen: collective, the same answer everywhere."""
        t = torch.tensor([self.latest()], dtype=torch.int64)
        runtime.current().transport.allreduce(t, op="max", what="elastic generation check")
        return int(t)


def join(backend: str, timeout_s: float):
    """``gradsync.init()`` in an elastic job: where the script first needs the job, announce this
    worker, wait to be listed and form the group (a standby: announced at once, admitted by a grow)."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = runtime._env_int("MASTER_PORT", 29500)
    wid = runtime._env_int("GRADSYNC_ELASTIC_ID", -1)
    if wid < 0:
        raise ConfigError("GRADSYNC_ELASTIC=1 needs GRADSYNC_ELASTIC_ID: start elastic jobs with gradsync run --elastic")
    if backend != "gloo":
        raise ConfigError(f"elastic jobs run on Gloo for now (got backend {backend!r}): NCCL aborts the process when "
                          "a peer dies, so survivors could not regroup")
    store = _client(addr, port, max(timeout_s, runtime.RENDEZVOUS_MIN_S))
    member = Membership(store, addr, port, wid, backend, timeout_s)
    if os.environ.get("GRADSYNC_ELASTIC_STANDBY") == "1":
        # A standby goes on with the script (its model is built ahead of need) and waits to be
        # admitted where it first needs the job: distribute(), gradsync.topology(), the rank.
        store.set(f"elastic/ready/{wid}", "1")
        runtime.defer(lambda: _enter_when_listed(member, None))
        return _Deferred()

    def enter() -> None:
        # Every other worker also goes on with the script and announces itself where it first
        # needs the job: the workers already in the job regroup for a joiner once it has built its
        # model, rather than wait for it in the model check, a collective bounded by the timeout.
        store.set(f"elastic/ready/{wid}", "1")
        _enter_when_listed(member, time.monotonic() + max(timeout_s, runtime.RENDEZVOUS_MIN_S))

    runtime.defer(enter)
    return _Deferred()


class _Deferred:
    """``join``'s answer for a standby: ``init()`` returns a topology that joins when read."""

    @property
    def topology(self):
        return runtime.init()


def _enter_when_listed(member: Membership, deadline: float | None):
    """Wait until a generation lists this worker (a standby: however long it takes), form its group."""
    gen = -1
    while True:
        if deadline is None:
            gen = _admitted_or_done(member, gen)
        else:
            member.exit_if_done()
            gen = member.wait_for(gen, max(1.0, deadline - time.monotonic()))
        if member.id in member.members_of(gen):
            break
    if not member.enter(gen):
        raise GradsyncError(f"elastic worker {member.id} was listed in generation {gen} and then not")
    return runtime.current()


def _admitted_or_done(member: Membership, gen: int) -> int:
    """A standby's wait: the next generation, however long it takes; the process exits (0) when
    the job ends before a grow admits it."""
    while True:
        if member._read("elastic/done") is not None:
            print(f"gradsync: standby worker {member.id}: the job ended before a grow needed it", flush=True)
            raise SystemExit(0)
        try:
            return member.wait_for(gen, 0.2)
        except GradsyncError:
            if member._failed():
                raise


def joining() -> bool:
    """Whether this worker has just joined a job that was already training (it must receive the state)."""
    member = current()
    return member is not None and member.gen > 0 and member.fresh


def current() -> Membership | None:
    return runtime.current().elastic if runtime.is_initialized() else None


OTHERS_STEP = "the others end their step"
"""The phase of a resize record (``ctl.resizes``) spent waiting for the other workers to ask: the
end of their step, which the next step's first collective would wait for anyway."""


def request_resize(size: int, timeout_s: float = 120.0, timings: dict | None = None) -> int:
    """Ask for ``size`` workers and wait for the launcher's answer. Collective: every worker calls it
    after the same step; rank 0 asks and tells the others the request's number in an all-reduce
    that ends once every worker has arrived (a barrier), then every worker reads the answer from
    the store (none waits in a collective meanwhile). Returns the generation to
    enter, or -1 when the launcher refused (it says why, and so does worker 0). ``timings`` gets the
    seconds spent waiting for the other workers to reach the request (the end of their step, as the
    next step's first collective would wait) and for the launcher's answer."""
    member = current()
    if member is None:
        raise ConfigError("resizing needs an elastic job: gradsync run --elastic --min-np A --max-np B")
    seq = torch.tensor([0], dtype=torch.int64)
    if runtime.current().topology.rank == 0:
        seq[0] = request_size(member.store, size)
    asked = time.perf_counter()
    # It ends only when every worker has arrived, so the wait for the others' step is all here
    # and the phases after it are the resize's own.
    runtime.current().transport.allreduce(seq, op="max", what="elastic resize request")
    agreed = time.perf_counter()
    reply = answer(member.store, int(seq), timeout_s)
    if timings is not None:
        timings.update({OTHERS_STEP: agreed - asked,
                        "request (new workers start)": time.perf_counter() - agreed})
    if isinstance(reply, str):
        if runtime.current().topology.rank == 0:
            print(f"gradsync: resize to {size} workers {reply}", flush=True)
        return -1
    return reply


# -- state hand-over ---------------------------------------------------------------------------------

def _encode_state(optimizer, extra: dict) -> tuple[dict, list[torch.Tensor]]:
    """The optimizer's ``state_dict`` as a JSON-able skeleton plus its tensors, in order."""
    sd = optimizer.state_dict()
    tensors: list[torch.Tensor] = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach())
            return {"__tensor__": len(tensors) - 1, "dtype": str(value.dtype).removeprefix("torch."),
                    "shape": list(value.shape)}
        if isinstance(value, dict):
            return {"__dict__": [[k, walk(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value

    return {"optimizer": walk(sd), **extra}, tensors


def _decode_state(skeleton, tensors: list[torch.Tensor]):
    def walk(value):
        if isinstance(value, dict) and "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if isinstance(value, dict) and "__dict__" in value:
            return {k: walk(v) for k, v in value["__dict__"]}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(skeleton)


def _views_of_flat(shapes: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
    """New tensors of these dtypes and shapes, those of one dtype consecutive views of one buffer."""
    totals: dict[torch.dtype, int] = {}
    for dtype, shape in shapes:
        totals[dtype] = totals.get(dtype, 0) + math.prod(shape)
    flats, at = {dtype: torch.empty(n, dtype=dtype) for dtype, n in totals.items()}, dict.fromkeys(totals, 0)
    views = []
    for dtype, shape in shapes:
        n = math.prod(shape)
        views.append(flats[dtype][at[dtype]:at[dtype] + n].view(shape))
        at[dtype] += n
    return views


TAG_STATE = 0x454C0001
"""The point-to-point tag of a hand-over from several holders (no strategy receives on it)."""


def share_state(optimizer, extra: dict, src: int, holders: list[int] | None = None) -> dict:
    """Broadcast ``optimizer``'s state and ``extra`` (JSON) from rank ``src``; load them everywhere.
    Returns ``extra`` as ``src`` had it. Collective over the workers. ``holders``: the ranks that
    hold ``src``'s very state (a strategy whose workers update alike): each sends it to a share of
    the other ranks, point to point and in parallel, and only those others load it."""
    transport = runtime.current().transport
    me = runtime.current().topology.rank
    if me == src:
        skeleton, tensors = _encode_state(optimizer, extra)
        blob = torch.frombuffer(bytearray(json.dumps(skeleton).encode()), dtype=torch.uint8)
        length = torch.tensor([blob.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    transport.broadcast(length, src, what="elastic state header")
    if me != src:
        blob = torch.empty(int(length), dtype=torch.uint8)
    transport.broadcast(blob, src, what="elastic state header")
    skeleton = json.loads(bytes(blob.tolist()).decode()) if me != src else skeleton
    holders = holders if holders is not None and len(holders) > 1 else [src]
    receiving = me not in holders  # with one holder, every rank but src
    if receiving:
        shapes = []

        def allocate(value):
            if isinstance(value, dict) and "__tensor__" in value:
                shapes.append((getattr(torch, value["dtype"]), value["shape"]))
            elif isinstance(value, dict) and "__dict__" in value:
                for _, v in value["__dict__"]:
                    allocate(v)
            elif isinstance(value, list):
                for v in value:
                    allocate(v)

        allocate(skeleton["optimizer"])
        tensors = _views_of_flat(shapes)  # received in place, a few messages, nothing to unpack
    if len(holders) == 1:
        transport.broadcast_tensors(tensors, src, what="elastic optimizer state")
    else:
        receivers = [r for r in range(runtime.current().topology.world_size) if r not in holders]
        if receiving:
            holder = holders[receivers.index(me) % len(holders)]
            transport.recv_tensors(tensors, holder, TAG_STATE, what=f"elastic optimizer state from rank {holder}")
        else:
            if me != src:
                tensors = _encode_state(optimizer, {})[1]
            for k, r in enumerate(receivers):
                if holders[k % len(holders)] == me:
                    transport.send_tensors(tensors, r, TAG_STATE, what=f"elastic optimizer state to rank {r}")
    if receiving:
        optimizer.load_state_dict(_decode_state(skeleton["optimizer"], tensors))
    return {k: v for k, v in skeleton.items() if k != "optimizer"}


runtime.ELASTIC_JOIN = join
