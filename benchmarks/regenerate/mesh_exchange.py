"""How fast N hosts exchange a share with every other host at once, against one peer each.

    sudo python benchmarks/regenerate/mesh_exchange.py [--np 4] [--net 1gbit] [--mb 25] [--kb 256] [--repeats 3]

``--np`` emulated hosts (links of ``--net``, full duplex) run one rank each. In the mesh, every
rank sends ``--mb`` MB to each other rank in messages of ``--kb`` KB, as co-located ``ps``
answers its share's pulls (each fused group to every peer in turn, every receive posted first),
so each host's link carries ``N-1`` flows each way at once. In the shift, every rank sends the
same bytes, in the same messages, to the next rank only: one flow on each link each way, as a
ring's step. Printed per pattern: the median over ``--repeats`` of the time until every rank is
done (its receives and its sends), the ratio of the link rate's time to it, and the spread of
the ranks' finishing times, and the machine's busy core-seconds over it (``/proc/stat``: the
kernel's TCP and the ranks' transport threads; less what the machine keeps busy while the ranks
wait, measured for a second before) per byte sent or received; then the median over the repeats
of the mesh's rate over the shift's, each repeat running the two one after the other.

It measures the network apart from any strategy: where the mesh's ratio falls below the
shift's, the flows that meet on one port share it less well than a fluid model's fair shares,
and ``gradsync simulate`` takes that as ``Network.mesh`` (``--mesh``). ``--matrix`` keeps it with
the validation matrix's host rates (``mesh``: host count -> link rate -> the mesh's ratio over the
shift's, with the command); the replay takes it for a run's hosts at its link's real rate, the
emulated rate over the dilation (an emulated 1 Gbit/s at ``--dilation 4`` is 250 Mbit/s). The
CPU a byte costs the machine where the ranks share its cores (``Host.net_cpu_s``, ``--net-cpu-ns``)
is kept too, the shift's (``net_cpu_s``: link rate -> seconds per byte sent or received), with the
machine's lone copy rate at the time (``net_cpu_copy_Bps``, per link rate too): the replay scales it
to the speed of the machine that recorded each group.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

RANK = r"""
import json, os, sys, time, torch
import gradsync
from gradsync import runtime
cfg = json.load(open(sys.argv[1]))
topo = gradsync.init()
t = runtime.current().transport
n, me = topo.world_size, topo.rank
size, count = cfg["bytes"], cfg["messages"]
payload = torch.ones(count * size, dtype=torch.uint8)  # touched: no page faults while timed
peers = [p for p in range(n) if p != me]
inboxes = {p: torch.empty(count * size, dtype=torch.uint8) for p in peers}


def busy_s():  # the machine's busy core-seconds so far (/proc/stat: every namespace's, the kernel's too)
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def timed(mesh):
    dsts = peers if mesh else [(me + 1) % n]
    srcs = peers if mesh else [(me - 1) % n]
    per_peer = count if mesh else count * (n - 1)  # the same bytes leave every host either way
    for p in peers:
        inboxes[p].resize_(per_peer * size)
    t.barrier(what="mesh start")
    start, busy = time.perf_counter(), busy_s()
    handles = [t.recv_async(inboxes[p][g * size:(g + 1) * size], p, 10 + g, what="mesh receive")
               for p in srcs for g in range(per_peer)]  # every receive posted first, as ps's pulls
    for g in range(per_peer):  # each message to every peer in turn, as ps's answers
        handles += [t.send_async(payload[(g % count) * size:(g % count + 1) * size], p, 10 + g, what="mesh send")
                    for p in dsts]
    for h in handles:
        h.wait()
    done = torch.zeros(n, dtype=torch.float64)
    done[me] = time.perf_counter() - start
    t.allreduce(done, world=True, what="finish times")
    return done.tolist() + [busy_s() - busy]  # the ranks' finishing times, then the cores' busy seconds


out = {"mesh": [], "shift": []}
timed(True)  # connections opened, buffers touched
if me == 0:  # the machine's own busy time while the ranks wait in the barrier: left out of the figures
    before = busy_s()
    time.sleep(1.0)
    out["idle"] = busy_s() - before
t.barrier(what="idle measured")
for _ in range(cfg["repeats"]):
    for name in ("mesh", "shift"):
        out[name].append(timed(name == "mesh"))
if me == 0:
    json.dump(out, open(sys.argv[2], "w"))
