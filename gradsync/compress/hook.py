"""Any compressor as a PyTorch DDP communication hook, so users of plain DDP benefit::

    from gradsync.compress import hook
    ddp_model.register_comm_hook(*hook.comm_hook("powersgd", rank=2, error_feedback=True))

The hook follows PyTorch's ``ddp_comm_hooks`` (a plain function plus an explicit state object):

- Each gradient is divided by the world size first, as PyTorch's ``fp16_compress_hook`` does, so a
  half-precision sum cannot overflow where the average would not.
- Element-wise compressors (everything but PowerSGD) compress the whole bucket as one flat tensor:
  one message per bucket. PowerSGD needs each gradient's matrix shape, so it compresses each
  gradient of the bucket (a vector or small matrix goes whole, in one all-reduce per bucket).
- Summable compressors (casts, random-k, PowerSGD) sum compressed payloads with all-reduces. Others
  all-gather every rank's payload and each rank decodes and sums them (GRACE's all-gather
  communicator; memory grows with the world size: ``N`` payloads per bucket).
- Before compressing, every gradient is checked for NaN/Inf, agreed over ranks: every rank raises
  the same error, naming the parameter and the rank that had it (never one rank raising, the rest hanging).

Codecs whose payloads sum in one all-reduce (fp16, bf16, random-k, none) return the collective's
own future: DDP's reducer goes on with backward while the payload and the NaN/Inf flags travel, and
the future's callback decodes the sum into the bucket (or raises the agreed error). PowerSGD's two
dependent rounds and the all-gather codecs run inside the hook and return a completed future, so
their communication does not overlap the rest of backward (Agarwal et al., arXiv 2103.00543, found
PowerSGD's hook faster that way). Compressor state (residuals, warm starts) is kept per
bucket, keyed by the bucket's parameters, and starts afresh if DDP rebuilds its buckets.
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist  # for the GradBucket annotation DDP checks; no calls here

from gradsync import transport
from gradsync.compress import build
from gradsync.compress.base import (CompressionError, Compressor, NonFiniteGradientError, all_finite, from_bytes,
                                    message_problem, to_bytes)
from gradsync.compress.powersgd import PowerSGD


@dataclass
class HookState:
    """Options and per-bucket compressors of one DDP model's hook."""

    compressor: str
    options: dict = field(default_factory=dict)
    error_feedback: bool = False
    process_group: Any = None
    names: dict = field(default_factory=dict)
    """Parameter -> name, for error messages (filled by :func:`comm_hook` when given the model)."""
    compressors: dict = field(default_factory=dict, repr=False)
    check_finite: bool = True
    """Check every gradient for NaN/Inf before compressing, agreed over ranks (one small all-reduce per
    bucket) so that every rank raises the same error instead of one raising and the others hanging."""
    bytes_sent: int = 0
    """Payload bytes this rank sent through the hook so far (all-reduce: ``2 (N-1)/N`` of the payload)."""

    def instance(self, key: str) -> Compressor:
        if key not in self.compressors:
            rank = transport.group_rank_and_size(self.process_group)[0]
            self.compressors[key] = build(self.compressor, key=key, worker=rank,
                                          error_feedback=self.error_feedback, **self.options)
        return self.compressors[key]


