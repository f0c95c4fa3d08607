"""gradsync experiment: the spec format, the results store, overrides, resume and the validator.

The experiments here run a small script (no torch) so that the machinery is tested in seconds;
the shipped specs are checked for form, and their commands for every target are built."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import types

import pytest

from gradsync.errors import ConfigError
from gradsync.experiment import cells, relations, spec as specs
from gradsync.experiment.store import SCHEMA_VERSION, Store

GRADSYNC = [sys.executable, "-m", "gradsync.cli"]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    speed, out, log = float(sys.argv[1]), sys.argv[2], sys.argv[3]
    with open(log, "a") as f:
        f.write(f"{speed}\\n")
    with open(log + ".pids", "a") as f:
        f.write(f"{os.getpid()}\\n")
    fail = os.environ.get("FAIL_SPEED")
    if fail is not None and float(fail) == speed:
        sys.exit("told to fail")
    time.sleep(float(os.environ.get("CELL_SLEEP", "0")))
    with open(out, "w") as f:
        json.dump({"rows": [{"kind": "fast", "rate": speed * 2}, {"kind": "slow", "rate": speed}]}, f)
    print("[worker 0] " + json.dumps({"kind": "printed", "rate": speed}))  # as gradsync run prefixes it
""")


def write_spec(tmp_path, relations_toml: str = "", speeds=(1, 2, 3)) -> str:
    script = tmp_path / "cell.py"
    script.write_text(SCRIPT)
    path = tmp_path / "toy.toml"
    path.write_text(textwrap.dedent(f"""
        name = "toy"
        title = "A toy experiment"
        paper = "Nobody, A toy (2026)"
        figure = "Fig. 1"
        runner = "script"
        metric = "rate"
        x = "speed"
        series = "kind"

        [vary]
        speed = {list(speeds)}

        [settings]
        log = "{tmp_path / 'calls.log'}"

        [script]
        command = ["{{python}}", "{script}", "{{speed}}", "{{out}}", "{{log}}"]
        records = "rows"

        [[published]]
        label = "fast / slow"
        where = {{speed = 2}}
        of = [{{kind = "fast"}}, {{kind = "slow"}}]
        value = 2.0
    """) + relations_toml)
    return str(path)


def run(args, store, **env):
    """``gradsync experiment ARGS --store STORE`` in this process (its cells still run as processes),
    with ``env`` set meanwhile: ``(returncode, stdout, stderr)`` as from ``subprocess.run``."""
    from gradsync.cli import main

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["experiment", *args, "--store", str(store)])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def fast_over_slow(factor: float) -> str:
    """A relation: the fast rows' rate at speed 3 is at least ``factor`` times the slow rows' (it is 2x)."""
    return f"""
[[relation]]
says = "fast >= {factor:g} x slow at speed 3"
left = {{kind = "fast", speed = 3}}
op = ">="
right = {{kind = "slow", speed = 3}}
factor = {factor}
"""


HOLDS, FAILS = fast_over_slow(1.9), fast_over_slow(3)


def test_shipped_specs_parse_and_build_commands_for_every_target():
    assert len(specs.names()) >= 9
    for name in specs.names():
        s = specs.load(name)
        vary, settings = s.scaled("default", {})
        assert s.cells(vary, settings), name
        assert s.relations, f"{name} states no relation to check"
        for target in cells.TARGETS:
            for cell in s.cells(vary, settings):
                try:
                    command = cells.command(s, cell, target, "out.json")
                except ConfigError as exc:  # a target the experiment cannot use says which it can
                    assert "--target" in str(exc), exc
                    continue
                assert command[: len(cells.GRADSYNC)] == cells.GRADSYNC or command[0] == sys.executable


