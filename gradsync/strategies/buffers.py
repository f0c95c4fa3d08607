"""Module buffers kept alike on every worker, as PyTorch DDP keeps them (``broadcast_buffers``).

Buffers are state that a training forward updates without gradients: BatchNorm's running mean
and variance and its batch counter. Each worker's forward updates them from its own batch, so
without synchronization the workers' models drift apart in them (and so does what each worker
evaluates). Before every forward in training mode, :class:`BufferBroadcast` sends worker 0's
buffers to every worker: one broadcast of all of them (every dtype in one message), packed and
unpacked with one copy call each.

That is DDP's default, with one difference: DDP broadcasts in evaluation mode too, which hangs a
script that evaluates on rank 0 alone; evaluation does not change the buffers, so gradsync
broadcasts only before training-mode forwards. A training-mode forward must then run on every
worker (as any DDP forward must). The broadcast also lines the workers up at the start of each
step, which keeps workers that share cores in step with one another.
"""
from __future__ import annotations

import torch
from torch import nn

from gradsync.transport import Transport


class BufferBroadcast:
    """Worker 0's buffers of ``model`` to every worker, when called (see the module docstring)."""

    def __init__(self, model: nn.Module, transport: Transport):
        self.model, self.transport = model, transport
        self.src = transport.topology.worker_ranks[0]
        self.groups = []  # per device: (buffers, their views in the flat bytes, the flat bytes)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for buffer in dict.fromkeys(model.buffers()):  # a buffer shared by two modules: once
            by_device.setdefault(buffer.device, []).append(buffer)
        for device, buffers in by_device.items():
            # All dtypes in one message: each buffer's bytes at an offset aligned for its dtype.
            offsets, end = [], 0
            for b in buffers:
                end = -(-end // 8) * 8
                offsets.append(end)
                end += b.numel() * b.element_size()
            flat = torch.empty(end, dtype=torch.uint8, device=device)
            views = [flat[o:o + b.numel() * b.element_size()].view(b.dtype).view_as(b)
                     for b, o in zip(buffers, offsets)]
            self.groups.append((buffers, views, flat))

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __call__(self) -> None:
        if not self.model.training:
            return
        me = self.transport.topology.rank == self.src
        for buffers, views, flat in self.groups:
            if me:
                torch._foreach_copy_(views, buffers)
            self.transport.broadcast(flat, self.src, what="broadcast of the model's buffers")
            if not me:
                torch._foreach_copy_(buffers, views)
