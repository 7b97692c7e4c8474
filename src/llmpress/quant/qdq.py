"""Quantize, dequantize and fake-quantize tensors: pure functions, no module state.

Scales and zero points have the shapes compressed-tensors uses for a weight ``[out, in]``:
``[1]`` per tensor, ``[out, 1]`` per channel, ``[out, ceil(in / group_size)]`` per group (and
per ``tensor_group``), ``[ceil(out / rows), ceil(in / cols)]`` per block. When a dimension is not a
multiple of its group or block, the last one is simply shorter.

The grids: integers, fp8 e4m3, and fp4 e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives,
rounded to nearest with ties to the even mantissa, as compressed-tensors and the hardware do).
NVFP4 (``tensor_group``) divides its fp8 group scales by one fp32 global scale per tensor:
the value is ``q * scale / global_scale``. MX scales are powers of two.
"""

from __future__ import annotations

import math

import torch

from llmpress import native
from llmpress.errors import SchemeError
from llmpress.quant.scheme import FP4_E2M1_MAX, FP8_E4M3_MAX, QuantizationArgs, QuantizationStrategy

__all__ = [
    "activation_qparams",
    "compute_qparams",
    "global_scale_of",
    "round_to_grid",
    "dequantize",
    "effective_scale",
    "expand_to_columns",
    "expand_to_weight",
    "fake_quantize",
    "fake_quantize_activation",
    "float_copy",
    "grouped",
    "num_groups",
    "quantize",
    "reduce_min_max",
]


def num_groups(columns: int, group_size: int) -> int:
    return math.ceil(columns / group_size)


def expand_to_columns(qparam: torch.Tensor, columns: int, args: QuantizationArgs) -> torch.Tensor:
    """Broadcast a per-group scale or zero point ``[out, n_groups]`` to ``[out, columns]``."""
    if not args.is_grouped:
        return qparam
    return qparam.repeat_interleave(args.group_size, dim=-1)[..., :columns]


def expand_to_weight(qparam: torch.Tensor, shape: torch.Size, args: QuantizationArgs) -> torch.Tensor:
    """A per-block qparam ``[row blocks, column blocks]`` broadcast to the weight's ``shape``."""
    rows, cols = args.block_structure
    return qparam.repeat_interleave(rows, dim=0)[: shape[0]].repeat_interleave(cols, dim=1)[:, : shape[1]]


def round_to_grid(x: torch.Tensor, args: QuantizationArgs, clamp: bool = True) -> torch.Tensor:
    """``x`` (already divided by its scale, zero point added) rounded onto the grid of
    ``args``, in place where it can be: integers (int8 storage), fp8 (float8_e4m3fn storage) or
    fp4 values (float32; ties to the even mantissa, a negative value rounding to zero keeps its
    sign, as the packed code does). ``clamp=False`` (integers and fp4, in float32): the grid
    continued past its ends (fp4 in steps of 2), so the caller sees where a value rounds to."""
    q_min, q_max = args.q_range
    if args.is_fp4:
        x = x.clamp_(q_min, q_max) if clamp else x
        magnitude = x.abs()
        # the grid's step: 0.5 below 2, 1 below 4, 2 above (sums of exact halves; 2.4x faster than nested wheres)
        step = (magnitude >= 2).to(torch.float32).mul_(0.5).add_((magnitude >= 4).to(torch.float32)).add_(0.5)
        return magnitude.div_(step).round_().mul_(step).copysign_(x)
    if args.is_float:
        return x.clamp_(q_min, q_max).to(torch.float8_e4m3fn)
    return x.round_().clamp_(q_min, q_max) if clamp else x.round_()


def global_scale_of(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale from the tensor's largest magnitude ``amax`` (any dtype: the
    division runs in it, as compressed-tensors computes it): fp8 max x fp4 max / amax, float32
    ``[1]``. Modules fused at inference (q/k/v, gate/up) pass the largest amax among them."""
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    scale = (FP8_E4M3_MAX * FP4_E2M1_MAX) / amax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def effective_scale(scale: torch.Tensor, args: QuantizationArgs, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The scale a value is divided by: NVFP4's fp8 group scale over its global scale."""
    scale = scale.to(torch.float32)
    if not args.has_global_scale:
        return scale
    if global_scale is None:
        raise SchemeError(
            "NVFP4 (strategy 'tensor_group') values need their global scale",
            got="no global_scale", expected="weight_global_scale (weights) or input_global_scale (inputs)",
            fix="pass global_scale= (llmpress.quant.qdq.global_scale_of(the tensor's absolute maximum))",
        )
    return scale / global_scale.to(torch.float32)


