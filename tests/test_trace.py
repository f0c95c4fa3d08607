"""Traces: the transport records communication and waits; files merge and render."""
import json

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
