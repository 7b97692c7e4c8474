"""Observers: choose the min/max range a weight is quantized over.

``minmax`` takes the observed range as it is. ``mse`` shrinks it step by step and keeps, for each
channel or group, the range that minimises the quantization error (|w - qdq(w)|^2.4, as GPTQ
implementations do), which clips rare outliers when that lowers the total error.
"""

from __future__ import annotations

import torch

from llmpress.quant.qdq import compute_qparams, fake_quantize, num_groups, reduce_min_max
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["weight_qparams"]


def weight_qparams(
    weight: torch.Tensor, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point for a 2-D weight under ``args`` (observer included)."""
    weight = weight.detach().to(torch.float32)
    min_vals, max_vals = reduce_min_max(weight, args)
    if not args.uses_mse:
        return compute_qparams(min_vals, max_vals, args)
    return _mse_qparams(weight, min_vals, max_vals, args)


def _per_unit_error(weight: torch.Tensor, args: QuantizationArgs, scale, zero_point, norm: float):
    error = (fake_quantize(weight, scale, zero_point, args) - weight).abs().pow(norm)
    if args.strategy == QuantizationStrategy.TENSOR:
        return error.sum().reshape(1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return error.sum(dim=-1, keepdim=True)
    rows, cols = error.shape
    groups = num_groups(cols, args.group_size)
    padded = torch.nn.functional.pad(error, (0, groups * args.group_size - cols))
    return padded.reshape(rows, groups, args.group_size).sum(dim=-1)


def _mse_qparams(weight, min_vals, max_vals, args: QuantizationArgs):
    kwargs = args.observer_kwargs
    grid = int(kwargs.get("grid", 100))
    max_shrink = float(kwargs.get("maxshrink", 0.2))
    norm = float(kwargs.get("norm", 2.4))
    best_scale, best_zp = compute_qparams(min_vals, max_vals, args)
    best_error = _per_unit_error(weight, args, best_scale, best_zp, norm)
    for step in range(1, int(max_shrink * grid) + 1):
        shrink = 1 - step / grid
        scale, zero_point = compute_qparams(min_vals * shrink, max_vals * shrink, args)
        error = _per_unit_error(weight, args, scale, zero_point, norm)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        if zero_point is not None:
            best_zp = torch.where(better, zero_point, best_zp)
    return best_scale, best_zp
