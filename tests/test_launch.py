"""Tests for ``gradsync run`` (gradsync/launch/).

Children are tiny ``python -c`` scripts (no torch), so every test takes well under a few seconds.
Processes are "gone" when /proc has no entry or a zombie: PID 1 of some containers never reaps
orphans, and a zombie can hold no resources.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from gradsync import launch
from gradsync.launch import RankSpec, launch_local, parse_hosts, plan_ranks, read_hostfile

PY = sys.executable


def child(source: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(source)]


def run_cli(argv: list[str]) -> int:
    """What ``gradsync.cli.main(["run", *argv])`` does, without importing the other subcommands."""
    parser = argparse.ArgumentParser(prog="gradsync")
    launch.add_parser(parser.add_subparsers(dest="command_name", required=True))
    args = parser.parse_args(["run", *argv])
    return args.handler(args)


def launcher_process(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "gradsync.launch", *argv], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout_s: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.02)
    return [pid for pid in pids if alive(pid)]


def read_pids(directory, count: int) -> list[int]:
    pids = [int((directory / name).read_text()) for name in os.listdir(directory) if name.startswith("pid-")]
    assert len(pids) == count
    return pids


# Each rank writes its pid to $PIDDIR/pid-$RANK; FAIL_RANK waits for all of them, writes 25 stderr
# lines and exits with FAIL_CODE (or SIGKILLs itself); the others sleep 60 s.
FAILING_JOB = """
    import os, signal, sys, time
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    d = os.environ["PIDDIR"]
    with open(os.path.join(d, f"tmp-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(d, f"tmp-{rank}"), os.path.join(d, f"pid-{rank}"))
    if rank != int(os.environ["FAIL_RANK"]):
        time.sleep(60)
    while len([n for n in os.listdir(d) if n.startswith("pid-")]) < world:
        time.sleep(0.01)
    for i in range(25):
        print(f"boom line {i}", file=sys.stderr)
    if os.environ["FAIL_CODE"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(os.environ["FAIL_CODE"]))
"""


# --- the environment contract and output ----------------------------------------------------------

def test_a_gradsync_command_ends_as_pythons_exit_does():
    # exit_now skips only the interpreter's teardown: threads still running are joined, atexit
    # functions run, buffered output reaches the reader, and the status is the command's.
    done = subprocess.run(child("""
        import atexit, threading, time
        from gradsync.fastexit import exit_now
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", end="; "))).start()
        atexit.register(lambda: print("atexit ran", end=""))
        print("buffered", end="; ")
        exit_now(3)
        print("never")
    """), capture_output=True, text=True, timeout=30)
    assert done.returncode == 3 and done.stdout == "buffered; thread done; atexit ran", done


@pytest.mark.parametrize("keep", [False, True])
def test_a_training_script_ends_without_the_last_collections_unless_asked(keep):
    # gradsync.init() freezes the collector's objects at exit, after the atexit functions registered
    # later (and its own shutdown), before those registered earlier; GRADSYNC_EXIT_GC=1 keeps them.
    done = subprocess.run(child("""
        import atexit, gc
        atexit.register(lambda: print("frozen" if gc.get_freeze_count() else "not frozen", end=""))
        import gradsync
        gradsync.init()
        atexit.register(lambda: print(gc.get_freeze_count(), end="; "))
    """), capture_output=True, text=True, timeout=60,
        env={**os.environ, "GRADSYNC_EXIT_GC": "1" if keep else "0"})
    assert done.returncode == 0 and done.stdout == ("0; not frozen" if keep else "0; frozen"), done


def test_env_contract_three_workers_two_servers(capsys, monkeypatch):
    monkeypatch.setenv("GRADSYNC_TEST_PARENT", "inherited")
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "GRADSYNC_NUM_WORKERS", "GRADSYNC_NUM_SERVERS", "GRADSYNC_ROLE",
            "GRADSYNC_ROLE_RANK", "PYTHONUNBUFFERED", "GRADSYNC_TEST_PARENT", "EXTRA"]
    script = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    result = launch_local(child(script), np=3, servers=2, env={"EXTRA": "x"})
    assert (result.returncode, result.failed, result.message) == (0, None, "")
    envs = {}
    for line in capsys.readouterr().out.splitlines():
        label, payload = line[1:].split("] ", 1)
        envs[label] = json.loads(payload)
    assert sorted(envs) == ["server 0", "server 1", "worker 0", "worker 1", "worker 2"]
    for label, env in envs.items():
        role, role_rank = label.split()
        assert env["GRADSYNC_ROLE"] == role and env["GRADSYNC_ROLE_RANK"] == role_rank
        assert int(env["RANK"]) == int(role_rank) + (3 if role == "server" else 0)
        assert env["LOCAL_RANK"] == env["RANK"]  # one machine: local ranks equal global ranks
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("5", "5", "0")
        assert (env["GRADSYNC_NUM_WORKERS"], env["GRADSYNC_NUM_SERVERS"]) == ("3", "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["PYTHONUNBUFFERED"] == "1"
        assert (env["GRADSYNC_TEST_PARENT"], env["EXTRA"]) == ("inherited", "x")
    ports = {env["MASTER_PORT"] for env in envs.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536  # one rendezvous port for the whole job


def test_prefixes_split_streams_and_whole_lines(capsys):
    script = """
        import os, sys
        r = os.environ["GRADSYNC_ROLE_RANK"]
        for i in range(200):
            print(r * 3000)                        # long lines: several pipe reads each
            print(f"err {r} {i}", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """
    assert launch_local(child(script), np=2, servers=1).returncode == 0
    captured = capsys.readouterr()
    out, err = captured.out.splitlines(), captured.err.splitlines()
    expected_out = {f"[{label}] {label[-1] * 3000}" for label in ("worker 0", "worker 1", "server 0")}
    assert set(out) - {f"[{label}] no newline at the end" for label in ("worker 0", "worker 1", "server 0")} \
        == expected_out
    assert len(out) == 3 * 201 and len(err) == 3 * 200
    assert "[worker 1] err 1 199" in err and "[server 0] err 0 0" in err
    assert all(line.startswith(("[worker 0] err 0 ", "[worker 1] err 1 ", "[server 0] err 0 ")) for line in err)


def test_logdir_has_one_unprefixed_file_per_rank(tmp_path, capsys):
    script = """
        import os, sys
        print("out", os.environ["RANK"]); print("err", os.environ["RANK"], file=sys.stderr)
    """
    assert launch_local(child(script), np=2, servers=1, logdir=str(tmp_path / "logs")).returncode == 0
    logs = {name: (tmp_path / "logs" / name).read_text() for name in os.listdir(tmp_path / "logs")}
    assert sorted(logs) == ["server-0.log", "worker-0.log", "worker-1.log"]
    assert sorted(logs["server-0.log"].splitlines()) == ["err 2", "out 2"]
    assert "[worker 0] out 0" in capsys.readouterr().out  # the terminal still gets the output


# --- failures ---------------------------------------------------------------------------------------

@pytest.mark.alone  # asserts the seconds to the error
def test_failed_rank_stops_the_others_and_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIDDIR", str(tmp_path))
    monkeypatch.setenv("FAIL_RANK", "1")
    monkeypatch.setenv("FAIL_CODE", "3")
    start = time.monotonic()
    result = launch_local(child(FAILING_JOB), np=3, servers=1)
    assert time.monotonic() - start < 5
    assert result.returncode == 3 and result.failed == RankSpec(1, "worker", 1, 1)
    first, *tail = result.message.splitlines()
    assert first == "gradsync run: worker 1 (rank 1) failed with exit code 3"
    assert [line.strip() for line in tail[1:]] == [f"boom line {i}" for i in range(5, 25)]  # the last 20
    assert wait_gone(read_pids(tmp_path, 4), timeout_s=0.5) == []


def test_rank_killed_by_signal(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIDDIR", str(tmp_path))
    monkeypatch.setenv("FAIL_RANK", "2")
    monkeypatch.setenv("FAIL_CODE", "kill")
    result = launch_local(child(FAILING_JOB), np=2, servers=1, grace_s=1)
    assert result.returncode == 128 + 9 and result.failed.role == "server"
    assert "server 0 (rank 2) was killed by signal 9 (SIGKILL)" in result.message
    assert wait_gone(read_pids(tmp_path, 3), timeout_s=0.5) == []


def test_a_rank_ended_by_a_fatal_signal_shows_its_python_threads(monkeypatch, capsys):
    """A C++ abort at exit ("terminate called without an active exception") names no Python code;
    the launcher turns on Python's fault handler in the ranks, so the report shows each thread's stack."""
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    script = """
        import os, threading, time
        def blocked_in_a_call():
            time.sleep(60)
        threading.Thread(target=blocked_in_a_call, daemon=True).start()
        time.sleep(0.2)
        os.abort()
    """
    result = launch_local(child(script), np=1, grace_s=0.3)
    assert result.returncode == 128 + signal.SIGABRT and "killed by signal 6 (SIGABRT)" in result.message
    assert "Fatal Python error: Aborted" in result.message and "in blocked_in_a_call" in result.message


def test_the_users_fault_handler_setting_stands(monkeypatch, capsys):
    show = child("import faulthandler, os; print(repr(os.environ.get('PYTHONFAULTHANDLER')), faulthandler.is_enabled())")
    for setting, shown in ((None, "'1' True"), ("", "'' False")):
        if setting is None:
            monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
        else:
            monkeypatch.setenv("PYTHONFAULTHANDLER", setting)
        assert launch_local(show, np=1).returncode == 0
        assert capsys.readouterr().out.splitlines() == [f"[worker 0] {shown}"]


@pytest.mark.parametrize("exit_code", [0, 1])
def test_grandchildren_are_stopped_even_if_they_ignore_sigterm(tmp_path, exit_code, capsys):
    script = f"""
        import subprocess, sys
        grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE, text=True)
        assert grandchild.stdout.readline() == "ready\\n"
        open({str(tmp_path / "grandchild")!r}, "w").write(str(grandchild.pid))
        sys.exit({exit_code})
    """
    result = launch_local(child(script), np=1, grace_s=0.3)
    assert result.returncode == exit_code
    assert wait_gone([int((tmp_path / "grandchild").read_text())], timeout_s=0.5) == []


def test_missing_program_is_reported(capsys):
    result = launch_local(["/nonexistent/program"], np=2)
    assert result.returncode == 127 and "cannot start worker 0" in result.message


# --- the launcher process itself ------------------------------------------------------------------

SLEEPER = child("import os, time; print(os.getpid(), flush=True); time.sleep(60)")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_stops_children(sig, code):
    proc = launcher_process(["-np", "2", "--", *SLEEPER])
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    proc.send_signal(sig)
    assert proc.wait(timeout=10) == code
    assert wait_gone(pids, timeout_s=0.5) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("forked", [False, True])
def test_killed_launcher_leaves_no_orphans(forked, tmp_path):
    command = SLEEPER
    if forked:  # a training script: forked by the forkserver, which dies with the launcher
        (tmp_path / "train.py").write_text(f"# torch\nexec({SLEEPER[-1]!r})\n")
        command = [PY, str(tmp_path / "train.py")]
    proc = launcher_process(["-np", "2", "--", *command])
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    servers = forkservers_of(proc.pid)
    assert len(servers) == int(forked)
    for pid in [*pids, *servers]:  # ps shows the script: pgrep -f train.py finds every forked rank
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[-2] == command[-1].encode()
    proc.kill()  # SIGKILL: no cleanup code runs; PR_SET_PDEATHSIG must do it
    proc.wait(timeout=10)
    assert wait_gone(pids + servers) == []


@pytest.mark.timeout(20)
def test_cli_through_pipes_reports_failure():
    script = "import os, sys; print('hi'); sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    proc = launcher_process(["-np", "2", "--", *child(script)])
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 3
    assert "[worker 0] hi" in out.splitlines() and "[worker 1] hi" in out.splitlines()
    assert "gradsync run: worker 1 (rank 1) failed with exit code 3" in err


def test_gradsync_cli_main_runs_the_launcher(capsys):
    pytest.importorskip("gradsync.bench.cli")  # cli.main imports every subcommand
    from gradsync import cli
    assert cli.main(["run", "-np", "2", "--", *child("print('ok')")]) == 0
    assert "[worker 1] ok" in capsys.readouterr().out


# --- ports and arguments ---------------------------------------------------------------------------

def test_port_in_use_exits_2_before_spawning(capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = run_cli(["-np", "1", "--port", str(port), "--", *child("print('started')")])
    captured = capsys.readouterr()
    assert code == 2 and "started" not in captured.out
    assert f"MASTER_PORT {port} is already in use" in captured.err
    assert "127.0.0.1" in captured.err and "--port" in captured.err and "stop the process" in captured.err


@pytest.mark.parametrize("argv, fragment", [
    (["-np", "0", "--", "x"], "must be >= 1"),
    (["-np", "2", "--servers", "-1", "--", "x"], "must be >= 0"),
    (["-np", "2"], "missing the command"),
    (["-np", "2", "--"], "missing the command"),
    (["-np", "2", "-H", "a:1", "--hostfile", "f", "--", "x"], "not allowed with"),
    (["-np", "5", "-H", "a:2,b:2", "--node-rank", "0", "--", "x"], "-np 5 exceeds the 4 slots"),
    (["-np", "2", "-H", "a:two", "--node-rank", "0", "--", "x"], "bad host entry"),
    (["-np", "2", "-H", "a:1,b:1", "--node-rank", "2", "--", "x"], "out of range"),
    (["-np", "1", "--node-rank", "1", "--", "x"], "--node-rank needs -H"),
    (["-np", "1", "--port", "70000", "--", "x"], "1..65535"),
    (["-np", "2", "--nproc-per-node", "2", "--", "x"], "give the number of workers once"),
    (["--nnodes", "2", "--", "x"], "--nnodes needs --nproc-per-node"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--", "x"], "--nnodes > 1 needs --master-addr"),
    (["--nproc-per-node", "1", "--nnodes", "2", "-H", "a:1,b:1", "--master-addr", "a", "--", "x"],
     "drop -H/--hostfile"),
    (["--", "x"], "the number of workers is required"),
    (["--nproc-per-node", "1", "--max-restarts", "3", "x.py"], "does not restart a failed job"),
    (["--nproc-per-node", "1", "--nnodes", "1:2", "x.py"], "a range of machines is torchrun's elastic form: add --elastic"),
    (["--nproc-per-node", "1", "--rdzv-endpoint", "a:1", "--master-addr", "a", "x.py"], "drop --master-addr"),
    (["--nproc-per-node", "1", "--rdzv-endpoint", "a:port", "x.py"], "--rdzv-endpoint a:port: the port"),
    (["--nproc-per-node", "1", "--rdzv-backend", "etcd", "x.py"], "invalid choice: 'etcd'"),
    (["--nproc-per-node", "1", "-m", "--no-python", "x"], "give one"),
    (["--nproc-per-node", "1", "--logdir", __file__, "x.py"], "is a file; name a folder"),
    (["--nproc-per-node", "1", "--checkpoint-dir", __file__, "x.py"], "is a file; name a folder"),
    (["--elastic", "--net", "1gbit", "-np", "3", "--ranks-per-host", "2", "x.py"], "-np 3 must be a multiple of"),
    (["--elastic", "--net", "1gbit", "-np", "2", "--max-np", "4", "x.py"], "give --max-np equal to -np"),
    (["--elastic", "--net", "1gbit,rank1=2gbit", "-np", "2", "x.py"], "one rate for every link"),
    (["--elastic", "--net", "1gbit", "-np", "2", "--servers", "1", "x.py"], "no -H, --hostfile, --master-addr"),
    (["--elastic", "-np", "2", "--servers", "1", "x.py"], "no -H, --hostfile or --servers"),
])
def test_argument_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_torchruns_names_start_the_same_job(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    show = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['OMP_NUM_THREADS'])"
    assert run_cli(["--nproc-per-node", "2", "--master-port", str(launch.find_free_port()), "--", *child(show)]) == 0
    out, err = capsys.readouterr()
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert sorted(line.split("] ")[1] for line in out.splitlines()) == [f"0 2 {threads}", f"1 2 {threads}"]
    assert f"OMP_NUM_THREADS={threads} for each of 2 local ranks" in err


def test_torchruns_command_forms_and_rendezvous_flags_work(capsys, tmp_path, monkeypatch):
    """As torchrun runs them: a .py script and -m MODULE with this Python, --standalone,
    --rdzv-endpoint as the rendezvous address and port, --nproc-per-node cpu."""
    script = tmp_path / "train.py"  # not executable: torchrun runs it with Python
    script.write_text("import os, sys; print('script', os.environ['RANK'], os.environ['WORLD_SIZE'], sys.argv[1:])\n")
    (tmp_path / "trainmod.py").write_text("import os; print('module', os.environ['RANK'])\n")
    port = launch.find_free_port()
    argv = ["--standalone", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id", "job",
            "--rdzv-endpoint", f"127.0.0.1:{port}", str(script), "--lr", "0.1"]
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    assert sorted(line.split("] ")[1] for line in out.splitlines()) == [
        "script 0 2 ['--lr', '0.1']", "script 1 2 ['--lr', '0.1']"]
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert run_cli(["--nproc-per-node", "cpu", "-m", "trainmod"]) == 0
    out = capsys.readouterr().out
    assert sorted(line.split("] ")[1] for line in out.splitlines()) == [f"module {r}" for r in range(os.cpu_count() or 1)]


def test_second_machine_of_a_torchrun_style_job_runs_its_own_ranks(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands, and nothing is said
    show = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['OMP_NUM_THREADS'])"
    argv = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
            "--master-port", "29999", "--", *child(show)]
    assert run_cli(argv) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[worker 1] 1 2 3"] and "OMP_NUM_THREADS" not in err


def test_version_strategies_help_and_the_launcher_do_not_import_torch(tmp_path):
    # `gradsync run` itself, checkpoint options and all, starts its ranks without torch's seconds of import
    job = ["run", "-np", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--", PY, "-c", "print('rank ran')"]
    code = ("import sys, contextlib, io\n"
            "from gradsync import cli\n"
            "for argv in (['--help'], ['--version'], ['run', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        try:\n"
            "            cli.main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "    print(out.getvalue().splitlines()[0])\n"
            f"print('job', cli.main({job!r}), flush=True)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert lines[0].startswith("usage: gradsync") and lines[1].startswith("gradsync 0.")
    assert lines[2].startswith("usage: gradsync run") and lines[-1] == "no torch", proc.stdout
    assert "job 0" in lines and "rank ran" in proc.stdout, proc.stdout


def test_every_command_s_help_is_plain_text_and_every_option_has_a_line():
    import argparse
    import contextlib
    import io

    from gradsync import cli

    for command in cli.COMMANDS:
        parser = cli.build_parser(command)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        parsers = [(command, sub)]
        for action in sub._actions:  # subcommands of a subcommand (gradsync cluster cleanup)
            if isinstance(action, argparse._SubParsersAction):
                parsers += [(f"{command} {name}", p) for name, p in action.choices.items()]
        for name, p in parsers:
            silent = [a.option_strings or [a.dest] for a in p._actions
                      if a.help is None and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
            assert not silent, f"gradsync {name}: options without a help line: {silent}"
            with contextlib.redirect_stdout(io.StringIO()) as out:
                p.print_help()
            text = out.getvalue()
            assert "``" not in text and "%%" not in text and not re.search(r":(func|class|mod|meth):`", text), \
                f"gradsync {name} --help shows markup:\n{text}"


def test_strategies_lists_every_strategy_with_exactness_and_backends():
    proc = subprocess.run([sys.executable, "-m", "gradsync.cli", "strategies"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:] if line.strip()}
    from gradsync.strategies import STRATEGIES
    for name in STRATEGIES:
        assert name in rows, name
    assert "  no " in rows["sma"] and "  yes " in rows["p3"] and "lossless" in rows["casync-ring"]
    assert "Gloo/NCCL" in rows["allreduce"] and "Gloo " in rows["hybrid"] and "NCCL" not in rows["hybrid"]


def test_strategies_name_shows_one_strategys_paper_and_options(cli, monkeypatch):
    code, out, err = cli("strategies", "p3")
    assert code == 0, err
    assert "Jayarajan et al., SysML 2019" in out and "``" not in out
    assert "slice_params           50000" in out and "credit_mb              1.0" in out
    code, out, _ = cli("strategies", "ps-async")
    assert "fuse_kb         256.0" in out and "fixed by this name" not in out  # its own class: nothing to fix
    assert "compression     None" in out and "error_feedback  False" in out  # its pushes' codec
    from functools import partial

    from gradsync.strategies import P3, STRATEGIES
    monkeypatch.setitem(STRATEGIES, "p3-fifo", partial(P3, priority=False))  # a user's registered variant
    code, out, _ = cli("strategies", "p3-fifo")
    assert "priority               False  (fixed by this name)" in out
    code, out, _ = cli("strategies", "casync-ps")  # its own options, its bases', then the compressor's
    assert "partition_mb" in out and "bucket_mb" in out and "the compressor's own options" in out
    code, _, err = cli("strategies", "nope")
    assert code == 2 and "unknown strategy 'nope'; valid strategies: allreduce" in err


# --- hosts ------------------------------------------------------------------------------------------

def test_plan_ranks_two_hosts_with_servers():
    hosts = [("h1", 2), ("h2", 2)]
    assert plan_ranks(4, 3, hosts, 0) == [
        RankSpec(0, "worker", 0, 0), RankSpec(1, "worker", 1, 1),
        RankSpec(4, "server", 0, 2), RankSpec(6, "server", 2, 3)]
    assert plan_ranks(4, 3, hosts, 1) == [
        RankSpec(2, "worker", 2, 0), RankSpec(3, "worker", 3, 1), RankSpec(5, "server", 1, 2)]
    assert plan_ranks(3, 0, hosts, 1) == [RankSpec(2, "worker", 2, 0)]  # workers fill h1 first
    with pytest.raises(ValueError, match="exceeds"):
        plan_ranks(5, 0, hosts, 0)


def test_every_rank_is_placed_exactly_once():
    hosts = [("a", 3), ("b", 1), ("c", 2)]
    for np_, servers in [(1, 0), (4, 5), (6, 2)]:
        ranks = [s.rank for node in range(3) for s in plan_ranks(np_, servers, hosts, node)]
        assert sorted(ranks) == list(range(np_ + servers))


def test_parse_hosts_and_hostfile(tmp_path):
    assert parse_hosts("h1:2, h2:4,h3,[fd00::1]:2") == [("h1", 2), ("h2", 4), ("h3", 1), ("fd00::1", 2)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\n\nnode2:2   # second\nnode3\n")
    assert read_hostfile(hostfile) == [("node1", 4), ("node2", 2), ("node3", 1)]
    hostfile.write_text("node1 slots=4 extra\n")
    with pytest.raises(ValueError, match="bad line"):
        read_hostfile(hostfile)
    with pytest.raises(ValueError, match="SLOTS >= 1"):
        parse_hosts("h1:0")


def test_node_rank_detection(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "NodeB")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "nodeb.cluster.example")
    assert launch.detect_node_rank([("nodea", 2), ("nodeb", 2)]) == 1
    assert launch.detect_node_rank([("nodea.cluster.example", 2), ("nodeb.cluster.example", 2)]) == 1
    assert launch.detect_node_rank([("198.51.100.7", 1), ("127.0.0.1", 1)]) == 1  # by local address
    with pytest.raises(ValueError, match="is not in the host list.*--node-rank"):
        launch.detect_node_rank([("198.51.100.7", 1), ("198.51.100.8", 1)])
    with pytest.raises(ValueError, match="matches several entries.*--node-rank"):
        launch.detect_node_rank([("nodeb", 1), ("nodeb", 1)])


def test_second_node_runs_its_own_ranks(capsys):
    script = ("import os; print(*[os.environ[k] for k in "
              "('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT')])")
    with socket.socket() as holder:  # only node 0 checks the port: node 1 must not care
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = launch_local(child(script), np=3, servers=2, port=port,
                              hosts=[("127.0.0.1", 1), ("localhost", 2)], node_rank=1)
    assert result.returncode == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == [f"[server 1] 4 2 3 1 127.0.0.1 {port}",
                     f"[worker 1] 1 0 3 1 127.0.0.1 {port}",
                     f"[worker 2] 2 1 3 1 127.0.0.1 {port}"]


@pytest.mark.parametrize("argv,message", [
    (["--delay", "5", "-np", "1", "--", "true"], "--delay needs --net"),
    (["--grace", "-5", "-np", "1", "--", "true"], "argument --grace: must be >= 0"),
    (["--delay", "nan", "--net", "1gbit", "-np", "1", "--", "true"], "argument --delay: must be >= 0 and finite"),
])
def test_run_refuses_meaningless_numbers(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "--slow", "2:2", "--", "true"], "--slow: rank 2 is out of range: the workers are ranks 0-1"),
    (["-np", "2", "--servers", "1", "--slow", "2:2", "--", "true"], "--slow: rank 2 is a parameter server"),
    (["-np", "2", "--slow", "1:0.9", "--", "true"], "argument --slow: '1:0.9': the factor must be a number >= 1"),
    (["-np", "2", "--slow", "1", "--", "true"], "argument --slow: '1': expected RANK:FACTOR"),
    (["-np", "2", "--slow", "1:2", "--slow", "1:3", "--", "true"], "rank 1 is named twice"),
    (["-np", "2", "--elastic", "--slow", "1:2", "--", "true"], "not with --elastic"),
    (["-np", "2", "--net", "1gbit,10gbit", "--", "true"], "one link rate for every host"),
    (["-np", "2", "--net", "1gbit,rank2=1mbit", "--", "true"], "--net 1gbit,rank2=1mbit: rank 2 is out of range"),
    (["-np", "4", "--net", "1gbit,rank0=1mbit,rank1=2mbit", "--ranks-per-host", "2", "--", "true"],
     "ranks 0 and 1 share emulated host 0"),
])
def test_run_refuses_bad_stragglers(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_run_hands_slow_ranks_to_every_rank(monkeypatch):
    from gradsync.launch import cli

    started = {}
    monkeypatch.setattr(cli, "launch_local", lambda command, **options: started.update(options) or launch.JobResult(0, None, ""))
    assert run_cli(["-np", "4", "--slow", "3:2", "--slow", "1:1.25", "--", "true"]) == 0
    assert started["env"] == {"GRADSYNC_SLOW": "1:1.25,3:2"}
    assert run_cli(["-np", "4", "--", "true"]) == 0 and started["env"] == {}


@pytest.mark.parametrize("timeout", [-1, 0, float("inf"), "soon"])
def test_init_refuses_a_timeout_that_is_not_a_positive_number(timeout):
    import gradsync
    from gradsync.errors import ConfigError

    with pytest.raises(ConfigError, match="timeout"):
        gradsync.init(timeout_s=timeout)
    assert not gradsync.runtime.is_initialized()


def test_elastic_job_on_a_port_in_use_is_a_clear_error(capsys):
    from gradsync import store as stores

    held = stores.listen("127.0.0.1", 0)
    try:
        code = run_cli(["--elastic", "-np", "1", "--port", str(held.getsockname()[1]), "--", "true"])
    finally:
        held.close()
    assert code == 2 and "the port is in use" in capsys.readouterr().err


# --- the forkserver: training scripts start forked from a process that imported torch ------------

# What a rank sees when it starts (the comment names torch: a training script is forked). Rank 1
# waits for rank 0's line, then fails as FAIL says.
FACTS = """\
import json, os, random, signal, sys, time  # a training script: torch
facts = {"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "rank": os.environ["RANK"],
         "own_session": os.getsid(0) == os.getpid(), "stdin": os.readlink("/proc/self/fd/0"),
         "warm": "torch" in sys.modules, "gradsync_inherited": "gradsync" in sys.modules, "random": random.random()}
print(json.dumps(facts), flush=True)
if facts["rank"] == "1":
    while not os.path.exists(os.path.join(os.environ["PIDDIR"], "printed")):
        time.sleep(0.01)
    if os.environ["FAIL"] == "raise":
        raise ValueError("the rank's own error")
    os.kill(os.getpid(), signal.SIGKILL)
open(os.path.join(os.environ["PIDDIR"], "printed"), "w").close()
"""


def forkservers_of(pid: int) -> list[int]:
    """This process's forkserver children that are still alive."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"forkserver import _serve" in f.read() and alive(int(entry)):
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                            found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("forkserver", ["1", "0", "no torch", "no torch, read late"])
def test_a_forked_rank_runs_its_script_as_python_would(forkserver, tmp_path, monkeypatch, capsys):
    """Forked, started with exec (GRADSYNC_FORKSERVER=0), or with exec after the forkserver failed to
    import torch: the same script sees the same. "read late": the launcher reads the refusal only after
    the forkserver exited with the ranks' requests unread (a busy machine), which Linux reports as a
    reset ahead of the refusal."""
    if forkserver == "no torch, read late":
        from gradsync.launch import forkserver as module
        read = module._Server._read
        monkeypatch.setattr(module._Server, "_read", lambda server: (server.proc.wait(), read(server)))
        forkserver = "no torch"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIDDIR", str(tmp_path))
    monkeypatch.setenv("FAIL", "raise")
    monkeypatch.setenv("GRADSYNC_FORKSERVER", "0" if forkserver == "0" else "1")
    if forkserver == "no torch":
        (tmp_path / "shadow" / "torch").mkdir(parents=True)
        (tmp_path / "shadow" / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / "shadow"))
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text(FACTS)
    result = launch_local([PY, "scripts/train.py", "--lr", "0.1"], np=2)
    out, err = capsys.readouterr()
    facts = [json.loads(line.split("] ", 1)[1]) for line in out.splitlines()]
    assert sorted(f["rank"] for f in facts) == ["0", "1"]
    for f in facts:
        assert f["argv"] == ["scripts/train.py", "--lr", "0.1"] and f["name"] == "__main__"
        assert f["file"] == str(tmp_path / "scripts" / "train.py") and f["path0"] == str(tmp_path / "scripts")
        assert f["own_session"] and f["stdin"] == "/dev/null" and not f["gradsync_inherited"]
        assert f["warm"] == (forkserver == "1")  # forked: torch was imported before the script started
    assert facts[0]["random"] != facts[1]["random"]  # each rank has its own seeds
    # An uncaught exception: exit code 1, and the traceback holds the script's frames only.
    assert result.returncode == 1 and result.failed.rank == 1
    assert [line.strip() for line in result.message.splitlines()[2:]] == [
        "Traceback (most recent call last):", f'File "{tmp_path / "scripts" / "train.py"}", line 10, in <module>',
        'raise ValueError("the rank\'s own error")', "ValueError: the rank's own error"]
    assert forkservers_of(os.getpid()) == []  # it ends with the job
    if forkserver == "no torch":
        assert "ranks start with exec, not forked: importing torch failed: ImportError: no torch here" in err


def test_a_module_is_forked_and_a_rank_killed_by_a_signal_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIDDIR", str(tmp_path))
    monkeypatch.setenv("FAIL", "kill")
    (tmp_path / "trainer.py").write_text(FACTS)
    result = launch_local([PY, "-m", "trainer", "x"], np=2, grace_s=1)
    facts = [json.loads(line.split("] ", 1)[1]) for line in capsys.readouterr().out.splitlines()]
    assert [f["argv"] for f in facts] == [[str(tmp_path / "trainer.py"), "x"]] * 2
    assert all(f["warm"] and f["path0"] == str(tmp_path) and f["name"] == "__main__" for f in facts)
    assert result.returncode == 128 + 9 and "worker 1 (rank 1) was killed by signal 9 (SIGKILL)" in result.message
    assert forkservers_of(os.getpid()) == []


def test_a_rank_stopped_before_it_is_forked_is_stopped(tmp_path):
    """Stopping a job while the forkserver still imports torch: the rank is forked, then its group
    gets the signal (the fork is reported only once the rank leads its own process group)."""
    from gradsync.launch.forkserver import Forks
    from gradsync.launch.processes import _spawn, _stop

    script = tmp_path / "sleep.py"
    script.write_text("import time  # torch\ntime.sleep(60)\n")
    forks = Forks()
    try:
        rank = _spawn([PY, str(script)], RankSpec(0, "worker", 0, 0), dict(os.environ), None, forks)
        assert rank.proc.poll() is None
        _stop([rank], 0.5)
        assert rank.proc.returncode == -signal.SIGTERM and wait_gone([rank.proc.pid], 1.0) == []
    finally:
        forks.close()
    assert forkservers_of(os.getpid()) == []


def test_which_commands_are_forked(tmp_path):
    from gradsync.launch.forkserver import python_target

    train, other = tmp_path / "train.py", tmp_path / "tool.py"
    train.write_text("import torch\n")
    other.write_text("print('no training here')\n")
    assert python_target([PY, str(train), "--lr", "1"]) == {"script": str(train), "args": ["--lr", "1"]}
    assert python_target([PY, "-u", str(train)]) == {"script": str(train), "args": []}
    assert python_target([PY, "-m", "gradsync.demo", "--quick"]) == {"module": "gradsync.demo", "args": ["--quick"]}
    for command in ([PY, str(other)], [PY, "-c", "import torch"], [PY, "-X", "dev", str(train)],
                    [PY, str(tmp_path / "missing.py")], ["bash", str(train)], [PY, "-m", "json.tool"], []):
        assert python_target(command) is None, command  # these start with exec
