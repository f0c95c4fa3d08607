"""A complete gradsync training script: run it alone, or under any launcher.

    python examples/train.py                                   # one process
    gradsync run -np 2 -- python examples/train.py             # 2 workers, all-reduce
    gradsync run -np 2 --servers 1 -- python examples/train.py --strategy ps
    torchrun --nproc-per-node 2 examples/train.py --strategy ddp
    gradsync run -np 4 -- python examples/train.py --device cuda --amp   # one GPU per rank (NCCL), bf16
"""
import argparse

import torch

import gradsync
from gradsync.models import get_model

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="allreduce", help="a strategy name (`gradsync strategies` lists them)")
parser.add_argument("--model", default="resnet50:tiny")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: each rank's local GPU when there is one, else the CPU")
parser.add_argument("--clip", type=float, default=None, help="clip gradients to this global norm")
parser.add_argument("--amp", nargs="?", const="bf16", choices=["bf16", "fp16"], default=None,
                    help="autocast: bf16 (any strategy), or fp16 with a GradScaler (CUDA; strategies that "
                         "synchronize at the end of backward: allreduce, ddp, casync-*, compressed-allgather)")
args = parser.parse_args()

use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
topo = gradsync.init(backend="nccl" if use_cuda else "gloo")  # reads RANK, WORLD_SIZE, MASTER_ADDR, ...
device = gradsync.device()                   # cuda:LOCAL_RANK under NCCL (set as current), else cpu
spec = get_model(args.model)
torch.manual_seed(0)
model = spec.build().to(device)
opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                          strategy=args.strategy,      # server ranks serve here, then exit
                          clip_grad_norm=args.clip)    # clipped where the update happens
amp_dtype = torch.float16 if args.amp == "fp16" else torch.bfloat16
scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # fp16 gradients need loss scaling

for step in range(args.steps):
    inputs, target = spec.batch(args.batch_size, seed=step * topo.num_workers + topo.rank)
    inputs, target = tuple(x.to(device) for x in inputs), target.to(device)
    with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp is not None):
        loss = spec.loss(model(*inputs), target)
    scaler.scale(loss).backward()
    scaler.step(opt)                         # opt.step(), unless a scaled gradient overflowed
    scaler.update()
    opt.zero_grad()
    if topo.rank == 0 and step % 5 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

gradsync.shutdown()                          # tells parameter servers to stop
