"""Jobs over the hosts of a registered machine (``gradsync bench --machine``, ``experiment --target``).

The machine's ``ssh`` is a stand-in that runs the command on this host, so the node launchers,
the rendezvous across them, the files shipped on stdin and sent back are all real; with root it
also mounts an empty tmpfs over the temporary folder, so the "other host" has its own /tmp.
"""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.geteuid() == 0
GRADSYNC = [sys.executable, "-m", "gradsync.cli"]

FAKE_SSH = textwrap.dedent("""\
    import os, shlex, subprocess, sys
    host, command = sys.argv[1], " ".join(sys.argv[2:])
    with open(os.environ["FAKE_SSH_LOG"], "a") as f:
        f.write(host + "\\n")
    if os.environ.get("FAKE_SSH_COMMANDS"):  # the command lines, to see what ps on a host would show
        with open(os.environ["FAKE_SSH_COMMANDS"], "a") as f:
            f.write(command + "\\n")
    if host.endswith(".down"):
        print(f"ssh: connect to host {host} port 22: Connection refused", file=sys.stderr)
        sys.exit(255)
    private = os.environ.get("FAKE_SSH_PRIVATE")  # a folder this host sees empty
    if private:
        command = f"mount -t tmpfs fake {shlex.quote(private)} && {command}"
        sys.exit(subprocess.call(["unshare", "--mount", "--propagation", "private", "sh", "-c", command]))
    sys.exit(subprocess.call(["sh", "-c", command]))
    """)


