"""Adaptive batch size from the gradient noise scale (McCandlish et al. 2018; KungFu's Fig. 4).

    gradsync run -np 2 -- python examples/adaptive_batch.py --mode adaptive
    gradsync run -np 2 -- python examples/adaptive_batch.py --mode fixed:16
    gradsync run -np 2 -- python examples/adaptive_batch.py --mode fixed:256

A student MLP learns a seeded teacher's noisy labels (so the loss has a floor and the noise scale
grows as training approaches it). Every ``--eval-every`` steps the held-out loss is measured; the
run stops at ``--target`` and worker 0 prints one JSON line: steps, samples, seconds to the target,
and the batch-size changes. ``fixed:B`` trains at B per worker with the learning rate scaled
linearly from ``--lr`` at ``--base-batch``; ``adaptive`` starts at ``--base-batch`` and lets
:class:`gradsync.adapt.AdaptiveBatchSize` double it (up to ``--max-batch``) whenever the noise scale
exceeds twice the global batch, scaling the learning rate the same way.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import gradsync
import gradsync.runtime
from gradsync.adapt import AdaptiveBatchSize, Controller, NoiseScale, monitor

DIM, CLASSES, TRAIN, TEST = 32, 10, 1 << 17, 4096


def teacher_data():
    gen = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(DIM, 64, generator=gen), torch.randn(64, CLASSES, generator=gen)
    x = torch.randn(TRAIN + TEST, DIM, generator=gen)
    logits = torch.tanh(x @ w1 / DIM**0.5) @ w2
    y = torch.multinomial(torch.softmax(logits, 1), 1, generator=gen).squeeze(1)  # noisy labels
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="adaptive", help="adaptive, or fixed:B (per worker)")
    p.add_argument("--base-batch", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05, help="at --base-batch per worker")
    p.add_argument("--target", type=float, default=1.07, help="held-out cross-entropy to reach")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--max-seconds", type=float, default=120)
    args = p.parse_args()

    gradsync.init()
    torch.set_num_threads(1)
    x, y, xt, yt = teacher_data()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))
    batch = args.base_batch if args.mode == "adaptive" else int(args.mode.split(":")[1])
    lr = args.lr * batch / args.base_batch
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=lr), "allreduce")
    policies = []
    if args.mode == "adaptive":
        noise = NoiseScale(batch, alpha=0.95)
        monitor(opt, noise, every=5)  # the policy looks every --eval-every steps; the EMA needs a few readings
        policies = [AdaptiveBatchSize(noise, args.max_batch, every=args.eval_every)]
    ctl = Controller(opt, policies, batch_size=batch, dataset_size=TRAIN)
    loss_fn = torch.nn.CrossEntropyLoss()
    start, samples, reached = time.perf_counter(), 0, None
    with ctl.train():
        for _ in ctl.epochs(1000):
            for step in ctl.steps():
                idx = ctl.batch_indices()
                loss_fn(model(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad()
                samples += ctl.global_batch_size
                if (step + 1) % args.eval_every == 0:
                    with torch.no_grad():
                        held_out = float(loss_fn(model(xt), yt))  # the same on every worker
                    out_of_time = torch.tensor([float(time.perf_counter() - start > args.max_seconds)])
                    gradsync.runtime.current().transport.allreduce(out_of_time, op="max")  # every worker alike
                    if held_out <= args.target or bool(out_of_time):
                        reached = held_out
                        ctl.stop()
                        break
    seconds = time.perf_counter() - start
    if gradsync.topology().rank == 0:
        print(json.dumps({"mode": args.mode, "workers": ctl.num_workers, "steps": ctl.step, "samples": samples,
                          "seconds": round(seconds, 2), "held_out_loss": reached, "target": args.target,
                          "reached": reached is not None and reached <= args.target,
                          "final_batch_per_worker": ctl.batch_size,
                          "changes": policies[0].history if policies else []}), flush=True)
    gradsync.shutdown()


if __name__ == "__main__":
    main()
