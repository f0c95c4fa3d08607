"""Timeline traces in the Chrome trace format (open in https://ui.perfetto.dev or chrome://tracing).

While a :class:`Tracer` is active (:func:`start`), gradsync records, per rank:

- ``compute`` track: each layer's forward and backward (real models: module hooks and gradient-ready
  hooks; emulated models: the emulated accelerator's own timeline), and the user's optimizer step
  wherever the strategy runs it (``optimizer step``; strategies that apply the updates themselves,
  such as ``p3`` and ``allreduce-priority`` with an optimizer per slice or partition, run none);
- ``comm`` tracks: every communication operation from launch to completion with its bytes, named by
  what it moves (``bucket 3``, ``push``, ``pull``, ``all-reduce`` ...). All-reduces end when Gloo or
  NCCL completes them; point-to-point operations, which offer no completion callback, end when the
  rank's wait for them returned (an upper bound); and, on the compressed strategies'
  communication thread, each ``encode`` and ``decode`` with its raw bytes;
- ``wait`` track: every time the training thread blocked on communication;
- ``server`` track: a server's own work (``hybrid``'s row servers: each table's update, each
  answer to a pull).

In a user's own job (``gradsync run --trace FILE``, or ``GRADSYNC_TRACE=FILE`` under another
launcher: :func:`start_from_env` at ``gradsync.init()``) the tracer also records each optimizer step
on the ``step`` track, the model's layers on ``compute`` (:func:`instrument`, hooked by
``distribute``), and the straggler monitor's readings (:mod:`gradsync.stragglers`): each worker's
pace per step as counters, worker 0's verdict as instant events. Each rank writes
``FILE.rank-R.json`` at ``gradsync.shutdown()``; ``gradsync run`` merges them into ``FILE``
(elsewhere: ``gradsync trace merge FILE.rank-*.json -o FILE``).

Each rank writes its own file (``Tracer.save``); :func:`merge` joins them into one trace with one
process per rank. Timestamps are ``time.perf_counter()`` (CLOCK_MONOTONIC): comparable across the
processes of one machine, which is where emulated clusters live; each file also carries its
clock's offset to the wall clock, and :func:`merge` puts files from several machines on the wall
clock (as close as the machines' clocks agree). When no tracer is active every hook is a single
``is None`` test.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time

_active: "Tracer | None" = None
TRACKS = {"step": 0, "compute": 1, "wait": 2, "comm": 3, "server": 4}
"""Thread ids of the tracks (Chrome traces want numbers; names go in metadata)."""
ENV = "GRADSYNC_TRACE"
"""A user's job traces itself when set: each rank writes ``$GRADSYNC_TRACE.rank-R.json``."""


