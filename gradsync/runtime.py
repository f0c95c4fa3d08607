"""Process-level state: ``gradsync.init()``, ``gradsync.shutdown()`` and peer-failure diagnosis.

``init`` reads the standard environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) that ``gradsync run``, torchrun, SLURM wrappers and Kubeflow's PyTorchJob all set,
plus ``GRADSYNC_NUM_SERVERS`` (how many of the last ranks are parameter servers) and
``GRADSYNC_TIMEOUT`` (seconds before a stuck operation fails, naming the peer at fault; default 30).
At start-up a rank
waits ``max(GRADSYNC_TIMEOUT, RENDEZVOUS_MIN_S)`` seconds (60 by default) for rank 0's store, then
fails with an error saying so.

Every rank runs a heartbeat thread (:mod:`gradsync.heartbeat`) that bumps a counter in the
rendezvous store once a second. When an operation fails, the rank names the ranks whose counter
stopped: "worker 1 (rank 1) stopped responding" instead of Gloo's "Connection reset by peer".

Why one file of this size: a process's life in gradsync (start, the failure diagnosis, the deadline
of a wait, shutdown and exit after a failure) is one sequence; the heartbeat lives in its own module.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync import flight
from gradsync.heartbeat import Heartbeat, _within
from gradsync import store as stores
from gradsync.errors import ConfigError, GradsyncError, PeerFailureError
from gradsync.topology import Topology
from gradsync.transport import REPORT_S, Transport, gloo_timeout

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
class Runtime:
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

    def explain(self, what: str, exc: BaseException) -> PeerFailureError:
        """Turn a failed communication into an error naming the rank(s) at fault: the ones whose
        heartbeat stopped, else the ones alive but absent from the operation (:meth:`behind`)."""
        me = self.topology.describe(self.topology.rank)
        timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc).lower()
        silent = self.heartbeat.silent_ranks(fresh=not timed_out) if self.heartbeat else []
        if silent:  # a rank that shut down cleanly (no barrier at the end: ps-async) is no fault
            gone = self.heartbeat.left(silent)
            silent = [r for r in silent if r not in gone]
        behind = self.behind() if timed_out and silent == [] else []
        if silent is None:
            self.store_lost = True
            cause = ("rank 0, which hosts the rendezvous store, is unreachable "
                     f"(it has probably exited, crashed or been stopped; or {me}'s own network link is down)")
        elif silent:
            cause = ", ".join(self.topology.describe(r) for r in silent) + " stopped responding"
            if len(silent) >= 2 and len(silent) == self.topology.world_size - 1:
                cause += (f" (every peer fell silent at once: {me}'s own network link or host is the likely "
                          "cause, not the peers)")
        elif behind:
            cause = "; ".join(
                f"{self.topology.describe(r)} is alive but has not reached this operation: it has been in its own "
                f"code (not in a gradsync operation) for {seconds:.1f} s at step {step}" for r, step, seconds in behind)
            cause += (" (a stuck data loader, an evaluation or a checkpoint on one rank only, a deadlock?). "
                      f"Every rank waits for it; the timeout is {self.timeout_s:g} s (raise it with "
                      "gradsync.init(timeout_s=...) or GRADSYNC_TIMEOUT if that rank's work legitimately takes longer)")
        else:
            cause = (f"no peer died; the operation did not complete within {self.timeout_s:g} s. "
                     "Either ranks issued different operations (different models, step counts or "
                     "strategies) or a step takes longer than the timeout (raise it with "
                     "gradsync.init(timeout_s=...) or GRADSYNC_TIMEOUT)")
        error = PeerFailureError(f"{what} failed on {me}: {cause}. Original error: {exc}")
        if self.transport is not None:
            self.transport.failure = error
        recorder = flight.current()
        if recorder is not None:  # for the launcher's cross-rank summary (gradsync.flight)
            recorder.dump(str(error))
        return error

    def behind(self) -> list[tuple[int, int, float]]:
        """The workers alive but absent from synchronization, as their heartbeats last published
        it: ``(rank, step, seconds)`` for each whose training thread has run the script's own code,
        outside every gradsync operation, for at least half the timeout (a rank merely computing a
        step shorter than the timeout is never named). Servers are never behind: they only serve."""
        if self.heartbeat is None:
            return []
        positions = self.heartbeat.positions()
        workers = set(self.topology.worker_ranks)
        return sorted((r, step, seconds) for r, (step, waiting, seconds) in positions.items()
                      if r in workers and not waiting and seconds >= self.timeout_s / 2)

    def overdue(self, what: str, since: float | None = None) -> PeerFailureError | None:
        """The error to end a wait with now, or None to go on waiting.

        A wait ends early when nothing this rank waited on has completed for the timeout (less the
        :data:`~gradsync.transport.REPORT_S` it takes to say so; a send's completion does not count:
        it proves only that the message was buffered) and the heartbeat watch has seen a peer stand
        still (:meth:`Heartbeat.watched_silent`), or the store has stopped answering its beats (its
        host, rank 0, is stopped or cut off, and the watch sees nothing): that peer has been
        unreachable since about the last completion, so the error comes within the timeout of the
        fault even for an operation issued after it (Gloo's own timeout counts from the
        operation's start). A link that comes back within the timeout is survived: operations
        complete meanwhile, or the heartbeat moves.

        ``since``: a training thread that waits on its strategy's communication threads (which
        no Gloo timeout ends: their other traffic, keep-alives included, keeps completing) passes
        when what it waits for last arrived (or its wait began). That wait ends at the timeout
        after it, whatever else completed, naming the ranks that hold it back (:meth:`explain`)."""
        heartbeat, transport = self.heartbeat, self.transport
        if transport is None or transport.failure is not None:
            return None
        now, limit = time.monotonic(), self.timeout_s - REPORT_S
        idle_s = now - transport.progress
        if heartbeat is not None and idle_s >= limit:
            silent = heartbeat.watched_silent()
            silent = [r for r in silent if r not in heartbeat.left(silent)]
            if not silent and heartbeat.store_lost():  # the store's host stopped: the watch sees nothing
                return self.explain(what, TimeoutError(
                    f"nothing completed for {idle_s:.1f} s (the timeout is {self.timeout_s:g} s) while the "
                    "rendezvous store did not answer"))
            if silent:
                who = ", ".join(self.topology.describe(r) for r in silent)
                return self.explain(what, TimeoutError(
                    f"nothing completed for {idle_s:.1f} s (the timeout is {self.timeout_s:g} s) while {who} "
                    "stayed silent"))
        if since is None or now - since < limit:
            return None
        return self.explain(what, TimeoutError(
            f"nothing this wait needs arrived for {now - since:.1f} s (the timeout is {self.timeout_s:g} s)"))


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
_AT_EXIT = False
_PEER_TROUBLE = re.compile(r"gloo|nccl|c10d|connection (reset|closed|refused)|timed out", re.IGNORECASE)


def _explain_uncaught(kind, value, tb) -> None:
    """``sys.excepthook``: a communication failure raised inside PyTorch (DDP's reducer, a user's own
    collective) leaves the script without passing through gradsync; before the traceback, say which
    peer went silent, as gradsync's own operations do."""
    runtime = _RUNTIME
    if (runtime is not None and isinstance(value, RuntimeError) and not isinstance(value, GradsyncError)
            and _PEER_TROUBLE.search(str(value))):
        try:
            explained = runtime.explain("a collective inside PyTorch (DDP's all-reduce, or the script's own)", value)
            print(f"gradsync: {str(explained).split('. Original error')[0]}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - the diagnosis must never hide the original error
            pass
    _PREVIOUS_HOOK(kind, value, tb)
    abandon(value)


def abandon(error: BaseException) -> None:
    """This rank is going down with ``error`` (uncaught in the script): :func:`shutdown` at exit
    then runs no closer (a strategy's flush or goodbye would wait on peers that wait on this rank)
    and, on the rank that serves the store, keeps it up while the others name this rank."""
    runtime = _RUNTIME
    if runtime is not None and not isinstance(error, (KeyboardInterrupt, SystemExit)):
        runtime.abandoned = error


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
    runtime = Runtime(topology, None, timeout_s, heartbeat, owns_group, store=store,
                      responder=flight.Responder.start_for(recorder))
    runtime.hosts_store = (owns_group and topology.rank == 0 and not heartbeat_prefix
                           and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true")
    runtime.transport = Transport(topology, worker_group, device, runtime.explain, timeout_s, runtime.overdue)
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
    _stop_threads(runtime)
    if runtime.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    return runtime


def on_stop(stopper) -> None:
    """Register ``stopper`` (see :attr:`Runtime.stoppers`), if a runtime is up."""
    stoppers = getattr(_RUNTIME, "stoppers", None)
    if stoppers is not None:
        stoppers.append(stopper)


def _stop_threads(runtime: Runtime) -> None:
    stoppers = getattr(runtime, "stoppers", [])
    while stoppers:
        stoppers.pop()()
    if runtime.heartbeat:
        runtime.heartbeat.stop(**({"wait_s": 0.5} if runtime.store_lost else {}))
    if runtime.responder:
        runtime.responder.stop()
    transport = runtime.transport
    if transport is not None and transport.waiter is not None:  # blocked for good after a failure: no wait
        transport.waiter.close(wait_s=0.0 if transport.failure is not None else 1.0)


def _warn_live_threads(store_lost: bool = False) -> None:
    """Say which gradsync thread is still running after shutdown: one blocked in a torch call when
    the interpreter finalizes would abort the process at exit, so this is a bug worth reporting.
    Not the heartbeat's, when the store's host stopped answering: that call never returns."""
    expected = ("gradsync-heartbeat", "gradsync-store-call") if store_lost else ()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("gradsync") and t.name not in expected
             and t.is_alive() and t is not threading.current_thread()]
    if alive:
        import warnings

        warnings.warn(f"gradsync threads still running after shutdown: {', '.join(alive)}; the process may "
                      "abort at exit. Please report this with the strategy used", RuntimeWarning, stacklevel=3)


def current() -> Runtime:
    """The runtime, initialising it from the environment on first use."""
    if _RUNTIME is None:
        init()
    return _RUNTIME


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
    (a thread may still be blocked in it), see :func:`_exit_after_failure`."""
    global _RUNTIME, _FAILED_AT_SHUTDOWN
    runtime = _RUNTIME
    if runtime is None:
        return
    # The runtime stays current while strategies close: they may still need its timeout and its
    # heartbeat (to name a peer that died). Closers are taken off the list as they run.
    error: BaseException | None = None
    abandoned = getattr(runtime, "abandoned", None) is not None
    try:
        while runtime.closers and not abandoned:
            try:
                runtime.closers.pop()()
            except BaseException as exc:  # noqa: BLE001 - the rest must still close; raised below
                error = error or exc
        # A strategy that failed to close (a peer out of step) may leave peers waiting on this rank's
        # goodbye: it leaves as a failed rank does, never waiting on them.
        failed = (abandoned or error is not None
                  or (runtime.transport is not None and runtime.transport.failure is not None))
        if runtime.heartbeat is not None:
            if not runtime.hosts_store:
                if not failed:  # a rank going down with an error is a fault its peers must name
                    runtime.heartbeat.say_left()
            elif failed:
                runtime.heartbeat.wait_for_peers()  # they may still be naming the failed rank: keep the store up
            else:  # ranks still training need the store
                recorder = flight.current()
                with recorder.waiting_for("shutdown (serving the rendezvous store to the ranks still running)") \
                        if recorder is not None else contextlib.nullcontext():
                    runtime.heartbeat.wait_for_leavers()
    finally:
        _RUNTIME = None
        _stop_threads(runtime)
    failed = runtime.transport is not None and runtime.transport.failure is not None
    if runtime.owns_group and dist.is_initialized() and not failed:
        dist.destroy_process_group()
    if not failed:
        _warn_live_threads(runtime.store_lost)
    _FAILED_AT_SHUTDOWN = failed
    if error is not None:
        raise error


_FAILED_AT_SHUTDOWN = False
"""Whether the last :func:`shutdown` found the process group broken by a peer failure."""


def _shutdown_at_exit() -> None:
    """``atexit``: :func:`shutdown`, then :func:`_exit_after_failure`."""
    try:
        shutdown()
    except BaseException as exc:
        # Shown here: atexit would print it only after the interpreter's own exit, which may not come.
        print(f"gradsync: while shutting down: {type(exc).__name__}: {exc}", file=sys.stderr)
        _exit_after_failure()
        raise
    _exit_after_failure()


def _exit_after_failure() -> None:
    """After a peer failure, end the process here rather than let the interpreter finalize while a
    gradsync thread is still blocked in a torch call on the broken group (a receive from a peer
    whose link is down returns only at the operation timeout). Such a thread returning during
    finalization is ended by ``pthread_exit``, which aborts the process (SIGABRT,
    pytorch/pytorch#38228) and hides the job's exit status. The error is already printed: flush
    the standard streams and the logging handlers and exit with status 1."""
    recorder = flight.current()
    if not _FAILED_AT_SHUTDOWN or recorder is None:
        return
    me = threading.get_ident()
    if not any(ident != me for ident in list(recorder.blocked)):
        return
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    os._exit(1)