def test_the_p3_spec_becomes_bench_and_simulate_commands():
    s = specs.load("p3-bandwidth")
    vary, settings = s.scaled("default", {"net": "4gbit", "steps": "4"})
    todo = s.cells(vary, settings)
    assert len(todo) == len(vary["model"]) and all(c["strategy"] == ["ps", "p3"] for c in todo)
    bench = cells.command(s, todo[0], "emulated", "o.json")
    text = cells.shown(bench)
    assert text.startswith("gradsync bench --json o.json --strategies ps,p3 --model resnet50 --np 2 --net 4gbit")
    assert "--steps 4" in text and "--dilation auto:500mbit" in text
    sim = cells.shown(cells.command(s, todo[0], "sim", "o.json"))
    assert sim.startswith("gradsync simulate --strategies ps,p3 --json o.json --model resnet50") and "--steps" not in sim
    with pytest.raises(ConfigError, match="varies the link rate"):
        cells.command(s, todo[0], "local", "o.json")
    paper_vary, paper_settings = s.scaled("paper", {})
    assert paper_settings["np"] == 4 and len(paper_vary["net"]) == 9


def test_a_script_argument_written_with_a_star_becomes_the_cells_flags():
    s = specs.load("elastic-standby")
    vary, settings = s.scaled("default", {})
    todo = {c["hosts"]: c for c in s.cells(vary, settings)}
    two = cells.command(s, todo["two"], "emulated", "o.json")
    at = two.index("--elastic")
    assert two[at:at + 9] == ["--elastic", "--net", "10gbit", "--ranks-per-host", "2", "-np", "4", "--min-np", "2"]
    one = cells.command(s, todo["one"], "emulated", "o.json")
    assert "--net" not in one and one[one.index("--elastic") + 1:][:2] == ["-np", "1"]
    assert one[one.index("--schedule") + 1] == "3:2,6:4,9:2,12:1" and one[-2:] == ["--out", "o.json"]
    with pytest.raises(ConfigError, match="launch = '-np \"1' does not split into arguments"):
        cells.command(s, {**todo["one"], "launch": '-np "1'}, "emulated", "o.json")


def test_the_results_table_gives_each_varied_key_its_rows_and_the_median_of_repeated_runs():
    from gradsync.experiment import report

    s = specs.load("hosts-two-level")  # x = series = strategy, panel = net, and model varied too
    records = [{"cell": {"model": m, "net": "1gbit", "strategy": "p3"}, "strategy": "p3", "samples_per_s": v}
               for m, v in (("resnet50", 140.0), ("vgg19", 25.0))]
    assert report.table(s, records).splitlines()[2:] == ["| 1gbit | resnet50 | 140 |", "| 1gbit | vgg19 | 25 |"]
    s = specs.load("elastic-standby")  # run = [1, 2, 3]: the same cell three times, records of each
    records = [{"cell": {"hosts": "one", "run": run}, "from": 4, "to": 2, "seconds": v}
               for run, v in ((1, 0.05), (2, 0.04), (3, 0.3))]
    assert report.table(s, records).splitlines()[2:] == ["| one | 2 | 0.05 (0.04-0.3, 3) |"]


