"""A fault campaign: randomized faults against real jobs, each judged by what a user would see.

    python benchmarks/fault_campaign.py --trials 200 --seed 0 --json campaign.json

Each trial starts one job with ``gradsync run`` and injects one fault at a random moment of its
training (``GRADSYNC_TIMEOUT=5``):

- ``kill-worker`` / ``kill-server``: SIGKILL of a random worker, or of the parameter server
  (``ps``, ``p3`` with ``--servers 1``); ``stop-worker``: SIGSTOP of a worker (a hang: the process
  is alive and silent). The job must fail, and the launcher's output must name the victim's rank:
  the first line naming it must come within ``GRADSYNC_TIMEOUT`` of the fault (``error_s``); the
  launcher's exit follows after its grace.
- ``stuck-in-code``: a random worker sleeps in its own code (a stuck data loader) for 3x
  ``GRADSYNC_TIMEOUT`` at a random step (benchmarks/fault_job.py ``--stuck``); its peers stay alive
  and its own threads keep running. The job must fail, naming the stuck rank, within the timeout
  of the moment it got stuck. Its trials go through every strategy in turn (:data:`ALL_STRATEGIES`).
- ``corrupt-message``: worker 1 sends the server a header no worker sends (benchmarks/fault_job.py
  ``--corrupt``): the job must fail naming rank 1 (``PeerProtocolError``).
- ``elastic-kill``: SIGKILL of a worker of an elastic job (examples/elastic.py, 3 workers): the
  job must finish, and its model must equal a single process replaying the global batches it
  recorded (no committed step lost, none applied twice).
- ``hostile-store``: values written into an elastic job's store by a process without its secret
  (a resize request, a generation, a member list, a counter): the job must finish with the
  reference model.
- On an emulated cluster (``gradsync run --net 1gbit``, one host per worker):
  ``link-down``: a random worker's link is taken down for good; the job must fail naming that
  worker's rank. ``link-flap``: the link is down for 0.5 to 2 s, then up again; ``packet-loss``:
  every link drops 1, 2 or 5 % of its frames (``--loss``) for the whole job. In both the job must
  finish with the model of the same job run without a fault.

After each trial: processes of the job still alive (the pids every rank wrote), shared-memory
files left in /dev/shm and emulated-cluster namespaces left, are counted. The table (one row per kind) and every trial go to ``--json``.
A trial that outlives its deadline is a hang; it is killed and counted.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "fault_job.py")
ELASTIC = os.path.join(ROOT, "examples", "elastic.py")
GRADSYNC = [sys.executable, "-m", "gradsync.cli"]
TIMEOUT_S = 5.0
DEADLINE_S = 90.0
KINDS = ["kill-worker", "kill-server", "stop-worker", "stuck-in-code", "corrupt-message", "elastic-kill", "hostile-store",
         "link-down", "link-flap", "packet-loss"]
SURVIVABLE = ("elastic-kill", "hostile-store", "link-flap", "packet-loss")
STEPS, SLEEP_S = 60, 0.05
STRATEGIES = ["allreduce", "ddp", "casync-ring", "ps", "p3", "allreduce-priority", "compressed-allgather"]
ALL_STRATEGIES = ["allreduce", "ddp", "ps", "ps-async", "p3", "ps-sliced", "allreduce-priority", "casync-ring",
                  "casync-ps", "compressed-allgather", "sma", "hybrid", "pair-averaging"]
"""The strategies ``stuck-in-code`` goes through, one a trial (``ps-async`` with a dedicated server)."""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids(folder: str) -> dict[int, int]:
    found = {}
    for name in os.listdir(folder):
        if name.startswith("rank-"):
            try:
                found[int(name[5:])] = int(open(os.path.join(folder, name)).read())
            except ValueError:
                pass  # being written
    return found


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _namespaces() -> set[str]:
    from gradsync.cluster import netns

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    return {line.split()[0] for line in listed if line.startswith(netns.PREFIX)}


def _finish(proc: subprocess.Popen, deadline: float) -> tuple[bool, str, list[tuple[float, str]]]:
    """Wait for the job until ``deadline`` (then kill it: a hang). Returns whether it hung, its
    stdout, and its stderr lines, each with the time it arrived."""
    lines: list[tuple[float, str]] = []
    out: list[str] = []

    def read_err() -> None:
        for line in proc.stderr:
            lines.append((time.monotonic(), line))

    readers = [threading.Thread(target=read_err, daemon=True),
               threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        hung = True
    for reader in readers:
        reader.join()
    return hung, "".join(out), lines


def _first(lines: list[tuple[float, str]], pattern: str, since: float) -> float | None:
    """Seconds from ``since`` to the first stderr line matching ``pattern``; None if none does."""
    return next((t - since for t, line in lines if re.search(pattern, line)), None)


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "GRADSYNC_TIMEOUT": str(TIMEOUT_S)}, start_new_session=True)


def failing_trial(kind: str, strategy: str, rng: random.Random) -> dict:
    """A fault the job cannot survive: it must stop, naming the victim, in bounded time."""
    pids = tempfile.mkdtemp(prefix="gradsync-campaign-")
    servers = 1 if kind in ("kill-server", "corrupt-message") or strategy == "ps-async" else 0
    workers = rng.choice([2, 3])
    command = [*GRADSYNC, "run", "-np", str(workers), "--servers", str(servers), "--", sys.executable, JOB,
               "--strategy", strategy, "--pids", pids, "--steps", str(STEPS), "--sleep", str(SLEEP_S)]
    victim = {"kill-server": workers, "corrupt-message": 1}.get(kind, rng.randrange(workers))
    if kind == "corrupt-message":
        command += ["--corrupt", str(rng.randint(2, 10))]
    if kind == "stuck-in-code":
        command += ["--stuck", f"{victim}:{rng.randint(5, 25)}:{3 * TIMEOUT_S:g}"]
    shm = _shm()
    started = time.monotonic()
    proc = _start(command)
    deadline = started + DEADLINE_S
    while len(_pids(pids)) < workers + servers and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(rng.uniform(0.5, 2.0))  # into training
    injected = time.monotonic()
    pid = _pids(pids).get(victim)
    if kind not in ("corrupt-message", "stuck-in-code") and pid is not None and proc.poll() is None:
        os.kill(pid, signal.SIGSTOP if kind == "stop-worker" else signal.SIGKILL)
    hung, _, lines = _finish(proc, deadline)
    if kind == "stuck-in-code":  # the fault's moment is when the victim's sleep began (its wall clock)
        try:
            injected = time.monotonic() - (time.time() - float(open(os.path.join(pids, "stuck")).read()))
        except (OSError, ValueError):
            pass  # it never got stuck (the job failed before): judged from the start of training
    seconds = time.monotonic() - injected
    err = "".join(line for _, line in lines)
    blame = rf"\(rank {victim}\) is alive but" if kind == "stuck-in-code" else rf"\brank {victim}\b"
    named = bool(re.search(blame, err))
    error_s = _first(lines, blame, injected)
    left = [p for p in _pids(pids).values() if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return {"kind": kind, "strategy": strategy, "workers": workers, "victim": victim, "hung": hung,
            "exit": proc.returncode, "failed": proc.returncode != 0, "named": named, "seconds": seconds,
            "error_s": error_s,
            "left_processes": len(left), "left_shm": len(_shm() - shm), "left_netns": 0, "wrong_model": False,
            "tail": err[-1500:] if (hung or not named or proc.returncode == 0) else "",
            "late": _timed(lines, injected) if error_s is not None and error_s > TIMEOUT_S else ""}


def _timed(lines: list[tuple[float, str]], since: float) -> str:
    """The job's stderr, each line with its seconds since ``since``: to trace an error that came late."""
    return "".join(f"{t - since:6.2f} {line}" for t, line in lines)[-6000:]


