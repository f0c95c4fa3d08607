"""The relations that call a result reproduced, and their verdicts on a run's records.

A relation is a TOML table of a spec (``[[relation]]``), in one of three forms::

    says = "p3 >= 1.2 x ps at 10 Gbit/s"            # what it checks, in words (required)
    left = {strategy = "p3", net = "10gbit"}        # a selector: records whose fields match
    op = ">="                                       # >=, <=, >, <
    right = {strategy = "ps", net = "10gbit"}       # another selector ...
    factor = 1.2                                    # ... times this (default 1)
    reduce = "max"                                  # how several right-hand records combine (max, min, mean)
    metric = "samples_per_s"                        # default: the spec's metric

    value = 5.0                                     # instead of right: a constant

    kind = "correct"                                # instead: every selected record matched the reference
    select = {strategy = ["ps", "allreduce", "hybrid"]}

A selector's value may be a list (any of them). A relation whose selector matches no record fails:
a check with nothing to check is not a pass.
"""
from __future__ import annotations

import operator
import statistics

from gradsync.errors import ConfigError

OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
REDUCE = {"max": max, "min": min, "mean": statistics.fmean}


def check_relation(relation: dict, where: str) -> None:
    """Refuse a malformed relation (``where`` names it in the error)."""
    if not isinstance(relation.get("says"), str):
        raise ConfigError(f"{where}: needs says = \"what it checks\"")
    if relation.get("kind") == "correct":
        if not isinstance(relation.get("select"), dict):
            raise ConfigError(f"{where}: kind = \"correct\" needs a select table")
        return
    if "kind" in relation:
        raise ConfigError(f"{where}: unknown kind {relation['kind']!r} (only \"correct\")")
    if not isinstance(relation.get("left"), dict):
        raise ConfigError(f"{where}: needs a left selector table")
    if relation.get("op") not in OPS:
        raise ConfigError(f"{where}: op must be one of {', '.join(OPS)}")
    if ("right" in relation) == ("value" in relation):
        raise ConfigError(f"{where}: needs exactly one of right (a selector) and value (a number)")
    if relation.get("reduce", "max") not in REDUCE:
        raise ConfigError(f"{where}: reduce must be one of {', '.join(REDUCE)}")


def field(record: dict, key: str):
    """``key`` of a record: the cell's value for a key the cell fixes (as the spec wrote it),
    else the record's own field."""
    cell = record.get("cell", {})
    if key in cell and not isinstance(cell[key], list):
        return cell[key]
    return record.get(key)


def _same(a, b) -> bool:
    return a == b or str(a) == str(b)


def select(records: list[dict], selector: dict) -> list[dict]:
    def matches(record):
        for key, want in selector.items():
            got = field(record, key)
            options = want if isinstance(want, list) else [want]
            if not any(_same(got, w) for w in options):
                return False
        return True
    return [r for r in records if matches(r)]


def describe(selector: dict) -> str:
    return ", ".join(f"{k}={' or '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in selector.items())


def measure(records: list[dict], selector: dict, metric: str, reduce: str = "max") -> float | None:
    """The metric over the selected records (several: combined by ``reduce``); None if none has it."""
    values = [field(r, metric) for r in select(records, selector)]
    values = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return REDUCE[reduce](values) if values else None


def evaluate(relation: dict, records: list[dict], metric: str) -> dict:
    """``{"says", "ok", "measured"}``: ``ok`` True or False, ``measured`` the values that decided it."""
    says = relation["says"]
    if relation.get("kind") == "correct":
        chosen = select(records, relation["select"])
        if not chosen:
            return {"says": says, "ok": False, "measured": f"no record matches {describe(relation['select'])}"}
        wrong = [f"{r.get('strategy')} ({_where(r)})" for r in chosen if r.get("correct") is not True]
        return {"says": says, "ok": not wrong,
                "measured": (f"{len(chosen)} of {len(chosen)} equal the reference" if not wrong
                             else "not equal to the reference or not checked: " + "; ".join(wrong))}
    metric = relation.get("metric", metric)
    left = measure(records, relation["left"], metric)
    if left is None:
        return {"says": says, "ok": False, "measured": f"no {metric} for {describe(relation['left'])}"}
    if "value" in relation:
        right, shown = float(relation["value"]), f"{relation['value']:g}"
    else:
        right = measure(records, relation["right"], metric, relation.get("reduce", "max"))
        if right is None:
            return {"says": says, "ok": False, "measured": f"no {metric} for {describe(relation['right'])}"}
        factor = float(relation.get("factor", 1.0))
        shown = f"{factor:g} x {right:.4g}" if factor != 1 else f"{right:.4g}"
        right *= factor
    ok = OPS[relation["op"]](left, right)
    ratio = f" (ratio {left / right * float(relation.get('factor', 1.0)):.4g})" if "right" in relation and right else ""
    return {"says": says, "ok": bool(ok), "measured": f"{left:.4g} {relation['op']} {shown}{ratio}"}


def _where(record: dict) -> str:
    cell = record.get("cell", {})
    return ", ".join(f"{k}={v}" for k, v in cell.items() if not isinstance(v, list) and k in ("model", "net", "np"))


def published_ours(entry: dict, records: list[dict], metric: str) -> float | None:
    """Our value for a ``[[published]]`` entry: the metric where its selector points, or the ratio
    of two selections (``of = [left, right]``, each a selector merged into ``where``)."""
    where = entry.get("where", {})
    metric = entry.get("metric", metric)
    if "of" in entry:
        left, right = ({**where, **part} for part in entry["of"])
        a, b = measure(records, left, metric), measure(records, right, metric)
        return None if a is None or not b else a / b
    return measure(records, where, metric)
