"""P3: priority-based parameter propagation (Jayarajan et al., SysML 2019), and its ablation ``ps-sliced``.

A parameter server whose traffic is cut into slices and sent in the order the *next forward pass*
needs it. Backward produces the last layer's gradient first and the first layer's last, while the
next forward needs the first layer first; a FIFO parameter server makes the first layer wait behind
everything else. P3's three parts, each an option here so that a benchmark can show its share:

1. **Slicing** (:mod:`gradsync.strategies.slicing`): parameters laid end to end in forward order and
   cut into slices of ``slice_params`` elements, spread round-robin over the servers.
2. **Priority** (``priority=True``): a slice's priority is its position in the forward pass. Each
   process sends through a :class:`~gradsync.strategies.scheduler.PrioritySender` with at most
   ``credit_mb`` in flight, so a newly ready slice near the input overtakes queued later ones;
   servers answer by the same priority. Every message is keyed ``(step, priority)``: an older
   step's message goes first. Without the step, a worker that finished its backward early pushed
   the next step's first layers ahead of the answers a slower worker still waited for (its last
   layers), which slowed that worker further: on VGG-19 the workers fell into alternating long and
   short steps (docs/bench-priority.md, VGG-19 trace).
3. **Forward overlap** (``overlap=True``): ``optimizer.step()`` returns at once; the next forward
   runs each module as soon as *its* slices have arrived (the ``on_params_needed`` hook point).

The pull rides on the push (:mod:`gradsync.strategies.p3.serving`). Servers are the dedicated
ranks (``gradsync run --servers S``) or, without any, the workers themselves (P3's own set-up: one
server per machine); a co-located server runs on its worker's communication threads. Where hosts
run several workers (on Gloo), each host's first worker sums its host's pushes of a slice and
alone pushes and pulls it, and co-located servers are those leaders: one server per machine again,
and a host's network link carries each slice once each way (:mod:`gradsync.strategies.p3.base`).
``ps-sliced`` (:class:`SlicedParameterServer`) is slicing alone: FIFO order (within a step), no
credit, and ``step()`` waits for every slice (pull after aggregation), like ``ps``.

Must match across ranks: the model and the optimizer's class and hyperparameters. With dedicated
servers the servers' own optimizer is used, so an LR scheduler in the training loop does not reach
it; co-located servers take each step's hyperparameters from their worker's optimizer.
Parameters are current after the next forward has passed them, or after ``optimizer.flush()``.
``compression="topk:ratio=0.01"`` (any codec without a shared seed; ``error_feedback=True`` keeps a
residual per slice) encodes each slice a pusher sends to a server, in the same priority order and
under the same credit, and the server decodes before it adds; each answer carries the slice's
change by the update, encoded with a residual per slice on the server, and workers add it
(:mod:`gradsync.strategies.coded`). Exact with a lossless codec; Gloo only.
Tune ``slice_params`` (P3: 40,000-50,000) and ``credit_mb`` (enough to keep a link busy; too much
and late slices can no longer be overtaken).
"""
from __future__ import annotations

import warnings
from typing import Callable

from gradsync.errors import ConfigError
from gradsync.strategies.p3.base import SlicedServer


class P3(SlicedServer):
    """Sliced, prioritized parameter server with forward overlap (see the module docstring)."""

    name = "p3"
    summary = "P3: slices pushed in forward-pass priority under a credit, next forward starts per layer"
    tune_space = {"credit_mb": [0.5, 1.0, 4.0, 16.0], "slice_params": [12_500, 50_000, 100_000],
                  "overlap": [True, False]}
    """What ``gradsync bench --tune`` searches (gradsync.bench.tune). Forward overlap is a cost where
    communication is already hidden (docs/bench-priority.md, loopback overhead), so it is tuned too."""

    def __new__(cls, slice_params: int = 50_000, credit_mb: float | None = 1.0,
                priority: bool | Callable[[str, int], float] = True, overlap: bool = True,
                elementwise_optimizer: bool | None = None, compression: str | None = None,
                error_feedback: bool = False):
        """``priority=False, overlap=False`` is the older spelling of :class:`SlicedParameterServer`."""
        if cls is P3 and priority is False and overlap is False:
            warnings.warn("P3(priority=False, overlap=False) is SlicedParameterServer (strategy 'ps-sliced'); "
                          "use that class", DeprecationWarning, stacklevel=2)
            return SlicedParameterServer(slice_params, elementwise_optimizer, compression, error_feedback)
        return super().__new__(cls)

    def __init__(self, slice_params: int = 50_000, credit_mb: float | None = 1.0,
                 priority: bool | Callable[[str, int], float] = True, overlap: bool = True,
                 elementwise_optimizer: bool | None = None, compression: str | None = None,
                 error_feedback: bool = False):
        super().__init__(slice_params, elementwise_optimizer, compression, error_feedback)
        if credit_mb is not None and (not isinstance(credit_mb, (int, float)) or not credit_mb > 0):
            raise ConfigError(f"credit_mb must be > 0 (or None: no limit), got {credit_mb!r}")
        if not isinstance(overlap, bool):
            raise ConfigError(f"overlap must be True or False, got {overlap!r}")
        if not (isinstance(priority, bool) or callable(priority)):
            raise ConfigError(f"priority must be True (forward order), False (FIFO) or a function "
                              f"(parameter name, forward position) -> number, got {priority!r}")
        self.credit_mb, self.priority, self.overlap = credit_mb, priority, overlap


class SlicedParameterServer(SlicedServer):
    """P3's slicing alone: slices pushed FIFO (within a step) with no credit, pulled at ``step()``."""

    name = "ps-sliced"
    summary = "P3's slicing alone (FIFO, pull at step): the ablation of p3"
    priority = False
    credit_mb = None
    overlap = False
    tune_space = {"slice_params": [12_500, 50_000, 200_000]}
    """What ``gradsync bench --tune`` searches: the slice size, the one knob this strategy has."""
