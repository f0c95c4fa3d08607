"""An experiment spec: one published result as data (a TOML file in ``gradsync/experiment/specs``).

A spec names the paper and figure, what is varied and what is fixed, how each cell is run (the
``runner``), what is measured, the paper's published values with their setup, and the relations
that must hold to call the result reproduced. ``gradsync experiment show NAME`` prints one; adding
an experiment is adding one file. The fields::

    name, title, paper, figure       what it reproduces (name = the file's stem)
    runner                           bench | codecs | script (see gradsync.experiment.cells)
    metric                           the record field the figure plots (e.g. samples_per_s)
    also                             more record fields, each tabled like the metric (e.g. bytes_sent)
    x, series, panel                 the chart: x axis, one line per series value, one panel per panel value
    [vary]                           lists, crossed into cells (bench: "strategy" runs side by side in each;
                                     "run" = [1, 2, ...] repeats every cell, and tables give the median)
    [settings]                       fixed values; ``--set KEY=VALUE`` overrides a setting or a varied key
    [paper_scale]                    the paper's cluster shape, replacing vary/settings keys (``--scale paper``)
    [[adjust]]                       settings for some cells only: where = {varied key = value}, then keys
                                     (e.g. a model's own compute profile)
    [[exclude]]                      cells not run: where = {varied key = value} (a combination of the
                                     varied keys that measures nothing the others do not)
    [[published]]                    the paper's values: where (a selector), value, of (ratio: [left, right]), setup
    [[relation]]                     the checks (gradsync.experiment.relations)
    [script]                         runner = "script": command (with {out} and {KEY} placeholders), records
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

from gradsync.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SPEC_DIR = os.path.join(os.path.dirname(__file__), "specs")
RUNNERS = ("bench", "codecs", "script")
BENCH_KEYS = {"model", "strategy", "np", "net", "batch_size", "steps", "warmup", "rounds", "compute", "dilation",
              "check_steps", "servers", "compression", "monitors", "optimizer", "lr", "threads", "delay", "set",
              "ranks_per_host", "server_hosts", "slow"}
CODECS_KEYS = {"compressor", "size", "repeats", "threads"}
SIDE_BY_SIDE = {"bench": "strategy", "codecs": "compressor", "script": None}
"""The varied key whose values one run measures together (interleaved, so drift hits all alike)."""


@dataclass
class Spec:
    name: str
    title: str
    paper: str
    figure: str
    runner: str
    metric: str
    x: str | None
    series: str | None
    panel: str | None
    vary: dict[str, list]
    settings: dict[str, object]
    paper_scale: dict[str, object]
    published: list[dict]
    relations: list[dict]
    script: dict = field(default_factory=dict)
    notes: str = ""
    path: str = ""
    adjust: list[dict] = field(default_factory=list)
    exclude: list[dict] = field(default_factory=list)
    also: list[str] = field(default_factory=list)

    def keys(self) -> set[str]:
        """Every key a cell may carry: the varied and the fixed ones."""
        return set(self.vary) | set(self.settings) | set(self.paper_scale)

    def scaled(self, scale: str, overrides: dict[str, str]) -> tuple[dict[str, list], dict[str, object]]:
        """``(vary, settings)`` at ``scale`` ("default" or "paper") with ``--set`` overrides applied.

        An override of a varied key takes a comma-separated list; of a setting, one value. A key the
        spec does not have is an error naming the keys it has."""
        vary, settings = dict(self.vary), dict(self.settings)
        if scale == "paper":
            if not self.paper_scale:
                raise ConfigError(f"experiment {self.name} has no paper scale ([paper_scale] in {self.path})")
            for key, value in self.paper_scale.items():
                (vary if isinstance(value, list) else settings)[key] = value
                (settings if isinstance(value, list) else vary).pop(key, None)
        elif scale != "default":
            raise ConfigError(f"unknown scale {scale!r}: default or paper")
        for key, raw in overrides.items():
            if key not in vary and key not in settings:
                raise ConfigError(f"experiment {self.name} has no key {key!r}; its keys: "
                                  f"{', '.join(sorted(set(vary) | set(settings)))}")
            if key in vary:
                vary[key] = [_value(v) for v in _listed(key, raw)]
            else:
                settings[key] = _value(raw)
        return vary, settings

    def cells(self, vary: dict[str, list], settings: dict[str, object], overridden=()) -> list[dict]:
        """The runs: every combination of the varied keys except the side-by-side one, each with
        the settings and that key's full list (e.g. every strategy, measured together).

        ``[[adjust]]`` entries set keys for the cells they select, except the ``overridden`` keys:
        what the user ``--set`` holds for every cell."""
        together = SIDE_BY_SIDE[self.runner]
        crossed = [k for k in vary if k != together]
        out = []
        for combo in itertools.product(*(vary[k] for k in crossed)):
            cell = {**settings, **dict(zip(crossed, combo))}
            if any(all(cell.get(k) in (v if isinstance(v, list) else [v]) for k, v in ex["where"].items())
                   for ex in self.exclude):
                continue
            for adjust in self.adjust:
                if all(cell.get(k) in (v if isinstance(v, list) else [v]) for k, v in adjust["where"].items()):
                    cell.update({k: v for k, v in adjust.items() if k != "where" and k not in overridden})
            if together in vary:
                cell[together] = list(vary[together])
            out.append(cell)
        return out


def _listed(key: str, raw: str) -> list[str]:
    """A varied key's ``--set`` list; for ``net``, each ``rankN=RATE`` joins every rate, as bench's
    ``--net 1gbit,10gbit,rank3=250mbit`` does (two cells, rank 3's host at 250 Mbit/s in both)."""
    items = [v.strip() for v in raw.split(",") if v.strip()]
    if key != "net":
        return items
    rates, ranks = [v for v in items if "=" not in v], [v for v in items if "=" in v]
    return [",".join([rate, *ranks]) for rate in rates] or items


def _value(text: str):
    """A --set value as TOML would read it: an int, a float, true/false, else the string."""
    text = text.strip()
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(SPEC_DIR) if f.endswith(".toml"))


