"""Process-level state: ``gradsync.init()``, ``gradsync.shutdown()``, and the runtime they make current.

``init`` reads the standard environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) that ``gradsync run``, torchrun, SLURM wrappers and Kubeflow's PyTorchJob all set,
plus ``GRADSYNC_NUM_SERVERS`` (how many of the last ranks are parameter servers) and
``GRADSYNC_TIMEOUT`` (seconds before a stuck operation fails, naming the peer at fault; default 30).
At start-up a rank
waits ``max(GRADSYNC_TIMEOUT, RENDEZVOUS_MIN_S)`` seconds (60 by default) for rank 0's store, then
fails with an error saying so.

A process has at most one :class:`Runtime` at a time, made here and read by the layers above
(:func:`current`). Its failure diagnosis, which names the rank at fault, is
:mod:`gradsync.diagnosis`; how it comes down at shutdown, at exit and after a failure,
:mod:`gradsync.teardown`; its heartbeat, :mod:`gradsync.heartbeat`.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync import fastexit, flight, hosts, stragglers, teardown, trace
from gradsync import store as stores
from gradsync.diagnosis import PeerDiagnosis, explain_uncaught
from gradsync.errors import ConfigError, GradsyncError
from gradsync.heartbeat import Heartbeat, _within
from gradsync.topology import Topology
from gradsync.transport import REPORT_S, Transport, TwoLevel, gloo_timeout

DEFAULT_TIMEOUT_S = 30.0
RENDEZVOUS_MIN_S = 60.0
"""Least time a rank waits for rank 0's store at start-up: ranks on other hosts may start late."""
ELASTIC_JOIN = None
"""``(backend, timeout_s) -> Runtime``: joins an elastic job's current generation. Set by
:mod:`gradsync.adapt.elastic` when imported (``gradsync.init()`` imports it in an elastic job), so
the runtime does not depend on the layer above it."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass
class Runtime(PeerDiagnosis):
    """A rank's part in the job: its topology, transport and heartbeat, what runs at shutdown, and
    the failure diagnosis (:meth:`explain`, :meth:`behind`, :meth:`overdue`: :class:`PeerDiagnosis`)."""

    topology: Topology
    transport: Transport
    timeout_s: float
    heartbeat: Heartbeat | None = None
    owns_group: bool = True
    closers: list = field(default_factory=list)
    store: object = None
    """The store the process group was made on: kept here, because torch holds only the C++ half
    of a store written in Python (:class:`gradsync.store.SignedStore`)."""
    responder: object = None
    """The thread that dumps this rank's flight record when the launcher asks (:mod:`gradsync.flight`)."""
    store_lost: bool = False
    """The rendezvous store stopped answering (found when explaining a failure)."""
    abandoned: BaseException | None = None
    """The error this rank is going down with (:func:`abandon`)."""
    hosts_store: bool = False
    """This rank serves the job's rendezvous store (rank 0 under ``gradsync run``)."""
    elastic: object = None
    """In an elastic job (``gradsync run --elastic``): its :class:`gradsync.adapt.elastic.Membership`."""
    stoppers: list = field(default_factory=list)
    """Callables that stop threads of this process without a word to any peer (a watchdog's):
    :func:`shutdown` runs them even for a rank going down with an error, which runs no closer."""
    peer_lost: str | None = None
    """Set from another thread when a member of this job is known to be gone (an elastic job's
    launcher published a generation without it): every wait ends with it at its next check
    (:meth:`overdue`), instead of at the timeout."""


def poll_s(longest: float = 0.5, since: float | None = None) -> float:
    """How long a waiting training thread may sleep before calling :func:`check_progress` again:
    ``longest``, or less near the transport's deadline (or the wait's own, from ``since``)."""
    runtime = _RUNTIME
    if runtime is None or runtime.transport is None:
        return longest
    left = runtime.transport.until_overdue()
    if since is not None:
        left = min(left, since + runtime.timeout_s - REPORT_S - time.monotonic())
    return min(longest, max(0.05, left))


def wait_until(cv, done, what: str, progress) -> None:
    """With ``cv`` (a ``threading.Condition``) held, wait on it until ``done()``: for a training
    thread that waits on its strategy's communication threads, which notify ``cv``. ``progress()``:
    when what it waits for last arrived (or the wait began); at the timeout after it the wait
    raises :meth:`Runtime.overdue`'s error. The flight record shows the thread waiting in ``what``."""
    with flight.waiting(what):
        while not done():
            if not cv.wait(poll_s(since=progress())):
                check_progress(what, since=progress())


