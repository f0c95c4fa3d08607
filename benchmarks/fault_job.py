"""The job the fault campaign (benchmarks/fault_campaign.py) attacks: a small MLP trained for
``--steps`` steps of ``--sleep`` seconds each under ``--strategy``. Every rank writes its pid to
``--pids DIR/rank-R``; worker 0 writes the final parameters to ``--out``.

``--stuck RANK:STEP:SECONDS``: worker RANK sleeps in its own code (a stuck data loader) at the start of
step STEP, after writing the time it starts to ``DIR/stuck``.

``--corrupt STEP``: worker 1 plays a bad peer at that step, sending each dedicated parameter
server a header with an operation no worker sends (``ps`` with ``--servers``), instead of training.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import gradsync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="allreduce")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--pids", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--corrupt", type=int, default=-1)
    parser.add_argument("--stuck", default="-1:-1:0")
    args = parser.parse_args()
    stuck_rank, stuck_step, stuck_s = (float(v) for v in args.stuck.split(":"))
    topo = gradsync.init()
    with open(os.path.join(args.pids, f"rank-{topo.rank}"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05), args.strategy)
    gen = torch.Generator().manual_seed(topo.rank)
    for step in range(args.steps):
        if step == stuck_step and topo.rank == stuck_rank:
            with open(os.path.join(args.pids, "stuck"), "w") as f:
                f.write(repr(time.time()))
            time.sleep(stuck_s)
        if step == args.corrupt and topo.rank == 1:
            from gradsync import runtime
            from gradsync.strategies.ps import TAG_CONTROL

            transport = runtime.current().transport
            for server in topo.server_ranks:
                transport.send_async(torch.tensor([99, step]), server, TAG_CONTROL).wait()
            time.sleep(600)  # the server must name this rank; the launcher then stops the job
        x = torch.randn(8, 16, generator=gen)
        nn.functional.mse_loss(model(x), x[:, :4]).backward()
        time.sleep(args.sleep)
        opt.step()
        opt.zero_grad()
    opt.flush()
    if topo.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump([p.detach().reshape(-1).tolist() for p in model.parameters()], f)
    gradsync.shutdown()


if __name__ == "__main__":
    main()
