"""From a spec's cells to commands, and from their output to records.

Each cell runs as one ``gradsync`` command (or one script), in a process of its own:

- ``bench``: ``gradsync bench`` with the cell's values; on the ``local`` target on loopback, on
  ``emulated`` on the netns cluster (``--net``, dilated as the spec says), on ``sim`` the same
  arguments go to ``gradsync simulate``; on a registered machine ``gradsync bench --machine NAME``
  over its hosts, at the rate of its own links (a cell at another rate is an error that says so).
  The strategies of a cell run side by side in one call.
- ``codecs``: ``gradsync codecs --json`` (this machine's CPU, whatever the target).
- ``script``: the spec's command, run from the gradsync checkout (``{out}`` is a JSON file it
  writes; ``{KEY}`` a cell value; an argument ``{*KEY}`` the value split as a shell would, for
  flags that differ by cell); its records are a list in that file (``records = "KEY"``) or the
  last JSON line it prints (``records = "stdout"``).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from gradsync.errors import ConfigError
from gradsync.experiment.spec import Spec

TARGETS = ("local", "emulated", "sim")
GRADSYNC = [sys.executable, "-m", "gradsync.cli"]
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BENCH_FLAGS = {"model": "--model", "np": "--np", "net": "--net", "batch_size": "--batch-size", "steps": "--steps",
                "warmup": "--warmup", "rounds": "--rounds", "compute": "--compute", "dilation": "--dilation",
                "check_steps": "--check-steps", "servers": "--servers", "compression": "--compression",
                "monitors": "--monitors", "optimizer": "--optimizer", "lr": "--lr", "threads": "--threads",
                "delay": "--delay", "ranks_per_host": "--ranks-per-host", "server_hosts": "--server-hosts",
                "slow": "--slow"}
_SIM_FLAGS = {"model": "--model", "np": "--np", "net": "--net", "batch_size": "--batch-size",
              "servers": "--servers", "compression": "--compression", "ranks_per_host": "--ranks-per-host"}


def command(spec: Spec, cell: dict, target: str, out: str) -> list[str]:
    """The command that runs ``cell`` on ``target`` and writes its records to ``out``."""
    if spec.runner == "bench":
        return _bench(spec, cell, target, out)
    if target == "sim":
        raise ConfigError(f"experiment {spec.name} measures this machine ({spec.runner}); the simulator cannot "
                          "run it: use --target local or emulated")
    if target not in TARGETS and spec.runner == "script":
        raise ConfigError(f"experiment {spec.name} runs a script on one host: use --target local on one of "
                          f"machine {target!r}'s hosts")
    if spec.runner == "codecs":
        args = [*GRADSYNC, "codecs", "--compressors", ",".join(map(str, cell["compressor"])), "--json", out]
        for key in ("size", "repeats", "threads"):
            if key in cell:
                args += [f"--{key}", str(cell[key])]
        return args
    values = {k: (",".join(map(str, v)) if isinstance(v, list) else str(v)) for k, v in cell.items()}
    try:
        args = []
        for part in spec.script["command"]:
            if part.startswith("{*") and part.endswith("}"):  # a cell's value as several arguments
                try:
                    args += shlex.split(values[part[2:-1]])
                except ValueError as exc:  # an unclosed quote
                    raise ConfigError(f"{spec.path}: {part[2:-1]} = {values[part[2:-1]]!r} does not split into "
                                      f"arguments: {exc}") from None
            else:
                args.append(part.format(out=out, python=sys.executable, **values))
    except KeyError as exc:
        raise ConfigError(f"{spec.path}: the script command names {exc}, which the cell does not have") from None
    if args and args[0] == "gradsync":
        args = [*GRADSYNC, *args[1:]]
    return args


def _bench(spec: Spec, cell: dict, target: str, out: str) -> list[str]:
    strategies = ",".join(map(str, cell.get("strategy", []))) if isinstance(cell.get("strategy"), list) \
        else str(cell.get("strategy", ""))
    stragglers = _stragglers(spec, cell)
    if target == "sim" and stragglers:
        raise ConfigError(f"experiment {spec.name} has {stragglers}, which the simulator does not model (every rank "
                          "alike): use --target emulated")
    if target == "sim":
        if "net" not in cell:
            raise ConfigError(f"experiment {spec.name} runs on loopback: the simulator needs link rates "
                              "(use --target local or emulated)")
        if any("@" in s for s in strategies.split(",")) or cell.get("monitors"):
            raise ConfigError(f"experiment {spec.name} measures monitors or BalanceBatches (STRATEGY@NAME), which "
                              "the simulator does not model "
                              "(use --target local or emulated)")
        args = [*GRADSYNC, "simulate", "--strategies", strategies, "--json", out]
        flags = _SIM_FLAGS
        compute = str(cell.get("compute", ""))
        if compute.startswith("emulated:"):
            args += ["--compute", compute.split(":", 1)[1]]
    elif target not in TARGETS:  # a registered machine: its links are real
        cell = _at_machine_rate(spec, cell, target)
        args = [*GRADSYNC, "bench", "--json", out, "--machine", target] + (["--strategies", strategies] if strategies else [])
        flags = _BENCH_FLAGS
    else:
        if target == "local" and "net" in cell:
            raise ConfigError(f"experiment {spec.name} varies the link rate (net = {cell['net']}): run it with "
                              "--target emulated (this machine's emulated cluster) or --target sim")
        args = [*GRADSYNC, "bench", "--json", out] + (["--strategies", strategies] if strategies else [])
        flags = _BENCH_FLAGS
    for key, flag in flags.items():
        if key in cell:
            value = cell[key]
            args += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    for item in ([] if target == "sim" and "set" not in cell else cell.get("set", [])):
        args += ["--set", item]
    return args


def _stragglers(spec: Spec, cell: dict) -> str:
    """The cell's ``slow`` and ``net``'s ``rankN=RATE``, checked against its ranks as bench checks
    them: ``"slow = ..., net = ..."`` for those it sets, ``""`` for none; ConfigError for a bad one."""
    from gradsync.cluster import parse_net
    from gradsync.emulate.slow import SlowRanks
    from gradsync.launch.emulated import placement

    def listed(key):
        value = cell.get(key, "")
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)

    found = []
    try:
        np = min(int(n) for n in listed("np").split(",")) if "np" in cell else 2  # bench's default --np
        servers = int(cell.get("servers", 0))
        slow = SlowRanks.parse(listed("slow"))
        slow.check(np, servers)
        if slow:
            found.append(f"slow = {listed('slow')}")
        rates = parse_net(listed("net"))[0] if "net" in cell else None
        if rates is not None and rates.ranks:
            rates.per_host(placement(np, servers, int(cell.get("ranks_per_host", 1)), cell.get("server_hosts", "own")))
            found.append(f"net = {listed('net')}")
    except (ConfigError, ValueError) as exc:
        where = ", ".join(f"{k}={cell[k]}" for k in spec.vary if k in cell and not isinstance(cell[k], list))
        raise ConfigError(f"experiment {spec.name}{f' (cell {where})' if where else ''}: {exc}") from None
    return ", ".join(found)


def _at_machine_rate(spec: Spec, cell: dict, name: str) -> dict:
    """``cell`` without its link rate, which must be the machine's own (its hosts file's ``net``)."""
    from gradsync.cluster import parse_rate
    from gradsync.launch import machines

    if "net" not in cell:
        return cell
    own = machines.get(name).get("net")
    if any("=" in part for part in str(cell["net"]).split(",")):
        raise ConfigError(f"experiment {spec.name} gives a rank a link of its own (net = {cell['net']}); machine "
                          f"{name!r} has real links, which gradsync does not throttle: use --target emulated")
    if own is None or parse_rate(str(cell["net"])) != parse_rate(str(own)):
        has = f"links of {own}" if own else 'links of a rate its hosts file does not give ("net")'
        raise ConfigError(f"experiment {spec.name} runs at net = {cell['net']}; machine {name!r} has {has}, which "
                          f"gradsync does not throttle: run --set net={own or 'RATE'} (and give \"net\" in the "
                          "hosts file), or --target emulated / sim for other rates")
    return {k: v for k, v in cell.items() if k != "net"}


def run_cell(spec: Spec, cell: dict, target: str) -> tuple[list[str], list[dict], str]:
    """Run one cell: ``(command, records, message)``; ``records`` is empty when it failed and
    ``message`` says why (the command's last lines). Output streams to this terminal as it comes."""
    with tempfile.TemporaryDirectory(prefix="gradsync-experiment-") as tmp:
        out = os.path.join(tmp, "records.json")
        args = command(spec, cell, target, out)
        if spec.runner == "script":
            script = next((a for a in args if a.endswith(".py")), None)
            if script is not None and not os.path.exists(os.path.join(CHECKOUT, script)):
                raise ConfigError(f"experiment {spec.name} runs {script} from a gradsync checkout; "
                                  f"{os.path.join(CHECKOUT, script)} does not exist (clone the repository)")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen(args, cwd=CHECKOUT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
        lines: list[str] = []
        try:
            for line in proc.stdout:
                print("    " + line, end="", flush=True)
                lines.append(line)
            proc.wait()
        except BaseException:  # Ctrl-C: end the cell's whole process group, then let it propagate
            _end(proc)
            raise
        if proc.returncode:
            tail = "".join(lines[-6:]).strip()
            return args, [], f"exit status {proc.returncode}: {tail}"
        try:
            records = _records(spec, out, lines)
        except (OSError, ValueError, KeyError) as exc:
            return args, [], f"no records: {exc}"
    return args, records, ""


def _records(spec: Spec, out: str, lines: list[str]) -> list[dict]:
    if spec.runner == "script" and spec.script["records"] == "stdout":
        # the last line holding a JSON object (after the launcher's "[worker 0] " prefix, if any)
        last = next((line for line in reversed(lines) if "{" in line and line.rstrip().endswith("}")), None)
        if last is None:
            raise ValueError("the script printed no JSON line")
        return [json.loads(last[last.index("{"):])]
    with open(out) as f:
        data = json.load(f)
    if spec.runner == "script":
        data = data[spec.script["records"]]
    if not isinstance(data, list):
        data = [data]
    return data


def _end(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def shown(args: list[str]) -> str:
    """A command as a user would type it (``gradsync`` for this interpreter's module)."""
    if args[: len(GRADSYNC)] == GRADSYNC:
        args = ["gradsync", *args[len(GRADSYNC):]]
    return shlex.join(args)


def environment(target: str) -> dict:
    """What a run's figures depend on: versions, the machine, and (emulated) the links as measured."""
    import platform

    import torch

    from gradsync import __version__

    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=CHECKOUT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=CHECKOUT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if commit and dirty:
            commit += "+changes"
    except (OSError, subprocess.TimeoutExpired):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {"gradsync": __version__, "commit": commit, "torch": torch.__version__, "python": platform.python_version(),
           "cpu": cpu, "cores": os.cpu_count(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "target": target, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if target == "emulated":
        env["netcheck"] = _netcheck()
    elif target not in TARGETS:
        from gradsync.launch import machines

        env["machine"] = machines.get(target)
    return env


def _netcheck() -> str:
    """``gradsync netcheck`` at 1 Gbit/s, the real rate the emulated cluster runs its links at (or below)."""
    args = [*GRADSYNC, "netcheck", "--net", "1gbit", "--seconds", "0.5", "--repeats", "1"]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=CHECKOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{shown(args)}: {exc}"
    return f"$ {shown(args)}\n{done.stdout.strip()}" + (f"\n{done.stderr.strip()}" if done.returncode else "")
