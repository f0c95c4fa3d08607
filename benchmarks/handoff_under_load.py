"""How long a woken Python thread takes to run, with the cores idle and with every core busy.

    python benchmarks/handoff_under_load.py [--repeats 300] [--busy 0,2]

What the simulator's ``Host.handoff_s`` stands for (one thread setting an event, another blocked on
it running again, while a third keeps running Python), timed as
:func:`gradsync.simulate.validate.measure_handoff` times it (``handoff_latencies``), once with nothing else running and
once beside ``--busy`` processes that spin in Python (as emulated ranks that outnumber the cores
keep them busy). Printed per case: the median, mean, 90th percentile and largest wakeup in
microseconds. The validation replays the median measured idle (``Host.handoff_s``) and, as often as
every core is busy, the mean with every core busy (``Host.busy_wake_s``,
:func:`gradsync.simulate.validate.measure_busy_wake`: one spinning process per other core beside
the measuring process's own spinning thread, ``--busy 1`` here on 2 cores).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from gradsync.simulate.validate import handoff_latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--busy", default="0,2", help="spinning processes beside the measurement, one case each")
    args = parser.parse_args()
    for count in (int(c) for c in args.busy.split(",")):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
        try:
            time.sleep(0.5)
            times = sorted(handoff_latencies(args.repeats))
        finally:
            for p in spinners:
                p.kill()
                p.wait()
        us = [t * 1e6 for t in times]
        print(f"{count} busy processes: median {statistics.median(us):.0f} us, mean {statistics.fmean(us):.0f}, "
              f"90th percentile {us[int(0.9 * len(us))]:.0f}, largest {us[-1]:.0f}", flush=True)


if __name__ == "__main__":
    main()
