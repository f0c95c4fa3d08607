"""Emulated clusters: namespaces, shaped links, teardown, and the commands that use them.

These tests create network namespaces and qdiscs, which needs root (CI runs as root); elsewhere
they skip. Every test checks that nothing is left behind: no namespace, no /etc/netns entry.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gradsync.cluster import EmulatedCluster, LinkRates, leftovers, netns, parse_net, parse_rate
from gradsync.emulate.slow import SlowRanks
from gradsync.errors import ConfigError

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="creating network namespaces and qdiscs needs root")
GRADSYNC = [sys.executable, "-m", "gradsync.cli"]


def ours() -> list[str]:
    """Namespaces this test process (or its children) created and did not remove."""
    return [n for n in leftovers(include_live=True) if n.startswith(f"{netns.PREFIX}{os.getpid()}-")]


def test_rates_parse_and_bad_rates_are_config_errors():
    assert parse_rate("100mbit") == 100e6 and parse_rate("2.5gbit") == 2.5e9 and parse_rate("10G") == 10e9
    for bad in ("fast", "-1gbit", "0gbit", "1 gallon"):
        with pytest.raises(ConfigError, match="bad link rate"):
            parse_rate(bad)


def test_per_rank_rates_parse_and_bad_ones_say_why():
    assert str(LinkRates.parse("1gbit")) == "1gbit" and LinkRates.parse("1gbit").ranks == {}
    rates = LinkRates.parse("1gbit, rank3=250mbit")
    assert (rates.default, rates.ranks, str(rates)) == (1e9, {3: 250e6}, "1gbit,rank3=250mbit")
    runs = parse_net("1gbit,10gbit,rank1=250mbit")  # bench: one run per rate, rank 1's host slow in each
    assert [(r.default, r.ranks) for r in runs] == [(1e9, {1: 250e6}), (10e9, {1: 250e6})]
    for bad, message in (("rank3=250mbit", "give the rate of every other host's link first, e.g. 1gbit,rank3"),
                         ("1gbit,host3=250mbit", "expected rankN=RATE"), ("1gbit,rankx=1gbit", "expected rankN=RATE"),
                         ("1gbit,rank3=fast", "bad link rate 'fast'"), ("1gbit,rank3=1g,rank3=2g", "rank 3 is named twice")):
        with pytest.raises(ConfigError, match=message):
            parse_net(bad)
    with pytest.raises(ConfigError, match="one link rate for every host"):
        LinkRates.parse("1gbit,10gbit")


def test_a_ranks_rate_goes_to_its_hosts_link_and_a_host_gets_one_rate():
    # two ranks a host: rank 3 is on host 1, which the rate names; the others keep the default
    assert LinkRates(1e9, {3: 250e6}).per_host([0, 0, 1, 1]) == {1: 250e6}
    assert LinkRates(1e9, {2: 250e6, 3: 250e6}).per_host([0, 0, 1, 1]) == {1: 250e6}
    with pytest.raises(ConfigError, match="ranks 2 and 3 share emulated host 1 .* 250 Mbit/s and 500 Mbit/s"):
        LinkRates(1e9, {2: 250e6, 3: 500e6}).per_host([0, 0, 1, 1])
    with pytest.raises(ConfigError, match="rank 4 is out of range: the job has ranks 0-3"):
        LinkRates(1e9, {4: 250e6}).per_host([0, 0, 1, 1])


def test_per_rank_rates_reach_the_shaping_of_the_right_namespace(monkeypatch):
    """launch_emulated's cluster, made but not created (no root needed): the tc commands of each link."""
    from gradsync.launch import emulated

    made = []

    class Planned(EmulatedCluster):
        def __enter__(self):
            made.append(self)
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(emulated, "EmulatedCluster", Planned)
    monkeypatch.setattr(emulated, "launch_local", lambda command, **options: options)
    emulated.launch_emulated(["true"], np=4, servers=1, rate_bps=1e9, rank_rates={3: 250e6}, ranks_per_host=2)
    cluster, = made
    assert cluster.hosts == 3 and [cluster.link_rate(h) for h in range(3)] == [1e9, 250e6, 1e9]
    slow = cluster.shaping(1)  # both ends of host 1's link: its eth0 (uplink) and its switch port (downlink)
    assert [(argv[2], argv[6]) for argv in slow] == [(cluster.host_ns(1), "eth0"), (cluster.switch, "p1")]
    assert all("250000000bit" in argv for argv in slow)
    assert all("1000000000bit" in argv for h in (0, 2) for argv in cluster.shaping(h))
    assert EmulatedCluster(2, None).shaping(0) == []
    with pytest.raises(ConfigError, match="host 2 has a link rate but the cluster has hosts 0-1"):
        EmulatedCluster(2, 1e9, host_rates={2: 1e6})