class Tracer:
    """Collects one rank's events in memory; ``save`` writes them as a Chrome trace."""

    def __init__(self, rank: int, label: str, path: str | None = None):
        self.rank, self.label = rank, label
        self.path = path  # where a user's job saves at shutdown (GRADSYNC_TRACE); None: the bench saves
        self.events: list[dict] = []
        self._lock = threading.Lock()  # completion callbacks arrive on communication threads
        self._ids = iter(range(1, 1 << 62))

    def span(self, name: str, track: str, start: float, end: float, **args) -> None:
        """A complete event on ``track`` (times in ``perf_counter`` seconds)."""
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": TRACKS[track], "ts": start * 1e6,
                 "dur": max(end - start, 0.0) * 1e6, "args": args}
        with self._lock:
            self.events.append(event)

    def begin_async(self, name: str, track: str, **args) -> tuple[int, str, str, dict]:
        """Start an operation that may overlap others on its track; pass the result to :meth:`end_async`."""
        with self._lock:
            op = next(self._ids)
        return op, name, track, {"start": time.perf_counter(), **args}

    def end_async(self, token, end: float | None = None) -> None:
        op, name, track, args = token
        start = args.pop("start")
        end = time.perf_counter() if end is None else end
        common = {"name": name, "cat": track, "id": op, "pid": self.rank, "tid": TRACKS[track]}
        with self._lock:
            self.events.append({**common, "ph": "b", "ts": start * 1e6, "args": args})
            self.events.append({**common, "ph": "e", "ts": end * 1e6})

    def counter(self, name: str, at: float, **values: float) -> None:
        """Counter values at ``at`` (Chrome's ``C`` event: a chart per name, one series per value)."""
        with self._lock:
            self.events.append({"name": name, "ph": "C", "pid": self.rank, "ts": at * 1e6, "args": values})

    def instant(self, name: str, track: str, at: float, **args) -> None:
        with self._lock:
            self.events.append({"name": name, "ph": "i", "s": "p", "pid": self.rank, "tid": TRACKS[track],
                                "ts": at * 1e6, "args": args})

    @contextlib.contextmanager
    def waiting(self, what: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(what, "wait", start, time.perf_counter())

    def save(self, path: str) -> None:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": self.label}},
                {"name": "clock_offset", "ph": "M", "pid": self.rank,  # wall clock - perf_counter, seconds
                 "args": {"seconds": time.time() - time.perf_counter()}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
                 for name, tid in TRACKS.items()]
        with self._lock:
            events = meta + self.events
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def start(rank: int, label: str) -> Tracer:
    global _active
    _active = Tracer(rank, label)
    return _active


def start_from_env(rank: int, label: str) -> Tracer | None:
    """Start tracing this rank when ``GRADSYNC_TRACE`` is set (at ``gradsync.init()``)."""
    path = os.environ.get(ENV)
    if not path:
        return None
    tracer = start(rank, label)
    tracer.path = f"{path}.rank-{rank}.json"
    return tracer


def save_from_env() -> str | None:
    """At ``gradsync.shutdown()``: stop a tracer :func:`start_from_env` started and write its file."""
    tracer = current()
    if tracer is None or tracer.path is None:
        return None
    stop()
    with contextlib.suppress(OSError):
        tracer.save(tracer.path)
        return tracer.path
    return None


def stop() -> Tracer | None:
    global _active
    tracer, _active = _active, None
    return tracer


def current() -> Tracer | None:
    return _active


def instrument(model) -> list:
    """Hooks recording a real model's layers: forward spans (module hooks) and backward spans (from one
    gradient becoming ready to the next, named by its parameter). Returns the handles to remove."""
    last = {"t": 0.0}

    def before(module, args):
        module._gradsync_trace_start = time.perf_counter()

    def after(name):
        def hook(module, args, output):
            tracer = current()
            last["t"] = time.perf_counter()
            if tracer is not None:
                tracer.span(f"forward {name or '(root)'}", "compute", module._gradsync_trace_start, last["t"])
        return hook

    def ready(name):
        def hook(param):
            tracer, now = current(), time.perf_counter()
            if tracer is not None:
                tracer.span(f"backward {name}", "compute", last["t"], now)
            last["t"] = now
        return hook

    handles = []
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None or module is model:
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after(name))]
    handles += [p.register_post_accumulate_grad_hook(ready(n)) for n, p in model.named_parameters() if p.requires_grad]
    return handles


def merge(paths: list[str], out: str) -> int:
    """Join per-rank traces into one file; returns the number of events. Files from several
    machines (their clock offsets differ by more than a millisecond) are put on the wall clock."""
    loaded = []
    for path in paths:
        events = load_events(path)
        offset = next((e["args"]["seconds"] for e in events if e.get("name") == "clock_offset"), None)
        loaded.append((events, offset))
    offsets = [o for _, o in loaded if o is not None]
    events = []
    for part, offset in loaded:
        if offsets and offset is not None and max(offsets) - min(offsets) > 1e-3:
            shift = (offset - offsets[0]) * 1e6
            part = [{**e, "ts": e["ts"] + shift} if "ts" in e else e for e in part]
        events += part
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)