_REFERENCES: dict[tuple[str, int], list] = {}


def _reference(strategy: str, workers: int) -> list:
    """The final parameters of the job without a fault (on loopback), run once per configuration."""
    if (strategy, workers) not in _REFERENCES:
        folder = tempfile.mkdtemp(prefix="gradsync-campaign-")
        out = os.path.join(folder, "out.json")
        subprocess.run([*GRADSYNC, "run", "-np", str(workers), "--", sys.executable, JOB, "--strategy", strategy,
                        "--pids", folder, "--steps", str(STEPS), "--sleep", "0", "--out", out],
                       cwd=ROOT, check=True, capture_output=True, timeout=DEADLINE_S)
        _REFERENCES[strategy, workers] = json.load(open(out))
    return _REFERENCES[strategy, workers]


def _same_model(got: list, want: list) -> bool:
    import torch

    return len(got) == len(want) and all(torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-6)
                                          for g, w in zip(got, want))


def _blame(victim: int) -> str:
    """What some rank's error says when it puts the fault on ``victim``: its peers say it stopped
    responding (or that it, the store's host, is unreachable), or it says its own link is the likely cause."""
    return (rf"\(rank {victim}\)(?:, [\w ]+\(rank \d+\))* stopped responding|rank {victim}, which hosts|"
            rf"\(rank {victim}\)'s own network link")