def test_without_privileges_the_error_says_what_is_needed(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns, "_has_net_admin", lambda: False)
    with pytest.raises(ConfigError, match="root or CAP_NET_ADMIN"):
        EmulatedCluster(2, 1e9).create()


def test_without_iproute2_the_error_says_what_to_install(monkeypatch, cli):
    # A machine without `ip` (a container image, a GPU VM) must not end in a FileNotFoundError traceback.
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "ip" else f"/usr/sbin/{tool}")
    with pytest.raises(ConfigError, match=r"need iproute2's ip and tc; ip not found on PATH here: install iproute2"):
        EmulatedCluster(2, 1e9).create()
    code, _, err = cli("bench", "--model", "toy", "--np", "2", "--net", "1gbit")
    assert code == 2 and "install iproute2" in err, err


@needs_root
def test_a_cluster_shapes_both_ends_and_leaves_nothing_behind():
    rate = 20e6
    with EmulatedCluster(2, rate) as cluster:
        assert len(ours()) == 3
        for ns, dev in ((cluster.host_ns(0), "eth0"), (cluster.switch, "p0")):
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "20Mbit" in qdisc, qdisc
        # 1 MB from host 0 to host 1 through the switch: shaped, so it takes about 0.4 s, not 1 ms.
        server = subprocess.Popen(cluster.exec_prefix(1) + [sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run(cluster.exec_prefix(0) + [sys.executable, "-c", _SENDER, cluster.address(1)], check=True, timeout=30)
        seconds = float(server.communicate(timeout=30)[0])
        assert 0.5 * 8e6 / rate < seconds < 3 * 8e6 / rate, f"1 MB took {seconds:.3f} s on a {rate / 1e6:.0f} Mbit/s link"
    assert ours() == []
    assert not os.path.exists(os.path.join(netns.ETC_NETNS, cluster.host_ns(0)))


_RECEIVER = """
import socket, time
s = socket.socket(); s.bind(("0.0.0.0", 5000)); s.listen(); c, _ = s.accept(); n = 0; t = None
while n < 1_000_000:
    b = c.recv(1 << 16); t = t or time.perf_counter(); n += len(b)
print(time.perf_counter() - t)
"""
_SENDER = """
import socket, sys
socket.create_connection((sys.argv[1], 5000)).sendall(bytes(1_000_000))
"""


@needs_root
@pytest.mark.alone  # its killed owner's namespaces are stale until reaped: others' checks would see them
def test_the_reaper_removes_a_cluster_whose_owner_was_killed():
    owner = subprocess.Popen([sys.executable, "-c", "from gradsync.cluster import EmulatedCluster\n"
                              "c = EmulatedCluster(2, None); c.create(); print('up', flush=True)\n"
                              "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "up"
    mine = [n for n in leftovers(include_live=True) if n.startswith(f"{netns.PREFIX}{owner.pid}-")]
    assert len(mine) == 3
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and set(mine) & set(leftovers(include_live=True)):
        time.sleep(0.2)
    assert not set(mine) & set(leftovers(include_live=True)), "the reaper left namespaces behind"


@needs_root
@pytest.mark.alone  # makes a stale namespace, and cleans up every stale one
def test_cleanup_removes_leftovers_of_dead_processes_only():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = f"{netns.PREFIX}{int(dead.stdout)}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with EmulatedCluster(1, None):
            out = subprocess.run(GRADSYNC + ["cluster", "cleanup"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert stale in out.stdout and stale not in leftovers(include_live=True)
            assert len(ours()) == 2, "cleanup removed a live cluster"
    finally:
        netns.remove([stale])
    assert ours() == []


@needs_root
def test_run_net_puts_each_rank_on_its_own_host():
    script = ("import os, torch, gradsync\n"
              "assert os.environ['GLOO_SOCKET_IFNAME'] == 'eth0' and os.environ['MASTER_ADDR'] == '10.213.0.1'\n"
              "topo = gradsync.init()\n"
              "t = torch.ones(3) * topo.rank\n"
              "gradsync.runtime.current().transport.allreduce(t)\n"
              "assert t.tolist() == [3.0] * 3, t\n"
              "print('address', os.popen('ip -4 -o addr show eth0').read().split()[3])\n"
              "gradsync.shutdown()\n")
    before = set(leftovers())  # stale ones: a concurrent test's live clusters are not this job's
    out = subprocess.run(GRADSYNC + ["run", "-np", "3", "--net", "200mbit", "--", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    addresses = sorted(line.split()[-1] for line in out.stdout.splitlines() if "address" in line)
    assert addresses == ["10.213.0.1/24", "10.213.0.2/24", "10.213.0.3/24"]
    assert set(leftovers()) <= before, "gradsync run left namespaces behind"


@pytest.mark.parametrize("args, message", [(["--seconds", "0"], "--seconds must be > 0, got 0"),
                                           (["--repeats", "0"], "--repeats must be >= 1, got 0"),
                                           (["--delay", "-1"], "--delay must be >= 0 ms, got -1")])
def test_netcheck_refuses_bad_numbers_before_making_hosts(cli, args, message):
    code, _, err = cli("netcheck", "--net", "1gbit", *args)
    assert code == 2 and message in err, err


@needs_root
def test_netcheck_reports_every_host_near_the_configured_rate():
    out = subprocess.run(GRADSYNC + ["netcheck", "--hosts", "2", "--net", "100mbit", "--seconds", "0.5", "--repeats", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line[:1].isdigit()]
    assert len(rows) == 2
    ratios = [float(cell.rstrip("x")) for row in rows for cell in row[2::2]]
    assert len(ratios) == 10 and all(0.5 < r < 1.2 for r in ratios), out.stdout


@needs_root
def test_bench_on_an_emulated_cluster_records_the_bound_and_a_trace(tmp_path):
    from test_emulate import toy_profile

    profile = toy_profile(tmp_path / "toy.json", ms=2.0)
    before = set(leftovers())  # stale ones: a concurrent test's live clusters are not this job's
    records, trace = tmp_path / "records.json", tmp_path / "trace.json"
    # a straggler on both counts: worker 1 computes twice as long, the server's host (rank 2) has a slower link
    out = subprocess.run(GRADSYNC + ["bench", "--model", "toy", "--batch-size", "4", "--compute", f"emulated:{profile}",
                                     "--dilation", "2", "--net", "100mbit,rank2=50mbit", "--strategies", "allreduce,ps",
                                     "--ranks-per-host", "2", "--servers", "1", "--slow", "1:2",
                                     # two warm-up steps: the link count starts once the first has settled
                                     "--steps", "3", "--warmup", "2", "--rounds", "1", "--check-steps", "2",
                                     "--json", str(records), "--trace", str(trace)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    records = {r["strategy"]: r for r in json.loads(records.read_text())}
    profile_s = (2.0 + 4.0) * 1e-3 * len(json.loads(open(profile).read())["layers"])  # forward + backward, a layer
    assert "rank 2's host at 50 Mbit/s" in out.stdout and "rank 1 computes 2x as long" in out.stdout, out.stdout
    for r in records.values():
        assert r["net"] == "0.1 Gbit/s (rank 2: 0.05)" and r["rank_rates_bps"] == {"2": 50e6} and r["slow"] == "1:2"
        assert r["compute_s"] >= 2 * profile_s  # the slowest worker's compute, undilated: the slowed one's
        assert r["compute"].startswith("emulated") and r["dilation"] == 2.0
        assert r["correct"] is True and 0 < r["efficiency"] and r["bound_samples_per_s"] <= r["ideal_samples_per_s"]
        assert r["t_comm_min_s"] == pytest.approx(r["min_bytes_per_host"] * 8 / 100e6)
        # two hosts: both workers on the first, the server on its own; each link's counters per step
        assert len(r["hosts_tx_bytes_per_step"]) == len(r["hosts_rx_bytes_per_step"]) == 2, r
        assert r["host_tx_bytes_per_step"] == max(r["hosts_tx_bytes_per_step"])
    # allreduce stays inside the workers' host: no bytes to cross a link, and next to none did
    ring, served = records["allreduce"], records["ps"]
    assert ring["min_bytes_per_host"] == 0 and ring["bytes_per_step"] > 0
    assert max(ring["host_tx_bytes_per_step"], ring["host_rx_bytes_per_step"]) < ring["bytes_per_step"] / 4, ring
    # ps: the workers' host pushes the model to the server's host at least once a step, and pulls it back
    model = served["min_bytes_per_host"]
    assert model > 0 and served["hosts_rx_bytes_per_step"][1] >= model and served["hosts_rx_bytes_per_step"][0] >= model
    busier = max(served["host_tx_bytes_per_step"], served["host_rx_bytes_per_step"])
    assert served["host_link_over_min"] == pytest.approx(busier / model) and "host_link_over_min" not in ring
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in (0, 1):
        names = {e["name"].split()[0] for e in events if e.get("pid") == rank and e["ph"] in "Xb"}
        assert {"forward", "backward", "allreduce", "ps"} <= names, names
        assert any(e["ph"] == "b" and e["args"]["bytes"] > 0 for e in events if e.get("pid") == rank)
        assert any(e.get("tid") == 2 for e in events if e.get("pid") == rank), "no waits recorded"
        # the step track: each step, and the training loop's calls inside it, one after the other
        track = sorted((e for e in events if e.get("pid") == rank and e.get("tid") == 0 and e["ph"] == "X"),
                       key=lambda e: (e["ts"], -e["dur"]))
        steps = [e for e in track if " step " in e["name"]]
        calls = [e for e in track if " step " not in e["name"]]
        assert len(calls) == 4 * len(steps) > 0
        for step, four in zip(steps, zip(*[iter(calls)] * 4)):
            assert [c["name"] for c in four] == ["forward + loss", "backward()", "optimizer.step()", "zero_grad()"]
            assert step["ts"] <= four[0]["ts"] and four[-1]["ts"] + four[-1]["dur"] <= step["ts"] + step["dur"] + 1
    assert set(leftovers()) <= before, "gradsync bench left namespaces behind"


@needs_root
def test_bench_leaves_the_straggler_monitors_link_probe_out_of_the_links_bytes(tmp_path):
    from test_emulate import toy_profile

    from gradsync import stragglers

    # One round of 11 steps: after the tenth the monitor probes each worker's link (16 MiB each way,
    # 1.5 MiB a step of the round if counted); the links' bytes per step are the strategy's alone.
    profile = toy_profile(tmp_path / "toy.json", ms=2.0)
    records = tmp_path / "records.json"
    out = subprocess.run(GRADSYNC + ["bench", "--model", "toy", "--batch-size", "4", "--compute", f"emulated:{profile}",
                                     "--net", "1gbit", "--np", "2", "--strategies", "allreduce,p3",
                                     "--steps", str(stragglers.PROBE_FIRST - 1), "--warmup", "2", "--rounds", "1",
                                     "--check-steps", "0", "--json", str(records)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in json.loads(records.read_text()):
        assert r["host_probe_bytes"] >= stragglers.PROBE_CHUNKS * stragglers.PROBE_BYTES, r["strategy"]
        # the toy model's few kB a step, headers and acknowledgements included, against 1.5 MiB
        assert max(r["host_tx_bytes_per_step"], r["host_rx_bytes_per_step"]) < 4 * r["bytes_per_step"] + 20_000, r


@needs_root
def test_a_delay_line_adds_the_delay_and_goes_away_with_the_cluster():
    with EmulatedCluster(2, 100e6, delay_ms=20) as cluster:
        line = cluster._line
        server = subprocess.Popen(cluster.exec_prefix(1) + [sys.executable, "-c", _ECHO])
        time.sleep(0.5)
        out = subprocess.run(cluster.exec_prefix(0) + [sys.executable, "-c", _PING, cluster.address(1)],
                             capture_output=True, text=True, timeout=30)
        server.kill()
        server.wait()
        rtt = float(out.stdout)
        # 20 ms one way: 40 ms there and back at least; far less than twice that.
        assert 0.040 <= rtt < 0.080, f"round trip {rtt * 1e3:.1f} ms with a 20 ms one-way delay"
    assert line.poll() is not None, "the delay line outlived its cluster"
    assert ours() == []


_ECHO = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 5001)); s.listen(); c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(64)):
    c.sendall(b)
"""
_PING = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5001)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(5):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(64); times.append(time.perf_counter() - t)
print(sorted(times)[2])
"""


def test_a_lossy_line_drops_the_given_share_of_frames_and_keeps_the_rest_whole_and_in_order():
    import contextlib
    import random
    import socket
    import threading

    from gradsync.cluster import delayline

    host, line_host = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one frame per message
    switch, line_switch = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    control_read, control_write = os.pipe()
    for end in (line_host, line_switch):
        end.setblocking(False)
    peer = {line_host.fileno(): line_switch.fileno(), line_switch.fileno(): line_host.fileno()}
    line = threading.Thread(target=delayline.run, args=(0.0, peer, control_read, 0.25, random.Random(0)))
    line.start()
    frames = [i.to_bytes(4, "big") * 64 for i in range(2000)]
    arrived = []

    def receive():
        switch.settimeout(2.0)
        with contextlib.suppress(TimeoutError):
            while True:
                arrived.append(switch.recv(4096))

    receiver = threading.Thread(target=receive)
    receiver.start()
    for n, frame in enumerate(frames):
        host.send(frame)
        if n % 50 == 0:
            time.sleep(0.01)  # a line writing to a full socket drops the frame, as a full NIC would
    receiver.join()
    os.close(control_write)
    line.join(timeout=10)
    assert not line.is_alive()
    assert all(frame in frames for frame in arrived)  # whole
    assert arrived == sorted(arrived)  # in order
    assert 0.2 < 1 - len(arrived) / len(frames) < 0.3, f"{len(frames) - len(arrived)} of {len(frames)} frames lost"
    for end in (host, line_host, switch, line_switch):
        end.close()
    os.close(control_read)


def test_loss_needs_net_and_a_share_below_everything():
    for args, message in ((["--loss", "5"], "--loss needs --net"), (["--net", "1gbit", "--loss", "100"], "below 100")):
        out = subprocess.run(GRADSYNC + ["run", "-np", "2", *args, "--", "true"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.parametrize("args,message", [
    (["--dilation", "2"], "needs --compute emulated"),
    (["--compute", "emulated:flops:1tflops", "--dilation", "0.5"], "--dilation must be >= 1"),
    (["--delay", "5"], "--delay needs --net"),
    (["--net", "1 parsec"], "bad link rate"),
    (["--compute", "emulated"], "no shipped compute profile"),
    (["--slow", "1:2"], "--slow needs --compute emulated"),
    (["--compute", "emulated:flops:1tflops", "--slow", "1:0.5"], "argument --slow: '1:0.5': the factor must be a number >= 1"),
    (["--compute", "emulated:flops:1tflops", "--slow", "one:2"], "argument --slow: 'one:2': expected RANK:FACTOR"),
    (["--compute", "emulated:flops:1tflops", "--slow", "2:2"], "--slow: rank 2 is out of range: the workers are ranks 0-1"),
    (["--compute", "emulated:flops:1tflops", "--slow", "2:2", "--servers", "1"], "rank 2 is a parameter server"),
    (["--compute", "emulated:flops:1tflops", "--np", "2,4", "--slow", "2:2"], "(with --np 2)"),
    (["--compute", "emulated:flops:1tflops", "--slow", "1:2", "--slow", "1:3"], "rank 1 is named twice"),
    (["--net", "rank1=250mbit"], "--net rank1=250mbit: give the rate of every other host's link first"),
    (["--net", "1gbit,rank2=250mbit"], "--net 1gbit,rank2=250mbit: rank 2 is out of range: the job has ranks 0-1"),
    (["--net", "1gbit,rank2=250mbit,rank3=500mbit", "--np", "4", "--ranks-per-host", "2"], "share emulated host 1"),
])
def test_bad_cluster_arguments_are_argument_errors(cli, args, message):
    code, _, err = cli("bench", "--model", "toy", *args)
    assert code == 2 and message in err, err


def _dilation(text: str, rate: float) -> float:
    from argparse import Namespace

    from gradsync.bench.args import _cluster_args, _config

    def error(message):
        raise SystemExit(message)

    args = Namespace(model="toy", batch_size=4, optimizer="sgd", lr=0.01, seed=0, compute="emulated", dilation=text,
                     servers=0, steps=2, warmup=1, threads=1, check_steps=0, rounds=1, delay=0.0, trace=None,
                     tune=False, tune_steps=6, np="4", net=None)
    _cluster_args(args, error)
    return _config(args, ["allreduce"], {}, 4, rate)["dilation"]


def test_a_run_records_its_slow_ranks_and_per_rank_rates(monkeypatch):
    from argparse import Namespace

    import gradsync.cluster
    from gradsync.bench.args import _cluster_args, _config
    from gradsync.bench.report import bound

    def error(message):
        raise SystemExit(message)

    monkeypatch.setattr(gradsync.cluster, "require_privileges", lambda: None)  # nothing is created here
    args = Namespace(model="toy", batch_size=4, optimizer="sgd", lr=0.01, seed=0, compute="emulated:flops:1tflops",
                     dilation="auto", servers=0, steps=2, warmup=1, threads=1, check_steps=0, rounds=1, delay=0.0,
                     trace=None, tune=False, tune_steps=6, np="4", net="1gbit,4gbit,rank3=250mbit",
                     slow=[SlowRanks.parse("1:2")])
    _cluster_args(args, error)
    assert args.rates == [1e9, 4e9]
    config = _config(args, ["allreduce"], {}, 4, 4e9)
    assert config["slow"] == "1:2" and config["rank_rates_bps"] == {"3": 250e6} and config["dilation"] == 4.0
    record = bound(1e6, 0.1, 128, config)
    assert record["net"] == "4 Gbit/s (rank 3: 0.25)" and record["rank_rates_bps"] == {"3": 250e6}
    assert record["t_comm_min_s"] == pytest.approx(1e6 * 8 / 4e9)  # the bound keeps the default rate


def test_auto_dilation_keeps_every_real_link_at_most_1_gbit():
    for rate, k in ((100e6, 1.0), (1e9, 1.0), (4e9, 4.0), (25e9, 25.0)):
        assert _dilation("auto", rate) == k
    assert _dilation("3", 25e9) == 3.0


def test_auto_dilation_to_a_lower_real_rate():
    for rate, k in ((100e6, 1.0), (1e9, 2.0), (10e9, 20.0), (30e9, 60.0)):
        assert _dilation("auto:500mbit", rate) == k
    with pytest.raises(SystemExit, match="auto:RATE"):
        _dilation("auto:fast", 1e9)
    with pytest.raises(SystemExit, match="--dilation must be"):
        _dilation("lots", 1e9)


def test_counters_read_drops_and_tcp_resends_from_the_kernels_text():
    """gradsync.cluster.counters (benchmarks/link_counters.py; docs/mechanisms.md quotes its counts) on tc's
    and /proc's text."""
    from gradsync.cluster import counters

    tc = ("qdisc tbf 8001: dev p0 root refcnt 2 rate 500Mbit burst 256Kb lat 20ms\n"
          " Sent 2319598681 bytes 289769 pkt (dropped 3, overlimits 1200 requeues 0)\n"
          "qdisc tbf 8002: dev p1 root refcnt 2 rate 500Mbit burst 256Kb lat 20ms\n"
          " Sent 19598681 bytes 2769 pkt (dropped 14, overlimits 0 requeues 0)\n")
    assert counters.tc_drops(tc) == 17
    snmp = ("Ip: Forwarding DefaultTTL\nIp: 2 64\n"
            "Tcp: RtoAlgorithm RtoMin OutSegs RetransSegs InErrs\nTcp: 1 200 290338 2 0\n"
            "TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes\nTcpExt: 0 1 6\n")
    assert counters.tcp_counters(snmp) == {"OutSegs": 290338, "RetransSegs": 2, "TCPTimeouts": 1}


@pytest.mark.parametrize("args", [[], ["--"]], ids=["nothing", "no-command"])
def test_link_counters_without_a_command_says_how_to_run_it(args):
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "link_counters.py")
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "usage: sudo python benchmarks/link_counters.py -- COMMAND" in done.stderr, done
