"""``gradsync experiment`` and ``gradsync machine``: published results as commands.

    gradsync experiment list                         the experiments, with their last stored run
    gradsync experiment show NAME [--target T]       what it varies, the paper's values, the relations, the commands
    gradsync experiment run NAME|--all [--target local|emulated|sim|MACHINE] [--scale default|paper] [--set K=V]
    gradsync experiment report NAME|--all [--out DIR]    charts and a markdown page per experiment
    gradsync experiment validate NAME|--all          check the relations; exit status 1 names each that fails
    gradsync machine add NAME --hosts hosts.json     register a cluster;  gradsync machine list

Runs are kept in the results store (gradsync.experiment.store; ``--store FILE``). A run that is
interrupted (Ctrl-C, a crash) resumes cell by cell when the same command runs again (``--fresh``
starts over). Each experiment's default scale finishes on a 2-core machine in 15 minutes or less,
except those of hosts-two-level and the stragglers family (20-235 minutes: docs/experiments.md says
which takes how long).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from gradsync.argtypes import output_dir
from gradsync.errors import ConfigError


class Terminated(KeyboardInterrupt):
    """SIGTERM during ``gradsync experiment run``: the running cell is ended and the run kept, as
    Ctrl-C does (exit status 143)."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("experiment", help="run, keep, report and check the published experiments",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("list", help="the experiments, with their last stored run").add_argument(
        "--store", help="results store (default: $GRADSYNC_STORE or the user's data directory)")
    show = sub.add_parser("show", help="an experiment: what it varies, the paper's values, relations, commands")
    show.add_argument("name", help="an experiment (gradsync experiment list)")
    show.add_argument("--target", default="emulated", help="whose commands to show (default emulated)")
    show.add_argument("--scale", default="default", help="default or paper")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key of the spec")
    for action, text in (("run", "run experiments and keep their records"),
                         ("report", "write charts and markdown from stored runs"),
                         ("validate", "check the relations of stored runs (exit status 1 if any fails)")):
        a = sub.add_parser(action, help=text, description=text)
        a.add_argument("names", nargs="*", metavar="NAME", help="experiments (or --all)")
        a.add_argument("--all", action="store_true", help="every experiment")
        a.add_argument("--store", help="results store (default: $GRADSYNC_STORE or the user's data directory)")
        a.add_argument("--target", default=None if action != "run" else "emulated",
                       help="local, emulated, sim or a registered machine" + (" (default emulated)" if action == "run"
                                                                             else " (default: the latest run of any)"))
        if action == "run":
            a.add_argument("--scale", default="default", help="default (this machine) or paper (the paper's shape)")
            a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="override a key of the spec (a varied key takes a comma-separated list)")
            a.add_argument("--fresh", action="store_true", help="start a new run instead of resuming an unfinished one")
        if action == "report":
            a.add_argument("--out", default="experiment-report", type=output_dir, help="folder for the pages and charts")
    p.set_defaults(handler=main)
    m = subparsers.add_parser("machine", help="register clusters for gradsync experiment --target",
                              description="Register a cluster (a JSON hosts file) as a target for experiments.")
    msub = m.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = msub.add_parser("add", help="register NAME from a hosts file")
    add.add_argument("name", help="the machine's name")
    add.add_argument("--hosts", required=True, help='JSON: {"hosts": [{"host": "node1", "slots": 2}, ...]}')
    add.add_argument("--no-check", action="store_true", help="do not check that every host answers")
    msub.add_parser("list", help="the registered machines")
    m.set_defaults(handler=machine_main)


def _overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _specs(args) -> list:
    from gradsync.experiment import spec

    if args.all and args.names:
        raise ConfigError("name experiments or pass --all, not both")
    names = spec.names() if args.all else args.names
    if not names:
        raise ConfigError("name an experiment (gradsync experiment list) or pass --all")
    return [spec.load(n) for n in names]


def main(args) -> int:
    try:
        return {"list": _list, "show": _show, "run": _run, "report": _report, "validate": _validate}[args.action](args)
    except ConfigError as exc:
        print(f"gradsync experiment: {exc}", file=sys.stderr)
        return 2


def _list(args) -> int:
    from gradsync.experiment import spec as specs
    from gradsync.experiment.store import open_stores

    stores = open_stores(args.store)
    for name in specs.names():
        s = specs.load(name)
        vary, settings = s.scaled("default", {})
        store, last = next(((st, r) for st in stores if (r := st.latest(name, done=False)) is not None), (None, None))
        state = "never run" if last is None else f"last run {last['id']}: {last['status']}, target {last['target']}"
        if store is not None and store.readonly:
            state += " (shipped with gradsync)"
        print(f"{name:<24} {s.figure:<28} {len(s.cells(vary, settings)):>3} cells  {state}\n    {s.title}")
    return 0