def check_progress(what: str, since: float | None = None) -> None:
    """Raise :meth:`Runtime.overdue`'s error, if any: for a strategy's training thread that waits on
    its communication threads (they may be blocked in an operation that cannot be interrupted).
    ``since``: when what the thread waits for last arrived, or its wait began (see ``overdue``)."""
    runtime = _RUNTIME
    if runtime is not None:
        error = runtime.overdue(what, since)
        if error is not None:
            raise error


_RUNTIME: Runtime | None = None
_DEFERRED = None  # a standby's join, run where the script first needs the job (current())
_AT_EXIT = False


def defer(join) -> None:
    """Run ``join()`` (which starts the runtime) where the script first needs the job rather than
    in ``init()``: an elastic standby builds its model ahead of being admitted."""
    global _DEFERRED
    _DEFERRED = join


def _explain_uncaught(kind, value, tb) -> None:
    """``sys.excepthook``: before the traceback of a communication failure raised inside PyTorch,
    say which peer went silent (:func:`gradsync.diagnosis.explain_uncaught`); then :func:`abandon`."""
    explain_uncaught(_RUNTIME, value)
    _PREVIOUS_HOOK(kind, value, tb)
    abandon(value)


def abandon(error: BaseException) -> None:
    """This rank is going down with ``error`` (uncaught in the script): :func:`shutdown` at exit
    then runs no closer and keeps the store up while the others name this rank (:func:`gradsync.teardown.abandon`)."""
    teardown.abandon(_RUNTIME, error)


_PREVIOUS_HOOK = sys.excepthook


def _make_store(addr: str, port: int, topology: Topology, timeout_s: float):
    # Under torchrun the agent already serves the store on MASTER_PORT: every rank is a client.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_master = topology.rank == 0 and not agent
    wait_s = max(timeout_s, RENDEZVOUS_MIN_S)
    if is_master:  # listening on MASTER_ADDR only, not on every interface (see gradsync.store)
        try:
            return stores.signed(stores.serve(stores.bind_address(addr), port, topology.world_size, wait_s),
                                 stores.job_secret())
        except ConfigError as exc:
            raise ConfigError(f"rank 0 {exc}") from None
    try:
        # A client connected to a port that another program holds waits for the store's answer
        # forever, whatever its timeout: bound the whole construction ourselves.
        return stores.signed(_within(wait_s, lambda: dist.TCPStore(addr, port, topology.world_size, is_master=False,
                                                                   timeout=timedelta(seconds=wait_s),
                                                                   wait_for_workers=False)),
                             stores.job_secret())
    except TimeoutError as exc:
        raise GradsyncError(
            f"{topology.describe(topology.rank)} got no answer from the rendezvous store at "
            f"{addr}:{port} within {wait_s:g} s. Either rank 0 is not running (check its log: it "
            "fails with 'port in use' when another program holds that port) or MASTER_ADDR/"
            "MASTER_PORT point elsewhere"
        ) from exc
    except Exception as exc:
        raise GradsyncError(
            f"{topology.describe(topology.rank)} could not reach the rendezvous store at "
            f"{addr}:{port}: {exc}. Check that rank 0 is running and MASTER_ADDR/MASTER_PORT are "
            "reachable from this host"
        ) from exc


