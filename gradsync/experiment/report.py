"""Reports of stored runs: per experiment a chart (PNG) with the paper's values beside ours, a
markdown page (published values, ours, each relation's verdict, the commands and the environment),
and with ``--all`` an index page of every experiment."""
from __future__ import annotations

import os
import statistics
import time

from gradsync.experiment import relations as rel
from gradsync.experiment.cells import shown
from gradsync.experiment.spec import Spec


def verdicts(spec: Spec, records: list[dict]) -> list[dict]:
    return [rel.evaluate(r, records, spec.metric) for r in spec.relations]


def _label(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def chart(spec: Spec, records: list[dict], path: str, subtitle: str) -> None:
    """One panel per ``panel`` value: the metric against ``x``, one line per ``series`` value; and a
    panel of the paper's values beside ours where the spec lists published values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradsync.bench.report import COLOURS, LINES

    panel_keys = [k for k in (spec.panel,) if k] + _other_keys(spec)  # a panel for each of their values

    def panel_of(record) -> str | None:
        return ", ".join(_label(rel.field(record, k)) for k in panel_keys) if panel_keys else None

    panels = list(dict.fromkeys(panel_of(r) for r in records))
    xs = list(dict.fromkeys(_label(rel.field(r, spec.x)) for r in records)) if spec.x else [""]
    series = list(dict.fromkeys(_label(rel.field(r, spec.series)) for r in records)) if spec.series else [spec.metric]
    published = [p for p in spec.published if "value" in p]
    ncols = len(panels) + (1 if published else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        chosen = [r for r in records if panel_of(r) == panel]
        for i, name in enumerate(series):
            ys = []
            for x in xs:
                match = [r for r in chosen if (not spec.x or _label(rel.field(r, spec.x)) == x)
                         and (not spec.series or _label(rel.field(r, spec.series)) == name)]
                values = [rel.field(r, spec.metric) for r in match]
                values = [v for v in values if isinstance(v, (int, float))]
                ys.append(statistics.median(values) if values else float("nan"))  # repeated runs: their median
            base = name.split("+")[0].split("@")[0]
            colour = COLOURS.get(base, f"C{i % 10}")
            ax.plot(range(len(xs)), ys, marker="o", color=colour, linestyle=LINES[i % len(LINES)], label=name)
        ax.set_xticks(range(len(xs)), xs, rotation=30 if max(map(len, xs)) > 6 else 0)
        ax.set_xlabel(spec.x or "")
        ax.set_ylabel(spec.metric)
        ax.set_ylim(bottom=0)
        ax.set_title(str(panel) if panel is not None else spec.title, fontsize=9)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if published:
        ax = axes[0][-1]
        names = [p.get("label", rel.describe(p.get("where", {}))) for p in published]
        paper = [float(p["value"]) for p in published]
        ours = [rel.published_ours(p, records, spec.metric) for p in published]
        pos = range(len(published))
        ax.barh([y + 0.2 for y in pos], paper, height=0.4, color="0.75", label="paper")
        ax.barh([y - 0.2 for y in pos], [o if o is not None else 0 for o in ours], height=0.4, color="tab:blue",
                label="gradsync")
        ax.set_yticks(list(pos), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_title("paper and gradsync", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"{spec.title}\n{subtitle}", fontsize=9)
    if spec.series and handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(labels), 6),
                   fontsize=8, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def curves(spec: Spec, records: list[dict], path: str, subtitle: str) -> bool:
    """Records that carry a ``curve`` (``[[tokens, seconds, value], ...]``, as a training script
    prints it): the value against tokens and against seconds, one row of two panels per ``panel``
    value, one line per cell (``series`` and ``x``). False, and nothing drawn, where none has one."""
    drawn = [r for r in records if isinstance(r.get("curve"), list) and r["curve"]]
    if not drawn:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(_label(rel.field(r, spec.panel)) for r in drawn)) if spec.panel else [None]
    fig, axes = plt.subplots(len(panels), 2, figsize=(10, 3.8 * len(panels)), squeeze=False)
    for row, panel in zip(axes, panels):
        chosen = [r for r in drawn if panel is None or _label(rel.field(r, spec.panel)) == panel]
        for i, r in enumerate(chosen):
            label = " ".join(f"{k}={_label(rel.field(r, k))}" if k != spec.series else _label(rel.field(r, k))
                             for k in (spec.series, spec.x) if k)
            points = r["curve"]
            for ax, column in zip(row, (0, 1)):
                ax.plot([p[column] for p in points], [p[2] for p in points], color=f"C{i % 10}",
                        linestyle=("-", "--", ":", "-.")[i // 10 % 4], label=label)
        for ax, what in zip(row, ("tokens", "seconds")):
            ax.set_xlabel(what)
            ax.set_ylabel(spec.metric)
            ax.set_title(f"{panel}: {spec.metric} against {what}" if panel is not None else what, fontsize=9)
            ax.grid(alpha=0.3)
        row[1].legend(fontsize=6, loc="upper right")
    fig.suptitle(f"{spec.title}\n{subtitle}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def table(spec: Spec, records: list[dict], metric: str | None = None) -> str:
    """The metric (or ``metric``) by ``x`` (rows) and ``series`` (columns), within each panel, a row
    for each value of the other varied keys too; a place that several records share (a varied
    ``run``: the cells repeated, or a script's repeated records) shows their median, range and count."""
    metric = metric or spec.metric
    rows_key = [k for k in (spec.panel, spec.x) if k and k != spec.series]  # x = series: one row per panel
    rows_key += _other_keys(spec)
    series = list(dict.fromkeys(_label(rel.field(r, spec.series)) for r in records)) if spec.series else [spec.metric]
    groups: dict[tuple, dict[str, list]] = {}  # rows in the order the records came
    for r in records:
        key = tuple(_label(rel.field(r, k)) for k in rows_key)
        name = _label(rel.field(r, spec.series)) if spec.series else spec.metric
        groups.setdefault(key, {}).setdefault(name, []).append(rel.field(r, metric))
    head = "| " + " | ".join(rows_key + series) + " |"
    lines = [head, "|" + "---|" * (len(rows_key) + len(series))]
    for key, values in groups.items():
        lines.append("| " + " | ".join(list(key) + [_cell(values.get(s)) for s in series]) + " |")
    return "\n".join(lines)


def _other_keys(spec: Spec) -> list[str]:
    """The varied keys the chart's axes, series and panel leave out (but ``run``, which repeats
    cells): each of their values gets panels and rows of its own, never merged with another's."""
    return [k for k in spec.vary if k not in (spec.series, spec.x, spec.panel, "run")]


def _cell(values: list | None) -> str:
    """One value as it is; several numbers as ``median (min-max, n)``."""
    if not values:
        return "-"
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(values) == 1 or len(numbers) != len(values):
        return _fmt(values[-1])
    return f"{_fmt(float(statistics.median(numbers)))} ({_fmt(float(min(numbers)))}-{_fmt(float(max(numbers)))}, {len(numbers)})"


def page(spec: Spec, run: dict, cells: list[dict], records: list[dict], previous: dict | None,
         previous_records: list[dict], image: str | None, curve_image: str | None = None) -> str:
    env = run["environment"]
    checked = verdicts(spec, records)
    before = {v["says"]: v for v in verdicts(spec, previous_records)} if previous else {}
    passed = sum(v["ok"] for v in checked)
    out = [f"## {spec.title}", "",
           f"{spec.paper}, {spec.figure}. Run {run['id']} on target `{run['target']}`, scale `{run['scale']}`"
           + (f", overrides {', '.join(f'{k}={v}' for k, v in run['overrides'].items())}" if run["overrides"] else "")
           + f": **{passed} of {len(checked)} relations hold**.", ""]
    if spec.notes:
        out += [spec.notes.strip(), ""]
    if image:
        out += [f"![{spec.name}]({image})", ""]
    if spec.published:
        out += ["| published | setup | paper | gradsync |", "|---|---|---|---|"]
        for p in spec.published:
            ours = rel.published_ours(p, records, spec.metric)
            label = p.get("label", rel.describe(p.get("where", {})))
            out.append(f"| {label} | {p.get('setup', '')} | {_fmt(p.get('value'))} | {_fmt(ours)} |")
        out.append("")
    if checked:
        out += ["| relation | measured | verdict |" + (" previous run |" if previous else ""),
                "|---|---|---|" + ("---|" if previous else "")]
        for v in checked:
            row = f"| {v['says']} | {v['measured']} | {'holds' if v['ok'] else '**fails**'} |"
            if previous:
                old = before.get(v["says"])
                row += f" {old['measured'] + (' (holds)' if old['ok'] else ' (fails)') if old else '-'} |"
            out.append(row)
        out.append("")
    if records and spec.x:
        out += [table(spec, records), ""]
        for metric in spec.also:
            out += [f"`{metric}`:", "", table(spec, records, metric), ""]
    if curve_image:
        out += [f"![{spec.name}: {spec.metric} against tokens and time]({curve_image})", ""]
    failed = [c for c in cells if c["status"] != "done"]
    out += [f"Commands ({len(cells)} cells, {sum(c['seconds'] for c in cells) / 60:.1f} min):", "", "```sh"]
    out += [shown(c["command"]) + ("   # FAILED" if c["status"] != "done" else "") for c in cells]
    out += ["```", ""]
    for c in failed:
        out += [f"Failed cell {c['cell']}: {c['message'][:400]}", ""]
    out += [f"Environment: gradsync {env.get('gradsync')} ({env.get('commit') or 'no git checkout'}), torch "
            f"{env.get('torch')}, Python {env.get('python')}, {env.get('cpu')} ({env.get('cores')} cores), "
            f"GPU {env.get('gpu') or 'none'}, {env.get('time')}.", ""]
    if env.get("netcheck"):
        out += ["Links as measured before the run:", "", "```", env["netcheck"], "```", ""]
    if previous:
        out += [f"Previous run of this experiment: {previous['id']} ({previous['environment'].get('time')}, "
                f"target `{previous['target']}`).", ""]
    return "\n".join(out)


def index(entries: list[tuple[Spec, dict | None, int, int]]) -> str:
    """The results page: each experiment's last run and how many of its relations hold."""
    out = ["# Results", "",
           "Generated by `gradsync experiment report --all` from the runs in the results store; each section "
           "below gives the commands and the environment that produced it. How the measurements are made, "
           "and what limits them on this kind of machine: [methods](../methods.md).", "",
           "| experiment | paper | target | relations holding |", "|---|---|---|---|"]
    for spec, run, passed, total in entries:
        where = f"[{spec.name}](#{_anchor(spec.title)})" if run else spec.name
        out.append(f"| {where} | {spec.figure} | {run['target'] if run else 'not run'} | "
                   f"{f'{passed} of {total}' if run else '-'} |")
    out += ["", f"_Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}._", ""]
    return "\n".join(out)


def _anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -")
    return keep.replace(" ", "-")
