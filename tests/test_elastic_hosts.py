"""Elastic jobs over several hosts (gradsync run --elastic --nnodes MIN:MAX): one agent per emulated
host, hosts that join, a host that is lost for good, a resize from another host, and the replay."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from gradsync.cluster import EmulatedCluster, leftovers
from test_elastic import EXAMPLE, GRADSYNC, ROOT, assert_matches_reference, example

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating network namespaces and qdiscs needs root")
PORT = 29411
SECRET = "0123456789abcdef0123456789abcdef"


class Log:
    """A process's output, read as it comes."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            assert time.monotonic() < deadline and self.proc.poll() is None, \
                f"no {pattern!r} within {timeout} s:\n{self.text()[-4000:]}"
            time.sleep(0.05)


def processes_with(marker: str, wait_s: float = 5.0) -> list[int]:
    """Live processes whose command line holds ``marker`` (a path of one test's), read from /proc
    until none is left, for at most ``wait_s`` (a worker is not in its agent's process group)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue  # gone meanwhile
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@needs_root
def test_hosts_join_one_is_lost_and_another_resizes_the_job(tmp_path):
    # Three emulated hosts, one agent each, started together, the first with two workers: 2 -> 4
    # workers as hosts register (in one or two generations), one host lost for good -> 3, a resize
    # from the other -> 2 (the first host's, the least a job of --nnodes 1:3 runs), then StopFile;
    # the replay of the global batches. While the first host runs two workers, its workers sum
    # before one pushes (the two-level all-reduce over emulated hosts:
    # test_an_elastic_job_on_emulated_hosts_runs_an_agent_on_each does it under ps), and p3's
    # optimizer state, spread over the workers, is gathered at each commit and spread anew over
    # each generation's layout. An agent with another secret stops at once.
    out, stop = tmp_path / "result.json", tmp_path / "stop"
    with EmulatedCluster(3, 10e9) as cluster:
        endpoint = f"{cluster.address(0)}:{PORT}"
        # The timeout is long enough for a joiner to wait out the running workers' step on a busy
        # machine (they regroup at a step boundary); the lost host is dropped at 2 s anyway. It is
        # also how long the threads blocked in the group that the lost host broke wait at the end.
        env = {**os.environ, **cluster.env(), "GRADSYNC_JOB_SECRET": SECRET, "GRADSYNC_TIMEOUT": "10",
               "GRADSYNC_HOST_LOST_S": "2"}

        def agent(host: int, secret: str = SECRET, command=("--out", str(out))) -> Log:
            return Log(subprocess.Popen(
                [*cluster.exec_prefix(host), *GRADSYNC, "run", "--elastic", "--nnodes", "1:3",
                 "--nproc-per-node", "2" if host == 0 else "1",
                 "--rdzv-endpoint", endpoint, "--", sys.executable, EXAMPLE, "--sleep", "0.05", "--steps", "100000",
                 "--stop-file", str(stop), "--strategy", "p3", *command],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
                env={**env, "GRADSYNC_HOST": f"emulated host {host}", "GRADSYNC_JOB_SECRET": secret}))

        agents = {0: agent(0), 1: agent(1), 2: agent(2)}
        wrong = agent(2, "f" * 32, ())
        try:
            lead = agents[0]
            lead.wait_for(r"generation \d: 4 workers \[0, 1, 2, 3\]")
            assert wrong.proc.wait(timeout=60) == 2, wrong.text()
            assert "has another secret than this agent's GRADSYNC_JOB_SECRET" in wrong.text(), wrong.text()
            # Which agent became host 1 (worker 2): the first to register.
            first = int(re.search(r"host 1 \(emulated host (\d)\) registered", lead.text()).group(1))
            other = 3 - first
            agents[other].wait_for(r"elastic worker 3 joined generation \d \(4 workers\)")
            lead.wait_for(r"step \d+: 4 workers")  # the job trains at 4 before a host is lost
            # Host 1 dies whole: its link goes down and its agent (and with it its worker) is killed.
            cluster.link_down(first)
            os.killpg(agents[first].proc.pid, signal.SIGKILL)
            lead.wait_for(rf"host 1 \(emulated host {first}\) is lost")
            lead.wait_for(r"generation \d: 3 workers \[0, 1, 3\] \(worker 2 failed: its host was lost")
            lead.wait_for(r"regrouped, 4 -> 3 workers")
            # A resize from the other host, through the endpoint, with the job's secret.
            asked = subprocess.run([*cluster.exec_prefix(other), *GRADSYNC, "resize", "2", "--addr",
                                    cluster.address(0), "--port", str(PORT)],
                                   capture_output=True, text=True, env=env, timeout=60)
            assert asked.returncode == 0, asked.stderr
            lead.wait_for(r"generation \d: 2 workers \[0, 1\]")
            stop.touch()
            assert lead.proc.wait(timeout=60) == 0, lead.text()[-4000:]
            assert agents[other].proc.wait(timeout=30) == 0, agents[other].text()[-4000:]
            assert "worker 3: left the job" in agents[other].text()
        finally:
            for log in (*agents.values(), wrong):
                if log.proc.poll() is None:
                    os.killpg(log.proc.pid, signal.SIGKILL)
                    log.proc.wait()
    result = json.loads(out.read_text())
    assert [(r["from"], r["to"]) for r in result["resizes"]][-2:] == [(4, 3), (3, 2)]
    # The survivors' waits on the cut host ended when the lead dropped it (2 s), not at the 10 s timeout.
    assert "the elastic launcher lost a member of generation" in result["resizes"][-2]["cause"], result["resizes"]
    # Before that the job grew to 4 as hosts registered: in one or two generations, or none where all
    # three had registered before the first generation started.
    grown = [(r["from"], r["to"]) for r in result["resizes"]][:-2]
    assert grown in ([], [(2, 4)], [(3, 4)], [(2, 3), (3, 4)]), result["resizes"]
    # Two-level while the first host's two workers had others on other hosts: over 3 hosts, then
    # over 2 once one was lost (before: over 2 where the hosts joined one at a time; flat where the
    # job was that one host: before the others joined, or after the resize if a step ran before
    # the stop).
    described = [d for _, d in result["described"]]
    layouts = (re.search(r"two-level over (\d) hosts|host sums: (\d) hosts push", d) for d in described)
    hosts = [int(m.group(1) or m.group(2)) for m in layouts if m]
    hosts = [h for i, h in enumerate(hosts) if i == 0 or hosts[i - 1] != h]  # one entry per layout
    assert hosts[-2:] == [3, 2] and len(hosts) <= 3, described
    assert_matches_reference(result)
    assert leftovers() == []


@needs_root
def test_an_elastic_job_on_emulated_hosts_runs_an_agent_on_each(tmp_path):
    # gradsync run --elastic --net: two hosts of two workers, an agent each, both started at once,
    # under ps (each host's workers sum before its first pushes; the server state is spread over
    # each generation's workers): the job runs on both (the second's workers join once they have built their model, seconds
    # before step 12 at 0.25 s a step), shrinks to the first host's two and grows back onto the
    # second host's slots one step later, while the workers that left may still hold them (new
    # workers start there as they free), and equals the replay; the cluster is removed.
    out = tmp_path / "result.json"
    proc = subprocess.run([*GRADSYNC, "run", "--elastic", "--net", "10gbit", "--ranks-per-host", "2", "-np", "4",
                           "--min-np", "2", "--", sys.executable, EXAMPLE, "--strategy", "ps", "--schedule", "12:2,13:4", "--steps", "16",
                           "--sleep", "0.25", "--out", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "GRADSYNC_JOB_SECRET"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    sizes = [result["sizes"][str(s)] for s in range(16)]
    assert 4 in sizes[:12] and sizes[12:] == [2] + [4] * 3, sizes
    described = [d for step, d in result["described"]]
    assert any("host sums: 2 hosts push" in d for d in described), described
    assert_matches_reference(result)
    assert leftovers() == []


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class BeatStore:
    """The lead's store as RemoteHosts reads it: one host, whose beat the test moves."""

    def __init__(self):
        self.beat, self.kept = 0, {}

    def add(self, key, n):
        return self.beat if key == "elastic/beat/1" else 0

    def check(self, keys):
        return False


