"""Per-step time and CPU of ``ddp``, ``allreduce`` and no synchronization at all, interleaved.

    gradsync run -np 1 -- python benchmarks/sync_overhead.py --model resnet50:tiny
    gradsync run -np 4 -- python benchmarks/sync_overhead.py --model resnet50:tiny

With one worker the collectives are trivial, so the difference to ``local`` (the plain optimizer,
no gradsync) is each strategy's own machinery: hooks, bucket copies, the end-of-backward wait.
With several workers it adds the collectives. The strategies run in rounds, each in turn on the
same model and batch (``--rounds``, ``--steps`` timed steps after 3 untimed ones), so drift hits
them alike. Rank 0 prints the median over rounds of the slowest rank's mean wall time per step,
of the process CPU time per step (Gloo's threads included), of the minor page faults per step
(large tensors the allocator maps afresh) and of the garbage collections per step.
"""
from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import torch

import gradsync
from gradsync.models import get_model


def timed(model, spec, batch, opt, steps: int) -> tuple[float, float, float, float]:
    """Mean wall and process-CPU seconds, minor page faults and garbage collections per step over ``steps`` steps."""
    collections = sum(g["collections"] for g in gc.get_stats())
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        spec.loss(model(*batch[0]), batch[1]).backward()
        opt.step()
        opt.zero_grad()
    wall, cpu = (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    return wall, cpu, faults, (sum(g["collections"] for g in gc.get_stats()) - collections) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50:tiny")
    parser.add_argument("--strategies", default="ddp,allreduce,local")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gradsync.init()
    topo = gradsync.topology()
    spec = get_model(args.model)
    torch.manual_seed(0)
    model = spec.build()
    batch = spec.batch(32, topo.rank)
    names = args.strategies.split(",")
    results: dict[str, list[tuple[float, ...]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            if name != "local":
                opt = gradsync.distribute(model, opt, name)
            timed(model, spec, batch, opt, 3)
            slowest = torch.tensor(timed(model, spec, batch, opt, args.steps), dtype=torch.float64)
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            results[name].append(tuple(slowest.tolist()))
            if name != "local":
                opt.close()
    if topo.rank == 0:
        print(f"{args.model}, {topo.num_workers} worker(s), {args.rounds} rounds of {args.steps} steps")
        for name in names:
            wall, cpu, faults, collections = (statistics.median(r[k] for r in results[name]) for k in range(4))
            print(f"{name:<12} wall {wall * 1e3:7.2f} ms/step   cpu {cpu * 1e3:7.2f} ms/step   "
                  f"page faults {faults:6.0f}/step   gc {collections:.2f}/step")
    gradsync.shutdown()


if __name__ == "__main__":
    main()
