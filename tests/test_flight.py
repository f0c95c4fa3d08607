"""Hang and desync diagnosis: each rank's flight record and the launcher's cross-rank summary."""
import json
import os
import signal
import subprocess
import sys
import time


from gradsync import flight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRADSYNC = [sys.executable, "-m", "gradsync.cli"]

# Three workers train a small model under allreduce; worker 1 stops in the middle of step 3 (after
# its forward, so the others wait in that step's all-reduce) for SLEEP seconds.
SCRIPT = """
import os, sys, time, torch, gradsync
from torch import nn
gradsync.init()
rank = gradsync.topology().rank
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce")
for step in range(1, 6):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    if rank == 1 and step == 3:
        print("sleeping", flush=True)
        time.sleep(float(sys.argv[1]))
    loss.backward()
    opt.step()
    opt.zero_grad()
gradsync.shutdown()
"""


def run(tmp_path, sleep: float, timeout: str, logdir=None, **kwargs):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    command = [*GRADSYNC, "run", "-np", "3",
               *(["--logdir", str(logdir)] if logdir else []),
               "--", sys.executable, str(script), str(sleep)]
    return subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "GRADSYNC_TIMEOUT": timeout}, **kwargs)


def test_sigusr1_prints_the_summary_the_job_goes_on_and_a_hang_prints_who_waits_where(tmp_path):
    """SIGUSR1 while worker 1 is stuck in its own code: the summary, and the job goes on; at the
    timeout the others fail naming worker 1, and the launcher prints the summary again."""
    job = run(tmp_path, sleep=60, timeout="3", logdir=tmp_path / "logs")
    try:
        for line in job.stdout:
            if "sleeping" in line:
                break
        time.sleep(0.5)  # the others reach the all-reduce of step 3 and wait
        job.send_signal(signal.SIGUSR1)
        _, err = job.communicate(timeout=90)
    finally:
        job.kill()
    assert job.returncode != 0
    asked, failed = err.index("where each rank is (SIGUSR1)"), err.index("where each rank is (worker")
    assert asked < failed, err  # the signal did not end the job: it failed later, at the timeout
    assert "ranks 0 and 2 wait in all-reduce of bucket" in err[asked:failed] and "rank 1 last completed" in err, err
    assert "worker 1 (rank 1) is alive but has not reached this operation" in err, err
    assert ("where each rank is (worker 0 (rank 0) failed)" in err
            or "where each rank is (worker 2 (rank 2) failed)" in err), err
    summary = err[failed:]
    # The ranks that waited name the all-reduce of step 3; the sleeping rank is outside gradsync.
    assert "worker 1 (rank 1): not in a gradsync operation (step 3); last completed" in summary, summary
    assert "rank 1 last completed" in summary, summary
    waits = [line for line in summary.splitlines() if "wait in all-reduce of bucket" in line]
    assert waits and "(step 3, collective #" in waits[0], summary
    written = json.loads((tmp_path / "logs" / "flight-summary.json").read_text())
    assert set(written["ranks"]) == {"0", "1", "2"} and written["reason"] != "SIGUSR1"
    assert written["ranks"]["1"]["waiting"] is None and written["ranks"]["1"]["step"] == 3


def dump(rank, whats, waiting=None, step=2):
    records = [{"what": w, "op": "all-reduce", "group": "workers", "seq": i, "step": step, "nbytes": 4,
                "peer": None, "issued": 100.0 + i, "done": 100.5 + i} for i, w in enumerate(whats)]
    if waiting is not None:
        records[waiting]["done"] = None
    return {"rank": rank, "label": f"worker {rank} (rank {rank})", "time": 110.0, "step": step, "reason": "",
            "waiting": None if waiting is None else records[waiting], "records": records}


def test_the_summary_names_the_first_collective_where_ranks_diverge():
    dumps = {0: dump(0, ["all-reduce of bucket 0", "all-reduce of bucket 1"], waiting=1),
             1: dump(1, ["all-reduce of bucket 0", "broadcast of the model's buffers"], waiting=1)}
    lines = flight.summarize(dumps, [0, 1, 2])
    assert lines[0].startswith("worker 0 (rank 0): waits in all-reduce of bucket 1 (step 2, collective #1 on workers)")
    assert lines[2] == "rank 2: no answer (dead, stopped, or blocked while holding Python's lock)"
    assert "rank 2 did not answer" in lines[3]
    assert lines[-1] == ("ranks diverge at collective #1 on workers: rank 1 issued \"broadcast of the model's "
                         "buffers\" where rank 0 issued 'all-reduce of bucket 1'")


def test_the_recorder_keeps_the_last_operations_and_numbers_collectives_per_group(tmp_path, monkeypatch):
    recorder = flight.FlightRecorder(0, "worker 0", size=3)
    for k in range(5):
        recorder.issue(f"op {k}", "all-reduce", 8, group="workers" if k % 2 == 0 else "world")
    recorder.issue("send", "send", 8, peer=1)
    snap = recorder.snapshot()
    assert [r["what"] for r in snap["records"]] == ["op 3", "op 4", "send"]
    assert [r["seq"] for r in snap["records"]] == [1, 2, -1]
    monkeypatch.setenv(flight.DIR_ENV, str(tmp_path))
    asked = flight.request(str(tmp_path))
    recorder.answer_request()
    assert flight.collect(str(tmp_path), [0], asked, 1.0)[0]["records"][-1]["what"] == "send"
