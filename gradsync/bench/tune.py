"""``gradsync bench --tune``: search a strategy's knobs on the live cluster before measuring it.

A strategy declares what can be tuned as a class attribute ``tune_space = {option: [values]}``
(``p3``: slice size, credit and forward overlap; ``allreduce-priority``: partition size and credit). The search is
a coordinate descent, one option at a time in the order declared: probe the defaults, then every
other value of the first option, keep the fastest, then the second option from there.
ByteScheduler tuned the same two knobs with Bayesian optimisation over ~15 points of ~100 steps
each; with two knobs of three values, coordinate descent needs five probes (of four, seven);
``p3``'s on/off overlap adds one.

Each probe is a short run of the strategy (a fresh model: slice and partition sizes change the
server-side optimizer state, which cannot be re-cut in place) on every rank of the job, scored by
its median step time (the slowest worker's per step, warm-up dropped). Every rank makes the same
choices: the scores come from rank 0, broadcast to all ranks, servers included.
"""
from __future__ import annotations

import inspect
import statistics
from typing import Callable

import torch


def starting_point(constructor, space: dict[str, list], options: dict) -> dict:
    """``options`` plus the constructor's default for every tuned option not given."""
    defaults = inspect.signature(constructor).parameters
    return {**{k: defaults[k].default for k in space}, **options}


def tune(space: dict[str, list], start: dict, probe: Callable[[dict], float | None],
         share: Callable[[float], float]) -> tuple[dict, list[dict]]:
    """Coordinate descent over ``space`` from ``start``; returns the best options and every probe.

    ``probe(options)`` runs the strategy and returns rank 0's median step time in seconds (``None``
    on ranks that do not time); ``share(seconds)`` makes rank 0's value every rank's.
    """
    best = dict(start)
    probes = [{"options": dict(best), "step_s": share(_time(probe, best))}]
    best_s = probes[0]["step_s"]
    for key, values in space.items():
        around = dict(best)
        for value in values:
            candidate = {**around, key: value}
            if any(p["options"] == candidate for p in probes):
                continue
            seconds = share(_time(probe, candidate))
            probes.append({"options": candidate, "step_s": seconds})
            if seconds < best_s:
                best, best_s = candidate, seconds
    return best, probes


def _time(probe, options) -> float:
    seconds = probe(options)
    return float("nan") if seconds is None else seconds


def median_step(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def broadcaster(transport) -> Callable[[float], float]:
    """Rank 0's number on every rank (servers too)."""
    def share(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=transport.device)
        return float(transport.broadcast(t, src=0, world=True, what="broadcast of a tuning probe"))
    return share
