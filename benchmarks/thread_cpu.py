"""Where a command's CPU goes, thread by thread: run it, sample every Python process's threads.

    python benchmarks/thread_cpu.py [--every S] [--skip F] -- gradsync bench --model resnet50 ...

Every ``--every`` seconds (default 1) the user and system time of each thread of each process
whose command line names python or gradsync is read from ``/proc``. Over the middle of the run
(the samples from ``--skip`` of the way in to as far from the end, default 0.35: past start-up and
the first strategy's warm-up, before the last ones end), each thread's share of a core is printed,
per process, busiest first. Linux only; a thread's name is what the kernel has (``python`` for a
Python thread, ``gloo_tcp_loop`` for Gloo's).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def sample() -> dict[tuple[int, int], tuple[str, float, float]]:
    """``(pid, tid) -> (name, user s, system s)`` of every thread of the Python processes."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            if "python" not in cmdline and "gradsync" not in cmdline or int(pid) == os.getpid():
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                out[(int(pid), int(tid))] = (name, int(fields[11]) / TICK, int(fields[12]) / TICK)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue  # a process or thread that ended meanwhile
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=float, default=1.0, help="seconds between samples (default 1)")
    p.add_argument("--skip", type=float, default=0.35, help="fraction of the run left out at each end (default 0.35)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not 0 <= args.skip < 0.5 or args.every <= 0:
        p.error("give a command after --, --skip in [0, 0.5) and --every > 0")
    try:
        run = subprocess.Popen(command)
    except OSError as exc:
        sys.exit(f"cannot run {command[0]!r}: {exc.strerror}")
    samples = []
    while run.poll() is None:
        samples.append((time.time(), sample()))
        time.sleep(args.every)
    if len(samples) < 3:
        sys.exit(f"the command ended after {len(samples)} samples: nothing to compare")
    first, last = int(len(samples) * args.skip), int(len(samples) * (1 - args.skip))
    (t0, a), (t1, b) = samples[first], samples[max(last, first + 1)]
    seconds = t1 - t0
    by_pid: dict[int, list] = {}
    for key, (name, user, system) in b.items():
        if key in a:
            du, ds = user - a[key][1], system - a[key][2]
            if du + ds > 0.01 * seconds:
                by_pid.setdefault(key[0], []).append((key[1], name, du / seconds, ds / seconds))
    print(f"over {seconds:.1f} s of the run (samples {first} to {max(last, first + 1)} of {len(samples)}), cores busy:")
    for pid, threads in sorted(by_pid.items()):
        print(f"process {pid}: {sum(u + s for _, _, u, s in threads):.3f}")
        for tid, name, user, system in sorted(threads, key=lambda t: -(t[2] + t[3])):
            print(f"  thread {tid:>8} {name:<16} user {user:.3f}  system {system:.3f}")
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
