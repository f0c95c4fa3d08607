"""Elastic jobs (gradsync run --elastic): resizing while training, a worker killed mid-step, and the
data order, each checked against a single process that applies the same per-step global batches."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from gradsync.adapt.elastic import OTHERS_STEP
from multirank import FORK_PROBES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "elastic.py")
GRADSYNC = [sys.executable, "-m", "gradsync.cli"]


def run_job(tmp_path, launcher_args, example_args, timeout=120, env=None, script=EXAMPLE):
    out = tmp_path / "result.json"
    proc = subprocess.run([*GRADSYNC, "run", "--elastic", *launcher_args, "--", sys.executable, script,
                           "--out", str(out), *example_args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "GRADSYNC_TIMEOUT": "20", **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text()), proc.stderr + proc.stdout


def printed_port(job: subprocess.Popen) -> str:
    """The store's port, read from the elastic launcher's stderr (the line it prints first)."""
    for line in job.stderr:
        found = re.search(r"gradsync resize N --port (\d+)", line)
        if found:
            return found.group(1)
    raise AssertionError("the launcher ended without printing its port")


def example():
    """examples/elastic.py as a module."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import elastic
    finally:
        sys.path.pop(0)
    return elastic


def replay(result) -> list[torch.Tensor]:
    """The example's single-process reference for the global batches the run recorded."""
    return example().replay(result["batches"], result.get("table", False))


def assert_matches_reference(result):
    for got, want in zip(result["params"], replay(result)):
        assert torch.allclose(torch.tensor(got), want, atol=1e-5), (got, want)


def test_grow_and_shrink_1_2_4_2_while_training_matches_the_reference(tmp_path):
    # One standby: the first grow admits it (worker 1), the second its replacement (worker 2) and
    # starts worker 3; worker 4, the last replacement, is still waiting when the job ends and exits.
    # Meanwhile StrategySwitch probes allreduce and casync-ring (identity) for 2 steps each, then
    # chooses: the workers joining at steps 3 and 6 (mid-probe, and as it chooses) attach the
    # script's strategy and must take over the policy's state, the strategy it runs and the noise
    # scale's averages; any difference would also break the collectives' order.
    result, log = run_job(tmp_path, ["-np", "1", "--min-np", "1", "--max-np", "4", "--standby", "1"],
                          ["--schedule", "3:2,6:4,10:2,12:9", "--steps", "14", "--adapt"],
                          env={"GRADSYNC_STANDBY_REPLACE_S": "0"})
    assert "for a resize to 2: admitting standbys [1]" in log, log[-3000:]
    assert "for a resize to 4: admitting standbys [2], starting 1 workers" in log, log[-3000:]
    # Worker 4 exits when it reads that the job is over, or the launcher ends it if it is still starting.
    assert re.search(r"standby worker 4: the job ended before a grow needed it|"
                     r"the job ended before a grow needed standby workers \[4\], still starting: ended", log), log[-3000:]
    sizes = [result["sizes"][str(s)] for s in range(14)]
    assert sizes == [1] * 3 + [2] * 3 + [4] * 4 + [2] * 4
    assert [(r["from"], r["to"]) for r in result["resizes"]] == [(1, 2), (2, 4), (4, 2)]
    assert "refused" in log and "'9' is outside --min-np 1 .. --max-np 4" in log  # 12:9, and training went on
    # One global order per epoch: the 14 global batches are disjoint stretches of it.
    seen = [i for s in range(14) for i in result["batches"][str(s)]]
    assert len(seen) == len(set(seen)) == sum(4 * n for n in sizes)
    # Both candidates ran; the two workers left at the end (0, and 1, which joined at step 3) agree.
    assert {d.split("(")[0] for _, d in result["described"]} == {"allreduce", "casync-ring"}, result["described"]
    ends = [json.loads((tmp_path / f"result.json.{w}").read_text()) for w in range(2)]
    assert len({e["strategy"] for e in ends}) == 1 and len({e["noise_scale"] for e in ends}) == 1
    assert ends[0]["noise_scale"] == ends[0]["noise_scale"]  # a number
    assert all(e["params"] == ends[0]["params"] for e in ends)
    assert_matches_reference(result)


