"""CPU kernels for quantized weights, and the conversions into their layouts.

4-bit weights run on llmpress's own kernels (``native``: an integer product for decode, at
memory speed; dequantized rows and a product in the input's dtype for prefill, bf16 only where
the CPU multiplies bf16 natively) where they build on this machine, in the layout ``blocks64``
(each 64 columns in 32 bytes: 16-bit lane j holds columns j, j + 16, j + 32 and j + 48, see
``native/blocks64.h``) with a float32 ``[1 or 2, out, groups]`` table of scales (and zeros).
Elsewhere, and for 8-bit
weights, PyTorch's kernels apply, both computing in bfloat16 (with fp32 activations they run
several times slower, so activations are cast to bf16 for the call and the result back):

- ``_weight_int4pack_mm_for_cpu``: 4-bit weights in groups of 32/64/128/256 columns, the weight
  packed by ``_convert_weight_to_int4pack_for_cpu`` from unsigned values ``u = q + 8``, with
  per-group ``(scale, zero)`` pairs meaning ``w = (u - 8) * scale + zero``. compressed-tensors'
  integer zero point ``zp`` (``w = (q - zp) * scale``) becomes ``zero = -zp * scale``.
- ``_weight_int8pack_mm``: 8-bit weights with one scale per output row (no zero point; an
  asymmetric zero point is applied as a rank-one correction afterwards).
"""

from __future__ import annotations

import functools

import torch

from llmpress import native

__all__ = [
    "COMPUTE_DTYPE",
    "aligned",
    "INT4_GROUP_SIZES",
    "int4_group",
    "int4_layout",
    "int4_matmul",
    "int4_pack",
    "int4_qparams",
    "int4_supported",
    "int4_unpack",
    "int8_matmul",
    "int8_supported",
]

COMPUTE_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (32, 64, 128, 256)
_INNER_K_TILES = 8
_UNPACK_ROWS = 1024
_PACK_ROWS = 512  # identity rows per kernel call when reading packed weights back
PREFILL_ROWS = 16  # more rows of x than this take the operators' prefill products (the int4 operator's GEMV_MAX_ROWS)


def _has(op: str) -> bool:
    return hasattr(torch.ops.aten, op)


def int4_layout() -> str:
    """``blocks64`` where llmpress's own int4 kernels run here, else ``aten`` (PyTorch's)."""
    return "blocks64" if native.available() else "aten"


def int4_supported(out_features: int, in_features: int, group_size: int | None) -> bool:
    if int4_layout() == "blocks64":  # any row count; columns in whole 64-column blocks
        return group_size in INT4_GROUP_SIZES and in_features > 0 and in_features % group_size == 0 and in_features % 64 == 0
    return (
        _has("_weight_int4pack_mm_for_cpu")
        and _has("_convert_weight_to_int4pack_for_cpu")
        and group_size in INT4_GROUP_SIZES
        and in_features > 0
        and in_features % group_size == 0
        and in_features % (2 * _INNER_K_TILES) == 0
        and out_features % 16 == 0
    )


def int4_group(out_features: int, in_features: int, strategy: str, group_size: int | None) -> int | None:
    """The kernel group size that holds a 4-bit grid exactly, or None. A group grid keeps its
    own group where the kernel takes it; otherwise the largest kernel group dividing both the
    stored group and the columns does (each stored group becomes several with its scale, and a
    shorter last group fits: groups of 128 over 576 columns run as 9 groups of 64). A channel
    or tensor grid takes the largest kernel group dividing the columns."""
    for group in reversed(INT4_GROUP_SIZES):
        if strategy == "group" and (not group_size or group_size % group):
            continue
        if int4_supported(out_features, in_features, group):
            return group
    return None