def init(*, backend: str | None = None, timeout_s: float | None = None,
         servers: int | None = None) -> Topology:
    """Join the job described by the environment. Idempotent; returns the :class:`Topology`.

    With no ``WORLD_SIZE``/``MASTER_ADDR`` in the environment it starts a one-process job, so
    the same script runs alone or under a launcher. ``backend`` (or ``GRADSYNC_BACKEND``):
    ``"gloo"`` or ``"nccl"``; by default NCCL where CUDA is available, else Gloo, and the user's own
    process group's backend when one exists.
    """
    if _RUNTIME is not None:
        return _RUNTIME.topology
    if _DEFERRED is not None:
        return _PendingTopology()
    fastexit.freeze_at_exit()
    source = "timeout_s" if timeout_s is not None else "GRADSYNC_TIMEOUT"
    raw_timeout = timeout_s if timeout_s is not None else (os.environ.get("GRADSYNC_TIMEOUT") or DEFAULT_TIMEOUT_S)
    try:
        timeout_s = float(raw_timeout)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}={raw_timeout!r} is not a number of seconds") from None
    if not 0 < timeout_s < float("inf"):
        raise ConfigError(f"{source}={raw_timeout!r}: the timeout must be a positive, finite number of seconds")
    servers = _env_int("GRADSYNC_NUM_SERVERS", 0) if servers is None else servers
    if backend is None and dist.is_initialized():  # the user's group: NCCL alone, or Gloo for host tensors
        backend = "nccl" if dist.get_backend() == "nccl" else "gloo"
    backend = _backend(backend)
    if os.environ.get("GRADSYNC_ELASTIC") == "1" and not dist.is_initialized():
        if ELASTIC_JOIN is None:
            raise ConfigError("this rank belongs to an elastic job (GRADSYNC_ELASTIC=1): call gradsync.init() "
                              "first, which joins the job's current generation")
        return ELASTIC_JOIN(backend, timeout_s).topology
    owns_group = not dist.is_initialized()
    if owns_group:
        topology = Topology(_env_int("WORLD_SIZE", 1), _env_int("RANK", 0), servers,
                            _env_int("LOCAL_RANK", 0))
    else:  # the user already created the default process group: adopt it
        topology = Topology(dist.get_world_size(), dist.get_rank(), servers, _env_int("LOCAL_RANK", 0))
    store = addr = port = None
    if owns_group:
        addr = os.environ.get("MASTER_ADDR")
        if topology.world_size == 1 and addr is None:
            store = dist.HashStore()
        else:
            addr = addr or "127.0.0.1"
            port = _env_int("MASTER_PORT", 29500)
            store = _make_store(addr, port, topology, timeout_s)
            topology = hosts.exchange(store, topology, max(timeout_s, RENDEZVOUS_MIN_S))
    return start(topology, store, backend=backend, timeout_s=timeout_s, heartbeat_at=(addr, port)).topology


