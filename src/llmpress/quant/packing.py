"""Pack narrow integers into int32 words exactly as compressed-tensors does.

Values (signed, ``num_bits`` wide, held in int8) are offset to unsigned, then laid densely into
a bit stream along ``dim``: element ``i`` starts at bit ``i * num_bits``; for widths that do not
divide 32 an element may straddle two words. Each row is padded to a multiple of 32 elements and
cut to ``ceil(n * num_bits / 32)`` words.
"""

from __future__ import annotations

import math
import sys

import torch

__all__ = ["bytewise", "pack_to_int32", "unpack_from_int32"]

_WORD = 32


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def bytewise(num_bits: int, cols: int) -> bool:
    """4- and 8-bit rows of whole words are plain bytes of the little-endian int32 words: they
    pack and unpack with uint8 operations, 1 byte per value instead of 8 for the general path."""
    return num_bits in (4, 8) and cols % (_WORD // num_bits) == 0 and sys.byteorder == "little"


def pack_to_int32(values: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    if values.dim() != 2:
        raise ValueError(f"pack_to_int32 packs 2-D tensors, got shape {tuple(values.shape)}")
    if dim == 0:
        return pack_to_int32(values.t(), num_bits, dim=1).t().contiguous()
    rows, cols = values.shape
    if bytewise(num_bits, cols):
        unsigned = (values.to(torch.int16) + (1 << (num_bits - 1))).to(torch.uint8)
        if num_bits == 4:
            pairs = unsigned.reshape(rows, -1, 2)
            unsigned = pairs[..., 0] | (pairs[..., 1] << 4)
        # flat first: a [1, n] tensor (a per-channel zero point, transposed) can carry a row stride
        # that a dtype view refuses
        return unsigned.contiguous().view(-1).view(torch.int32).view(rows, -1)
    unsigned = values.to(torch.int64) + (1 << (num_bits - 1))
    padded_cols = math.ceil(cols / _WORD) * _WORD
    unsigned = torch.nn.functional.pad(unsigned, (0, padded_cols - cols))
    out_words = math.ceil(cols * num_bits / _WORD)
    if _WORD % num_bits == 0:
        per_word = _WORD // num_bits
        shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
        words = (unsigned.reshape(rows, -1, per_word) << shifts).sum(dim=-1)
        return _to_int32(words[:, :out_words]).contiguous()
    # other widths: every 32 values fill exactly num_bits words; value i of a period starts at
    # bit i * num_bits of it and spills into the next word when it crosses a word boundary. The
    # bit fields do not overlap, so each word is the sum of its parts: two index_adds, not a
    # loop over the 32 positions
    period = unsigned.reshape(rows, -1, _WORD)
    starts = torch.arange(_WORD, dtype=torch.int64) * num_bits
    word, shift = starts // _WORD, starts % _WORD
    words = torch.zeros(rows, period.shape[1], num_bits, dtype=torch.int64)
    words.index_add_(2, word, (period << shift) & 0xFFFFFFFF)
    spill = (shift + num_bits > _WORD).nonzero()[:, 0]
    if len(spill):
        words.index_add_(2, word[spill] + 1, period[..., spill] >> (_WORD - shift[spill]))
    return _to_int32(words.reshape(rows, -1)[:, :out_words]).contiguous()


def unpack_from_int32(
    packed: torch.Tensor, num_bits: int, shape: tuple[int, int] | torch.Size, dim: int = 1
) -> torch.Tensor:
    """Inverse of :func:`pack_to_int32`: int8 values of the original ``shape``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_from_int32 expects int32, got {packed.dtype}")
    shape = tuple(int(s) for s in shape)
    if dim == 0:
        return unpack_from_int32(packed.t(), num_bits, (shape[1], shape[0]), dim=1).t().contiguous()
    rows, cols = shape
    if bytewise(num_bits, cols) and packed.shape == (rows, cols * num_bits // _WORD):
        data = packed.contiguous().view(torch.uint8)
        if num_bits == 8:  # b - 128 as int8 is b with its top bit flipped
            return (data ^ 0x80).view(torch.int8).reshape(rows, cols)
        values = torch.empty(rows, cols // 2, 2, dtype=torch.uint8)
        torch.bitwise_and(data, 0xF, out=values[..., 0])
        torch.bitwise_right_shift(data, 4, out=values[..., 1])
        return values.view(torch.int8).reshape(rows, cols).sub_(8)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    if _WORD % num_bits == 0:
        per_word = _WORD // num_bits
        shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
        unsigned = ((words.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)).reshape(rows, -1)
    else:  # the periods of pack_to_int32: num_bits words hold 32 values
        periods = math.ceil(cols / _WORD)
        words = torch.nn.functional.pad(words, (0, periods * num_bits - words.shape[1])).reshape(rows, periods, num_bits)
        unsigned = torch.empty(rows, periods, _WORD, dtype=torch.int64)
        for i in range(_WORD):
            word, shift = divmod(i * num_bits, _WORD)
            value = words[..., word] >> shift
            if shift + num_bits > _WORD:
                value = value | (words[..., word + 1] << (_WORD - shift))
            unsigned[..., i] = value & ((1 << num_bits) - 1)
        unsigned = unsigned.reshape(rows, -1)
    return (unsigned[:, :cols] - (1 << (num_bits - 1))).to(torch.int8)
