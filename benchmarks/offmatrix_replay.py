"""Replay shipped.sqlite's off-matrix emulated records (runs given by id, e.g. 15,6,7) on the matrix's machine rates (the 1 Gbit/s ddp..allreduce-priority group of the same worker count): the simulator's error off the fitted matrix.

    PYTHONPATH=. python benchmarks/offmatrix_replay.py 15,6,7
"""
import json, sqlite3, sys, statistics
from gradsync.simulate import validate as v
m = json.load(open(v.MATRIX))
def group_rates(np):
    want = f"--np {np} --net 1gbit --dilation {np} --strategies ddp,allreduce,ps,p3,ps-sliced,allreduce-priority"
    g = [g for g in m["groups"] if want in g["command"]][-1]
    return g["host_rates"]
c = sqlite3.connect("gradsync/experiment/shipped.sqlite")
runs = [int(x) for x in sys.argv[1].split(",")]
groups = []
for run_id, cmd, recs in c.execute(f"select run_id, command, records from cells where status='done' and run_id in ({','.join(map(str,runs))})"):
    recs = json.loads(recs)
    recs = [r for r in (recs if isinstance(recs, list) else [recs]) if "samples_per_s" in r and r["strategy"].split("+")[0] in ("ps","p3","allreduce","sma","ddp","casync-ring","casync-ps")]
    if not recs: continue
    groups.append({"command": " ".join(json.loads(cmd)[3:]), "host_rates": group_rates(recs[0]["np"]), "records": recs})
out = {k: val for k, val in m.items() if k != "groups"}
out["groups"] = groups
json.dump(out, open("/tmp/offmatrix_replay.json", "w"))
res = v.replay("/tmp/offmatrix_replay.json")
for cell in res["cells"]:
    print(f"{cell['model']:<13} {cell['np']} {cell['net_bps']/1e9:>4g} {cell['strategy']:<20} {cell['measured']:8.1f} {cell['simulated']:8.1f} {cell['error']:+.3f} cpu {cell['host_cpu_busy']:.2f}")
print({k: res[k] for k in ("cells_counted", "median_abs_error", "max_abs_error")})
