"""A complete gradsync training script: run it alone, or under any launcher.

    python examples/train.py                                   # one process
    gradsync run -np 2 -- python examples/train.py             # 2 workers, all-reduce
    gradsync run -np 2 --servers 1 -- python examples/train.py --strategy ps
    torchrun --nproc-per-node 2 examples/train.py --strategy ddp
"""
import argparse

import torch

import gradsync
from gradsync.models import get_model

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="allreduce", help=f"one of {gradsync.strategy_names()}")
parser.add_argument("--model", default="resnet50:tiny")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()

topo = gradsync.init()                       # reads RANK, WORLD_SIZE, MASTER_ADDR, ...
spec = get_model(args.model)
torch.manual_seed(0)
model = spec.build()
opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                          strategy=args.strategy)   # server ranks serve here, then exit

for step in range(args.steps):
    inputs, target = spec.batch(args.batch_size, seed=step * topo.num_workers + topo.rank)
    loss = spec.loss(model(*inputs), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if topo.rank == 0 and step % 5 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

gradsync.shutdown()                          # tells parameter servers to stop