def int4_qparams(qparam: torch.Tensor, group_size: int | None, kernel_group: int, out_features: int, in_features: int) -> torch.Tensor:
    """A stored scale or zero point (``[out, groups]``, ``[out, 1]`` or ``[1]``) as one per
    kernel group ``[out, in / kernel_group]``."""
    groups = in_features // kernel_group
    rows = qparam.reshape(1, 1) if qparam.numel() == 1 else qparam.reshape(out_features, -1)
    if rows.shape[1] == groups:
        return rows.expand(out_features, groups)
    if rows.shape[1] == 1:  # per channel or per tensor
        return rows.expand(out_features, groups)
    return rows.repeat_interleave(group_size // kernel_group, dim=1)[:, :groups]


def int8_supported(in_features: int) -> bool:
    """PyTorch's int8 kernel takes whole 16-column blocks: with 200 columns it dies with SIGSEGV on
    an AVX-512 CPU (PyTorch 2.13)."""
    return _has("_weight_int8pack_mm") and in_features > 0 and in_features % 16 == 0


def _convert_in_blocks(rows: int, cols: int, fill, rows_per_chunk: int) -> torch.Tensor:
    """The kernel's packed weight ``[rows, cols / 2]``, converting from an int32 staging block
    that ``fill(block, start, stop)`` writes with the unsigned values ``q + 8`` of those rows.
    The kernel's layout is made per 64-row block, so blocks of whole 64s convert separately: the
    staging copy stays a few MB instead of 4 bytes per weight."""
    step = rows_per_chunk if rows % 64 == 0 and rows_per_chunk % 64 == 0 else rows
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    staging = torch.empty(min(step, rows), cols, dtype=torch.int32)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        block = staging[: stop - start]
        fill(block, start, stop)
        packed[start:stop] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(block, _INNER_K_TILES)
    return packed


def _blocks64(u: torch.Tensor) -> torch.Tensor:
    """Unsigned values ``u`` ``[out, in]`` (uint8, 0..15) in the ``blocks64`` layout ``[out, in / 2]``:
    per 64 columns, byte 2j = columns j | j + 16 (high nibble), byte 2j + 1 = j + 32 | j + 48."""
    rows, cols = u.shape
    quarters = u.view(rows, cols // 64, 4, 16)
    low = torch.bitwise_or(quarters[:, :, 0], quarters[:, :, 1].bitwise_left_shift(4))
    high = torch.bitwise_or(quarters[:, :, 2], quarters[:, :, 3].bitwise_left_shift(4))
    return torch.stack([low, high], dim=-1).view(rows, cols // 2)


def _blocks64_from_bytes(data: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' bytes ``[out, in / 2]`` (column 2i in the low nibble of byte i, 2i + 1
    in the high one) in the ``blocks64`` layout, nibble by nibble without unpacking: with the
    four 8-byte quarters s0..s3 of each 32 source bytes (columns 0-15, 16-31, 32-47, 48-63),
    output bytes 4k..4k+3 are lo(s0)|lo(s1)<<4, lo(s2)|lo(s3)<<4, hi(s0)|hi(s1)<<4 and
    hi(s2)|hi(s3)<<4 of source byte k."""
    rows, half = data.shape
    s = data.view(rows, half // 32, 4, 8)
    out = torch.empty(rows, half // 32, 8, 4, dtype=torch.uint8)
    for first, target in ((0, 0), (2, 1)):  # low nibbles: columns 4k's pairs; from s0/s1, then s2/s3
        a, b = s[:, :, first], s[:, :, first + 1]
        torch.bitwise_or(a.bitwise_and(0xF), b.bitwise_and(0xF).bitwise_left_shift_(4), out=out[..., target])
        torch.bitwise_or(a.bitwise_right_shift(4), b.bitwise_and(0xF0), out=out[..., target + 2])
    return out.view(rows, half)


def _unblocks64(packed: torch.Tensor) -> torch.Tensor:
    """``_blocks64`` undone: the unsigned values ``[out, in]`` (uint8)."""
    rows, half = packed.shape
    pairs = packed.view(rows, half // 32, 16, 2)
    quarters = [pairs[..., 0].bitwise_and(0xF), pairs[..., 0].bitwise_right_shift(4), pairs[..., 1].bitwise_and(0xF), pairs[..., 1].bitwise_right_shift(4)]
    return torch.stack(quarters, dim=2).view(rows, half * 2)


def _native_table(scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[1, out, groups]`` scales, or ``[2, out, groups]`` scales and zeros ``-zp * scale``."""
    scale = scale.to(torch.float32)
    if zero_point is None:
        return scale.unsqueeze(0).contiguous()
    return torch.stack([scale, -zero_point.to(torch.float32) * scale]).contiguous()


def int4_pack(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, rows_per_chunk: int = _PACK_ROWS, layout: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed 4-bit values ``q`` ``[out, in]`` with per-group ``scale`` / ``zero_point``
    ``[out, groups]`` into the kernel's packed weight and its scale-zero table (``layout``:
    ``int4_layout()`` by default)."""
    if (layout or int4_layout()) == "blocks64":
        return _blocks64((q + 8).to(torch.uint8)), _native_table(scale, zero_point)
    block = _kernel_block()
    if block is not None and q.shape[0] % block == 0 and q.shape[1] % 2 == 0:
        low = (q[:, 0::2] + 8).to(torch.uint8)
        data = low.bitwise_or_((q[:, 1::2] + 8).to(torch.uint8).bitwise_left_shift_(4))
        return _pack_bytes(data, block), _scale_zero_table(scale, zero_point)

    def fill(block: torch.Tensor, start: int, stop: int) -> None:
        torch.add(q[start:stop], 8, out=block)  # one pass: widen and offset

    return _convert_in_blocks(*q.shape, fill, rows_per_chunk), _scale_zero_table(scale, zero_point)


def int4_pack_words(
    words: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, rows_per_chunk: int = _PACK_ROWS, layout: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as ``int4_pack`` straight from compressed-tensors' int32 words ``[out, in / 8]``:
    each byte holds two values already offset by 8 (low nibble first), which is what the kernel
    takes. Where this CPU's kernel layout is known (checked against the kernel once), the bytes
    are rearranged into it directly, several times faster than converting through int32 values."""
    data = words.contiguous().view(torch.uint8)
    rows, half = data.shape
    if (layout or int4_layout()) == "blocks64":
        return _blocks64_from_bytes(data), _native_table(scale, zero_point)
    block = _kernel_block()
    if block is not None and rows % block == 0:
        return _pack_bytes(data, block), _scale_zero_table(scale, zero_point)

    def fill(block: torch.Tensor, start: int, stop: int) -> None:
        pairs = block.view(stop - start, half, 2)
        torch.bitwise_and(data[start:stop], 0xF, out=pairs[..., 0])
        torch.bitwise_right_shift(data[start:stop], 4, out=pairs[..., 1])

    return _convert_in_blocks(rows, 2 * half, fill, rows_per_chunk), _scale_zero_table(scale, zero_point)


def _pack_bytes(data: torch.Tensor, block: int, rows_per_chunk: int = 1024) -> torch.Tensor:
    """The kernel layout from bytes ``[out, in / 2]`` (two unsigned values each, low nibble first).

    For each block of ``block`` rows the kernel stores, for every column ``k``, ``block / 2``
    bytes whose low nibble is row ``j`` and high nibble row ``j + block / 2``. Built here with
    byte operations: even columns come from the low nibbles, odd columns from the high ones."""
    rows, half = data.shape
    side = block // 2
    out = torch.empty(rows // block, half, 2, side, dtype=torch.uint8)
    for start in range(0, rows, rows_per_chunk):
        stop = min(start + rows_per_chunk, rows)
        pairs = data[start:stop].view(-1, block, half)
        low, high = pairs[:, :side], pairs[:, side:]
        dst = out[start // block : stop // block]
        even, odd = dst[:, :, 0].transpose(1, 2), dst[:, :, 1].transpose(1, 2)
        torch.bitwise_or(torch.bitwise_left_shift(high, 4), torch.bitwise_and(low, 0xF), out=even)
        torch.bitwise_or(torch.bitwise_and(high, 0xF0), torch.bitwise_right_shift(low, 4), out=odd)
    return out.view(rows, half)


@functools.cache
def _kernel_block() -> int | None:
    """Rows per block of the kernel's packed layout on this CPU (64 with AVX-512, 32 with AVX2),
    found by packing a test matrix with the kernel itself; None when the layout is another."""
    if not _has("_convert_weight_to_int4pack_for_cpu"):
        return None
    values = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    reference = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, _INNER_K_TILES)
    as_bytes = (values[:, 0::2] | (values[:, 1::2] << 4)).to(torch.uint8)
    for block in (64, 32):
        if torch.equal(_pack_bytes(as_bytes, block), reference):
            return block
    return None


def _scale_zero_table(scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    scale = scale.to(torch.float32)
    zero = torch.zeros_like(scale) if zero_point is None else -zero_point.to(torch.float32) * scale
    return torch.stack([scale.t(), zero.t()], dim=-1).to(COMPUTE_DTYPE).contiguous()


def _is_blocks64(table: torch.Tensor) -> bool:
    return table.dtype == torch.float32  # PyTorch's kernel takes a bf16 table


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, table: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``[..., in]``; the result has ``x``'s dtype."""
    if _is_blocks64(table):
        if x.dtype == torch.bfloat16 and x.numel() > PREFILL_ROWS * x.shape[-1] and not native.bf16_native():
            return native.int4_linear(x.float(), packed, table, group_size).to(x.dtype)  # emulated bf16 is slower
        return native.int4_linear(x, packed, table, group_size)
    flat = x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group_size, table)
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def int4_unpack(packed: torch.Tensor, group_size: int, table: torch.Tensor, in_features: int) -> torch.Tensor:
    """The signed values ``q`` ``[out, in]`` back from the kernel layout (exact): byte by byte
    where this CPU's layout is known, else through the kernel itself."""
    if _is_blocks64(table):
        return _unblocks64(packed).view(torch.int8).sub(8)
    block = _kernel_block()
    rows = packed.shape[0]
    if block is not None and rows % block == 0 and packed.shape[1] * 2 == in_features:
        return _unpack_bytes(packed, block).view(torch.int8).sub_(8)
    return _unpack_through_kernel(packed, group_size, table, in_features)


def _unpack_bytes(packed: torch.Tensor, block: int) -> torch.Tensor:
    """The unsigned values ``[out, in]`` (uint8) from the kernel layout: ``_pack_bytes`` undone."""
    rows, half = packed.shape
    side = block // 2
    layout = packed.view(rows // block, half, 2, side)
    values = torch.empty(rows // block, 2, side, half, 2, dtype=torch.uint8)
    for parity in (0, 1):  # even columns, odd columns
        source = layout[:, :, parity].transpose(1, 2)  # [blocks, side, half]
        torch.bitwise_and(source, 0xF, out=values[:, 0, :, :, parity])  # rows j
        torch.bitwise_right_shift(source, 4, out=values[:, 1, :, :, parity])  # rows j + side
    return values.view(rows, 2 * half)


def _unpack_through_kernel(packed: torch.Tensor, group_size: int, table: torch.Tensor, in_features: int) -> torch.Tensor:
    """Identity rows through the kernel give ``w.T`` in bf16, and ``(w - zero) / scale`` rounds
    to ``q`` exactly (|error| < 0.05)."""
    scale = table[..., 0].t().float().repeat_interleave(group_size, dim=1)
    zero = table[..., 1].t().float().repeat_interleave(group_size, dim=1)
    rows = []
    for start in range(0, in_features, _UNPACK_ROWS):
        stop = min(start + _UNPACK_ROWS, in_features)
        eye = torch.zeros(stop - start, in_features, dtype=COMPUTE_DTYPE)
        eye[:, start:stop].fill_diagonal_(1)
        rows.append(torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group_size, table).t().float())
    w = torch.cat(rows, dim=1)
    return torch.round((w - zero) / scale).clamp(-8, 7).to(torch.int8)


def aligned(t: torch.Tensor, alignment: int = 64) -> torch.Tensor:
    """``t`` contiguous at an address PyTorch's CPU kernels can load whole vectors from. A tensor
    read straight from a safetensors file starts wherever the file puts it: an int8 weight 8 bytes
    off made ``_weight_int8pack_mm`` die with SIGSEGV on an AVX-512 CPU (PyTorch 2.13)."""
    t = t.contiguous()
    return t if t.data_ptr() % alignment == 0 else t.clone()


def int8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero_correction: torch.Tensor | None
) -> torch.Tensor:
    """``x @ ((q - zp) * scale).T`` with ``weight`` int8 ``[out, in]`` and ``scale`` ``[out]``
    (float32); ``zero_correction`` is ``zp * scale`` ``[out]`` for asymmetric weights.

    Decode (up to 16 tokens) runs on llmpress's integer product where it builds and the columns
    are whole 32s (``x`` quantized to int16 per 32-128 columns: 1e-4 from the float32 product;
    faster than PyTorch's bf16 kernel); prefill in bf16 where the CPU multiplies bf16 natively
    (many times PyTorch's kernel); PyTorch's ``_weight_int8pack_mm`` (bf16) elsewhere (the
    figures: ``bench/README.md``, "Figures behind the code")."""
    decode = x.numel() <= PREFILL_ROWS * x.shape[-1]
    if decode and x.is_cpu and x.shape[-1] % 32 == 0 and x.dtype in (torch.float32, torch.bfloat16) and native.available():
        return native.int8_linear(x, weight, scale.float(), None if zero_correction is None else zero_correction.float())
    if not decode and native.bf16_native() and native.available():
        return native.int8_linear_bf16(x.to(COMPUTE_DTYPE), weight, scale, zero_correction).to(x.dtype)
    flat = x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE)
    out = torch.ops.aten._weight_int8pack_mm(flat, weight, scale.to(COMPUTE_DTYPE))
    if zero_correction is not None:
        out = out - flat.float().sum(dim=-1, keepdim=True).to(COMPUTE_DTYPE) * zero_correction.to(COMPUTE_DTYPE)
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