def machine(tmp_path, second="nodeb", more=(), name="lab", **extra):
    """Register ``name``: this host, ``second`` and ``more``, one slot each, reached through the stand-in ssh."""
    ssh = tmp_path / "fake_ssh.py"
    ssh.write_text(FAKE_SSH)
    hosts = tmp_path / f"{name}.json"
    hosts.write_text(json.dumps({"hosts": [{"host": h, "slots": 1} for h in ("localhost", second, *more)],
                                 "master_addr": "127.0.0.1", "ssh": [sys.executable, str(ssh)], **extra}))
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "FAKE_SSH_LOG": str(tmp_path / "ssh.log")}
    done = subprocess.run([*GRADSYNC, "machine", "add", name, "--hosts", str(hosts), "--no-check"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return env


@pytest.mark.parametrize("own_tmp", [False, pytest.param(True, marks=pytest.mark.skipif(
    not ROOT, reason="a private /tmp for the second host needs a mount namespace (root)"))])
def test_bench_runs_over_a_machines_hosts_and_gets_their_files_back(tmp_path, own_tmp):
    """``own_tmp``: the second host has its own temporary folder (config and trace travel); else
    it shares this one's, as on a shared filesystem (it must not remove what node 0 wrote). The
    first also runs ps (servers on both hosts), the second allreduce only."""
    env = machine(tmp_path, net="10gbit")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env.update(TMPDIR=str(tmp), **({"FAKE_SSH_PRIVATE": str(tmp)} if own_tmp else {}))
    out, trace = tmp_path / "records.json", tmp_path / "trace.json"
    done = subprocess.run([*GRADSYNC, "bench", "--machine", "lab", "--model", "toy", "--np", "2", "--batch-size", "4",
                           "--steps", "2", "--warmup", "1", "--rounds", "1", "--check-steps", "2",
                           "--strategies", "allreduce,ps" if own_tmp else "allreduce", "--json", str(out),
                           "--trace", str(trace)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "ssh.log").read_text().split() == ["nodeb"]  # node 0 ran here, node 1 "over ssh"
    assert "machine lab (2 hosts, 10 Gbit/s links)" in done.stdout
    records = {r["strategy"]: r for r in json.loads(out.read_text())}
    for name in records:  # the two hosts' ranks trained one model, equal to the reference
        r = records[name]
        assert r["correct"] is True and r["workers_max_diff"] == 0.0, r
        assert r["machine"] == "lab" and r["net_bps"] == 10e9 and r["dilation"] == 1.0
    # worker 1 wrote its trace in its host's /tmp; from its own, it came back over the node's stdout
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert any("rank 1" in n for n in names) and any("rank 0" in n for n in names), names
    assert [n for n in os.listdir(tmp) if n.startswith("gradsync")] == []  # no run or flight folder left


def test_a_host_that_ssh_cannot_reach_fails_the_job_at_once_naming_it(tmp_path):
    env = machine(tmp_path, second="nodeb.down")
    started = time.monotonic()
    done = subprocess.run([*GRADSYNC, "bench", "--machine", "lab", "--model", "toy", "--np", "2", "--batch-size", "4",
                           "--steps", "2", "--warmup", "1", "--rounds", "1", "--check-steps", "0",
                           "--strategies", "allreduce"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 255, done.stdout + done.stderr
    assert "node 1 (nodeb.down) failed with exit status 255" in done.stderr
    assert "Connection refused" in done.stderr
    assert time.monotonic() - started < 60  # not node 0 waiting out the rendezvous


def test_machine_arguments_that_cannot_work_are_refused(tmp_path, monkeypatch, capsys):
    from gradsync import cli

    monkeypatch.setenv("XDG_DATA_HOME", machine(tmp_path)["XDG_DATA_HOME"])

    def gradsync(*argv) -> tuple[int, str]:  # in this process: the refusals come before any job starts
        capsys.readouterr()
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = exc.code
        return code, capsys.readouterr().err

    for args, says in [(["--machine", "lab", "--np", "3"], "--np 3 exceeds the 2 slots of machine 'lab'"),
                       (["--machine", "lab", "--net", "1gbit"], "drop --net"),
                       (["--machine", "lab", "--compute", "emulated", "--dilation", "4"], "has real ones (drop --dilation)"),
                       (["--machine", "nope"], "no registered machine 'nope'")]:
        code, err = gradsync("bench", "--model", "toy", *args)
        assert code == 2 and says in err, (args, err)
    hosts = tmp_path / "far.json"  # a machine whose first host is elsewhere starts there, not here
    hosts.write_text(json.dumps({"hosts": [{"host": "far-away.invalid", "slots": 1}, {"host": "localhost", "slots": 1}]}))
    assert gradsync("machine", "add", "far", "--hosts", str(hosts), "--no-check")[0] == 0
    code, err = gradsync("bench", "--model", "toy", "--machine", "far")
    assert code == 2 and "starts from its first host, 'far-away.invalid'" in err
    for bad, says in [({"ssh": "ssh -p 22"}, '"ssh" is the command before a host'),
                      ({"net": "fast"}, "net: bad link rate 'fast'"), ({"python": 3}, "'python' must be a non-empty string")]:
        hosts.write_text(json.dumps({"hosts": [{"host": "localhost"}], **bad}))
        code, err = gradsync("machine", "add", "bad", "--hosts", str(hosts), "--no-check")
        assert code == 2 and says in err, (bad, err)


def test_an_experiment_on_a_machine_runs_at_the_machines_own_rate(tmp_path):
    env = machine(tmp_path, net="4gbit")
    store = tmp_path / "s.sqlite"
    show = subprocess.run([*GRADSYNC, "experiment", "show", "p3-bandwidth", "--target", "lab", "--set", "net=4gbit",
                           "--set", "model=resnet50"], capture_output=True, text=True, env=env)
    assert show.returncode == 0, show.stderr
    assert "gradsync bench --json OUT.json --machine lab --strategies ps,p3 --model resnet50 --np 2 " in show.stdout
    assert "--net" not in show.stdout
    other = subprocess.run([*GRADSYNC, "experiment", "run", "p3-bandwidth", "--target", "lab", "--store", str(store)],
                           capture_output=True, text=True, env=env)
    assert other.returncode == 2 and "runs at net = 1gbit; machine 'lab' has links of 4gbit" in other.stderr
    assert "--set net=4gbit" in other.stderr
    script = subprocess.run([*GRADSYNC, "experiment", "run", "kungfu-resize", "--target", "lab", "--store", str(store)],
                            capture_output=True, text=True, env=env)
    assert script.returncode == 2 and "use --target local on one of machine 'lab''s hosts" in script.stderr


def test_gradsync_run_over_a_machines_hosts_and_an_elastic_job_with_an_agent_on_each(tmp_path):
    """``gradsync run --machine``: a fixed job's ranks on both hosts; then an elastic job, an agent
    on each host (the second's over ssh, the secret in its stdin), shrinking to the first host's
    worker and growing back onto the second, ending with the one-process replay's model."""
    from test_elastic import EXAMPLE, assert_matches_reference
    from test_elastic_hosts import Log

    env = machine(tmp_path)
    script = tmp_path / "hello.py"
    script.write_text("import os, torch, torch.distributed as dist, gradsync\n"
                      "topo = gradsync.init()\n"
                      "t = torch.tensor([float(topo.rank + 1)])\n"
                      "dist.all_reduce(t)\n"
                      "print(f'rank {topo.rank} of {topo.world_size}: sum {t.item():g}', flush=True)\n"
                      "gradsync.shutdown()\n")
    trace = tmp_path / "traces" / "job.json"
    trace.parent.mkdir()
    fixed = subprocess.run([*GRADSYNC, "run", "--machine", "lab", "-np", "2", "--trace", str(trace), "--", str(script)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "rank 0 of 2: sum 3" in fixed.stdout and "rank 1 of 2: sum 3" in fixed.stdout, fixed.stdout
    assert (tmp_path / "ssh.log").read_text().split() == ["nodeb"]
    events = json.loads(trace.read_text())["traceEvents"]  # both hosts' ranks, merged
    assert {e["pid"] for e in events if e.get("name") == "process_name"} == {0, 1}, fixed.stderr
    assert sorted(os.listdir(trace.parent)) == ["job.json"]  # the parts merged and removed, nothing else left

    # The elastic job on "lab3": this host, nodeb, and nodec, which ssh cannot reach; with --min-np 1
    # the job goes on without nodec, saying so.
    machine(tmp_path, more=["nodec.down"], name="lab3")
    out, commands, stop = tmp_path / "result.json", tmp_path / "commands.log", tmp_path / "stop"
    secret = "5ec7e7" * 5 + "ab"
    env = {**env, "GRADSYNC_JOB_SECRET": secret, "FAKE_SSH_COMMANDS": str(commands)}
    lead = Log(subprocess.Popen([*GRADSYNC, "run", "--elastic", "--machine", "lab3", "--min-np", "1", "--", EXAMPLE,
                                 "--sleep", "0.05", "--steps", "100000", "--stop-file", str(stop), "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True))
    try:  # it starts on this host's worker and grows onto the second host's as that agent registers
        lead.wait_for(r"host 1 \(nodeb\) registered with 1 slots")
        lead.wait_for(r"step \d+: 2 workers")
        port = re.search(r"gradsync resize N --port (\d+)", lead.text()).group(1)
        for size, says in ((1, r"regrouped, 2 -> 1 workers"), (2, r"regrouped, 1 -> 2 workers after step [1-9]")):
            asked = subprocess.run([*GRADSYNC, "resize", str(size), "--port", port], capture_output=True, text=True,
                                   env=env, timeout=60)
            assert asked.returncode == 0, asked.stderr
            lead.wait_for(says)
        stop.touch()
        assert lead.proc.wait(timeout=60) == 0, lead.text()[-4000:]
    finally:
        if lead.proc.poll() is None:
            os.killpg(lead.proc.pid, signal.SIGKILL)
            lead.proc.wait()
    assert sorted((tmp_path / "ssh.log").read_text().split()) == ["nodeb", "nodeb", "nodec.down"]  # the agents
    assert "the agent of host 2 (nodec.down) failed with exit status 255 before it joined the job; the job goes " \
           "on without it" in lead.text(), lead.text()[-4000:]
    assert "gradsync.launch.remote" in commands.read_text() and secret not in commands.read_text()
    result = json.loads(out.read_text())
    assert [(r["from"], r["to"]) for r in result["resizes"]][-2:] == [(2, 1), (1, 2)], result["resizes"]
    assert_matches_reference(result)


def test_an_elastic_job_on_a_machine_whose_host_ssh_cannot_reach_fails_naming_it(tmp_path):
    env = machine(tmp_path, second="nodeb.down")
    started = time.monotonic()
    job = subprocess.run([*GRADSYNC, "run", "--elastic", "--machine", "lab", "--", "true"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert job.returncode == 255, job.stdout + job.stderr
    assert "the agent of host 1 (nodeb.down) failed with exit status 255 before it joined the job" in job.stderr
    assert "Connection refused" in job.stderr
    assert time.monotonic() - started < 30  # not the lead waiting out the hosts' registration
    assert "1 of the machine's 2 hosts failed before they joined, and the job needs 2 (--min-np)" in job.stderr
    for args, says in [(["--elastic", "-np", "2"], "no -np, --max-np"),
                       (["--elastic", "--trace", str(tmp_path / "t.json")], "--trace with --elastic --machine"),
                       (["-np", "2", "--logdir", str(tmp_path / "logs")], "no --logdir or --port"),
                       (["-np", "2", "--bind", "0.0.0.0"], "no --bind, --delay or --loss"),
                       (["--elastic", "--min-np", "3"], "--min-np 3: the machine's 2 hosts hold 1 to 2 workers")]:
        refused = subprocess.run([*GRADSYNC, "run", "--machine", "lab", *args, "--", "true"],
                                 capture_output=True, text=True, env=env, timeout=60)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
    uneven = tmp_path / "uneven.json"  # hosts of 2 and 1 slots: --nproc-per-node is one number
    uneven.write_text(json.dumps({"hosts": [{"host": "localhost", "slots": 2}, {"host": "nodeb", "slots": 1}],
                                  "master_addr": "127.0.0.1"}))
    assert subprocess.run([*GRADSYNC, "machine", "add", "uneven", "--hosts", str(uneven), "--no-check"],
                          env=env, capture_output=True).returncode == 0
    refused = subprocess.run([*GRADSYNC, "run", "--elastic", "--machine", "uneven", "--", "true"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2 and "its hosts have localhost:2, nodeb:1 slots" in refused.stderr, refused.stderr
