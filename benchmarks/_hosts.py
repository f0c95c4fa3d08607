"""The scaffolding of the benchmarks that time a rank script on emulated hosts
(benchmarks/duplex.py, benchmarks/slice_exchange.py on two, benchmarks/mesh_exchange.py on N)."""
from __future__ import annotations

import json
import os
import sys
import tempfile


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