def _show(args) -> int:
    from gradsync.experiment import cells, spec as specs

    s = specs.load(args.name)
    overrides = _overrides(args.set)
    vary, settings = s.scaled(args.scale, overrides)
    print(f"{s.name}: {s.title}\n  {s.paper}, {s.figure}\n  runner {s.runner}, measures {s.metric}")
    if s.notes:
        print("  " + s.notes.strip().replace("\n", "\n  "))
    print("  varies: " + "; ".join(f"{k} = {', '.join(map(str, v))}" for k, v in vary.items()))
    print("  fixed:  " + "; ".join(f"{k} = {v}" for k, v in settings.items()))
    if s.paper_scale:
        print("  paper scale: " + "; ".join(f"{k} = {v}" for k, v in s.paper_scale.items()))
    for adjust in s.adjust:
        where = ", ".join(f"{k} = {v}" for k, v in adjust["where"].items())
        print(f"  where {where}: " + "; ".join(f"{k} = {v}" for k, v in adjust.items() if k != "where"))
    for p in s.published:
        print(f"  published: {p.get('label', '')} = {p.get('value')} ({p.get('setup', '')})")
    for r in s.relations:
        print(f"  relation: {r['says']}")
    print(f"  commands (--target {args.target}):")
    for cell in s.cells(vary, settings, overrides):
        try:
            print("    " + cells.shown(cells.command(s, cell, _target(args.target), "OUT.json")))
        except ConfigError as exc:
            print(f"    (cannot run here: {exc})")
    return 0


def _target(name: str) -> str:
    """``local``, ``emulated``, ``sim``, or a registered machine's name (``local`` where it is just this host)."""
    from gradsync.experiment import cells
    from gradsync.launch import machines

    if name in cells.TARGETS:
        return name
    try:
        machine = machines.get(name)
    except ConfigError as exc:
        raise ConfigError(f"unknown target {name!r}: neither local, emulated, sim nor a registered machine; {exc}") from None
    return "local" if machines.is_this_host(machine) else name


def _run(args) -> int:
    from gradsync.experiment import cells as runner
    from gradsync.experiment.store import Store

    specs = _specs(args)
    target = _target(args.target)
    overrides = _overrides(args.set)
    unused = sorted(k for k in overrides if not any(k in s.keys() for s in specs))
    if len(specs) > 1 and unused:
        raise ConfigError(f"no experiment has the key(s) {', '.join(unused)}")
    plans = []
    for s in specs:  # every command is built before anything runs: bad input stops here
        try:
            mine = {k: v for k, v in overrides.items() if len(specs) == 1 or k in s.keys()}
            vary, settings = s.scaled(args.scale, mine)
            todo = s.cells(vary, settings, mine)
            for cell in todo:
                runner.command(s, cell, target, "OUT.json")
        except ConfigError as exc:
            if not args.all:
                raise
            print(f"gradsync experiment: skipping {s.name}: {exc}", file=sys.stderr)
            continue
        plans.append((s, todo))
    store = Store(args.store)
    previous = signal.signal(signal.SIGTERM, _terminate)  # kill, timeout, a batch system's cancel: as Ctrl-C
    try:
        return _run_plans(args, plans, store, target, overrides)
    finally:
        signal.signal(signal.SIGTERM, previous)  # the caller's again once the cells are over


def _run_plans(args, plans, store, target: str, overrides: dict) -> int:
    """Run each experiment's cells not yet in ``store``, then print its relations' verdicts."""
    from gradsync.experiment import cells as runner
    from gradsync.experiment.report import verdicts
    from gradsync.experiment.store import cell_key
    print(f"gradsync experiment: results store {store.path}", flush=True)
    environment = None
    failures = 0
    for s, todo in plans:
        mine = {k: v for k, v in overrides.items() if k in s.keys()}
        run_id = None if args.fresh else store.unfinished_run(s.name, args.target, args.scale, mine)
        if run_id is None:
            environment = environment or runner.environment(target)
            run_id = store.start_run(s.name, args.target, args.scale, mine, {**environment, "target": args.target})
        done = store.done_keys(run_id)
        print(f"\n== {s.name}: {s.title} (run {run_id}, {len(todo)} cells"
              + (f", {len(done)} already done" if done else "") + ")", flush=True)
        ok = True
        for i, cell in enumerate(todo, 1):
            if cell_key(cell) in done:
                continue
            what = ", ".join(f"{k}={v}" for k, v in cell.items() if not isinstance(v, list) and k in s.vary)
            print(f"-- cell {i}/{len(todo)}{': ' + what if what else ''}", flush=True)
            started = time.monotonic()
            try:
                command, records, message = runner.run_cell(s, cell, target)
            except KeyboardInterrupt as exc:  # the cell's processes are ended (runner.run_cell)
                store.finish_run(run_id, "interrupted")
                print(f"\ninterrupted: run {run_id} keeps its {len(store.done_keys(run_id))} finished cells; "
                      "the same command resumes it", file=sys.stderr)
                return 143 if isinstance(exc, Terminated) else 130
            store.save_cell(run_id, cell, command, records, time.monotonic() - started,
                            "done" if not message else "failed", message)
            if message:
                ok = False
                print(f"   cell failed: {message[-300:]}", file=sys.stderr)
        store.finish_run(run_id, "done" if ok else "failed")
        failures += not ok
        records = store.records(run_id)
        previous = [r for r in store.runs(s.name) if r["status"] in ("done", "failed") and r["id"] != run_id]
        before = {v["says"]: v for v in verdicts(s, store.records(previous[-1]["id"]))} if previous else {}
        for v in verdicts(s, records):
            old = before.get(v["says"])
            print(f"   {'holds' if v['ok'] else 'FAILS'}: {v['says']}: {v['measured']}"
                  + (f" (run {previous[-1]['id']}: {old['measured']})" if old else ""), flush=True)
    return 1 if failures else 0


