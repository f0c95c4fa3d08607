"""Start every rank from the same model, or stop with an error that says where they differ.

``check_models_match`` compares a fixed-format signature of every parameter and buffer
(kind, dtype, shape) with rank 0's: one broadcast of rank 0's signature, one all-reduce to find
the first difference anywhere, then (only on a mismatch) broadcasts of the offending rank's row and
of both ranks' names for that tensor, so every rank raises the same message. Ranks never reach a
collective with mismatched tensors, so there is no hang.
``broadcast_model`` then copies rank 0's values to every rank in flat chunks, unless every rank
already holds them: on CPU (Gloo) each rank hashes its values (SHA-256, ~1 GB/s) and the digests
are compared first, so seeded identical models, the common case, skip a broadcast that costs
minutes for a large model on a slow link.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from gradsync.errors import ModelMismatchError
from gradsync.transport import Transport

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_MAX_DIMS = 8
_ROW = 3 + _MAX_DIMS
_NAME_LEN = 200  # bytes of a tensor's name sent with a mismatch report
CHUNK_BYTES = 64 * 1024 * 1024


def _tensors(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    params = [(name, "parameter", p) for name, p in model.named_parameters()]
    return params + [(name, "buffer", b) for name, b in model.named_buffers()]


def _row(kind: str, t: torch.Tensor) -> list[int]:
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
    dims = list(t.shape)[:_MAX_DIMS] + [-1] * max(0, _MAX_DIMS - t.dim())
    return [0 if kind == "parameter" else 1, dtype, t.dim()] + dims


def _show(row: list[int]) -> str:
    dtype = str(_DTYPES[row[1]]).replace("torch.", "") if row[1] < len(_DTYPES) else "other"
    return f"{dtype}{list(row[3:3 + min(row[2], _MAX_DIMS)])}"


def check_models_match(model: nn.Module, transport: Transport, *, world: bool) -> None:
    """Raise :class:`ModelMismatchError` on every rank if any rank's model differs from rank 0's."""
    tensors = _tensors(model)
    mine = torch.tensor([_row(kind, t) for _, kind, t in tensors] or [[0] * _ROW], dtype=torch.int64)[:len(tensors)]
    count = transport.broadcast(torch.tensor([len(tensors)]), 0, world=world, what="model check").item()
    reference = torch.zeros(count, _ROW, dtype=torch.int64)
    if transport.topology.rank == 0:
        reference.copy_(mine)
    transport.broadcast(reference, 0, world=world, what="model check")
    shared = min(count, len(tensors))
    differs = (mine[:shared] != reference[:shared]).any(dim=1).nonzero()
    first = int(differs[0]) if len(differs) else (shared if len(tensors) != count else 2**40)
    ranks = transport.topology.world_size
    key = torch.tensor([first * ranks + transport.topology.rank])
    transport.allreduce(key, op="min", world=world, what="model check")
    first, culprit = divmod(int(key), ranks)
    if first == 2**40:
        return
    # Every rank raises the same message, so names cross the wire too: the culprit's and rank 0's.
    rank = transport.topology.rank
    row = torch.zeros(1 + _ROW + _NAME_LEN, dtype=torch.int64)
    if rank == culprit:
        row[0] = len(tensors)
        if first < len(tensors):
            row[1:1 + _ROW] = mine[first]
            row[1 + _ROW:] = _encode(tensors[first][0])
    transport.broadcast(row, culprit, world=world, what="model check")
    name0 = _encode(tensors[first][0] if rank == 0 and first < len(tensors) else "")
    transport.broadcast(name0, 0, world=world, what="model check")
    row = row.tolist()
    theirs = (row[1:1 + _ROW], _decode(row[1 + _ROW:]))
    ours = (reference[first].tolist() if first < count else None, _decode(name0.tolist()))
    raise ModelMismatchError(_mismatch_message(first, count, row[0], transport.topology.describe(culprit),
                                               theirs, ours))


def _encode(name: str) -> torch.Tensor:
    codes = list(name.encode()[:_NAME_LEN])
    return torch.tensor(codes + [0] * (_NAME_LEN - len(codes)), dtype=torch.int64)


def _decode(codes: list[int]) -> str:
    return bytes(c for c in codes if c).decode(errors="replace")


def _mismatch_message(first: int, count0: int, count: int, who: str, theirs, ours) -> str:
    """``theirs``/``ours``: (row, name) of tensor ``first`` on the culprit ``who`` / on rank 0."""
    if first >= min(count0, count):  # one model has more tensors than the other
        (row, name), where = (theirs, who) if count > count0 else (ours, "rank 0")
        return (f"models differ across ranks: rank 0 has {count0} parameters and buffers, {who} has "
                f"{count}; the first without a counterpart is {_kind(row)} {name!r} ({_show(row)}) on "
                f"{where}. Every rank must build the same model before gradsync.distribute")
    (row, name), (row0, name0) = theirs, ours
    renamed = "" if name == name0 else f" (called {name0!r} on rank 0)"
    return (f"models differ across ranks: {_kind(row)} {name!r} (index {first}){renamed} is {_show(row)} "
            f"on {who} but {_show(row0)} on rank 0. Every rank must build the same model "
            "(same architecture, sizes and dtype) before gradsync.distribute")


def _kind(row: list[int]) -> str:
    return "parameter" if row[0] == 0 else "buffer"


def _digest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """SHA-256 of the tensors' bytes in order, as ``int64[4]``."""
    h = hashlib.sha256()
    for t in tensors:
        if t.numel():
            h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.int64)


def all_hold_rank0s(tensors: list[torch.Tensor], transport: Transport, world: bool) -> bool:
    """Whether every rank's tensors are bytewise rank 0's (SHA-256 digests compared: 32 bytes each)."""
    mine = _digest(tensors)
    theirs = mine.clone()
    transport.broadcast(theirs, 0, world=world, what="model digest")
    differ = torch.tensor([float(not torch.equal(mine, theirs))])
    transport.allreduce(differ, world=world, what="model digest")
    return not differ.item()


@torch.no_grad()
def broadcast_model(model: nn.Module, transport: Transport, *, world: bool, compare_first: bool = True) -> None:
    """Copy rank 0's parameters and buffers to every rank, in flat chunks of one dtype (skipped, on
    CPU, when every rank's SHA-256 digest of its values equals rank 0's; ``compare_first=False``
    when some rank certainly differs, as a worker joining an elastic job does). Every rank must
    pass the same ``compare_first``."""
    tensors = [t for _, _, t in _tensors(model)]
    if compare_first and transport.device.type == "cpu" and all_hold_rank0s(tensors, transport, world):
        return
    transport.broadcast_tensors(tensors, 0, world=world, what="initial broadcast of the model", chunk_bytes=CHUNK_BYTES)