def _backend(backend: str | None) -> str:
    """The backend asked for (argument, then ``GRADSYNC_BACKEND``), else NCCL where CUDA is available."""
    source = "backend" if backend is not None else "GRADSYNC_BACKEND"
    backend = backend if backend is not None else (os.environ.get("GRADSYNC_BACKEND") or None)
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"{source}={backend!r}: gradsync runs on 'gloo' or 'nccl'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(f"{source}='nccl' but this process sees no CUDA device (torch {torch.__version__}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use 'gloo' on CPUs")
    return backend


def _nccl_device(topology: Topology) -> torch.device:
    """This rank's GPU under NCCL: ``cuda:LOCAL_RANK``. NCCL refuses two ranks on one GPU, so a host
    with fewer GPUs than ranks (parameter servers count) is an error here, not NCCL's later."""
    gpus = torch.cuda.device_count()
    local = max(_env_int("LOCAL_WORLD_SIZE", 0), topology.local_rank + 1)
    if local > gpus:
        raise ConfigError(
            f"{topology.describe(topology.rank)}, local rank {topology.local_rank}: NCCL needs a GPU for every "
            f"rank on a host, parameter servers included; this host runs {local} ranks and has {gpus} "
            f"GPU{'s' if gpus != 1 else ''}. Start at most {gpus} ranks per host, or use Gloo (GRADSYNC_BACKEND=gloo "
            "or gradsync.init(backend='gloo'); tensors on a GPU are then staged through host memory)")
    return torch.device("cuda", topology.local_rank)


def start(topology: Topology, store, *, backend: str, timeout_s: float, heartbeat_at=(None, None),
          heartbeat_prefix: str = "") -> Runtime:
    """Create the process group on ``store`` (None: adopt the user's) and make it the runtime."""
    global _RUNTIME
    device = torch.device("cpu")
    if backend == "nccl":
        device = _nccl_device(topology)
        torch.cuda.set_device(device)
    heartbeat = None
    owns_group = store is not None
    if owns_group:
        dist.init_process_group(backend, store=store, rank=topology.rank,
                                world_size=topology.world_size, timeout=gloo_timeout(timeout_s))
        if topology.world_size > 1 and heartbeat_at[0] is not None:
            heartbeat = Heartbeat(*heartbeat_at, topology, heartbeat_prefix, timeout_s)
    worker_group = dist.group.WORLD
    if topology.num_servers:
        worker_group = dist.new_group(topology.worker_ranks, timeout=gloo_timeout(timeout_s))
    recorder = flight.FlightRecorder(topology.rank, topology.describe(topology.rank))
    flight.install(recorder)
    stragglers.reset()
    if trace.current() is None:
        trace.start_from_env(topology.rank, topology.describe(topology.rank))
    runtime = Runtime(topology, None, timeout_s, heartbeat, owns_group, store=store,
                      responder=flight.Responder.start_for(recorder))
    runtime.hosts_store = (owns_group and topology.rank == 0 and not heartbeat_prefix
                           and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true")
    # Host groups where hosts run several workers: Gloo's two-level all-reduce (NCCL's own collectives
    # already follow the machine's topology).
    two_level = TwoLevel.create(topology, gloo_timeout(timeout_s)) \
        if backend == "gloo" and topology.shares_hosts else None
    runtime.transport = Transport(topology, worker_group, device, runtime.explain, timeout_s, runtime.overdue,
                                  two_level=two_level)
    _RUNTIME = runtime
    global _AT_EXIT, _PREVIOUS_HOOK
    if not _AT_EXIT:
        atexit.register(_shutdown_at_exit)
        _AT_EXIT = True
        if sys.excepthook is not _explain_uncaught:
            _PREVIOUS_HOOK, sys.excepthook = sys.excepthook, _explain_uncaught
    return runtime


def leave() -> Runtime | None:
    """Leave the process group without closing anything registered (an elastic job regrouping:
    the strategies were closed by their owner). Returns the runtime that was left."""
    global _RUNTIME
    runtime, _RUNTIME = _RUNTIME, None
    if runtime is None:
        return None
    teardown.stop_threads(runtime)
    if runtime.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    if runtime.transport is not None and runtime.transport.failure is not None:
        teardown.left_behind(runtime.timeout_s)
    teardown.collect_before_forks(runtime.transport)
    return runtime


def on_stop(stopper) -> None:
    """Register ``stopper`` (see :attr:`Runtime.stoppers`), if a runtime is up."""
    stoppers = getattr(_RUNTIME, "stoppers", None)
    if stoppers is not None:
        stoppers.append(stopper)


def current() -> Runtime:
    """The runtime, initialising it from the environment on first use (or running a deferred join)."""
    global _DEFERRED
    if _RUNTIME is None and _DEFERRED is not None:
        join, _DEFERRED = _DEFERRED, None
        join()
    if _RUNTIME is None:
        init()
    return _RUNTIME


class _PendingTopology:
    """What ``init()`` returns before a deferred join: reading any of it joins first."""

    def __getattr__(self, name):
        return getattr(current().topology, name)

    def __repr__(self) -> str:
        return repr(current().topology)


def is_initialized() -> bool:
    return _RUNTIME is not None


def on_shutdown(closer) -> None:
    """Register a callable run (in reverse order) by :func:`shutdown`, e.g. a strategy's close."""
    current().closers.append(closer)


def forget(closer) -> None:
    """Unregister ``closer`` (already run by its owner): the registry no longer keeps what it
    refers to alive, e.g. a closed strategy with its model and optimizer state."""
    if _RUNTIME is not None:  # during shutdown() there is nothing left to unregister from
        _RUNTIME.closers[:] = [c for c in _RUNTIME.closers if c != closer]


def shutdown() -> None:
    """Close strategies (servers are told to stop), stop the heartbeat, leave the process group.

    Every closer runs even if one raises (the first error is raised at the end), and the heartbeat
    is stopped in any case. After a peer failure the process group is broken: it is not torn down
    (a thread may still be blocked in it), see :func:`gradsync.teardown.exit_after_failure`."""
    global _RUNTIME, _DEFERRED
    _DEFERRED = None  # a standby that ends before it was admitted
    runtime = _RUNTIME
    if runtime is None:
        return
    # The runtime stays current while strategies close: they may still need its timeout and its
    # heartbeat (to name a peer that died). Closers are taken off the list as they run.
    try:
        error = teardown.close(runtime)
    finally:
        _RUNTIME = None
        teardown.stop_threads(runtime)
        trace.save_from_env()
    teardown.leave_group(runtime)
    teardown.collect_before_forks(runtime.transport)
    if error is not None:
        raise error


def _shutdown_at_exit() -> None:
    """``atexit``: :func:`shutdown`, then the exit after a peer failure (:func:`gradsync.teardown.at_exit`)."""
    teardown.at_exit(shutdown)
