"""Quantize, dequantize and fake-quantize tensors: pure functions, no module state.

Scales and zero points have the shapes compressed-tensors uses for a weight ``[out, in]``:
``[1]`` per tensor, ``[out, 1]`` per channel, ``[out, ceil(in / group_size)]`` per group. When
``in`` is not a multiple of the group size, the last group is simply shorter.
"""

from __future__ import annotations

import math

import torch

from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = [
    "activation_qparams",
    "compute_qparams",
    "dequantize",
    "expand_to_columns",
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
    if args.strategy != QuantizationStrategy.GROUP:
        return qparam
    return qparam.repeat_interleave(args.group_size, dim=-1)[..., :columns]


def grouped(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x``, ``scale`` and ``zero_point`` shaped to broadcast against each other, the layout
    chosen once from the scale. Whole groups go as ``[out, groups, group_size]`` against
    ``[out, groups, 1]``, with no column-wide copy of the qparams; anything else (a shorter last
    group, a qparam of another shape) falls back to ``expand_to_columns``."""
    if args.strategy == QuantizationStrategy.GROUP and x.dim() == 2:
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
    if args.strategy == QuantizationStrategy.TENSOR:
        return x.min().reshape(1), x.max().reshape(1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    if args.strategy == QuantizationStrategy.TOKEN:
        flat = x.reshape(-1, x.shape[-1])
        return flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
    rows, cols = x.shape
    groups = num_groups(cols, args.group_size)
    pad = groups * args.group_size - cols
    # zero padding never changes min/max: zero is always inside the quantized range
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    grouped = padded.reshape(rows, groups, args.group_size)
    return grouped.amin(dim=-1), grouped.amax(dim=-1)


def compute_qparams(
    min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point (``None`` when symmetric) from observed min and max."""
    min_vals = torch.clamp(min_vals, max=0.0)
    max_vals = torch.clamp(max_vals, min=0.0)
    q_min, q_max = args.q_range
    eps = torch.finfo(torch.float32).eps
    if args.symmetric:
        absmax = torch.maximum(min_vals.abs(), max_vals.abs())
        half_range = q_max if args.is_float else (q_max - q_min) / 2
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
) -> torch.Tensor:
    """Quantized values (int8 holding ``num_bits``-wide integers, or float8_e4m3fn). Works in
    one float32 copy of ``x``."""
    q_min, q_max = args.q_range
    zero_point = None if args.is_float or zero_point is None else zero_point.to(torch.float32)
    values = float_copy(x)
    view, scale, zero_point = grouped(values, scale.to(torch.float32), zero_point, args)
    view.div_(scale)
    if args.is_float:
        return view.clamp_(q_min, q_max).reshape(x.shape).to(torch.float8_e4m3fn)
    if zero_point is not None:
        view.add_(zero_point)
    return view.round_().clamp_(q_min, q_max).reshape(x.shape).to(torch.int8)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(q - zero_point) * scale`` in ``dtype``, worked in one float32 copy of ``q``."""
    zero_point = None if args.is_float or zero_point is None else zero_point.to(torch.float32)
    values = float_copy(q)
    view, scale, zero_point = grouped(values, scale.to(torch.float32), zero_point, args)
    if zero_point is not None:
        view.sub_(zero_point)
    return view.mul_(scale).reshape(q.shape).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype: what the model sees after compression."""
    return dequantize(quantize(x, scale, zero_point, args), scale, zero_point, args, x.dtype)


def activation_qparams(
    flat: torch.Tensor, args: QuantizationArgs, scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scale and zero point a module input ``[tokens, features]`` is quantized with: the
    calibrated ones for static args, else computed from ``flat`` now (per token: ``[tokens, 1]``)."""
    if args.dynamic or scale is None:
        min_vals, max_vals = reduce_min_max(flat.detach(), args)
        return compute_qparams(min_vals, max_vals, args)
    return scale, zero_point


def fake_quantize_activation(
    x: torch.Tensor, args: QuantizationArgs, scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize a module input: dynamic args compute the scale from ``x`` now (per token
    or per tensor); static args use the calibrated ``scale`` (and ``zero_point``, asymmetric).
    With gradients on, the gradient of the rounding is the identity (straight-through)."""
    flat = x.reshape(-1, x.shape[-1])
    scale, zero_point = activation_qparams(flat, args, scale, zero_point)
    quantized = fake_quantize(flat.detach(), scale.detach(), zero_point, args).reshape(x.shape)
    if x.requires_grad:  # training (QAT): the rounding passes gradients straight through
        return x + (quantized - x).detach()
    return quantized
