"""This machine's host rates, as the validation's matrix keeps them for the machine that recorded it.

Micro-benchmarks of the CPU beside the ranks' work: a lone thread's copy and optimizer-update
rates (:func:`calibrate`), a thread handoff with a core to spare (:func:`measure_handoff`) and with
every core busy (:func:`measure_busy_wake`), and the compressors' cost lines
(:func:`calibrate_codecs`). ``benchmarks/regenerate/simulator_matrix.py`` records them beside the runs;
:mod:`gradsync.simulate.hostmodel` turns them into the host of each run.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from gradsync.bench.workload import OPTIMIZERS
from gradsync.compress import parse_spec
from gradsync.simulate.compressed import codec_cost


def calibrate(numel: int = 1 << 25, repeats: int = 3, *, start_at: float | None = None,
              seconds: float | None = None, handoff_repeats: int = 100) -> dict:
    """This machine's copy and optimizer-update rates (bytes/s, one thread, 128 MB: memory, not cache):
    the median of ``repeats``, or of as many as fit in ``seconds`` each (from the wall-clock time
    ``start_at``, so that processes started apart measure at the same time). The update is the
    benchmark's own optimizer's (``gradsync bench``'s ``sgd``: momentum and weight decay), so that
    the two cannot differ. Also this machine's thread handoff (:func:`measure_handoff`, unless
    ``handoff_repeats`` is 0)."""
    torch.set_num_threads(1)
    src, dst = torch.randn(numel), torch.empty(numel)
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = OPTIMIZERS["sgd"][0]([param], 0.01)
    opt.step()  # the momentum buffer exists from here
    dst.copy_(src)  # and the copy's destination is touched: no page faults while timed

    def rate(fn) -> float:
        times, until = [], None if seconds is None else time.time() + seconds

        def more() -> bool:
            return len(times) < repeats if until is None else not times or time.time() < until

        while more():
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return numel * 4 / statistics.median(times)

    handoff = {"handoff_s": measure_handoff(handoff_repeats)} if handoff_repeats else {}
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    return {"copy_Bps": rate(lambda: dst.copy_(src)), "update_Bps": rate(opt.step), **handoff}


def measure_handoff(repeats: int = 100) -> float:
    """This machine's ``Host.handoff_s``: from one Python thread setting an event to another thread,
    blocked on it, running again, while a third thread keeps running Python (the strategies'
    processes have several threads wanting the interpreter lock); the median of ``repeats``.

    The woken thread and the running one race for the interpreter lock: where the running one wins,
    the woken one waits out the interpreter's switch interval (5 ms) as well. Which wins depends on
    the machine's scheduler, from handoff to handoff and from machine to machine (on one 2-core
    machine half of 100 handoffs took 46-190 us and half 16-29 ms, where others measured 43-107 us
    in nearly all), so the median of all can land in either mode. The idle handoff the model
    charges is the median of the ones that did not wait out the interval (all, where none did not)."""
    latencies = handoff_latencies(repeats)
    won = [t for t in latencies if t < sys.getswitchinterval()]
    return statistics.median(won or latencies)


def measure_busy_wake(repeats: int = 300) -> float:
    """This machine's ``Host.busy_wake_s``: a thread handoff as :func:`measure_handoff` times it,
    while every core is busy (the measuring process's spinning thread and a spinning process on
    each other core), so that the woken thread waits for the scheduler to give it a core; the
    mean of ``repeats`` (milliseconds, where the idle median is microseconds)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range((os.cpu_count() or 1) - 1)]
    try:
        time.sleep(0.5)  # they run by now
        return statistics.fmean(handoff_latencies(repeats))
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def handoff_latencies(repeats: int) -> list[float]:
    """``repeats`` thread handoffs as :func:`measure_handoff` times them, in seconds."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    latencies = []
    try:
        for _ in range(repeats):
            event, woke = threading.Event(), []
            waiter = threading.Thread(target=lambda: (event.wait(), woke.append(time.perf_counter())))
            waiter.start()
            time.sleep(0.001)  # the waiter is blocked by now
            start = time.perf_counter()
            event.set()
            waiter.join()
            latencies.append(woke[0] - start)
    finally:
        stop.set()
        busy.join()
    return latencies


def calibrate_codecs(specs: list[str]) -> dict:
    """This machine's encode/decode cost lines and ratio of each compressor (as the simulator uses
    them): spec -> ``[encode a, encode b, decode a, decode b, ratio]``, the form of :attr:`Host.codecs`."""
    out = {}
    for spec in specs:
        name, options = parse_spec(spec)
        c = codec_cost(name, options, 1.0)
        out[spec] = [c.encode.a, c.encode.b, c.decode.a, c.decode.b, c.ratio]
    return out
