"""The one multi-rank test helper: run a function on N ranks over Gloo and collect the results.

Each rank is a fresh process (``forkserver``, preloaded with torch and ``torch._dynamo`` so a rank
starts in a fraction of a second) that joins the job through the real ``gradsync.init()`` path:
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` on a free loopback port. The first rank to fail stops the others
and its traceback becomes the test failure; a job that outlives ``timeout`` is killed and reported,
never left hanging.
"""
from __future__ import annotations

import copy
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

DEVICE = os.environ.get("GRADSYNC_TEST_DEVICE", "cpu")
"""Where the parity and loop tests put their models: ``cpu``, or ``cuda`` on a GPU machine (ranks
there run NCCL, one per GPU, or share the GPUs over Gloo with ``GRADSYNC_BACKEND=gloo``)."""

_CTX = mp.get_context("forkserver")
# torch.optim imports torch._dynamo on the first optimizer a process makes (1.2 s here): imported
# once in the server, every rank inherits it.
_CTX.set_forkserver_preload(["torch", "torch._dynamo", "gradsync"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, servers, port, env, args, results):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "GRADSYNC_NUM_SERVERS": str(servers), **env})
    import torch
    import gradsync
    import gradsync.runtime

    torch.set_num_threads(1)
    # Tensors in ``args`` arrive in shared memory, one storage for the parent and every rank: a
    # rank's in-place update (an optimizer state loaded from a checkpoint) would reach the others.
    args = copy.deepcopy(args)
    try:
        gradsync.init()
        value = fn(*args)
        gradsync.shutdown()
        buffer = io.BytesIO()  # tensors by value: a shared-memory handle dies with this process
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - every failure, SystemExit included, goes to the parent
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()  # the report reaches the parent now, even if the clean-up below blocks
        try:  # what a script's exit does: rank 0 keeps the store up while the others name the failed rank
            gradsync.runtime.abandon(exc)
            gradsync.shutdown()
        except BaseException:  # noqa: BLE001 - already failed; the report above is what counts
            pass
        os._exit(1)


def _launch(fn, world_size, args, servers, env):
    port, results = free_port(), _CTX.Queue()
    # ``env``: the same variables for every rank, or a list with each rank's own
    envs = env if isinstance(env, list) else [env or {}] * world_size
    procs = [_CTX.Process(target=_child, args=(fn, r, world_size, servers, port, envs[r], args, results),
                          daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, results


def _collect(results, procs, timeout: float, stop_on_error: bool,
             wait_for=None) -> dict[int, tuple[str, object]]:
    """Results by rank until every rank of ``wait_for`` (default: all) reported or exited, the
    first error (if ``stop_on_error``) or the deadline. A rank that exited without reporting
    (``os._exit``, a signal) counts as an error at once instead of running into the deadline."""
    out: dict[int, tuple[str, object]] = {}
    wanted = set(range(len(procs)) if wait_for is None else wait_for)
    deadline = time.monotonic() + timeout
    while not wanted <= set(out):
        # Read exit codes before polling: a rank flushes its report before it exits (see _child),
        # so a rank that had exited and whose report is not in an empty queue sent none.
        exited = {r: p.exitcode for r, p in enumerate(procs) if r not in out and p.exitcode is not None}
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            for rank, code in exited.items():
                out[rank] = ("error", f"rank {rank} exited with code {code} without reporting a result")
                if stop_on_error:
                    raise AssertionError(out[rank][1]) from None
            if time.monotonic() < deadline:
                continue
            if stop_on_error:
                missing = sorted(wanted - set(out))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:g} s") from None
            break
        out[rank] = (status, value)
        if status == "error" and stop_on_error:
            raise AssertionError(f"rank {rank} failed:\n{value}")
    return out


def _reap(procs, grace: float) -> None:
    for p in procs:
        p.join(timeout=grace)
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(fn, world_size: int, *args, servers: int = 0, timeout: float = 120.0,
              env: dict[str, str] | None = None) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks (the last ``servers`` are servers); return results by rank."""
    procs, results = _launch(fn, world_size, args, servers, env)
    ok = False
    try:
        out = _collect(results, procs, timeout, stop_on_error=True)
        ok = True
    finally:
        _reap(procs, grace=5.0 if ok else 0.1)
    import torch

    return [torch.load(io.BytesIO(out[r][1]), weights_only=False) for r in range(world_size)]


def run_ranks_expect_failure(fn, world_size: int, *args, servers: int = 0, timeout: float = 120.0,
                             env: dict[str, str] | None = None, wait_for=None) -> dict[int, str]:
    """Run ``fn`` expecting failures; return ``{rank: traceback}`` of every rank that failed in time
    (for a rank that exited without a report, a line saying so). ``wait_for``: wait only for these
    ranks (default: all), e.g. to leave a deliberately hung rank behind; it is then killed."""
    procs, results = _launch(fn, world_size, args, servers, env)
    try:
        out = _collect(results, procs, timeout, stop_on_error=False, wait_for=wait_for)
    finally:
        _reap(procs, grace=0.5)
    return {rank: value for rank, (status, value) in out.items() if status == "error"}


FORK_PROBES = """
import gc
import os


def collect_garbage(worker_id):
    gc.collect()  # a DataLoader worker's first collection: whatever its parent left in cycles


def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read())
        except OSError:  # a thread that ended meanwhile (ENOENT, or ESRCH while its entry goes)
            pass
    return sum(name.startswith("pt_gloo") for name in names)
"""
"""The head of a script run by ``gradsync run`` that forks DataLoader workers: ``collect_garbage``
(a ``worker_init_fn`` that collects first thing, as a child's collection may at any time) and
``gloo_threads`` (this process's Gloo threads, from /proc/self/task)."""