def test_a_host_is_lost_when_its_beat_stops_not_when_the_lead_could_not_look(monkeypatch):
    from gradsync.launch import elastic_hosts as eh

    clock = Clock()
    monkeypatch.setattr(eh.time, "monotonic", clock)
    store = BeatStore()
    hosts = eh.RemoteHosts(store, lambda key, value: store.kept.__setitem__(key, value))
    hosts.hosts[1] = eh.RemoteHost(1, 2, "b", beat_at=clock.now)
    hosts.alive[5] = 1

    def look(after_s):
        clock.now += after_s
        return hosts.exits()

    assert look(0.1) == []
    # The lead is held up for 3 x HOST_LOST_S (its store stalled): the beat has not moved, but
    # the lead did not look either, so the host is not lost.
    assert look(3 * eh.HOST_LOST_S) == [] and not hosts.hosts[1].lost
    for _ in range(int((eh.HOST_LOST_S - eh.READ_GAP_S) / 0.1) - 2):  # looks every 0.1 s: within the limit
        assert look(0.1) == []
    store.beat = 1
    for _ in range(int(eh.HOST_LOST_S / 0.1) + 2):  # the beat moved once, then stops for good
        ended = look(0.1)
        if ended:
            break
    assert ended == [(5, None)] and hosts.hosts[1].lost and store.kept == {"elastic/lost/1": "1"}