@pytest.mark.parametrize("strategy", ["ps", "hybrid", "ddp"])
def test_every_strategy_grows_and_survives_a_worker_killed_mid_step(tmp_path, strategy):
    # (p3 grows and loses a worker in test_elastic_hosts.py, its host lost mid-training.)
    # ps, p3 and hybrid keep optimizer state (and hybrid its table rows) on the workers' servers:
    # the grow hands it over in the new layout, and every commit gathers it, so the survivors of
    # the killed worker redo only the interrupted step. Their waits end on the launcher's word that
    # the worker is gone (a wait for the dead one's push would otherwise last the timeout), and
    # threads left blocked in the broken group are waited for at shutdown, never left to abort it.
    # ddp fails inside PyTorch's reducer and regroups too (it starts with 3 workers, no grow).
    grows = strategy in ("ps", "p3", "hybrid")
    result, log = run_job(tmp_path, ["-np", "2" if grows else "3", "--min-np", "2", "--max-np", "3"],
                          ["--strategy", strategy, "--table", "--schedule", "2:3" if grows else "", "--die", "5:1",
                           "--steps", "8"], env={"GRADSYNC_TIMEOUT": "10"})
    assert re.search(r"worker 1 failed with exit code 137; continuing without it", log), log[-2000:]
    sizes = [result["sizes"][str(s)] for s in range(8)]
    assert sizes == ([2] * 2 if grows else [3] * 2) + [3] * 3 + [2] * 3  # step 5 was redone by the two survivors
    *grow, failure = result["resizes"]
    assert [(r["from"], r["to"], r["cause"]) for r in grow] == ([(2, 3, "resize to 3")] if grows else [])
    assert failure["cause"].startswith("failure") and failure["step"] == 5 and failure["to"] == 2
    generation = 1 if grows else 0
    assert f"the elastic launcher lost a member of generation {generation}: worker 1 failed" in failure["cause"], failure
    assert "threads still running" not in log and "terminate called" not in log, log[-3000:]
    assert_matches_reference(result)


WORKER_1_DIES = """
import os, runpy, signal, sys
if os.environ["GRADSYNC_ELASTIC_ID"] == "1":
    {patch} = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
sys.argv[0] = {example!r}
runpy.run_path({example!r}, run_name="__main__")
"""


def worker_1_dies_in(tmp_path, module: str, method: str) -> str:
    """examples/elastic.py, but worker 1 kills itself (SIGKILL) as it calls ``method`` of ``module``."""
    script = tmp_path / "worker_1_dies.py"
    owner, name = method.split(".")
    script.write_text(f"from {module} import {owner}\n" + WORKER_1_DIES.format(patch=f"{owner}.{name}", example=EXAMPLE))
    return str(script)


WORKER_1_ASKS_LATE = """
import os, runpy, sys, time
from gradsync.adapt import elastic
if os.environ["GRADSYNC_ELASTIC_ID"] == "1":
    asked = elastic.request_resize
    def late(*args, **kwargs):
        time.sleep(0.5)
        return asked(*args, **kwargs)
    elastic.request_resize = late
sys.argv[0] = {example!r}
runpy.run_path({example!r}, run_name="__main__")
"""


def test_a_resize_waits_for_every_worker_and_records_that_wait_apart_from_its_pause(tmp_path):
    # Worker 1 reaches the resize 0.5 s after worker 0: worker 0's request waits for it, and its
    # record keeps that wait out of the pause (what the resize itself cost).
    script = tmp_path / "late.py"
    script.write_text(WORKER_1_ASKS_LATE.format(example=EXAMPLE))
    result, _ = run_job(tmp_path, ["-np", "2", "--min-np", "1", "--max-np", "2"], ["--schedule", "3:1", "--steps", "5"],
                        script=str(script))
    [shrink] = result["resizes"]
    waited = shrink["phases"][OTHERS_STEP]
    assert waited >= 0.4 and shrink["pause"] < waited, shrink
    assert shrink["pause"] == pytest.approx(shrink["seconds"] - waited), shrink
    assert_matches_reference(result)


