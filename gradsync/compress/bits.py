"""Bit packing: ``n`` codes of ``bits`` bits each into ``ceil(n * bits / 8)`` bytes, and back.

Quantizers produce small integer codes (a sign bit, a ternary digit, a QSGD level); sending them one
per byte would waste 4-8x of the bandwidth they were meant to save. Codes are packed little-end
first within each byte: code ``j`` of a byte occupies bits ``[j * bits, (j + 1) * bits)``.

One-bit codes are the hot path of the sign compressors, so they skip the per-lane loop: eight code
bytes read as one 64-bit word ``sum_j c_j 2^(8j)``, times ``sum_i 2^(7i)``, put ``c_j`` at bit
``8j + 7i``; for ``i = 7 - j`` that is bit ``49 + j``, and no two ``(i, j)`` share a bit, so nothing
carries and ``(word * M) >> 49`` is the packed byte (a 64-bit multiply instead of 8 shifted lanes).
:func:`select` decodes one-bit codes to two values with a 256-row table, one row per byte value.
"""
from __future__ import annotations

import torch

WIDTHS = (1, 2, 4, 8)


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


_GATHER = sum(1 << (7 * i) for i in range(8))  # see the module docstring
_BYTE_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # row b: the 8 codes in byte b


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
    if bits == 1:
        codes = codes.contiguous()
        if codes.storage_offset() % 8:  # a view of uint8 codes that does not start on a word
            codes = codes.clone()
        return ((codes.view(torch.int64) * _GATHER) >> 49).to(torch.uint8)
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


def select(packed: torch.Tensor, n: int, one: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Decode ``n`` one-bit codes: ``one`` where the code is 1, ``zero`` where it is 0 (0-d tensors).

    The same as ``torch.where(unpack(packed, 1, n).bool(), one, zero)``, in one gather of 8-value rows
    (moved as 64-bit words: index_select copies those several times faster than float rows).
    """
    table = torch.where(_BYTE_BITS.to(packed.device).bool(), one, zero).contiguous()  # (256, 8)
    rows = torch.index_select(table.view(torch.int64), 0, packed.long())  # a row is 8 values: whole words
    return rows.view(table.dtype).reshape(-1)[:n]


def width_for(values: int) -> int:
    """The smallest packing width that holds ``values`` distinct codes."""
    for bits in WIDTHS:
        if values <= 1 << bits:
            return bits
    raise ValueError(f"{values} distinct codes do not fit in a byte")


def packed_bytes(n: int, bits: int) -> int:
    return -(-n * bits // 8)