def grouped(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x``, ``scale`` and ``zero_point`` shaped to broadcast against each other, the layout
    chosen once from the scale. Whole groups go as ``[out, groups, group_size]`` against
    ``[out, groups, 1]``, with no column-wide copy of the qparams; anything else (a shorter last
    group, a qparam of another shape) falls back to ``expand_to_columns``."""
    if args.strategy == QuantizationStrategy.BLOCK:
        expand = expand_to_weight
        return x, expand(scale, x.shape, args), None if zero_point is None else expand(zero_point, x.shape, args)
    if args.is_grouped and x.dim() == 2:
        rows, cols = x.shape
        size = args.group_size
        shape = (rows, cols // size)
        whole = cols % size == 0 and tuple(scale.shape) == shape
        if whole and (zero_point is None or tuple(zero_point.shape) == shape):
            zp = None if zero_point is None else zero_point.unsqueeze(-1)
            return x.reshape(rows, cols // size, size), scale.unsqueeze(-1), zp
    columns = x.shape[-1]
    zp = None if zero_point is None else expand_to_columns(zero_point, columns, args)
    return x, expand_to_columns(scale, columns, args), zp


def float_copy(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous float32 tensor with ``x``'s values: the one buffer qdq works in."""
    return x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def reduce_min_max(x: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of a weight ``[out, in]`` over each unit of ``args.strategy``."""
    if _input_major(x) and args.strategy in _ALONG_ROWS:
        return _reduce_input_major(x.t(), args)
    if args.strategy == QuantizationStrategy.TENSOR:
        return x.min().reshape(1), x.max().reshape(1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    if args.strategy == QuantizationStrategy.TOKEN:  # (torch.aminmax along a dim is several times slower on CPU)
        flat = x.reshape(-1, x.shape[-1])
        return flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
    if args.strategy == QuantizationStrategy.BLOCK:
        (rows, cols), (size_r, size_c) = x.shape, args.block_structure
        pad_r, pad_c = -rows % size_r, -cols % size_c
        tiles = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r)).reshape((rows + pad_r) // size_r, size_r, -1, size_c)
        return tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    rows, cols = x.shape
    if args.group_size <= 32 and (ranges := native.group_min_max(x, args.group_size)) is not None:
        return ranges  # small groups of whole vectors: one pass, no transposed copy
    groups = num_groups(cols, args.group_size)
    pad = groups * args.group_size - cols
    # zero padding never changes min/max: zero is always inside the quantized range
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    if args.group_size <= 16 or (args.group_size <= 32 and x.dtype != torch.float32):
        # small groups (NVFP4's 16, MX's 32) reduce 2-3x faster along the outer dimension of a
        # transposed copy than along an inner one of 16 or 32 values (same values: min and max are exact)
        across = padded.reshape(-1, args.group_size).t().contiguous()
        return across.amin(dim=0).reshape(rows, groups), across.amax(dim=0).reshape(rows, groups)
    grouped = padded.reshape(rows, groups, args.group_size)
    return grouped.amin(dim=-1), grouped.amax(dim=-1)


#: the strategies whose units run along a weight's rows (a row, or groups of its columns)
_ALONG_ROWS = (QuantizationStrategy.CHANNEL, QuantizationStrategy.TOKEN, QuantizationStrategy.GROUP,
               QuantizationStrategy.TENSOR_GROUP)


def _input_major(x: torch.Tensor) -> bool:
    """Whether ``x`` ``[out, in]`` is the transpose of a contiguous ``[in, out]`` tensor (GPTQ's
    working layout): its rows are strided, and a reduction along them reads one value a cache line."""
    return x.dim() == 2 and x.shape[0] > 1 and x.shape[1] > 1 and x.stride(0) == 1 and x.t().is_contiguous()


def _reduce_input_major(columns: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``reduce_min_max`` of ``columns.t()`` from the contiguous ``columns`` ``[in, out]``: each
    unit reduced over its input rows, across every output at once (20x faster than along the
    strided rows of the transpose for GPTQ's 5632 x 1024 q/k/v; min and max are exact, so the
    same values)."""
    if args.strategy in (QuantizationStrategy.CHANNEL, QuantizationStrategy.TOKEN):
        return columns.amin(dim=0).unsqueeze(-1), columns.amax(dim=0).unsqueeze(-1)
    cols, rows = columns.shape
    groups = num_groups(cols, args.group_size)
    pad = groups * args.group_size - cols  # zero padding never changes min/max (as above)
    padded = torch.nn.functional.pad(columns, (0, 0, 0, pad)) if pad else columns
    stacked = padded.view(groups, args.group_size, rows)
    return stacked.amin(dim=1).t().contiguous(), stacked.amax(dim=1).t().contiguous()


def _mx_scale(absmax: torch.Tensor, offset: int) -> torch.Tensor:
    """An MX power-of-two group scale: 2^(e - offset), ``e`` the exponent of ``absmax`` rounded up
    where its mantissa is 1.75 or more, ``offset`` the exponent of the element type's largest
    value (2 for fp4's 6, 8 for fp8's 448), as compressed-tensors and vLLM's reference compute it
    (so fp4 values near the next power of two do not clip at 6); stored as the uint8 code
    ``127 + e - offset`` (0 for an all-zero group)."""
    mantissa, exponent = torch.frexp(absmax.to(torch.float32))  # absmax = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype)  # 2^(exponent - 1) <= absmax; 1.75 x that rounds up
    code = torch.where(absmax > 0, exponent + 127 - offset, torch.zeros_like(exponent)).clamp(0, 255)
    return torch.exp2(code.to(torch.float32) - 127)


def compute_qparams(
    min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantizationArgs, global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point (``None`` when symmetric) from observed min and max. NVFP4's scales
    are fp8 values relative to ``global_scale``; MX scales are powers of two."""
    min_vals = torch.clamp(min_vals, max=0.0)
    max_vals = torch.clamp(max_vals, min=0.0)
    q_min, q_max = args.q_range
    eps = torch.finfo(torch.float32).eps
    if args.symmetric:
        absmax = torch.maximum(min_vals.abs(), max_vals.abs())
        if args.is_mx:
            return _mx_scale(absmax, 2 if args.is_fp4 else 8), None
        half_range = q_max if args.is_float else (q_max - q_min) / 2
        if args.has_global_scale:
            if global_scale is None:
                raise SchemeError("NVFP4 group scales are relative to a global scale", got="no global_scale",
                                  expected="global_scale_of(absolute maximum of the tensor)", fix="pass global_scale=")
            scale = (global_scale.to(torch.float32) * (absmax / half_range)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
            scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
            return scale.masked_fill_(scale == 0, 0.125), None  # fp8's smallest normal step, as compressed-tensors
        scale = (absmax / half_range).clamp(min=eps)
        return scale, None
    scale = ((max_vals - min_vals) / (q_max - q_min)).clamp(min=eps)
    zero_point = torch.clamp(torch.round(q_min - min_vals / scale), q_min, q_max).to(torch.int8)
    return scale, zero_point


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantized values (int8 holding ``num_bits``-wide integers, float8_e4m3fn, or float32
    fp4 grid values). Works in one float32 copy of ``x``. ``global_scale``: NVFP4's."""
    q = _rounded(x, scale, zero_point, args, global_scale)[0].reshape(x.shape)
    return q if args.is_float else q.to(torch.int8)


def _rounded(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs,
    global_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x / scale + zero_point`` rounded onto the grid, in one float32 copy of ``x`` (grouped as
    ``grouped`` lays it out), with the scale and zero point shaped to broadcast against it."""
    zero_point = None if args.is_float or zero_point is None else zero_point.to(torch.float32)
    view, scale, zero_point = grouped(float_copy(x), effective_scale(scale, args, global_scale), zero_point, args)
    view.div_(scale)
    if zero_point is not None:
        view.add_(zero_point)
    return round_to_grid(view, args), scale, zero_point


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    dtype: torch.dtype = torch.float32,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(q - zero_point) * scale`` in ``dtype``, worked in one float32 copy of ``q``."""
    zero_point = None if args.is_float or zero_point is None else zero_point.to(torch.float32)
    values = float_copy(q)
    view, scale, zero_point = grouped(values, effective_scale(scale, args, global_scale), zero_point, args)
    if zero_point is not None:
        view.sub_(zero_point)
    return view.mul_(scale).reshape(q.shape).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype: what the model sees after compression.
    Integer grids stay in the one float32 buffer (the rounded values are exact there), with
    no int8 copy and back: the same bits in two fewer passes over ``x``."""
    if args.is_float:
        q = quantize(x, scale, zero_point, args, global_scale)
        return dequantize(q, scale, zero_point, args, x.dtype, global_scale)
    view, scale, zero_point = _rounded(x, scale, zero_point, args, global_scale)
    view.add_(0.0)  # a -0.0 rounding becomes 0.0, as through int8
    if zero_point is not None:
        view.sub_(zero_point)
    return view.mul_(scale).reshape(x.shape).to(x.dtype)


def activation_qparams(
    flat: torch.Tensor, args: QuantizationArgs, scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scale and zero point a module input ``[tokens, features]`` is quantized with: the
    calibrated ones for static args, else computed from ``flat`` now (per token: ``[tokens, 1]``;
    per group: ``[tokens, groups]``, NVFP4's against the calibrated ``global_scale``)."""
    if args.dynamic or scale is None:
        min_vals, max_vals = reduce_min_max(flat.detach(), args)
        return compute_qparams(min_vals, max_vals, args, global_scale)
    return scale, zero_point


def fake_quantize_activation(
    x: torch.Tensor, args: QuantizationArgs, scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize a module input: dynamic args compute the scale from ``x`` now (per token,
    per group or per tensor); static args use the calibrated ``scale`` (and ``zero_point``,
    asymmetric); NVFP4's group scales are relative to the calibrated ``global_scale``.
    With gradients on, the gradient of the rounding is the identity (straight-through)."""
    flat = x.reshape(-1, x.shape[-1])
    if args.has_global_scale and global_scale is None:  # not calibrated: this input's own
        global_scale = global_scale_of(flat.detach().abs().amax())
    scale, zero_point = activation_qparams(flat, args, scale, zero_point, global_scale)
    quantized = fake_quantize(flat.detach(), scale.detach(), zero_point, args, global_scale).reshape(x.shape)
    if x.requires_grad:  # training (QAT): the rounding passes gradients straight through
        return x + (quantized - x).detach()
    return quantized