def test_a_worker_lost_in_the_first_commit_of_spread_optimizer_state(tmp_path):
    # ps's first commit gathers the optimizer state from the workers' servers, a collective: the
    # survivor's gather fails, it has no commit to restore, and the hand-over gives it the start.
    script = worker_1_dies_in(tmp_path, "gradsync.adapt.commits", "Commits.commit")
    result, log = run_job(tmp_path, ["-np", "2", "--min-np", "1", "--max-np", "2"],
                          ["--strategy", "ps", "--steps", "4"], env={"GRADSYNC_TIMEOUT": "6"}, script=script)
    assert "worker 1 failed with exit code 137; continuing without it" in log, log[-2000:]
    [failure] = result["resizes"]
    assert failure["cause"].startswith("failure") and failure["step"] == 0 and failure["to"] == 1, failure
    assert [result["sizes"][str(s)] for s in range(4)] == [1] * 4
    assert_matches_reference(result)


def test_a_worker_lost_while_it_hands_its_state_to_a_joiner(tmp_path):
    # allreduce's workers hold the same state: on a grow 2 -> 4 each sends it to one joiner. Worker
    # 1 dies as it begins: its joiner (worker 3) regroups with the survivors instead of failing, and
    # gets the state from the next generation's hand-over.
    script = worker_1_dies_in(tmp_path, "gradsync.transport", "Transport.send_tensors")
    result, log = run_job(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "4"],
                          ["--schedule", "2:4", "--steps", "5"], env={"GRADSYNC_TIMEOUT": "10"}, script=script)
    assert "worker 1 failed with exit code 137; continuing without it" in log, log[-2000:]
    assert "worker 3 failed" not in log and "worker 3] gradsync: elastic worker 3 joined generation 2" in log, log[-3000:]
    assert [result["sizes"][str(s)] for s in range(5)] == [2, 2, 3, 3, 3]
    grow, failure = result["resizes"]
    assert (grow["from"], grow["to"], failure["to"], failure["step"]) == (2, 4, 3, 2), failure
    assert_matches_reference(result)