def test_bad_specs_and_overrides_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match="unknown experiment 'nope'"):
        specs.load("nope")
    good = specs.load(write_spec(tmp_path))
    with pytest.raises(ConfigError, match="has no key 'batch'; its keys: log, speed"):
        good.scaled("default", {"batch": "3"})
    with pytest.raises(ConfigError, match="has no paper scale"):
        good.scaled("paper", {})
    vary, _ = good.scaled("default", {"speed": "5,6"})
    assert vary["speed"] == [5, 6]
    base = {"name": "x", "title": "t", "paper": "p", "figure": "f", "metric": "m"}
    with pytest.raises(ConfigError, match="runner 'magic' is none of"):
        specs.parse({**base, "runner": "magic"})
    with pytest.raises(ConfigError, match="batch mean nothing to the bench runner"):
        specs.parse({**base, "runner": "bench", "settings": {"batch": 3}})
    with pytest.raises(ConfigError, match="op must be one of"):
        specs.parse({**base, "runner": "bench", "relation": [{"says": "s", "left": {}, "op": "=>", "value": 1}]})
    with pytest.raises(ConfigError, match="exactly one of right"):
        specs.parse({**base, "runner": "bench", "relation": [{"says": "s", "left": {}, "op": ">="}]})
    with pytest.raises(ConfigError, match="unknown field"):
        specs.parse({**base, "runner": "bench", "colour": "red"})
    broken = tmp_path / "broken.toml"
    broken.write_text("name = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        specs.load(str(broken))


def test_adjust_sets_a_setting_for_the_cells_it_selects_and_is_checked():
    base = {"name": "x", "title": "t", "paper": "p", "figure": "f", "metric": "samples_per_s", "runner": "bench",
            "vary": {"model": ["big", "small"], "strategy": ["a", "b"]}, "settings": {"compute": "emulated"}}
    s = specs.parse({**base, "adjust": [{"where": {"model": "big"}, "compute": "emulated:flops:1tflops"}]})
    by_model = {c["model"]: c for c in s.cells(*s.scaled("default", {}))}
    assert by_model["big"]["compute"] == "emulated:flops:1tflops" and by_model["small"]["compute"] == "emulated"
    assert by_model["big"]["strategy"] == ["a", "b"]
    overrides = {"compute": "emulated:flops:2tflops"}  # --set holds for every cell, adjusted or not
    by_model = {c["model"]: c for c in s.cells(*s.scaled("default", overrides), overrides)}
    assert by_model["big"]["compute"] == by_model["small"]["compute"] == "emulated:flops:2tflops"
    for adjust, reason in [({"where": {"np": 2}, "compute": "c"}, "selects on np, which is not varied"),
                           ({"where": {"strategy": "a"}, "compute": "c"}, "which one run measures together"),
                           ({"where": {"model": "big"}}, "sets nothing"),
                           ({"where": {"model": "big"}, "colour": 1}, "colour mean nothing to the bench runner"),
                           ({"compute": "c"}, "needs where")]:
        with pytest.raises(ConfigError, match=reason):
            specs.parse({**base, "adjust": [adjust]})


def test_exclude_drops_the_cells_it_selects_and_is_checked():
    base = {"name": "x", "title": "t", "paper": "p", "figure": "f", "metric": "samples_per_s", "runner": "bench",
            "vary": {"slow": ["none", "1:2"], "net": ["1gbit", "1gbit,rank1=500mbit"], "strategy": ["a"]}}
    s = specs.parse({**base, "exclude": [{"where": {"slow": "1:2", "net": "1gbit,rank1=500mbit"}}]})
    assert sorted((c["slow"], c["net"]) for c in s.cells(*s.scaled("default", {}))) == \
        [("1:2", "1gbit"), ("none", "1gbit"), ("none", "1gbit,rank1=500mbit")]
    for exclude, reason in [({"where": {"np": 2}}, "selects on np"), ({"where": {"strategy": "a"}}, "selects on strategy"),
                            ({"where": {"slow": "none"}, "net": "x"}, "nothing else"), ({}, "needs where")]:
        with pytest.raises(ConfigError, match=reason):
            specs.parse({**base, "exclude": [exclude]})


def test_a_cell_slows_a_rank_and_its_link_and_bench_gets_both():
    base = {"name": "x", "title": "t", "paper": "p", "figure": "f", "metric": "samples_per_s", "runner": "bench",
            "vary": {"slow": ["none", "1:2"], "net": ["1gbit", "1gbit,rank1=250mbit"], "strategy": ["allreduce"]},
            "settings": {"np": 4, "compute": "emulated"}}
    s = specs.parse(base)
    todo = s.cells(*s.scaled("default", {}))
    assert len(todo) == 4
    slowed = next(c for c in todo if c["slow"] == "1:2" and "rank1" in c["net"])
    text = cells.shown(cells.command(s, slowed, "emulated", "o.json"))
    assert "--net 1gbit,rank1=250mbit" in text and "--slow 1:2" in text, text
    assert "--slow none" in cells.shown(cells.command(s, todo[0], "emulated", "o.json"))
    with pytest.raises(ConfigError, match="simulator does not model .* use --target emulated"):
        cells.command(s, slowed, "sim", "o.json")
    # --set on the varied net: each rankN=RATE joins every rate, as bench's --net reads it
    vary, _ = s.scaled("default", {"net": "1gbit,10gbit,rank3=100mbit"})
    assert vary["net"] == ["1gbit,rank3=100mbit", "10gbit,rank3=100mbit"]
    for settings, reason in [({"slow": "4:2"}, r"\(cell slow=4:2.*rank 4 is out of range: the workers are ranks 0-3"),
                             ({"slow": "1:0.5"}, "the factor must be a number >= 1"),
                             ({"slow": "1:2", "servers": 1, "np": 1}, "rank 1 is a parameter server"),
                             ({"net": "1gbit,rank9=1mbit"}, "rank 9 is out of range: the job has ranks 0-3"),
                             ({"net": "1gbit,rank1=1mbit,rank0=2mbit", "ranks_per_host": 2}, "share emulated host 0")]:
        bad = specs.parse({**base, "vary": {"slow": [settings.pop("slow", "none")], "strategy": ["allreduce"]},
                           "settings": {**base["settings"], **settings}})
        with pytest.raises(ConfigError, match=reason):
            cells.command(bad, bad.cells(*bad.scaled("default", {}))[0], "emulated", "o.json")


def test_relations_fail_when_they_should():
    records = [{"strategy": "a", "rate": 10.0, "correct": True, "cell": {"net": "1gbit"}},
               {"strategy": "b", "rate": 4.0, "correct": False, "cell": {"net": "1gbit"}}]
    ge = {"says": "a >= 2 x b", "left": {"strategy": "a"}, "op": ">=", "right": {"strategy": "b"}, "factor": 2}
    assert relations.evaluate(ge, records, "rate")["ok"] is True
    assert relations.evaluate({**ge, "factor": 3}, records, "rate")["ok"] is False
    assert relations.evaluate({**ge, "left": {"strategy": "zzz"}}, records, "rate") == {
        "says": "a >= 2 x b", "ok": False, "measured": "no rate for strategy=zzz"}
    best = {"says": "a >= best", "left": {"strategy": "a"}, "op": ">=", "right": {"strategy": ["a", "b"]}}
    assert relations.evaluate(best, records, "rate")["ok"] is True
    assert relations.evaluate({**best, "op": ">"}, records, "rate")["ok"] is False
    constant = {"says": "b <= 5", "left": {"strategy": "b", "net": "1gbit"}, "op": "<=", "value": 5}
    assert relations.evaluate(constant, records, "rate")["ok"] is True
    correct = {"says": "equal", "kind": "correct", "select": {"strategy": ["a", "b"]}}
    verdict = relations.evaluate(correct, records, "rate")
    assert verdict["ok"] is False and "b (net=1gbit)" in verdict["measured"]
    assert relations.evaluate({**correct, "select": {"strategy": "a"}}, records, "rate")["ok"] is True
    assert relations.evaluate({**correct, "select": {"strategy": "none"}}, records, "rate")["ok"] is False


def test_run_report_validate_and_rerun_compares(tmp_path):
    path, store = write_spec(tmp_path, HOLDS + FAILS), tmp_path / "results.sqlite"
    done = run(["run", path, "--target", "local"], store)
    assert done.returncode == 0, done.stderr  # every cell ran; the verdicts are validate's business
    assert "holds: fast >= 1.9 x slow at speed 3: 6 >= 1.9 x 3" in done.stdout, done.stdout
    assert "FAILS: fast >= 3 x slow at speed 3: 6 >= 3 x 3" in done.stdout
    checked = run(["validate", path], store)
    assert checked.returncode == 1
    assert "toy: FAILS: fast >= 3 x slow at speed 3" in checked.stdout and "1 relation(s) fail" in checked.stdout
    out = tmp_path / "report"
    report = run(["report", path, "--out", str(out)], store)
    assert report.returncode == 0, report.stderr
    page = (out / "toy.md").read_text()
    assert "| fast / slow |" in page and "| 2 | 2 |" in page  # the paper's value, ours beside it
    assert "**fails**" in page and "holds" in page and "Environment: gradsync" in page
    assert (out / "toy.png").stat().st_size > 1000
    again = run(["run", path, "--target", "local"], store)
    assert "(run 1: 6 >= 1.9 x 3" in again.stdout, again.stdout  # compared with the earlier run
    assert run(["report", path, "--out", str(out)], store).returncode == 0
    assert "| previous run |" in (out / "toy.md").read_text() and "Previous run of this experiment: 1" in (out / "toy.md").read_text()
    other = tmp_path / "other"
    other.mkdir()
    only_holds = write_spec(other, HOLDS)
    store2 = tmp_path / "two.sqlite"
    assert run(["run", only_holds, "--target", "local"], store2).returncode == 0
    assert run(["validate", only_holds], store2).returncode == 0


def test_a_failed_cell_is_resumed_alone(tmp_path):
    path, store = write_spec(tmp_path, HOLDS), tmp_path / "results.sqlite"
    caller = signal.getsignal(signal.SIGTERM)
    first = run(["run", path, "--target", "local"], store, FAIL_SPEED="2")
    assert first.returncode == 1 and "cell failed: exit status 1" in first.stderr and "told to fail" in first.stderr
    assert signal.getsignal(signal.SIGTERM) is caller  # the runner's own handler lasts as long as its cells
    second = run(["run", path, "--target", "local"], store)
    assert second.returncode == 0, second.stderr
    assert "2 already done" in second.stdout
    calls = (tmp_path / "calls.log").read_text().split()
    assert calls == ["1.0", "2.0", "3.0", "2.0"]  # only the failed cell ran again, in the same run
    s = Store(str(store))
    assert [r["status"] for r in s.runs("toy")] == ["done"] and len(s.cells(1)) == 3


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_run_leaves_the_store_consistent_and_resumes(tmp_path, how):
    path, store = write_spec(tmp_path, HOLDS), tmp_path / "results.sqlite"
    proc = subprocess.Popen([*GRADSYNC, "experiment", "run", path, "--target", "local", "--store", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CELL_SLEEP": "3"}, start_new_session=True,
                            # a background job of a shell ignores SIGINT, and its children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = tmp_path / "calls.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().split()) < 2):
        time.sleep(0.1)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole group
    else:
        os.kill(proc.pid, signal.SIGTERM)  # kill PID, timeout, a batch system's cancel: the runner alone
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if how == "ctrl-c" else 143), (out, err)
    assert "interrupted: run 1 keeps its 1 finished cells" in err
    for pid in map(int, (tmp_path / "calls.log.pids").read_text().split()):  # the running cell ended too
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split(") ")[1][0] == "Z", f"cell process {pid} outlived the run"
        except FileNotFoundError:
            pass
    s = Store(str(store))
    assert s.runs("toy")[0]["status"] == "interrupted" and len(s.done_keys(1)) == 1
    resumed = run(["run", path, "--target", "local"], store)
    assert resumed.returncode == 0 and "1 already done" in resumed.stdout, resumed.stdout


def test_records_from_a_line_the_script_prints(tmp_path):
    printed = """
[[relation]]
says = "printed 4"
left = {kind = "printed"}
op = ">="
value = 4
"""
    path = write_spec(tmp_path, printed, speeds=(4,))
    with open(path) as f:
        text = f.read().replace('records = "rows"', 'records = "stdout"')
    with open(path, "w") as f:
        f.write(text)
    done = run(["run", path, "--target", "local"], tmp_path / "s.sqlite")
    assert done.returncode == 0 and "holds: printed 4: 4 >= 4" in done.stdout, done.stdout + done.stderr


def test_the_store_refuses_a_newer_version_and_a_file_that_is_no_store(tmp_path):
    newer = tmp_path / "newer.sqlite"
    Store(str(newer)).close()
    with sqlite3.connect(newer) as db:
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    with pytest.raises(ConfigError, match="written by a newer gradsync"):
        Store(str(newer))
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(ConfigError, match="is not a gradsync results store"):
        Store(str(junk))


def test_unknown_targets_machines_and_hosts_files(tmp_path):
    env = {"XDG_DATA_HOME": str(tmp_path / "data")}
    store = tmp_path / "s.sqlite"
    bad = run(["run", "p3-bandwidth", "--target", "bigiron"], store, **env)
    assert bad.returncode == 2 and "unknown target 'bigiron'" in bad.stderr
    unknown = run(["run", "nope"], store, **env)
    assert unknown.returncode == 2 and "unknown experiment 'nope'" in unknown.stderr
    override = run(["run", "p3-bandwidth", "--set", "colour=red"], store, **env)
    assert override.returncode == 2 and "has no key 'colour'" in override.stderr
    hosts = tmp_path / "hosts.json"
    hosts.write_text("{not json")
    machine = [*GRADSYNC, "machine", "add", "lab", "--hosts", str(hosts)]
    done = subprocess.run(machine, capture_output=True, text=True, env={**os.environ, **env})
    assert done.returncode == 2 and "is not JSON" in done.stderr
    hosts.write_text(json.dumps({"hosts": [{"host": "no-such-host.invalid", "slots": 2}]}))
    done = subprocess.run(machine, capture_output=True, text=True, env={**os.environ, **env})
    assert done.returncode == 2 and "no-such-host.invalid" in done.stderr and "do not answer" in done.stderr
    hosts.write_text(json.dumps({"hosts": [{"host": "localhost", "slots": 2}]}))
    assert subprocess.run(machine, capture_output=True, text=True, env={**os.environ, **env}).returncode == 0
    listed = subprocess.run([*GRADSYNC, "machine", "list"], capture_output=True, text=True, env={**os.environ, **env})
    assert "lab" in listed.stdout and "localhost:2" in listed.stdout
    # a one-host machine that is this host runs like --target local
    toy = write_spec(tmp_path, HOLDS, speeds=(1,))
    assert run(["run", toy, "--target", "lab"], store, **env).returncode == 0


def test_a_fresh_installation_lists_reports_and_validates_the_shipped_runs(tmp_path, monkeypatch):
    """With an empty store of the user's, the runs behind docs/results answer (read only: the
    shipped file is not written), and a run of the user's own comes first once there is one."""
    from gradsync.experiment import cli
    from gradsync.experiment.store import SHIPPED

    before = os.stat(SHIPPED).st_mtime_ns, open(SHIPPED, "rb").read()
    monkeypatch.setenv("GRADSYNC_STORE", str(tmp_path / "mine.sqlite"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(types.SimpleNamespace(action="list", store=None)) == 0
    listed = [line for line in out.getvalue().splitlines() if not line.startswith(" ")]
    assert listed and all("(shipped with gradsync)" in line for line in listed), out.getvalue()
    report = tmp_path / "report"
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(types.SimpleNamespace(action="report", store=None, names=["p3-bandwidth"], all=False,
                                       target=None, out=str(report)))
    assert "P3" in (report / "p3-bandwidth.md").read_text()
    assert (os.stat(SHIPPED).st_mtime_ns, open(SHIPPED, "rb").read()) == before
    mine = Store(str(tmp_path / "mine.sqlite"))
    mine.finish_run(mine.start_run("p3-bandwidth", "local", "default", {}, {}), "done")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(types.SimpleNamespace(action="list", store=None))
    p3 = next(line for line in out.getvalue().splitlines() if line.startswith("p3-bandwidth"))
    assert "last run 1: done, target local" in p3 and "shipped" not in p3, p3
