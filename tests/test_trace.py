"""Traces: the transport records communication and waits; files merge and render."""
import json
import sys
import time

import pytest
import torch

import gradsync
from gradsync import runtime, trace
from multirank import run_ranks


def traced_allreduce(path_prefix):
    topo = gradsync.topology()
    tracer = trace.start(topo.rank, f"worker {topo.rank}")
    transport = runtime.current().transport
    t = torch.ones(1000)
    transport.allreduce_async(t, what="bucket 0").wait()
    if topo.rank == 0:
        transport.send_async(t, 1, tag=3, what="push of x").wait()
    else:
        transport.recv_async(t, 0, tag=3, what="pull of x").wait()
    transport.allgather_bytes(torch.full((7,), topo.rank, dtype=torch.uint8), limit=16, what="gather of bucket 1")
    transport.barrier()
    trace.stop()
    path = f"{path_prefix}-{topo.rank}.json"
    tracer.save(path)
    return path


def test_transport_operations_and_waits_are_traced_and_merge(tmp_path):
    paths = run_ranks(traced_allreduce, 2, str(tmp_path / "trace"))
    merged = tmp_path / "merged.json"
    count = trace.merge(paths, str(merged))
    events = json.loads(merged.read_text())["traceEvents"]
    assert len(events) == count
    for rank, p2p in ((0, "push of x"), (1, "pull of x")):
        mine = [e for e in events if e.get("pid") == rank]
        begins = {e["name"]: e for e in mine if e["ph"] == "b"}
        assert begins["bucket 0"]["args"] == {"bytes": 4000, "op": "all-reduce"}
        assert begins["gather of bucket 1"]["args"] == {"bytes": 7, "op": "all-gather"}  # compressed payloads
        assert begins[p2p]["args"]["bytes"] == 4000
        ends = {e["id"] for e in mine if e["ph"] == "e"}
        assert {b["id"] for b in begins.values()} <= ends, "an operation never ended"
        waits = [e for e in mine if e["ph"] == "X" and e["tid"] == trace.TRACKS["wait"]]
        assert {"bucket 0", p2p} <= {w["name"] for w in waits}
    png = tmp_path / "t.png"
    trace.render(str(merged), str(png), title="test")
    assert png.stat().st_size > 1000


def test_no_tracer_means_no_events():
    assert trace.current() is None
    tracer = trace.start(0, "x")
    assert trace.current() is tracer
    assert trace.stop() is tracer and trace.current() is None


def traced_p3(path_prefix):
    from gradsync.bench.workload import Workload, train_step

    topo = gradsync.topology()
    work = Workload(model="toy", batch_size=6)
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, "p3", slice_params=20)
    tracer = trace.start(topo.rank, f"worker {topo.rank}")
    trace.instrument(model)
    for step in range(3):
        start = time.perf_counter()
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)
        tracer.span(f"p3 step {step}", "step", start, time.perf_counter())
    opt.flush()
    trace.stop()
    path = f"{path_prefix}-{topo.rank}.json"
    tracer.save(path)
    return path


def test_p3_traces_every_pulled_slice_with_its_priority_and_draws_arrivals(tmp_path):
    paths = run_ranks(traced_p3, 2, str(tmp_path / "trace"))
    merged = tmp_path / "merged.json"
    trace.merge(paths, str(merged))
    events = json.loads(merged.read_text())["traceEvents"]
    pulled = set()
    for rank in (0, 1):
        pulls = [e for e in events if e.get("pid") == rank and e["name"].startswith("pull slice")]
        priorities = {int(e["args"]["priority"]) for e in pulls}  # priority = position = slice index here
        assert priorities and all(k % 2 != rank for k in priorities), priorities  # the other rank owns them
        assert len(pulls) >= 3 * len(priorities)  # every step's update of each came back
        pulled |= priorities
    assert pulled == set(range(len(pulled))) and len(pulled) > 2, pulled  # together: every slice
    png = tmp_path / "arrivals.png"
    trace.render_arrivals(str(merged), str(png), steps=("p3", 1, 2), rank=1, title="test")
    assert png.stat().st_size > 1000
    with pytest.raises(ValueError, match="no steps"):
        trace.render_arrivals(str(merged), str(png), steps=("ps", 1, 2))


def traced_training(path_prefix, strategy, names=("optimizer step",), compression=None):
    """Three steps of ``strategy`` traced: ``(name, track, duration, args)`` of each span named in ``names``."""
    from gradsync.bench.workload import Workload, train_step

    topo = gradsync.topology()
    work = Workload(model="toy", batch_size=6)
    spec = work.spec()
    model, opt = work.build()
    opt = gradsync.distribute(model, opt, strategy, **({"compression": compression} if compression else {}))
    tracer = trace.start(topo.rank, f"worker {topo.rank}")
    for step in range(3):
        inputs, target = work.batch(spec, step, topo.rank, topo.num_workers)
        train_step(model, opt, spec, inputs, target)
    opt.flush()
    trace.stop()
    return [(e["name"], e["tid"], e["dur"], e["args"]) for e in tracer.events if e["ph"] == "X" and e["name"] in names]