def load(name: str) -> Spec:
    """The spec called ``name`` (a shipped one), or the spec in the file ``name`` (a path)."""
    path = name if name.endswith(".toml") and os.path.exists(name) else os.path.join(SPEC_DIR, f"{name}.toml")
    if not os.path.exists(path):
        raise ConfigError(f"unknown experiment {name!r}; the experiments: {', '.join(names())}")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse(raw, path)


def parse(raw: dict, path: str = "<spec>") -> Spec:
    """Check a spec's fields and build it; every problem is an error naming the file and the field."""
    def need(key, kind=str):
        if key not in raw:
            raise ConfigError(f"{path}: missing field {key!r}")
        if not isinstance(raw[key], kind):
            raise ConfigError(f"{path}: field {key!r} must be a {kind.__name__}")
        return raw[key]

    known = {"name", "title", "paper", "figure", "runner", "metric", "x", "series", "panel", "vary", "settings",
             "paper_scale", "published", "relation", "script", "notes", "adjust", "exclude", "also"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown field(s) {', '.join(unknown)}")
    runner = need("runner")
    if runner not in RUNNERS:
        raise ConfigError(f"{path}: runner {runner!r} is none of {', '.join(RUNNERS)}")
    vary = raw.get("vary", {})
    for key, values in vary.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: vary.{key} must be a non-empty list")
    settings = raw.get("settings", {})
    paper_scale = raw.get("paper_scale", {})
    allowed = {"bench": BENCH_KEYS, "codecs": CODECS_KEYS}.get(runner)
    if allowed is not None:
        bad = sorted((set(vary) | set(settings) | set(paper_scale)) - allowed)
        if bad:
            raise ConfigError(f"{path}: key(s) {', '.join(bad)} mean nothing to the {runner} runner; "
                              f"it takes {', '.join(sorted(allowed))}")
    adjust = raw.get("adjust", [])
    for i, entry in enumerate(adjust):
        where = entry.get("where") if isinstance(entry, dict) else None
        if not isinstance(where, dict) or not where:
            raise ConfigError(f"{path}: adjust {i + 1} needs where = {{varied key = value}}")
        if set(where) - set(vary) - {SIDE_BY_SIDE.get(runner)}:
            raise ConfigError(f"{path}: adjust {i + 1} selects on {', '.join(sorted(set(where) - set(vary)))}, "
                              f"which is not varied (varied: {', '.join(sorted(vary))})")
        if SIDE_BY_SIDE.get(runner) in where:
            raise ConfigError(f"{path}: adjust {i + 1} selects on {SIDE_BY_SIDE[runner]!r}, which one run measures "
                              "together: a setting cannot differ within it")
        keys = set(entry) - {"where"}
        if not keys:
            raise ConfigError(f"{path}: adjust {i + 1} sets nothing")
        if allowed is not None and keys - allowed:
            raise ConfigError(f"{path}: adjust {i + 1}: key(s) {', '.join(sorted(keys - allowed))} mean nothing to "
                              f"the {runner} runner")
    exclude = raw.get("exclude", [])
    for i, entry in enumerate(exclude):
        where = entry.get("where") if isinstance(entry, dict) else None
        if not isinstance(where, dict) or not where or set(entry) != {"where"}:
            raise ConfigError(f"{path}: exclude {i + 1} needs where = {{varied key = value}} and nothing else")
        if set(where) - set(vary) or SIDE_BY_SIDE.get(runner) in where:
            raise ConfigError(f"{path}: exclude {i + 1} selects on {', '.join(sorted(where))}: it takes the varied keys "
                              f"other than {SIDE_BY_SIDE.get(runner)!r} ({', '.join(sorted(vary))})")
    script = raw.get("script", {})
    if runner == "script" and not ("command" in script and "records" in script):
        raise ConfigError(f"{path}: a script experiment needs [script] command and records")
    name = need("name")
    stem = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".toml") and stem != name:
        raise ConfigError(f"{path}: name {name!r} differs from the file's name {stem!r}")
    spec = Spec(name=name, title=need("title"), paper=need("paper"), figure=need("figure"), runner=runner,
                metric=need("metric"), x=raw.get("x"), series=raw.get("series"), panel=raw.get("panel"),
                vary=vary, settings=settings, paper_scale=paper_scale, published=raw.get("published", []),
                relations=raw.get("relation", []), script=script, notes=raw.get("notes", ""), path=path,
                adjust=adjust, exclude=exclude, also=raw.get("also", []))
    if not isinstance(spec.also, list) or not all(isinstance(k, str) for k in spec.also):
        raise ConfigError(f"{path}: also must be a list of record fields")
    for key in (spec.x, spec.series, spec.panel):  # a script's records bring fields of their own
        if key is not None and key not in spec.keys() and runner != "script" and key != SIDE_BY_SIDE[runner]:
            raise ConfigError(f"{path}: chart key {key!r} is neither varied nor set")
    from gradsync.experiment.relations import check_relation

    for i, relation in enumerate(spec.relations):
        check_relation(relation, f"{path}: relation {i + 1}")
    return spec