def link_trial(kind: str, strategy: str, rng: random.Random) -> dict:
    """A fault of an emulated link: taken down (the job must fail naming the rank behind it),
    down briefly (it must recover), or lossy (it must finish); survivors end with the reference."""
    from gradsync.cluster import netns

    folder = tempfile.mkdtemp(prefix="gradsync-campaign-")
    out = os.path.join(folder, "out.json")
    workers = 3 if kind == "link-down" else rng.choice([2, 3])  # 2 hosts cut apart cannot tell whose link it is
    loss = rng.choice([1, 2, 5]) if kind == "packet-loss" else 0
    command = [*GRADSYNC, "run", "-np", str(workers), "--net", "1gbit", "--loss", str(loss), "--",
               sys.executable, JOB, "--strategy", strategy, "--pids", folder, "--steps", str(STEPS),
               "--sleep", str(SLEEP_S), "--out", out]
    shm, spaces = _shm(), _namespaces()
    started = time.monotonic()
    proc = _start(command)
    victim = rng.randrange(workers)
    deadline = started + DEADLINE_S
    while len(_pids(folder)) < workers and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(rng.uniform(0.5, 2.0))  # into training
    injected = time.monotonic()
    down_s = rng.uniform(0.5, 2.0) if kind == "link-flap" else None
    if kind in ("link-down", "link-flap") and proc.poll() is None:
        host = next((n for n in _namespaces() if n.startswith(f"{netns.PREFIX}{proc.pid}-")
                     and n.endswith(f"-h{victim}")), None)
        if host is not None:
            subprocess.run(["ip", "-n", host, "link", "set", netns.IFNAME, "down"], capture_output=True)
            if down_s is not None:
                time.sleep(down_s)
                subprocess.run(["ip", "-n", host, "link", "set", netns.IFNAME, "up"], capture_output=True)
    hung, _, lines = _finish(proc, deadline)
    seconds = time.monotonic() - injected
    err = "".join(line for _, line in lines)
    left = [p for p in _pids(folder).values() if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    survive = kind != "link-down"
    # Silently wrong: the job said it finished, and its model is not the reference's. A job that
    # failed with an error is counted under "exit as expected" instead.
    wrong = survive and proc.returncode == 0 and not (
        os.path.exists(out) and _same_model(json.load(open(out)), _reference(strategy, workers)))
    named = survive or bool(re.search(_blame(victim), err))
    error_s = None if survive else _first(lines, _blame(victim), injected)
    return {"kind": kind, "strategy": strategy, "workers": workers, "victim": victim, "hung": hung,
            "exit": proc.returncode, "failed": proc.returncode != 0, "named": named, "seconds": seconds,
            "error_s": error_s, "loss_percent": loss, "down_s": down_s, "left_processes": len(left), "left_shm": len(_shm() - shm),
            "left_netns": len(_namespaces() - spaces), "wrong_model": wrong,
            "tail": err[-1500:] if (hung or wrong or not named or (proc.returncode == 0) != survive) else ""}


def _replay(result: dict) -> list[list[float]]:
    """The single-process reference of examples/elastic.py for the global batches the run recorded."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import elastic as example
    finally:
        sys.path.pop(0)
    return [p.tolist() for p in example.replay(result["batches"])]


def elastic_trial(kind: str, rng: random.Random) -> dict:
    """A fault an elastic job must survive, ending with the reference model."""
    import torch

    folder = tempfile.mkdtemp(prefix="gradsync-campaign-")
    out = os.path.join(folder, "result.json")
    steps = 40
    command = [*GRADSYNC, "run", "--elastic", "-np", "3", "--min-np", "1", "--", sys.executable, ELASTIC,
               "--steps", str(steps), "--sleep", "0.05", "--out", out]
    if kind == "elastic-kill":
        command += ["--die", f"{rng.randint(3, steps - 5)}:{rng.randrange(3)}"]
    shm = _shm()
    proc = _start(command)
    injected = time.monotonic()
    if kind == "hostile-store":
        from datetime import timedelta

        import torch.distributed as dist

        port = None
        for line in proc.stderr:  # the store's port, printed at start
            found = re.search(r"gradsync resize N --port (\d+)", line)
            if found:
                port = int(found.group(1))
                break
        time.sleep(rng.uniform(0.5, 2.0))
        injected = time.monotonic()
        if port is not None:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=5))
            key, value = rng.choice([("elastic/gen", "9"), ("elastic/members/0", "7,8"),
                                     ("elastic/request/99", "2"), ("elastic/failed", "no"),
                                     ("elastic/request_seq", "not-a-number")])
            try:
                store.set(key, value)
                if key == "elastic/request/99":
                    store.add("elastic/request_seq", 1)
            except Exception:  # noqa: BLE001 - the job may have ended already
                pass
    hung, _, lines = _finish(proc, time.monotonic() + DEADLINE_S)
    seconds = time.monotonic() - injected
    err = "".join(line for _, line in lines)
    wrong = proc.returncode == 0  # finished, yet no model to check is wrong too; a failure counts as an exit
    if proc.returncode == 0 and os.path.exists(out):
        result = json.load(open(out))
        want = _replay(result)
        wrong = not all(torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-5)
                        for g, w in zip(result["params"], want)) or len(result["batches"]) != steps
    return {"kind": kind, "strategy": "allreduce", "workers": 3, "victim": None, "hung": hung,
            "exit": proc.returncode, "failed": proc.returncode != 0, "named": True, "seconds": seconds,
            "left_processes": 0, "left_shm": len(_shm() - shm), "left_netns": 0, "wrong_model": wrong,
            "tail": err[-1500:] if (hung or wrong or proc.returncode) else ""}


def run_trial(kind: str, rng: random.Random, strategies: list[str] = STRATEGIES) -> dict:
    if kind in ("elastic-kill", "hostile-store"):
        return elastic_trial(kind, rng)
    if kind.startswith(("link", "packet")):
        return link_trial(kind, rng.choice(strategies), rng)
    servers = [s for s in strategies if s in ("ps", "p3")] or ["ps", "p3"]
    strategy = {"kill-server": rng.choice(servers), "corrupt-message": "ps"}.get(kind, rng.choice(strategies))
    if kind == "stuck-in-code":
        _STUCK[0] += 1
        strategy = ALL_STRATEGIES[(_STUCK[0] - 1) % len(ALL_STRATEGIES)]
    return failing_trial(kind, strategy, rng)


_STUCK = [0]  # stuck-in-code trials so far: the next one takes the next strategy


def table(trials: list[dict]) -> list[str]:
    rows = ["| fault | trials | hangs | wrong models | named the rank | exit as expected | seconds to the first "
            "error naming the rank (median, max) | seconds to the launcher's exit or the end (median, max) | "
            "processes left | /dev/shm files left | namespaces left |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        mine = [t for t in trials if t["kind"] == kind]
        if not mine:
            continue
        expected_exit = sum((t["exit"] == 0) if kind in SURVIVABLE else t["failed"] for t in mine)
        secs = [t["seconds"] for t in mine]
        named = [t["error_s"] for t in mine if t.get("error_s") is not None]
        to_error = f"{statistics.median(named):.1f}, {max(named):.1f}" if named else "-"
        rows.append(f"| {kind} | {len(mine)} | {sum(t['hung'] for t in mine)} | {sum(t['wrong_model'] for t in mine)} | "
                    f"{sum(t['named'] for t in mine)} | {expected_exit} | {to_error} | "
                    f"{statistics.median(secs):.1f}, {max(secs):.1f} | "
                    f"{sum(t['left_processes'] for t in mine)} | {sum(t['left_shm'] for t in mine)} | "
                    f"{sum(t.get('left_netns', 0) for t in mine)} |")
    return rows


def stuck_table(trials: list[dict]) -> list[str]:
    """``stuck-in-code`` per strategy: seconds from the hang to the first error naming the rank."""
    mine = [t for t in trials if t["kind"] == "stuck-in-code"]
    if not mine:
        return []
    rows = ["| strategy (stuck-in-code) | trials | named the rank | seconds from the hang to the first error naming "
            "it (max) | processes left |", "|---|---|---|---|---|"]
    for strategy in ALL_STRATEGIES:
        runs = [t for t in mine if t["strategy"] == strategy]
        if runs:
            named = [t["error_s"] for t in runs if t.get("error_s") is not None]
            rows.append(f"| {strategy} | {len(runs)} | {sum(t['named'] for t in runs)} | "
                        f"{max(named):.1f} |" if named else f"| {strategy} | {len(runs)} | 0 | - |")
            rows[-1] += f" {sum(t['left_processes'] for t in runs)} |"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="strategies the trials draw from (default: all of them)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    trials = []
    started = time.monotonic()
    for n in range(args.trials):
        trial = run_trial(kinds[n % len(kinds)], rng, args.strategies.split(","))
        trials.append(trial)
        bad = trial["hung"] or trial["wrong_model"] or not trial["named"] or trial["left_processes"] \
            or trial["left_netns"] or (trial["exit"] == 0) != (trial["kind"] in SURVIVABLE)
        error_s = "" if trial.get("error_s") is None else f" (error after {trial['error_s']:.1f} s)"
        print(f"{n + 1:4d} {trial['kind']:<16} {trial['strategy']:<20} exit {trial['exit']:>4} "
              f"{trial['seconds']:5.1f} s{error_s}{'  <-- ' + trial['tail'][-300:] if bad else ''}", flush=True)
    print(f"\n{args.trials} trials in {time.monotonic() - started:.0f} s\n")
    print("\n".join(table(trials)))
    if stuck_table(trials):
        print("\n" + "\n".join(stuck_table(trials)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trials": trials, "table": table(trials), "stuck": stuck_table(trials)}, f, indent=1)


if __name__ == "__main__":
    main()
