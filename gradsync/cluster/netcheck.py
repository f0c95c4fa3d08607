"""``gradsync netcheck``: does the emulated network deliver the configured rate?

Each host of an :class:`~gradsync.cluster.EmulatedCluster` runs one rank; the ranks measure, through
gradsync's own transport (so the figures are what a strategy can get):

- **one-way**: host ``i`` sends to host ``i+1`` while every other host is idle (host ``i``'s uplink
  and host ``i+1``'s downlink alone);
- **bidirectional**: every host sends to the next and receives from the previous at once, so each
  host's uplink and downlink are busy together (full duplex);
- **round trip**: a 4-byte message from host 0 to host 1 and back, median of 20 (the delay);
- **all-reduce bus bandwidth**: ``algbw * 2 (N-1) / N`` of a ring all-reduce, which equals the link
  rate when the ring keeps every link busy (the NCCL-tests convention).

Each transfer lasts about ``seconds`` at the configured rate; the median of ``repeats`` is reported.
Run a rank: ``python -m gradsync.cluster.netcheck RUN_DIR`` (the CLI does this inside the cluster).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

COLUMNS = ["up_one_way", "down_one_way", "up_bidir", "down_bidir"]
TARGET = 0.10
BUFFER = 64 << 20  # within 10 % of the configured rate


def _timed_exchange(transport, send_to, recv_from, payload, inbox, chunk: int, nbytes: int) -> float:
    """Seconds until this rank's receive (if any) of ``nbytes`` completed; 0 when it only sends or idles.

    The bytes go as messages of ``chunk`` bytes, cycling over the buffers: a single large
    exchange posted send first gets half the rate each way from Gloo (docs/mechanisms.md);
    messages of about 10 ms of link time each, interleaved, keep both directions busy.
    """
    outs, ins = payload.split(chunk // 4), inbox.split(chunk // 4)
    transport.barrier(what="netcheck start")
    start = time.perf_counter()
    sends, receives = [], []
    for k in range(max(1, nbytes // chunk)):  # interleaved, so both directions flow
        out, into = outs[k % len(outs)], ins[k % len(ins)]
        if send_to is not None:
            sends.append(transport.send_async(out, send_to, tag=7, what=f"netcheck send to rank {send_to}"))
        if recv_from is not None:
            receives.append(transport.recv_async(into, recv_from, tag=7, what=f"netcheck receive from rank {recv_from}"))
    for handle in receives:
        handle.wait()
    elapsed = time.perf_counter() - start
    for handle in sends:
        handle.wait()
    return elapsed if recv_from is not None else 0.0


def measure(transport, n: int, rank: int, nbytes: int, repeats: int, rate_bps: float) -> list[float]:
    """This rank's row of measured rates, bits/s: COLUMNS + [allreduce bus bandwidth]."""
    import torch

    chunk = min(4 << 20, max(64 << 10, int(rate_bps / 8 * 0.01))) // 4 * 4
    nbytes = max(nbytes // chunk, 1) * chunk
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    row = [0.0] * (len(COLUMNS) + 1)
    rate = lambda seconds: nbytes * 8 / seconds  # noqa: E731
    # Buffers of at most 64 MB, reused (a 5 Gbit/s transfer of 2 s would need 1.25 GB each), and
    # touched once up front: page faults in a fresh receive buffer slow a transfer at Gbit rates.
    size = min(nbytes, BUFFER) // chunk * chunk
    payload, inbox, ring = (torch.zeros(size // 4, dtype=torch.float32) for _ in range(3))
    _timed_exchange(transport, nxt, prev, payload, inbox, chunk, size)  # opens the connections
    for sender in range(n):  # one-way, one sender at a time
        times = [_timed_exchange(transport, nxt if rank == sender else None,
                                 prev if rank == (sender + 1) % n else None, payload, inbox, chunk, nbytes) for _ in range(repeats)]
        if rank == (sender + 1) % n:
            row[1] = rate(statistics.median(times))
    times = [_timed_exchange(transport, nxt, prev, payload, inbox, chunk, nbytes) for _ in range(repeats)]
    row[3] = rate(statistics.median(times))
    transport.allreduce(ring, what="netcheck all-reduce")
    times = []
    for _ in range(repeats):
        transport.barrier(what="netcheck all-reduce start")
        start = time.perf_counter()
        for _ in range(nbytes // size):
            transport.allreduce(ring, what="netcheck all-reduce")
        times.append(time.perf_counter() - start)
    row[4] = (nbytes // size) * size * 8 / statistics.median(times) * 2 * (n - 1) / n
    return row


def round_trip(transport, rank: int, repeats: int = 20) -> float:
    """Median seconds for a 4-byte message from rank 0 to rank 1 and back (other ranks idle)."""
    import torch

    ball, times = torch.zeros(1), []
    transport.barrier(what="netcheck round trip start")
    for _ in range(repeats):
        start = time.perf_counter()
        if rank == 0:
            transport.send_async(ball, 1, tag=8, what="netcheck ping").wait()
            transport.recv_async(ball, 1, tag=8, what="netcheck pong").wait()
        elif rank == 1:
            transport.recv_async(ball, 0, tag=8, what="netcheck ping").wait()
            transport.send_async(ball, 0, tag=8, what="netcheck pong").wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gather(transport, n: int, rank: int, row: list[float]) -> list[list[float]]:
    """Every host's row; a host's uplink figures are what its receiver measured."""
    import torch

    table = torch.zeros(n, len(row), dtype=torch.float64)
    table[rank] = torch.tensor(row, dtype=torch.float64)
    transport.allreduce(table, what="netcheck gather")
    rows = table.tolist()
    for host in range(n):  # host's traffic was received by host + 1
        rows[host][0] = rows[(host + 1) % n][1]
        rows[host][2] = rows[(host + 1) % n][3]
    return rows


def main(run_dir: str) -> int:
    import gradsync
    from gradsync import runtime

    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    topo = gradsync.init()
    transport = runtime.current().transport
    nbytes = max(1 << 20, int(config["rate_bps"] / 8 * config["seconds"])) // 4 * 4
    row = measure(transport, topo.world_size, topo.rank, nbytes, config["repeats"], config["rate_bps"])
    rows = _gather(transport, topo.world_size, topo.rank, row)
    rtt = round_trip(transport, topo.rank)
    if topo.rank == 0:
        with open(os.path.join(run_dir, "results.json"), "w") as f:
            json.dump({"rows": rows, "bytes": nbytes, "rtt_ms": rtt * 1e3}, f)
    gradsync.shutdown()
    return 0


def report(rows: list[list[float]], rate_bps: float, dilation: float = 1.0) -> tuple[str, bool]:
    """A table of per-host rates (Mbit/s, undilated) against the configured rate; and whether all meet the target."""
    head = f"{'host':<6}" + "".join(f"{c:>15}" for c in [*COLUMNS, "allreduce_bus"])
    lines, ok = [head, "-" * len(head)], True
    for host, row in enumerate(rows):
        cells = []
        for value in row:
            ratio = value / rate_bps
            ok = ok and abs(ratio - 1) <= TARGET
            cells.append(f"{value * dilation / 1e6:>8.0f} {ratio:>5.2f}x")
        lines.append(f"{host:<6}" + "".join(f"{c:>15}" for c in cells))
    return "\n".join(lines), ok


if __name__ == "__main__":
    from gradsync.fastexit import exit_now

    exit_now(main(sys.argv[1]))
