"""Elastic training: the job grows and shrinks while it trains, and survives a worker's death.

    gradsync run --elastic -np 1 --min-np 1 --max-np 4 -- python examples/elastic.py --schedule 3:2,6:4,10:2
    gradsync resize 3 --port PORT        # from another shell: PORT is printed at start

Over several hosts, the same on each (``GRADSYNC_JOB_SECRET`` the same everywhere; the first host's
agent, the one that owns HOST's address, hosts the store):

    gradsync run --elastic --nnodes 1:3 --nproc-per-node 1 --rdzv-endpoint HOST:29400 -- \
        python examples/elastic.py --stop-file /shared/stop

A least-squares model on a fixed dataset. Every step takes the next global batch (``--batch`` per
worker times the current number of workers) of one order per epoch (gradsync.adapt.GlobalBatches),
so the run is reproducible whatever happens to the job. Worker 0 writes ``--out``: the final
parameters, the global batch of every step, the record of every resize and each step's seconds.
``--table`` adds an embedding table (for ``--strategy hybrid``); ``--model resnet50`` trains a real
model on synthetic data instead, for resize latencies (``--compute emulated``: its layers take a
profiled GPU's time, so several workers share a few cores as they would share a host's GPUs).

``--die STEP:ID`` kills worker ID (SIGKILL, no clean-up) in the middle of step STEP's backward:
the survivors restore their last commit and continue without it.

``--balance`` adds :class:`gradsync.adapt.BalanceBatches`: with ``--sample-ms 2 --slow-worker 1:3``
each worker "computes" 2 ms per sample of its share and worker 1 three times that, and the shares
follow (recorded per step in ``--out``); after every resize they start equal again.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

import gradsync
from gradsync.adapt import BalanceBatches, Controller, NoiseScale, ScheduledResize, StopFile, StrategySwitch, monitor

DIM, DATA = 8, 1024


def dataset():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(DATA, DIM, generator=gen)
    y = x @ torch.linspace(-1, 1, DIM) + 0.1 * torch.randn(DATA, generator=gen)
    return x, y


class WithTable(torch.nn.Module):
    """The linear model plus a learned offset per sample: an embedding table, whose rows ``hybrid``
    serves from parameter servers (each step touches only its batch's rows)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(DIM, 1)
        self.offset = torch.nn.Embedding(DATA, 1)
        torch.nn.init.zeros_(self.offset.weight)

    def forward(self, x, idx):
        return self.linear(x) + self.offset(idx)


def build(table: bool = False):
    torch.manual_seed(0)
    model = WithTable() if table else torch.nn.Linear(DIM, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def loss_of(model, x, y, idx=None):
    out = model(x, idx) if isinstance(model, WithTable) else model(x)
    return 0.5 * (out.squeeze(1) - y).pow(2).mean()


def replay(batches: dict, table: bool = False) -> list[torch.Tensor]:
    """The reference for a run's ``--out``: one process, one model, each step's gradient over
    that step's whole global batch (``batches``: step -> sample indices). Each worker's gradient
    counted by its share of the samples, so the workers' weighted mean is this mean."""
    x, y = dataset()
    model, opt = build(table)
    for step in sorted(batches, key=int):
        idx = torch.tensor(batches[step])
        loss_of(model, x[idx], y[idx], idx).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().reshape(-1) for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--schedule", default="", help="STEP:SIZE,... resizes (ScheduledResize)")
    parser.add_argument("--die", default="", help="STEP:ID: worker ID dies during step STEP")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of 'compute' per step")
    parser.add_argument("--strategy", default="allreduce")
    parser.add_argument("--adapt", action="store_true",
                        help="also monitor the noise scale and let StrategySwitch choose between allreduce and "
                             "casync-ring (identity codec): policies and monitors across resizes")
    parser.add_argument("--model", default="", help="a gradsync model (e.g. resnet50) on synthetic data instead "
                        "of least squares: for resize latencies with a model's real size")
    parser.add_argument("--compute", default="real", help="with --model: real, or emulated (the model's real "
                        "parameters and gradients, its layers taking a profiled GPU's time: gradsync.emulate)")
    parser.add_argument("--table", action="store_true", help="add an embedding table (a learned offset per "
                        "sample), for the hybrid strategy")
    parser.add_argument("--commit-every", type=int, default=1, help="steps between commits (a failure redoes at "
                        "most this many); under ps, p3 and hybrid each commit gathers the optimizer state")
    parser.add_argument("--stop-file", default="", help="end after the first step at which this file exists (StopFile)")
    parser.add_argument("--balance", action="store_true", help="BalanceBatches: shares of the global batch follow "
                        "the workers' speeds (with --sample-ms and --slow-worker)")
    parser.add_argument("--sample-ms", type=float, default=0.0, help="milliseconds of 'compute' per sample of a "
                        "worker's share, each step")
    parser.add_argument("--slow-worker", default="", help="ID:FACTOR: worker ID's --sample-ms is FACTOR times as long")
    parser.add_argument("--loader-workers", type=int, default=-1, help="N >= 0: take each step's part through "
                        "ctl.loader (a DataLoader of N worker processes that follows the shares) instead of "
                        "ctl.batch_indices()")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.compute != "real" and not args.model:
        parser.error("--compute applies to --model (the least-squares model computes for real)")

    gradsync.init()
    me = int(os.environ.get("GRADSYNC_ELASTIC_ID", "0"))
    x, y = dataset()
    model, opt = build(args.table)
    if args.model:
        from gradsync.bench.workload import Workload

        spec = Workload(model=args.model, batch_size=args.batch, compute=args.compute).spec()
        torch.manual_seed(0)
        model = spec.build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = gradsync.distribute(model, opt, args.strategy)
    schedule = {int(a): int(b) for a, b in (item.split(":") for item in args.schedule.split(",") if item)}
    die_step, die_id = (int(v) for v in args.die.split(":")) if args.die else (-1, -1)
    if me == die_id:
        next(model.parameters()).register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL) if ctl.step == die_step else g)
    policies = [ScheduledResize(schedule)] + ([StopFile(args.stop_file)] if args.stop_file else [])
    if args.balance:
        policies.append(BalanceBatches(every=2, warmup=1))
    slow_id, slow_factor = args.slow_worker.split(":") if args.slow_worker else (-1, 1)
    per_sample = args.sample_ms / 1e3 * (float(slow_factor) if me == int(slow_id) else 1.0)
    noise = None
    if args.adapt:
        noise = NoiseScale(args.batch)
        monitor(opt, noise)
        policies.append(StrategySwitch(["allreduce", ("casync-ring", {"compression": "none"})], probe_steps=2,
                                       check_every=4, tolerance=0.5))
    ctl = Controller(opt, policies, batch_size=args.batch, dataset_size=DATA, commit_every=args.commit_every)
    loader = None
    if args.loader_workers >= 0:
        samples = torch.utils.data.TensorDataset(torch.arange(DATA), x, y)
        loader = ctl.loader(samples, num_workers=args.loader_workers,
                            **({"prefetch_factor": 4} if args.loader_workers else {}))
    batches: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    shares: dict[int, list[int]] = {}  # every worker's samples in each step
    began: dict[int, float] = {}  # when each step began (a redone step: its last start)
    layouts: list[tuple[int, str]] = []  # (step, what the strategy says of itself: its hosts, say) as it changes

    def train(ctl):
        for _ in ctl.epochs(1_000_000):  # resumes at ctl.epoch, ctl.step after a failure
            for step in ctl.steps():
                if step >= args.steps:
                    ctl.stop()
                    break
                batches[step] = ctl.data.global_batch(ctl.global_batch_size).tolist()
                if gradsync.topology().rank == 0 and sizes.get(step - 1) != ctl.num_workers:
                    print(f"step {step}: {ctl.num_workers} workers", flush=True)
                sizes[step] = ctl.num_workers
                shares[step] = list(ctl.step_sizes)
                if not layouts or layouts[-1][1] != opt.strategy.describe():
                    layouts.append((step, opt.strategy.describe()))
                began[step] = time.perf_counter()
                idx = ctl.batch_indices()  # may be empty in an epoch's last step: then no gradient
                xs, ys = x[idx], y[idx]
                if loader is not None:
                    loaded = next(loader)  # None where this worker has no samples
                    if loaded is not None:
                        idx, xs, ys = loaded
                    assert idx.tolist() == ctl.batch_indices().tolist(), (step, idx)
                time.sleep(args.sleep + per_sample * len(idx))
                if args.model:
                    inputs, target = spec.batch(len(idx), step * 1000 + gradsync.topology().rank)
                    spec.loss(model(*inputs), target).backward()
                elif len(idx):
                    loss_of(model, xs, ys, idx).backward()
                opt.step()
                opt.zero_grad()

    ctl.run(train)
    if not ctl.detached:
        opt.flush()  # the whole model up to date here (hybrid's tables live on their servers)
    # The parameters, to compare with the replay (the small model only: a real model's are for timing,
    # and ResNet-50's would be 25 M numbers of JSON per worker).
    params = [] if args.model else [p.detach().reshape(-1).tolist() for p in model.parameters()]
    if args.out and not ctl.detached:  # every worker: what it ended with, to compare across workers
        with open(f"{args.out}.{me}", "w") as f:
            json.dump({"strategy": opt.strategy.name, "noise_scale": noise.value if noise else None,
                       "params": params}, f)
    if ctl.detached:
        print(f"worker {me}: left the job after step {ctl.step}", flush=True)
    elif gradsync.topology().rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"params": params,
                       "batches": batches, "sizes": sizes, "shares": shares, "resizes": ctl.resizes, "id": me,
                       "table": args.table, "loader_restarts": loader.restarts if loader is not None else None,
                       "described": layouts,
                       "step_seconds": {s: began[s + 1] - began[s] for s in began if s + 1 in began}}, f)
    gradsync.shutdown()


if __name__ == "__main__":
    main()
