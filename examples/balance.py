"""Workers of unequal speed: equal shares of the global batch against BalanceBatches.

    gradsync run -np 2 -- python examples/balance.py --slow 1:2
    gradsync run -np 4 -- python examples/balance.py --slow 3:2

A least-squares model on synthetic data, with emulated compute: each step a worker sleeps
``--sample-ms`` per sample of its share, times its ``--slow`` factor (the slow worker stands for a
slower GPU or a busier host), then runs the real forward and backward. The same training runs
twice, from the same model and data: with equal shares, then under
:class:`gradsync.adapt.BalanceBatches`. Worker 0 prints one JSON line: each run's samples per second
over its last ``--measure`` steps, the ratio, the final shares and whether both runs ended with the
same parameters (they should: the global batches and the update are the same, only who computes
which samples differs).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import gradsync
from gradsync.adapt import BalanceBatches, Controller

DIM, DATA = 16, 1 << 15


def train(args, balanced: bool, x, y, factor: float) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05), args.strategy)
    policies = [BalanceBatches(every=args.every, warmup=2)] if balanced else []
    ctl = Controller(opt, policies, batch_size=args.batch, dataset_size=DATA)
    stamps = []
    with ctl.train():
        for _ in ctl.epochs(1):
            for _ in ctl.steps(args.steps):
                idx = ctl.batch_indices()
                time.sleep(args.sample_ms / 1000 * factor * len(idx))
                (0.5 * (model(x[idx]).squeeze(1) - y[idx]).pow(2).mean()).backward()
                opt.step()
                opt.zero_grad()
                stamps.append(time.perf_counter())
    measured = stamps[-1] - stamps[-args.measure - 1]
    result = {"samples_per_s": args.measure * ctl.global_batch_size / measured,
              "shares": ctl.shares or [ctl.batch_size] * ctl.num_workers,
              "history": policies[0].history if balanced else [],
              "params": [p.detach().clone() for p in model.parameters()]}
    opt.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slow", default="1:2", help="RANK:FACTOR, the slower worker")
    p.add_argument("--sample-ms", type=float, default=2.0, help="emulated compute per sample at factor 1")
    p.add_argument("--batch", type=int, default=16, help="per worker (the global batch is this x workers)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--measure", type=int, default=30, help="the last steps, timed")
    p.add_argument("--every", type=int, default=5, help="BalanceBatches(every=)")
    p.add_argument("--strategy", default="allreduce")
    args = p.parse_args()

    topo = gradsync.init()
    torch.set_num_threads(1)
    slow_rank, slow_factor = args.slow.split(":")
    factor = float(slow_factor) if topo.rank == int(slow_rank) else 1.0
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(DATA, DIM, generator=gen)
    y = x @ torch.linspace(-1, 1, DIM) + 0.1 * torch.randn(DATA, generator=gen)
    equal, balanced = (train(args, b, x, y, factor) for b in (False, True))
    if topo.rank == 0:
        same = all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(equal["params"], balanced["params"]))
        print(json.dumps({"workers": topo.num_workers, "slow": args.slow, "strategy": args.strategy,
                          "equal_samples_per_s": round(equal["samples_per_s"], 1),
                          "balanced_samples_per_s": round(balanced["samples_per_s"], 1),
                          "speedup": round(balanced["samples_per_s"] / equal["samples_per_s"], 2),
                          "shares": balanced["shares"], "changes": balanced["history"], "same_params": same}))
    gradsync.shutdown()


if __name__ == "__main__":
    main()