def _runs_for(stores, s, target: str | None):
    """The first store with a finished run of ``s`` (every cell tried, some may have failed): that
    store, its latest such run and the one before; ``(stores[0], None, None)`` when none has one."""
    for store in stores:
        runs = [r for r in store.runs(s.name) if r["status"] in ("done", "failed")
                and (target is None or r["target"] == target)]
        if runs:
            return store, runs[-1], (runs[-2] if len(runs) > 1 else None)
    return stores[0], None, None


def _report(args) -> int:
    from gradsync.experiment import report
    from gradsync.experiment.store import open_stores

    stores = open_stores(args.store)
    os.makedirs(args.out, exist_ok=True)
    entries, sections = [], []
    for s in _specs(args):
        store, run, previous = _runs_for(stores, s, args.target)
        if run is None:
            print(f"{s.name}: no finished run in {store.path}", file=sys.stderr)
            entries.append((s, None, 0, 0))
            continue
        records = store.records(run["id"])
        image = f"{s.name}.png"
        subtitle = f"run {run['id']}, target {run['target']}, {run['environment'].get('time')}"
        report.chart(s, records, os.path.join(args.out, image), subtitle)
        curve_image = f"{s.name}-curves.png"
        if not report.curves(s, records, os.path.join(args.out, curve_image), subtitle):
            curve_image = None
        text = report.page(s, run, store.cells(run["id"]), records, previous,
                           store.records(previous["id"]) if previous else [], image, curve_image)
        with open(os.path.join(args.out, f"{s.name}.md"), "w") as f:
            f.write(text + "\n")
        checked = report.verdicts(s, records)
        entries.append((s, run, sum(v["ok"] for v in checked), len(checked)))
        sections.append(text)
        print(f"{s.name}: {os.path.join(args.out, s.name + '.md')}, {os.path.join(args.out, image)}")
    if args.all:
        path = os.path.join(args.out, "results.md")
        with open(path, "w") as f:
            f.write(report.index(entries) + "\n" + "\n".join(sections) + "\n")
        print(f"results page: {path}")
    return 0


def _validate(args) -> int:
    from gradsync.experiment.report import verdicts
    from gradsync.experiment.store import open_stores

    stores = open_stores(args.store)
    failing = 0
    for s in _specs(args):
        store, run, _ = _runs_for(stores, s, args.target)
        if run is None:
            print(f"{s.name}: FAILS: no finished run in {store.path} (gradsync experiment run {s.name})")
            failing += 1
            continue
        for v in verdicts(s, store.records(run["id"])):
            failing += not v["ok"]
            print(f"{s.name}: {'holds' if v['ok'] else 'FAILS'}: {v['says']}: {v['measured']}")
    print(f"\n{failing} relation(s) fail" if failing else "\nevery relation holds")
    return 1 if failing else 0


def machine_main(args) -> int:
    from gradsync.launch import machines

    try:
        if args.action == "add":
            machine = machines.add(args.name, args.hosts, check=not args.no_check)
            print(f"machine {args.name}: {len(machine['hosts'])} hosts, {sum(h['slots'] for h in machine['hosts'])} "
                  f"slots ({machines.registry_path()})")
        else:
            for name, machine in sorted(machines.load_all().items()):
                hosts = ", ".join(f"{h['host']}:{h['slots']}" for h in machine["hosts"])
                print(f"{name:<16} {hosts}")
        return 0
    except ConfigError as exc:
        print(f"gradsync machine: {exc}", file=sys.stderr)
        return 2