def test_an_agent_without_the_jobs_secret_stops_at_once():
    none = subprocess.run([*GRADSYNC, "run", "--elastic", "--nnodes", "1:2", "--nproc-per-node", "1",
                           "--rdzv-endpoint", "127.0.0.1:1", "--", "true"], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "GRADSYNC_JOB_SECRET"}, timeout=60)
    assert none.returncode == 2 and "needs the job's secret on every host" in none.stderr, none.stderr


def test_an_agent_that_cannot_reach_the_store_or_finds_no_job_there_says_so_naming_its_host(monkeypatch):
    # Nothing listens at the endpoint; then a store listens, but no lead's agent started a job on it.
    # Each ends after CONNECT_S (here 1 s, not a connection attempt's own 10 s) with the host's name.
    import socket

    import torch.distributed as dist

    from gradsync.errors import GradsyncError
    from gradsync.launch import elastic_hosts

    monkeypatch.setattr(elastic_hosts, "CONNECT_S", 1.0)
    monkeypatch.setenv("GRADSYNC_JOB_SECRET", SECRET)
    monkeypatch.setenv("GRADSYNC_HOST", "emulated host 2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(GradsyncError, match=rf"host emulated host 2: cannot reach the elastic job's store at "
                                            rf"127.0.0.1:{port} within 1 s .*is the lead's agent running"):
        elastic_hosts.HostAgent(["true"], "127.0.0.1", port, 1, None, 1.0)
    assert time.monotonic() - start < 8
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(GradsyncError, match=rf"host emulated host 2: 127.0.0.1:{server.port} answers, but no elastic "
                                            r"job has started there within 1 s \(is --rdzv-endpoint the lead's\?\)"):
        elastic_hosts.HostAgent(["true"], "127.0.0.1", server.port, 1, None, 1.0)


