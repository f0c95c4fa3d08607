"""The straggler verdict as a monitor (:mod:`gradsync.stragglers`): for TensorBoard and policies."""
from __future__ import annotations

from gradsync import flight, stragglers
from gradsync.adapt.monitors.base import Monitor

CAUSES = {"compute": 1.0, "between steps": 2.0, "link": 3.0}


class Stragglers(Monitor):
    """Which worker holds the others back. The verdict is worker 0's (its heartbeat reads every
    worker's pace each second), so the values are worker 0's view on every worker that reads
    them there; elsewhere only this worker's own pace is current.

    Values: ``straggler_rank`` (-1: none), ``straggler_cause`` (0 none, 1 compute, 2 between steps,
    3 link), ``straggler_ratio`` (its time over the others', or the other links' rate over its),
    ``straggler_held_ms`` (what the others wait for it a step), ``slower_rank`` and ``slower_ratio``
    (a worker slower than the others whose extra time hides behind communication,
    :func:`gradsync.stragglers.slower`; -1 and 1 for none), and this worker's ``compute_ms``,
    ``between_ms`` and ``wait_ms`` per step (medians over its last steps, :data:`gradsync.stragglers.WINDOW`).
    """

    def values(self) -> dict[str, float]:
        found = stragglers.latest()
        first = found[0] if found else None
        out = {"straggler_rank": float(first.rank) if first else -1.0,
               "straggler_cause": CAUSES[first.cause] if first else 0.0,
               "straggler_ratio": first.ratio if first else 1.0,
               "straggler_held_ms": first.held_s * 1e3 if first else 0.0}
        hidden = stragglers.latest_hidden()
        out.update(slower_rank=float(hidden[0].rank) if hidden else -1.0, slower_ratio=hidden[0].ratio if hidden else 1.0)
        recorder = flight.current()
        pace = None if recorder is None else recorder.pace.as_dict()
        if pace is not None:
            out.update({f"{k}_ms": pace[k] * 1e3 for k in ("compute", "between", "wait")})
        return out