def test_a_store_that_stalls_for_seconds_costs_a_pause_not_the_job(tmp_path):
    # The launcher holds the job's store: stopped (SIGSTOP) for 3 s while its workers train, their
    # store calls wait and retry, and the job ends with every worker, the reference model, no regroup.
    out = tmp_path / "result.json"
    job = subprocess.Popen([*GRADSYNC, "run", "--elastic", "-np", "2", "--min-np", "1", "--max-np", "2", "--",
                            sys.executable, EXAMPLE, "--sleep", "0.05", "--steps", "40", "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                           env={**os.environ, "GRADSYNC_TIMEOUT": "10"})
    try:
        log = []
        for line in job.stdout:
            log.append(line)
            if "step 0: 2 workers" in line:
                break
        job.send_signal(signal.SIGSTOP)
        time.sleep(3)
        job.send_signal(signal.SIGCONT)
        rest, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    text = "".join(log) + rest
    assert job.returncode == 0, text[-3000:]
    result = json.loads(out.read_text())
    assert set(result["sizes"].values()) == {2} and len(result["sizes"]) == 40 and result["resizes"] == [], result
    assert_matches_reference(result)


def test_below_min_np_the_job_fails_with_a_clear_message(tmp_path):
    proc = subprocess.run([*GRADSYNC, "run", "--elastic", "-np", "2", "--min-np", "2", "--", sys.executable, EXAMPLE,
                           "--die", "2:1", "--steps", "6"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 137
    assert "worker 1 failed (exit code 137) and 1 workers are left, fewer than --min-np 2" in proc.stderr


@pytest.mark.alone  # every rank answers SIGUSR1 within the summary's wait
def test_gradsync_resize_from_another_shell_and_hostile_writes_to_the_store(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "GRADSYNC_STATE_DIR": str(tmp_path / "state")}
    env.pop("GRADSYNC_JOB_SECRET", None)
    # Steps of 50 ms until the StopFile below: the resize starts a worker, whose start (torch's
    # import alone takes seconds on a loaded machine) the job trains through
    stop = tmp_path / "stop"
    job = subprocess.Popen([*GRADSYNC, "run", "--elastic", "-np", "1", "--max-np", "2", "--", sys.executable, EXAMPLE,
                            "--steps", "2000", "--sleep", "0.05", "--out", str(out), "--stop-file", str(stop)],
                           stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    try:
        port = printed_port(job)
        secret = tmp_path / "state" / "jobs" / f"elastic-{port}.key"
        assert secret.exists() and (secret.stat().st_mode & 0o777) == 0o600
        time.sleep(0.5)
        too_many = subprocess.run([*GRADSYNC, "resize", "99", "--port", port], capture_output=True, text=True,
                                  timeout=60, env=env)
        assert too_many.returncode == 1 and "refused" in too_many.stderr and "--max-np 2" in too_many.stderr, too_many
        # Hostile writes without the job's secret: a request (refused), generation keys (restored),
        # the request counter (reset). The job goes on and still ends at the reference model.
        hostile = torch.distributed.TCPStore("127.0.0.1", int(port), is_master=False, wait_for_workers=False)
        seq = hostile.add("elastic/request_seq", 1)
        hostile.set(f"elastic/request/{seq}", "2")
        hostile.set("elastic/gen", "7")
        hostile.set("elastic/members/0", "5,6")
        time.sleep(0.3)  # the agent polls every 20 ms
        hostile.set("elastic/request_seq", "not-a-number")
        time.sleep(0.3)
        asked = subprocess.run([*GRADSYNC, "resize", "2", "--port", port], capture_output=True, text=True, timeout=120,
                               env=env)
        assert asked.returncode == 0, asked.stderr
        assert "the job has 2 workers from generation" in asked.stdout, asked.stdout
        job.send_signal(signal.SIGUSR1)  # where each worker is, and the job goes on
        no_secret = subprocess.run([*GRADSYNC, "resize", "2", "--port", port, "--secret-file", str(tmp_path / "none")],
                                   capture_output=True, text=True, timeout=60, env=env)
        assert no_secret.returncode == 1 and "cannot read the job's secret" in no_secret.stderr, no_secret
        stop.touch()  # StopFile: the workers agree to end after the same step
        rest = job.stderr.read()
        assert job.wait(timeout=90) == 0, rest[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert "ignored a malformed resize request" in rest, rest[-3000:]
    assert f"resize request {seq} refused: not signed with the job's secret" in rest, rest[-3000:]
    assert "elastic/gen was overwritten from outside the job" in rest and "elastic/members/0 was overwritten" in rest
    assert not secret.exists()  # removed when the job ends
    assert re.search(r"where each worker is \(SIGUSR1; generation \d+: ranks 0\.\. are workers \[0, 1\]\)", rest), rest
    path = rest.split("every rank's last operations: ")[1].split()[0]
    assert json.loads(open(path).read())["reason"] == "SIGUSR1" and set(json.loads(open(path).read())["ranks"]) == {"0", "1"}
    shutil.rmtree(os.path.dirname(path))  # the launcher keeps a folder it wrote a summary into
    result = json.loads(out.read_text())
    sizes = [result["sizes"][str(s)] for s in range(len(result["sizes"]))]
    assert sizes[0] == 1 and sizes[-1] == 2 and sorted(sizes) == sizes and len(sizes) < 2000
    assert_matches_reference(result)


def test_gradsync_resize_of_a_store_that_is_no_elastic_job_fails():
    from gradsync import store as stores

    server = stores.serve("127.0.0.1", 0, None, 10)
    asked = subprocess.run([*GRADSYNC, "resize", "2", "--port", str(server.port)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "GRADSYNC_JOB_SECRET": "s" * 64})
    assert asked.returncode == 1 and "is no elastic job's" in asked.stderr, asked


def test_stop_file_needs_a_path_and_one_worker_stops_at_the_step_it_appears(tmp_path):
    import pytest

    from gradsync.adapt import StopFile
    from gradsync.errors import ConfigError

    with pytest.raises(ConfigError, match="StopFile needs the path"):
        StopFile("")

    class Ctl:  # one worker: no agreement needed
        num_workers, stopped = 1, False

        def stop(self):
            self.stopped = True

    policy, ctl = StopFile(str(tmp_path / "stop")), Ctl()
    policy.after_step(ctl)
    assert not ctl.stopped
    (tmp_path / "stop").touch()
    policy.after_step(ctl)
    assert ctl.stopped


def _reattached_after_a_shrink():
    import copy

    import gradsync
    from gradsync.optimizer import detach, reattach
    from gradsync.strategies import resolve

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce", bucket_mb=1e-4)

    def step():
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()

    step()
    sync = opt._gradsync
    old = sync.strategy
    detach(opt)
    new = copy.deepcopy(sync.template)
    reattach(opt, new, previous=old)
    kept = [a.buffer is b.buffer for a, b in zip(old.buckets, new.buckets)] + [len(old.buckets) == len(new.buckets)]
    step()
    other = resolve("allreduce", bucket_mb=1.0)  # other buckets: nothing to keep
    detach(opt)
    reattach(opt, other, previous=new)
    step()
    return {"kept": kept, "steps": new.steps, "other_shares": any(b.buffer is a.buffer for a in new.buckets
                                                                   for b in other.buckets), "buckets": len(old.buckets)}


def test_a_shrink_keeps_allreduces_buckets_and_their_order():
    # What a regroup without new workers does (Regrouping._regroup): the fresh strategy adopts the
    # old one's buckets, learned at its first step, instead of allocating and learning them again.
    from multirank import run_ranks

    [result] = run_ranks(_reattached_after_a_shrink, 1)
    assert result["buckets"] > 1 and all(result["kept"]) and result["steps"] == 2, result
    assert not result["other_shares"], result


LOADS_ACROSS_RESIZES = FORK_PROBES + """
import json, signal, sys
import torch
import gradsync
from gradsync.adapt import Controller, ScheduledResize


gradsync.init()
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
model = torch.nn.Linear(4, 1)
opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), sys.argv[2])
die = sys.argv[3:] == ["die"]  # worker 1 dies in step 3 instead of the resizes; no loader, a collection each step
ctl = Controller(opt, [ScheduledResize({} if die else {2: 3, 4: 2, 6: 3, 8: 2})], batch_size=4,
                 dataset_size=len(data))
threads = {}

def train(ctl):
    for _ in ctl.epochs(100):
        for step in ctl.steps():
            if step >= 10:
                ctl.stop()
                break
            if die:
                if step == 3 and os.environ.get("GRADSYNC_ELASTIC_ID") == "1":
                    os.kill(os.getpid(), signal.SIGKILL)
                x, y = data[ctl.batch_indices()]
                torch.nn.functional.mse_loss(model(x), y).backward()
            else:
                part = torch.utils.data.Subset(data, ctl.batch_indices().tolist())
                loader = torch.utils.data.DataLoader(part, batch_size=len(part), num_workers=1, timeout=20,
                                                     worker_init_fn=collect_garbage)
                for x, y in loader:  # a new worker process every step
                    torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if die:
                gc.collect()
            threads[step] = (ctl.num_workers, gloo_threads())

ctl.run(train)
if not ctl.detached and gradsync.topology().rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"threads": threads}, f)
gradsync.shutdown()
"""


def run_loads(tmp_path, np: int, *args: str) -> tuple[dict[int, tuple[int, int]], str]:
    """LOADS_ACROSS_RESIZES as an elastic job of ``np`` workers: by step, (workers, Gloo threads);
    and what the job printed."""
    script = tmp_path / "loads.py"
    script.write_text(LOADS_ACROSS_RESIZES)
    out = tmp_path / "threads.json"
    proc = subprocess.run([*GRADSYNC, "run", "--elastic", "-np", str(np), "--min-np", "1", "--max-np", "3", "--",
                           sys.executable, str(script), str(out), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "GRADSYNC_TIMEOUT": "20"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return ({int(step): tuple(v) for step, v in json.loads(out.read_text())["threads"].items()},
            proc.stdout[-3000:] + proc.stderr[-5000:])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads by /proc/self/task")
@pytest.mark.parametrize("strategy", ["allreduce", "allreduce-priority", "ddp"])
def test_dataloader_workers_forked_after_each_resize_load_and_old_groups_are_gone(tmp_path, strategy):
    """A generation's strategy, transport and runtime refer to each other and hold its process
    groups, whose Gloo threads run until the groups are freed. Left for a later collection, they
    are freed in whatever process collects first: a DataLoader worker forked after the regroup,
    where a group's destructor waits for threads the child does not have (it hangs, or crashes).
    The next fork after a regroup collects them first (``ddp``'s reducer holds its group where no
    explicit release reaches): the workers load every step, and the Gloo threads stay as many at
    each size as at its first visit."""
    threads, printed = run_loads(tmp_path, 2, strategy)
    assert [threads[s][0] for s in range(10)] == [2, 2, 3, 3, 2, 2, 3, 3, 2, 2], (threads, printed)
    for size in (2, 3):  # the same count whenever the job is at this size again
        assert len({n for workers, n in threads.values() if workers == size}) == 1, (sorted(threads.items()), printed)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads by /proc/self/task")
def test_after_a_workers_death_nothing_holds_the_broken_group(tmp_path):
    """Worker 1 of 3 dies in step 3; the survivors redo it at 2 workers. Once they have regrouped,
    nothing holds the broken generation (its failure's traceback did, until the job ended): a
    collection frees its group, and the Gloo threads are as many as before the death."""
    threads, printed = run_loads(tmp_path, 3, "allreduce", "die")
    assert [threads[s][0] for s in range(10)] == [3, 3, 3] + [2] * 7, (threads, printed)
    assert len({n for _, n in threads.values()}) == 1, (sorted(threads.items()), printed)


@pytest.mark.parametrize("loader", [None, 2], ids=["batch_indices", "ctl.loader"])
def test_balance_batches_in_an_elastic_job_rebalances_after_each_resize(tmp_path, loader):
    """BalanceBatches with worker 1 three times as slow per sample: it gets fewer samples, the shares
    start equal again at every new size (the joiner has no speed yet), the job is rebalanced, and the
    weighted updates still equal one process on the same global batches. Also with each step's part
    loaded by ctl.loader, a DataLoader of 2 processes loading 8 batches ahead: every batch is the
    step's part (the example checks), the plans dropped at each new share and size."""
    result, _ = run_job(tmp_path, ["-np", "2", "--min-np", "1", "--max-np", "3"],
                        ["--schedule", "6:3,12:2", "--steps", "16", "--balance", "--sample-ms", "10",
                         "--slow-worker", "1:3", *(["--loader-workers", str(loader)] if loader else [])])
    shares = [result["shares"][str(s)] for s in range(16)]
    assert [len(s) for s in shares] == [2] * 6 + [3] * 6 + [2] * 4
    assert all(sum(s) == 4 * len(s) for s in shares), shares  # the global batch never changes with the shares
    changes = sum(a != b for a, b in zip(shares, shares[1:]))
    if loader:  # a plan made again at most once per new share or size, and at both resizes at least
        # (worker 0's part may stay the same across a change); the speeds timed with the loaders'
        # processes on the same cores move too much to check the balance's shape here.
        assert 2 <= result["loader_restarts"] <= changes, (result["loader_restarts"], shares)
    else:
        for first, last in ((0, 5), (6, 11), (12, 15)):  # each size starts equal and ends with worker 1 lighter
            assert len(set(shares[first])) == 1, shares
            assert shares[last][1] < min(s for r, s in enumerate(shares[last]) if r != 1), shares
    assert_matches_reference(result)