@pytest.mark.parametrize("strategy, steps", [("allreduce", 3), ("p3", 0)])
def test_the_users_optimizer_step_is_traced_where_the_strategy_runs_it(tmp_path, strategy, steps):
    for spans in run_ranks(traced_training, 2, str(tmp_path / "trace"), strategy):
        assert len(spans) == steps  # p3 updates its slices with optimizers of its own
        assert all(tid == trace.TRACKS["compute"] and dur >= 0 for _, tid, dur, _ in spans)


def test_arrivals_need_a_trace_with_pulled_slices(tmp_path):
    paths = run_ranks(traced_allreduce, 2, str(tmp_path / "trace"))
    merged = tmp_path / "merged.json"
    trace.merge(paths, str(merged))
    events = json.loads(merged.read_text())["traceEvents"]
    start = min(e["ts"] for e in events if "ts" in e)
    events.append({"ph": "X", "pid": 0, "tid": trace.TRACKS["step"], "ts": start, "dur": 1e6, "name": "allreduce step 0"})
    merged.write_text(json.dumps({"traceEvents": events}))
    with pytest.raises(ValueError, match="no pulled slices on rank 0"):
        trace.render_arrivals(str(merged), str(tmp_path / "x.png"), steps=("allreduce", 0, 0))


def test_a_file_that_is_not_a_trace_is_refused_by_name(tmp_path):
    from gradsync.errors import ConfigError

    bad, empty = tmp_path / "bad.json", tmp_path / "empty.json"
    bad.write_text("{not json")
    empty.write_text(json.dumps({"other": 1}))
    for path, what in ((bad, "not a readable trace file"), (empty, "without trace events"),
                       (tmp_path / "missing.json", "not a readable trace file")):
        with pytest.raises(ConfigError, match=f"{path.name}: .*{what}.*gradsync bench --trace"):
            trace.render(str(path), str(tmp_path / "x.png"))
    from gradsync.cli import main  # gradsync trace merge: the same words, and exit status 2

    assert main(["trace", "merge", str(bad), "-o", str(tmp_path / "m.json")]) == 2
    events = [{"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1, "name": "s"}]
    (tmp_path / "list.json").write_text(json.dumps(events))  # the bare list is Chrome's format too
    assert trace.load_events(str(tmp_path / "list.json")) == events


@pytest.mark.parametrize("strategy", ["casync-ring", "compressed-allgather"])
def test_compressed_strategies_trace_each_encode_and_decode(tmp_path, strategy):
    for spans in run_ranks(traced_training, 2, str(tmp_path / "trace"), strategy, ("encode", "decode"), "onebit"):
        encodes = [s for s in spans if s[0] == "encode"]
        decodes = [s for s in spans if s[0] == "decode"]
        # a ring of 2: its own chunk, then the merged one, per bucket; all-gather: one encode, 2 decodes
        assert encodes and len(decodes) >= len(encodes), (len(encodes), len(decodes))
        assert all(tid == trace.TRACKS["comm"] and dur >= 0 and args["bytes"] > 0 for _, tid, dur, args in spans)


def user_job_with_a_slow_rank():
    # A user's own loop; GRADSYNC_TRACE (set by ``gradsync run --trace``) makes it trace itself.
    from gradsync import stragglers

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce")
    for _ in range(stragglers.PROBE_FIRST + 2):
        loss = model(torch.randn(4, 8)).sum()
        time.sleep(0.01 if gradsync.topology().rank == 1 else 0.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return trace.current().path


def test_a_users_job_traces_itself_under_GRADSYNC_TRACE(tmp_path):
    base = str(tmp_path / "job.json")
    paths = run_ranks(user_job_with_a_slow_rank, 2, env={trace.ENV: base})
    assert paths == [f"{base}.rank-0.json", f"{base}.rank-1.json"]
    merged = str(tmp_path / "merged.json")
    trace.merge(paths, merged)  # what gradsync run --trace does after the job
    events = json.loads(open(merged).read())["traceEvents"]
    for rank in (0, 1):
        mine = [e for e in events if e.get("pid") == rank]
        steps = [e["name"] for e in mine if e["ph"] == "X" and e["tid"] == trace.TRACKS["step"]]
        assert steps == [f"step {k}" for k in range(1, 12)]  # from the second step on: one span a step
        layers = {e["name"] for e in mine if e["ph"] == "X" and e["tid"] == trace.TRACKS["compute"]}
        assert {"forward 0", "forward 2", "backward 0.weight", "optimizer step"} <= layers
        assert any(e["ph"] == "b" and e["tid"] == trace.TRACKS["comm"] for e in mine)
        pace = [e["args"] for e in mine if e["ph"] == "C"]
        assert len(pace) == 11 and set(pace[0]) == {"compute", "between", "wait"}
    # rank 1 computes 10 ms longer a step: its counters say so, and rank 0 waits for it
    compute = {r: sorted(e["args"]["compute"] for e in events if e["ph"] == "C" and e["pid"] == r)[5] for r in (0, 1)}
    assert compute[1] > compute[0] + 5


def test_gradsync_run_trace_says_when_no_rank_traced(tmp_path, capfd):
    # A command that never calls gradsync.init() writes no trace, and the launcher says so.
    from gradsync.cli import main

    code = main(["run", "-np", "1", "--trace", str(tmp_path / "t.json"), "--", sys.executable, "-c", "pass"])
    assert code == 0
    assert "no rank wrote a trace" in capfd.readouterr().err
    assert not (tmp_path / "t.json").exists()