def comm_hook(compressor: str, model: torch.nn.Module | None = None, *, error_feedback: bool = False,
              process_group=None, **options: Any) -> tuple[HookState, Any]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook``. ``model``: name parameters in errors."""
    state = HookState(compressor, dict(options), error_feedback, process_group)
    if model is not None:
        state.names = {p: n for n, p in model.named_parameters()}
    build(compressor, **options)  # fail now, not in the middle of backward, on a bad name or option
    return state, compression_hook


def compression_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    rank, size = transport.group_rank_and_size(state.process_group)
    names = [state.names.get(p, f"parameter {i} of bucket {bucket.index()}")
             for i, p in enumerate(bucket.parameters())]
    grads = bucket.gradients()
    key = "|".join(names)
    compressor = state.instance(key)
    if compressor.summable and not isinstance(_inner(compressor), PowerSGD):
        return _one_round(state, compressor, bucket.buffer(), grads, names, rank, size)
    if state.check_finite:
        _agree_finite(state, grads, names, size)
    buffer = bucket.buffer()
    buffer.div_(size)
    if isinstance(_inner(state.instance(key)), PowerSGD):
        _reduce_each(state, key, buffer, grads, names, rank)
    else:
        buffer.copy_(_sync(state, state.instance(key), buffer, key, rank, size))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _one_round(state: HookState, compressor: Compressor, buffer: torch.Tensor, grads: list[torch.Tensor],
               names: list[str], rank: int, size: int) -> torch.futures.Future:
    """Compress, start the payload's all-reduces and the flags', and return a future of the decoded sum.

    ``flags[r]`` is 1 + the index of rank ``r``'s first non-finite gradient, ``flags[size + r]`` 1 + the
    index of a gradient its codec could not encode: a rank with either sends a zero payload and still
    takes part, so every rank's callback sees the same flags and raises the same error."""
    flags = torch.zeros(2 * size, dtype=torch.int64, device=buffer.device)
    bad = next((i for i, g in enumerate(grads) if not all_finite(g)), None) if state.check_finite else None
    if bad is not None:
        flags[rank] = bad + 1
    buffer.div_(size)
    payload = ctx = None
    if bad is None:
        try:
            payload, ctx = compressor.compress(buffer)
        except CompressionError:
            flags[size + rank] = 1
    if payload is None:
        payload, ctx = compressor.compress(torch.zeros_like(buffer))
    futures = [transport.allreduce_sum_async(flags, state.process_group)]
    for part in payload:
        state.bytes_sent += int(2 * (size - 1) / size * part.numel() * part.element_size())
        futures.append(transport.allreduce_sum_async(part, state.process_group))

    def finish(_done) -> torch.Tensor:
        for future in _done.value():
            future.value()  # re-raise a failed collective
        nonfinite, out_of_range = flags[:size].tolist(), flags[size:].tolist()
        for bad_rank, flag in enumerate(nonfinite):
            if flag:
                raise NonFiniteGradientError(
                    f"gradient of {names[flag - 1]!r} on rank {bad_rank} has NaN/Inf elements; nothing was applied "
                    "(every rank raises this). Lower the learning rate, clip gradients, or skip the step.")
        for bad_rank, flag in enumerate(out_of_range):
            if flag:
                raise CompressionError(f"compressing the bucket of {names[0]!r}.. on rank {bad_rank} with "
                                       f"{compressor.name} failed (out of its range); use bf16, or scale the loss "
                                       "down (every rank raises this)")
        total = compressor.decompress(payload, ctx)
        if not all_finite(total):
            raise CompressionError(f"the sum over ranks of the bucket of {names[0]!r}.. overflowed "
                                   f"{compressor.name}'s range; use bf16 or scale the loss down")
        return buffer.copy_(total)

    return torch.futures.collect_all(futures).then(finish)


def _agree_finite(state: HookState, grads: list[torch.Tensor], names: list[str], size: int) -> None:
    """Raise :class:`NonFiniteGradientError` on every rank if any rank has a NaN/Inf gradient."""
    rank = transport.group_rank_and_size(state.process_group)[0]
    flags = torch.zeros(size, dtype=torch.int64)  # flags[r]: 1 + index of rank r's first bad gradient
    for i, grad in enumerate(grads):
        if not all_finite(grad):
            flags[rank] = i + 1
            break
    transport.allreduce_sum_(flags, state.process_group)
    for bad_rank, flag in enumerate(flags.tolist()):
        if flag:
            raise NonFiniteGradientError(
                f"gradient of {names[flag - 1]!r} on rank {bad_rank} has NaN/Inf elements; nothing was sent "
                "(every rank raises this). Lower the learning rate, clip gradients, or skip the step.")


def _inner(compressor: Compressor) -> Compressor:
    return getattr(compressor, "inner", compressor)


def _allreduce(state: HookState, size: int):
    def allreduce(t: torch.Tensor) -> None:
        state.bytes_sent += int(2 * (size - 1) / size * t.numel() * t.element_size())
        transport.allreduce_sum_(t, state.process_group)
    return allreduce


def _sync(state: HookState, compressor: Compressor, tensor: torch.Tensor, name: str, rank: int,
          size: int) -> torch.Tensor:
    """The sum over ranks of ``tensor``, through ``compressor``."""
    if compressor.summable:
        try:
            return compressor.reduce(tensor, _allreduce(state, size))[0]
        except CompressionError as exc:
            raise type(exc)(f"compressing {name!r} on rank {rank} with {compressor.name}: {exc}") from None
    try:
        payload, ctx = compressor.compress(tensor)
    except CompressionError as exc:
        raise type(exc)(f"compressing {name!r} on rank {rank} with {compressor.name}: {exc}") from None
    message = to_bytes(payload)
    state.bytes_sent += message.numel() * (size - 1)
    total = torch.zeros_like(tensor)
    what = f"compressed {name!r}"
    received = transport.allgather_bytes(message, state.process_group, limit=transport.payload_limit(tensor.numel()),
                                         what=what)
    for r, one in enumerate(received):
        problem = message_problem(one)
        transport.check_peer(problem is None, transport.global_rank(state.process_group, r), what, problem)
        total += compressor.decompress(from_bytes(one, payload), ctx)
    return total


def _reduce_each(state: HookState, key: str, buffer: torch.Tensor, grads: list[torch.Tensor], names: list[str],
                 rank: int) -> None:
    """Per gradient, written back into the bucket's buffer (``bucket.gradients()`` may be copies)."""
    size = transport.group_rank_and_size(state.process_group)[1]
    offset = 0
    for i, (grad, name) in enumerate(zip(grads, names)):
        view = buffer[offset: offset + grad.numel()].view(grad.shape)
        offset += grad.numel()
        view.copy_(_sync(state, state.instance(f"{key}#{i}"), view, name, rank, size))