@needs_root
def test_without_a_checkpoint_dir_the_store_hosts_death_ends_the_job_and_the_agents_say_so(tmp_path):
    marker = str(tmp_path / "never")  # on the workers' command lines: to find them
    with EmulatedCluster(2, 10e9) as cluster:
        env = {**os.environ, **cluster.env(), "GRADSYNC_JOB_SECRET": SECRET, "GRADSYNC_TIMEOUT": "6",
               "GRADSYNC_STORE_LOST_S": "2"}

        def agent(host: int) -> Log:
            return Log(subprocess.Popen(
                [*cluster.exec_prefix(host), *GRADSYNC, "run", "--elastic", "--nnodes", "2:2", "--nproc-per-node", "1",
                 "--rdzv-endpoint", f"{cluster.address(0)}:{PORT + 1}", "--", sys.executable, EXAMPLE, "--sleep", "0.05",
                 "--steps", "100000", "--stop-file", marker], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                start_new_session=True, env={**env, "GRADSYNC_HOST": f"emulated host {host}"}))

        lead, other = agent(0), agent(1)
        try:
            lead.wait_for(r"generation \d: 2 workers \[0, 1\]")
            time.sleep(2)  # both train
            assert len(processes_with(marker, wait_s=0)) >= 4  # the two agents and their workers (and forkservers)
            os.killpg(lead.proc.pid, signal.SIGKILL)  # the lead's agent, its store and its worker
            assert other.proc.wait(timeout=60) == 1, other.text()[-4000:]
            assert processes_with(marker) == []  # its worker was stopped with it, and the lead's died with it
        finally:
            for log in (lead, other):
                if log.proc.poll() is None:
                    os.killpg(log.proc.pid, signal.SIGKILL)
                    log.proc.wait()
        text = other.text()
        assert re.search(r"the job's store at [\d.]+:\d+ has not answered for 2 s", text), text[-3000:]
        assert "the job goes on under another host's agent from the newest commit" in text, text[-3000:]
    assert leftovers() == []