def render(path: str, png: str, *, steps: tuple[str, int, int] | None = None, title: str = "") -> None:
    """Draw a merged trace as a picture (rows: each rank's step, compute, comm and wait tracks).

    ``steps=(label, first, last)`` shows only the time of those step spans (e.g. ``("allreduce", 3, 4)``).
    A stand-in for a Perfetto screenshot where no browser is at hand; the trace file has more detail.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = _spans(load_events(path))
    window = _window(spans, steps)
    ranks = sorted({s[0] for s in spans})
    colors = {"forward": "tab:blue", "backward": "tab:green", "optimizer": "tab:brown", "step": "tab:gray",
              "wait": "tab:red", "comm": "tab:orange"}
    fig, ax = plt.subplots(figsize=(12, 1.1 + 1.0 * len(ranks)))
    names = {v: k for k, v in TRACKS.items()}
    for pid, tid, start, end, name in spans:
        if end < window[0] or start > window[1]:
            continue
        kind = name.split()[0] if names[tid] == "compute" else names[tid]
        y = ranks.index(pid) * 5 + tid
        ax.barh(y, (end - start) / 1e3, left=(start - window[0]) / 1e3, height=0.8,
                color=colors.get(kind, "tab:purple"), edgecolor="black", linewidth=0.2, alpha=0.85 if kind == "comm" else 1)
    ax.set_xlim(0, (window[1] - window[0]) / 1e3)
    ax.set_yticks([r * 5 + t for r in range(len(ranks)) for t in TRACKS.values()])
    ax.set_yticklabels([f"rank {rank} {track}" for rank in ranks for track in TRACKS], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=7, loc="upper right", ncol=5)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def render_arrivals(path: str, png: str, *, steps: tuple[str, int, int], rank: int = 0, title: str = "") -> None:
    """P3's picture: when each parameter slice came back to ``rank``, against its forward and backward.

    One dot per pulled slice (``p3``/``ps-sliced`` traces), at its arrival time and at the height of
    its priority, i.e. its position in the forward pass (input first, at the top); the rank's forward
    and backward layers are shaded behind. With priority, the top of the model arrives first and the
    next forward starts while the bottom is still in flight.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = load_events(path)
    window = _window(_spans(events), steps)
    pulls = [(e["ts"] + e["dur"], e["args"]["priority"]) for e in events
             if e["ph"] == "X" and e["pid"] == rank and e["name"].startswith("pull slice")
             and window[0] <= e["ts"] + e["dur"] <= window[1]]
    if not pulls:
        raise ValueError(f"no pulled slices on rank {rank} in steps {steps[1]}..{steps[2]}: trace p3 or ps-sliced")
    top = max(p for _, p in pulls) + 1
    shade = {"forward": "tab:blue", "backward": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 4))
    for pid, tid, start, end, name in _spans(events):
        kind = name.split()[0]
        if pid == rank and tid == TRACKS["compute"] and kind in shade and end > window[0] and start < window[1]:
            ax.axvspan((start - window[0]) / 1e3, (end - window[0]) / 1e3, color=shade[kind], alpha=0.25, linewidth=0)
    ax.scatter([(t - window[0]) / 1e3 for t, _ in pulls], [p for _, p in pulls], s=6, color="tab:orange", zorder=3)
    ax.set_xlim(0, (window[1] - window[0]) / 1e3)
    ax.set_ylim(top, -1)
    ax.set_xlabel("ms")
    ax.set_ylabel("slice (forward order: input at the top)")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.25) for c in shade.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="tab:orange"))
    labels = [f"rank {rank} forward", f"rank {rank} backward", "slice pulled (arrived)"]
    ax.legend(handles, labels, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def load_events(path: str) -> list[dict]:
    """The events of a trace file as ``--trace`` writes it (Chrome's format: an object with
    ``traceEvents``, or the bare list); a clear error naming the file where it is not one."""
    from gradsync.errors import ConfigError

    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable trace file ({exc}); make one with gradsync bench --trace "
                          "or gradsync run --trace") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise ConfigError(f"{path}: a JSON file without trace events; make one with gradsync bench --trace "
                          "or gradsync run --trace")
    return events


def _spans(events: list[dict]) -> list[tuple]:
    """(pid, tid, start, end, name) of every complete span and every closed async pair."""
    spans, opened = [], {}
    for e in events:
        if e["ph"] == "X":
            spans.append((e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e["ph"] == "b":
            opened[(e["pid"], e["id"])] = e
        elif e["ph"] == "e" and (e["pid"], e["id"]) in opened:
            b = opened.pop((e["pid"], e["id"]))
            spans.append((e["pid"], b["tid"], b["ts"], e["ts"], b["name"]))
    return spans


def _window(spans, steps) -> tuple[float, float]:
    if steps is None:
        return min(s[2] for s in spans), max(s[3] for s in spans)
    label, first, last = steps
    chosen = [s for s in spans if s[1] == TRACKS["step"] and s[4].split(" step ")[0] == label
              and first <= int(s[4].rsplit(" ", 1)[1]) <= last]
    if not chosen:
        raise ValueError(f"no steps {first}..{last} of {label!r} in the trace")
    return min(s[2] for s in chosen), max(s[3] for s in chosen)


# -- gradsync trace merge --------------------------------------------------------------------------
def add_parser(subparsers) -> None:
    command = subparsers.add_parser("trace", help="join the per-rank traces of a job (GRADSYNC_TRACE) into one")
    actions = command.add_subparsers(dest="action", required=True, metavar="ACTION")
    join = actions.add_parser("merge", help="join FILE.rank-R.json files into one Chrome trace")
    join.add_argument("parts", nargs="+", metavar="PART", help="the ranks' files (FILE.rank-*.json)")
    join.add_argument("-o", "--out", required=True, metavar="FILE", help="the merged trace")
    join.set_defaults(handler=merge_main)


def merge_main(args) -> int:
    import sys

    from gradsync.errors import ConfigError

    try:
        count = merge(sorted(args.parts), args.out)
    except ConfigError as exc:
        print(f"gradsync trace merge: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {count} events from {len(args.parts)} rank(s); open in https://ui.perfetto.dev or chrome://tracing")
    return 0
