"""Bit packing: ``n`` codes of ``bits`` bits each into ``ceil(n * bits / 8)`` bytes, and back.

Quantizers produce small integer codes (a sign bit, a ternary digit, a QSGD level); sending them one
per byte would waste 4-8x of the bandwidth they were meant to save. Codes are packed little-end
first within each byte: code ``j`` of a byte occupies bits ``[j * bits, (j + 1) * bits)``.
"""
from __future__ import annotations

import torch

WIDTHS = (1, 2, 4, 8)


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat tensor of integer codes in ``[0, 2**bits)`` into a ``uint8`` tensor."""
    if bits not in WIDTHS:
        raise ValueError(f"bits must be one of {WIDTHS}, got {bits}")
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    lanes = codes.view(-1, per_byte) << _shifts(bits, codes.device)
    # Lanes occupy disjoint bits, so OR-ing them is a sum that cannot carry.
    out = lanes[:, 0].clone()
    for j in range(1, per_byte):
        out |= lanes[:, j]
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first ``n`` codes of a tensor made by :func:`pack`, as ``uint8``."""
    if bits not in WIDTHS:
        raise ValueError(f"bits must be one of {WIDTHS}, got {bits}")
    if bits == 8:
        return packed[:n]
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(-1)[:n]


def width_for(values: int) -> int:
    """The smallest packing width that holds ``values`` distinct codes."""
    for bits in WIDTHS:
        if values <= 1 << bits:
            return bits
    raise ValueError(f"{values} distinct codes do not fit in a byte")


def packed_bytes(n: int, bits: int) -> int:
    return -(-n * bits // 8)
