"""Durable commits: written atomically off the step's path, and a job resumed after its launcher
was killed ends with the model of an uninterrupted run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from gradsync.adapt import GlobalBatches, durable
from gradsync.errors import ConfigError

from test_elastic import example, printed_port, replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "elastic.py")
GRADSYNC = [sys.executable, "-m", "gradsync.cli"]


def commit(step: int) -> dict:
    return {"params": [torch.full((3,), float(step))], "buffers": [], "optimizer": {"state": {}, "param_groups": []},
            "counters": {"step": step, "epoch": 0, "data": (0, 4 * step), "batch_size": 4, "stop": False}}


def test_commits_are_written_whole_the_newest_two_kept_and_wrecks_skipped(tmp_path):
    writer = durable.DurableCommits(str(tmp_path), durable.Schedule(every_steps=1))
    for step in (1, 2, 3):
        writer.submit(commit(step))
        writer.flush()
    writer.close()
    assert [s for s, _ in durable.commits(str(tmp_path))] == [3, 2]  # pruned to the newest two
    # What a kill leaves behind: a temporary file, and (damage on disk) a newest file that does not load.
    (tmp_path / ".commit-000000004.pt.123.tmp").write_bytes(b"half a commit")
    (tmp_path / "commit-000000005.pt").write_bytes(b"not a checkpoint")
    newest = durable.latest(str(tmp_path))
    assert newest["counters"]["step"] == 3 and newest["params"][0].tolist() == [3.0] * 3
    assert newest["path"].endswith("commit-000000003.pt")


def test_bad_schedules_are_refused():
    with pytest.raises(ConfigError, match="checkpoint_every must be >= 1"):
        durable.Schedule(every_steps=0)
    with pytest.raises(ConfigError, match="checkpoint_seconds must be a positive number"):
        durable.Schedule(every_steps=5, every_s=float("nan"))


def run_example(tmp_path, name, launcher_args, steps=24):
    out = tmp_path / f"{name}.json"
    command = [*GRADSYNC, "run", "--elastic", "-np", "2", *launcher_args, "--", sys.executable, EXAMPLE,
               "--steps", str(steps), "--sleep", "0.03", "--out", str(out)]
    return out, subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={**os.environ, "GRADSYNC_TIMEOUT": "20"}, start_new_session=True)


def test_resume_after_the_launcher_is_killed_ends_with_the_uninterrupted_model(tmp_path):
    folder = tmp_path / "ckpt"
    _, job = run_example(tmp_path, "killed", ["--checkpoint-dir", str(folder), "--checkpoint-every", "1"])
    deadline = time.monotonic() + 60
    while not any(step >= 8 for step, _ in durable.commits(str(folder))):
        assert time.monotonic() < deadline and job.poll() is None, job.stderr.read()[-3000:]
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)  # the launcher only: its workers die with it (PDEATHSIG), mid-write or not
    job.wait()
    time.sleep(0.5)
    killed_at = durable.commits(str(folder))[0][0]
    assert killed_at < 24

    out, resumed = run_example(tmp_path, "resumed", ["--resume", str(folder)])
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "gradsync run: resuming from" in stderr and "gradsync: resumed from" in stdout, stdout + stderr
    result = json.loads(out.read_text())
    first = min(map(int, result["batches"]))
    assert first >= killed_at > 0  # it went on from a commit, not from the start
    # The uninterrupted run: 2 workers of 4 samples take the next 8 of the epoch's one order each
    # step (24 steps, all in the first epoch), as one process replays them.
    order = GlobalBatches(example().DATA).order.tolist()
    uninterrupted = {str(step): order[8 * step:8 * step + 8] for step in range(24)}
    for step, batch in result["batches"].items():  # the same global batches as the uninterrupted run
        assert batch == uninterrupted[step], step
    for got, want in zip(result["params"], replay({"batches": uninterrupted})):
        assert torch.allclose(torch.tensor(got), want, atol=1e-6), (got, want)


def test_a_plain_p3_job_writes_its_spread_optimizer_state_whole(tmp_path):
    # Not elastic: p3 keeps each slice's momentum on its server, so every worker joins each written
    # commit's gather. The commit of step 10 holds the parameters and the whole momentum that one
    # process has after the same 10 global batches.
    folder, out = tmp_path / "ckpt", tmp_path / "result.json"
    proc = subprocess.run([*GRADSYNC, "run", "-np", "2", "--checkpoint-dir", str(folder), "--checkpoint-every", "5",
                           "--", sys.executable, EXAMPLE, "--strategy", "p3", "--steps", "10", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "GRADSYNC_TIMEOUT": "20"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [step for step, _ in durable.commits(str(folder))] == [10, 5]
    x, y = example().dataset()
    model, opt = example().build()
    for _, idx in sorted(json.loads(out.read_text())["batches"].items(), key=lambda kv: int(kv[0])):
        idx = torch.tensor(idx)
        example().loss_of(model, x[idx], y[idx]).backward()
        opt.step()
        opt.zero_grad()
    commit = durable.latest(str(folder))
    for got, want in zip(commit["params"], model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-5)
    for i, p in enumerate(model.parameters()):
        torch.testing.assert_close(commit["optimizer"]["state"][i]["momentum_buffer"], opt.state[p]["momentum_buffer"],
                                   rtol=0, atol=1e-5)


WORKER_0_LATE = """
import os, runpy, sys, time
if os.environ["GRADSYNC_ELASTIC_ID"] == "0":  # it starts after the grow was decided
    from gradsync.adapt.elastic import _client
    store = _client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 60)
    while int(store.get("elastic/gen").decode()) < 1:
        time.sleep(0.05)
sys.argv[0] = {example!r}
runpy.run_path({example!r}, run_name="__main__")
"""


def test_a_resumed_job_that_grows_before_anyone_trained_starts_from_the_commit(tmp_path):
    # Hosts registering as a resumed job starts: the grow is decided before the first worker entered
    # the job, so every member of the first generation that trains is new, a joiner at step 0 with
    # no one to hand it a trained state. Each loads the newest commit instead; the job ends with
    # the model of a job never interrupted.
    folder, out = tmp_path / "ckpt", tmp_path / "resumed.json"
    first, job = run_example(tmp_path, "first", ["--checkpoint-dir", str(folder), "--checkpoint-every", "1"], steps=6)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 0, stderr[-3000:]
    script = tmp_path / "worker_0_late.py"
    script.write_text(WORKER_0_LATE.format(example=EXAMPLE))
    env = {**os.environ, "GRADSYNC_TIMEOUT": "20"}
    job = subprocess.Popen([*GRADSYNC, "run", "--elastic", "-np", "1", "--max-np", "2", "--resume", str(folder), "--",
                            sys.executable, str(script), "--steps", "10", "--sleep", "0.03", "--out", str(out)],
                           cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           start_new_session=True)
    try:
        grow = subprocess.run([*GRADSYNC, "resize", "2", "--port", printed_port(job)], capture_output=True, text=True,
                              timeout=60, env=env)
        assert grow.returncode == 0, grow.stderr
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, stderr[-3000:]
    assert re.search(r"worker 0 joined generation 1 \(2 workers\) at step 0", stdout), stdout[-3000:]
    result = json.loads(out.read_text())
    assert sorted(map(int, result["batches"])) == [6, 7, 8, 9], result["batches"].keys()  # from the commit
    assert {result["sizes"][str(s)] for s in range(6, 10)} == {2}
    batches = {**json.loads(first.read_text())["batches"], **result["batches"]}
    for got, want in zip(result["params"], replay({"batches": batches})):
        assert torch.allclose(torch.tensor(got), want, atol=1e-5), (got, want)