@needs_root
def test_when_the_lead_host_dies_the_others_go_on_from_the_newest_commit(tmp_path):
    # Three emulated hosts of one worker each, commits on a folder they share. The lead's host dies
    # whole (link down, agent killed): the others find its beat in the folder standing still, the
    # first of them to have registered leads from the newest commit, the other registers with it.
    # The job ends with the model of one process that starts from that commit and takes the same
    # global batches.
    import torch

    from gradsync.adapt import durable

    out, stop, folder = tmp_path / "result.json", tmp_path / "stop", tmp_path / "ckpt"
    with EmulatedCluster(3, 10e9) as cluster:
        env = {**os.environ, **cluster.env(), "GRADSYNC_JOB_SECRET": SECRET, "GRADSYNC_TIMEOUT": "6",
               "GRADSYNC_STORE_LOST_S": "2", "GRADSYNC_HOST_LOST_S": "2"}

        def agent(host: int) -> Log:
            return Log(subprocess.Popen(
                [*cluster.exec_prefix(host), *GRADSYNC, "run", "--elastic", "--nnodes", "1:3", "--nproc-per-node", "1",
                 "--rdzv-endpoint", f"{cluster.address(0)}:{PORT + 2}", "--checkpoint-dir", str(folder),
                 "--checkpoint-every", "1", "--", sys.executable, EXAMPLE, "--sleep", "0.05", "--steps", "100000",
                 "--stop-file", str(stop), "--out", str(out)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
                env={**env, "GRADSYNC_HOST": f"emulated host {host}"}))

        agents = [agent(host) for host in range(3)]
        try:
            lead = agents[0]
            lead.wait_for(r"step \d+: 3 workers")
            first = int(re.search(r"host 1 \(emulated host (\d)\) registered", lead.text()).group(1))
            other = 3 - first
            time.sleep(1)  # commits of three workers' steps
            cluster.link_down(0)
            os.killpg(lead.proc.pid, signal.SIGKILL)
            lead.proc.wait()
            time.sleep(0.5)  # the killed worker's last write, if any, is whole or a wreck by now
            start = durable.latest(str(folder))  # where the next lead resumes: no one writes until it does
            agents[first].wait_for(r"this host leads the job now")
            agents[other].wait_for(r"the job goes on under")
            agents[first].wait_for(r"step \d+: 2 workers")
            stop.touch()
            assert agents[first].proc.wait(timeout=60) == 0, agents[first].text()[-4000:]
            assert agents[other].proc.wait(timeout=30) == 0, agents[other].text()[-4000:]
        finally:
            for log in agents:
                if log.proc.poll() is None:
                    os.killpg(log.proc.pid, signal.SIGKILL)
                    log.proc.wait()
        assert "the lead's beat stands still" in agents[first].text()
        assert not (folder / ".gradsync-lead").exists()  # the job ended: no beat left to follow
        texts = "\n=====\n".join(log.text()[-3000:] for log in agents)
    result = json.loads(out.read_text())
    steps = sorted(map(int, result["batches"]))
    assert steps[0] == start["counters"]["step"] > 0, (steps[:3], start["counters"], texts)
    x, y = example().dataset()
    model, opt = example().build()
    with torch.no_grad():
        for p, saved in zip(model.parameters(), start["params"]):
            p.copy_(saved.view_as(p))
    opt.load_state_dict(start["optimizer"])
    for step in steps:
        idx = torch.tensor(result["batches"][str(step)])
        example().loss_of(model, x[idx], y[idx]).backward()
        opt.step()
        opt.zero_grad()
    for got, want in zip(result["params"], model.parameters()):
        assert torch.allclose(torch.tensor(got), want.detach().reshape(-1), atol=1e-5), (got, want)
    assert leftovers() == []


def test_a_lead_whose_beat_another_lead_replaced_stops_and_leaves_that_beat(tmp_path, monkeypatch):
    # A lead taken for dead (its storage stalled while its link was cut) finds, once it can read
    # the folder again, the beat of the lead that took over: it stops rather than go on writing
    # commits beside it, and leaves that beat for the other hosts to follow.
    from gradsync.launch import elastic_hosts
    from gradsync.launch.elastic_hosts import LEASE_FILE, Lease

    monkeypatch.setattr(elastic_hosts, "BEAT_S", 0.0)
    folder = str(tmp_path)
    (tmp_path / LEASE_FILE).write_text("41 10.0.0.7:29400\n")  # an earlier job's lead, killed: left behind
    lease = Lease(folder, "10.0.0.1:29400")
    assert lease.beat() and Lease.read(folder) == (1, "10.0.0.1:29400")  # its first beat replaces it
    assert lease.beat() and Lease.read(folder) == (2, "10.0.0.1:29400")
    (tmp_path / LEASE_FILE).write_text("1 10.0.0.2:29400\n")  # host 1 took over
    assert not lease.beat() and lease.deposed == "10.0.0.2:29400"
    assert not lease.beat()  # for good
    lease.end()
    assert Lease.read(folder) == (1, "10.0.0.2:29400")  # the new lead's beat is kept
    new = Lease(folder, "10.0.0.2:29400")
    assert new.beat() and Lease.read(folder) == (1, "10.0.0.2:29400")
    new.end()
    assert Lease.read(folder) is None  # its own beat goes with its job


def test_a_running_lead_that_finds_another_leads_beat_stops_its_workers_and_names_it(tmp_path):
    # The agent's side of the above, in a real job (one host; loopback; the folder does not exist
    # yet, as on a first start): the folder's beat names
    # another lead, as after a take-over that took this lead for dead. Its agent stops its workers
    # and fails with that lead's endpoint; the other lead's beat stays for the other hosts.
    from gradsync.launch.elastic_hosts import LEASE_FILE, Lease

    folder = tmp_path / "ckpt"
    lead = Log(subprocess.Popen(
        [*GRADSYNC, "run", "--elastic", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint",
         f"127.0.0.1:{PORT + 3}", "--checkpoint-dir", str(folder), "--", sys.executable, EXAMPLE, "--sleep", "0.05",
         "--steps", "100000", "--stop-file", str(tmp_path / "never")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        start_new_session=True, env={**os.environ, "GRADSYNC_JOB_SECRET": SECRET}))
    try:
        lead.wait_for(r"step \d+: 1 workers")
        assert Lease.read(str(folder))[1] == f"127.0.0.1:{PORT + 3}"
        assert len(processes_with(str(tmp_path / "never"), wait_s=0)) >= 2  # the agent and its worker (and forkserver)
        (folder / LEASE_FILE).write_text("1 10.0.0.2:29400\n")  # host 1 took over
        assert lead.proc.wait(timeout=30) == 1, lead.text()[-3000:]
        assert processes_with(str(tmp_path / "never")) == []  # its worker was stopped with it
    finally:
        if lead.proc.poll() is None:
            os.killpg(lead.proc.pid, signal.SIGKILL)
            lead.proc.wait()
    assert f"the lead at 10.0.0.2:29400 beats in {folder} now" in lead.text(), lead.text()[-3000:]
    assert "cannot write the lead's beat" not in lead.text()  # its first beat made the folder
    assert Lease.read(str(folder)) == (1, "10.0.0.2:29400")


def test_an_agent_that_lost_the_store_follows_the_beat_in_the_shared_folder(tmp_path, monkeypatch):
    # The decision alone, without hosts: who leads next, or whether this host is the one cut off.
    from gradsync.adapt import durable
    from gradsync.launch import elastic_hosts
    from gradsync.launch.elastic_hosts import NextLead

    monkeypatch.setenv(durable.RESUME_ENV, "0")

    def agent(index: int, peers: dict, dropped=()) -> elastic_hosts.HostAgent:
        a = object.__new__(elastic_hosts.HostAgent)
        a.command, a.addr, a.port, a.nproc, a.logdir, a.grace_s = ["train.py"], "127.0.0.1", 29400, 2, None, 1.0
        a.min_np, a.max_np, a.standby, a.index, a.folder = 2, 8, 1, index, str(tmp_path)
        a.peers, a.dropped, a.procs, a.flight_dir = peers, set(dropped), {}, str(tmp_path / "flight")
        a.forks = type("Forks", (), {"close": lambda self: None})()
        return a

    def beat(count: int, endpoint: str = "127.0.0.1:29400") -> None:
        (tmp_path / elastic_hosts.LEASE_FILE).write_text(f"{count} {endpoint}\n")

    # No beat at all: a dead lead cannot be told from a cut link; nobody takes over.
    result = agent(1, {2: "10.0.0.3"})._take_over("silent")
    assert result.returncode == 1 and "no lead beats in" in result.message, result.message
    # The lost lead's beat goes on: the lead lives, this host is the one cut off; nobody takes over.
    beat(1)
    beating = threading.Event()

    def go_on():
        count = 2
        while not beating.wait(0.1):
            beat(count)
            count += 1

    threading.Thread(target=go_on, daemon=True).start()
    result = agent(1, {2: "10.0.0.3"})._take_over("silent")
    beating.set()
    assert result.returncode == 1 and "still beats" in result.message and "cut off" in result.message
    assert os.environ[durable.RESUME_ENV] == "0"
    # It stands still: the first registered of the survivors leads, and the others follow it ...
    beat(7)
    assert agent(3, {1: "10.0.0.2", 2: "10.0.0.3"}, dropped={1})._take_over("silent") == NextLead("10.0.0.3", 29400, False, 2, 8, 1)
    assert os.environ[durable.RESUME_ENV] == "1"  # the workers it starts next resume from the newest commit
    assert agent(2, {3: "10.0.0.4"})._take_over("silent") == NextLead("127.0.0.1", 29400, True, 2, 8, 1)  # --standby 1 as before
    # ... or the beat names the new lead already: follow it at once.
    beat(1, "10.0.0.9:29411")
    assert agent(4, {1: "10.0.0.2"})._take_over("silent") == NextLead("10.0.0.9", 29411, False, 2, 8, 1)