gradsync.shutdown()
"""


def run_on_hosts(rank_script: str, config: dict, rate_bps: float, prefix: str, np: int = 2) -> dict | None:
    """Write ``config`` and ``rank_script`` to a temporary directory, run the script as
    ``python SCRIPT CONFIG RESULT`` on ``np`` (default two) emulated hosts with links of ``rate_bps``, and
    return the JSON rank 0 wrote to RESULT; None, with the ranks' error printed, if they failed."""
    from gradsync.launch.emulated import launch_emulated

    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        cfg, script, result = (os.path.join(d, n) for n in ("config.json", "rank.py", "result.json"))
        with open(cfg, "w") as f:
            json.dump(config, f)
        with open(script, "w") as f:
            f.write(rank_script)
        job = launch_emulated([sys.executable, script, cfg, result], np=np, rate_bps=rate_bps,
                              env={"GRADSYNC_TIMEOUT": "600"})
        if job.returncode:
            print(f"the ranks failed: {job.message}", file=sys.stderr)
            return None
        with open(result) as f:
            return json.load(f)


def main() -> int:
    from gradsync.cluster import format_rate, parse_rate
    from gradsync.errors import ConfigError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=4, help="hosts (one rank each), >= 3")
    parser.add_argument("--net", default="1gbit")
    parser.add_argument("--mb", type=float, default=25.0, help="MB each rank sends to each other rank")
    parser.add_argument("--kb", type=float, default=256.0, help="message size, KB (ps's fuse_kb: 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--matrix", help="keep the mesh's ratio over the shift's in this validation matrix")
    args = parser.parse_args()
    try:
        rate = parse_rate(args.net)
    except ConfigError as exc:
        parser.error(f"--net: {exc}")
    if args.np < 3 or args.repeats < 1 or args.mb <= 0 or args.kb <= 0:
        parser.error("--np must be >= 3, --repeats >= 1, --mb and --kb > 0")
    if args.matrix and not os.path.isfile(args.matrix):  # before a minute of runs, not after
        parser.error(f"--matrix {args.matrix}: no such file (the validation matrix: gradsync/simulate/validation.json)")
    size = int(args.kb * 1024)
    messages = max(1, round(args.mb * 1e6 / size))
    from gradsync.simulate.validate import calibrate

    copy_Bps = calibrate(handoff_repeats=0)["copy_Bps"]  # this machine's speed, to scale the CPU per byte by
    result = run_on_hosts(RANK, {"bytes": size, "messages": messages, "repeats": args.repeats}, rate,
                              "gradsync-mesh-", np=args.np)
    if result is None:
        return 1
    line = (args.np - 1) * messages * size * 8 / rate
    print(f"{args.np} hosts, links of {format_rate(rate)}; each sends {(args.np - 1) * messages * size / 1e6:.1f} MB "
          f"in messages of {size / 1024:g} KB; median of {args.repeats}; at the link rate: {line:.3f} s")
    ratio = {}
    sent = args.np * (args.np - 1) * messages * size  # by all hosts, each byte also received once
    idle = result.pop("idle")  # core-seconds per second
    cpu = {}
    for name, runs in result.items():
        last = statistics.median(max(r[:-1]) for r in runs)
        spread = statistics.median(max(r[:-1]) - min(r[:-1]) for r in runs)
        cpu[name] = statistics.median((r[-1] - idle * max(r[:-1])) for r in runs) / (2 * sent)
        ratio[name] = line / last
        print(f"{name:6s} {last:7.3f} s  {ratio[name]:5.3f}x the link rate   ranks done within {spread * 1e3:6.1f} ms   "
              f"{cpu[name] * 1e9:5.2f} ns of CPU per byte sent or received")
    # each repeat runs the two side by side: the median of their ratios
    pairs = [max(s[:-1]) / max(m[:-1]) for m, s in zip(result["mesh"], result["shift"])]
    mesh = statistics.median(pairs)
    print(f"mesh over shift: {mesh:.3f} (median of the repeats' ratios, {min(pairs):.3f}-{max(pairs):.3f}); "
          f"the machine's own busy time, left out: {idle:.3f} of a core; its copy rate {copy_Bps / 1e9:.1f} GB/s")
    if args.matrix:
        with open(args.matrix) as f:
            matrix = json.load(f)
        rates = matrix.setdefault("host_rates", {})
        key = str(round(rate))  # the link's real rate: an emulated run's rate over its dilation
        rates.setdefault("mesh", {}).setdefault(str(args.np), {})[key] = mesh
        rates.setdefault("mesh_command", {}).setdefault(str(args.np), {})[key] = (
            "sudo python benchmarks/regenerate/mesh_exchange.py " + " ".join(sys.argv[1:]))
        rates.setdefault("net_cpu_s", {})[key] = cpu["shift"]  # per byte end, as a ring's or a pair's traffic
        rates.setdefault("net_cpu_copy_Bps", {})[key] = copy_Bps
        with open(args.matrix, "w") as f:
            json.dump(matrix, f, indent=1)
        print(f"kept in {args.matrix} as host_rates.mesh[{args.np}][{key}] and host_rates.net_cpu_s[{key}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
