"""Observers: choose the min/max range a weight is quantized over.

``minmax`` takes the observed range as it is. ``mse`` shrinks it step by step and keeps, for each
channel or group, the range that minimises the quantization error (|w - qdq(w)|^2.4, as GPTQ
implementations do), which clips rare outliers when that lowers the total error. Its grid,
``maxshrink`` and ``patience`` mean what they mean in llm-compressor's observer.
"""

from __future__ import annotations

import torch

from llmpress import native
from llmpress.quant.qdq import compute_qparams, fake_quantize, global_scale_of, num_groups, reduce_min_max, round_to_grid
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["fake_quantize_weight", "searched_range", "weight_global_scale", "weight_qparams"]


def searched_range(args: QuantizationArgs) -> QuantizationArgs:
    """``args`` with the squared-error range search as its observer where it names none, as
    GPTQ and AutoRound apply weights (not int8, whose fine grid gains nothing from clipping;
    ``GPTQModifier``'s ``_with_gptq_defaults`` has the measurements)."""
    if args.observer is not None or (args.type == "int" and args.num_bits >= 8):
        return args
    return args.model_copy(update={"observer": "mse", "observer_kwargs": {"norm": 2.0}})


def weight_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """NVFP4's global scale shared by ``weights`` (one module's, or those vLLM fuses into one
    layer: q/k/v, gate/up), from their largest magnitude, computed in their dtype."""
    amax = torch.stack([w.detach().abs().amax() for w in weights]).amax()
    return global_scale_of(amax)


def fake_quantize_weight(weight: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """``weight`` on the grid of its own qparams (observer included; NVFP4: its own global
    scale), as a search over candidate weights (AWQ's scales, clipping) scores them."""
    global_scale = weight_global_scale([weight]) if args.has_global_scale else None
    return fake_quantize(weight, *weight_qparams(weight, args, global_scale), args, global_scale)


def weight_qparams(
    weight: torch.Tensor, args: QuantizationArgs, global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point for a 2-D weight under ``args`` (observer included). NVFP4's group
    scales are relative to ``global_scale`` (by default the weight's own)."""
    if args.has_global_scale and global_scale is None:
        global_scale = weight_global_scale([weight])
    if args.has_global_scale and not args.uses_mse:  # group max / 6 in the weight's dtype, as compressed-tensors
        return compute_qparams(*reduce_min_max(weight.detach(), args), args, global_scale)
    weight = weight.detach().to(torch.float32)
    min_vals, max_vals = reduce_min_max(weight, args)
    if not args.uses_mse:
        return compute_qparams(min_vals, max_vals, args, global_scale)
    if args.strategy == QuantizationStrategy.BLOCK:  # one min-max per tile: nothing to search per row
        return compute_qparams(min_vals, max_vals, args, global_scale)
    return _mse_qparams(weight, min_vals, max_vals, args, global_scale)


_CANDIDATE_ELEMENTS = 1 << 19  # bound on the temporary [candidates, rows, cols] tensor


def on_native_grid(args: QuantizationArgs, *tensors: torch.Tensor) -> bool:
    """Whether llmpress's own operators (``llmpress.native``) round onto this integer grid:
    ``tensors`` (a weight, its scales) float32 on a CPU where the operators are built."""
    return (not args.is_float and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and native.available())


def _candidate_errors(weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                      args: QuantizationArgs, norm: float, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantization error |w - qdq(w)|^norm summed per unit, for a stack of candidate qparams
    ``[candidates, rows, units]``: one temporary of the candidates' size, updated in place."""
    rows, cols = weight.shape
    if global_scale is not None:  # NVFP4: the fp8 group scale over the global scale
        scale = scale / global_scale
    if args.is_grouped:
        groups = num_groups(cols, args.group_size)
        padded = torch.nn.functional.pad(weight, (0, groups * args.group_size - cols))  # zeros: no error
        blocks = padded.reshape(rows, groups, args.group_size)
    else:
        blocks = weight.reshape(rows, 1, cols)
    if norm == 2 and on_native_grid(args, weight, scale):  # one pass, no temporary of the candidates' size
        shape = (scale.shape[0], rows, blocks.shape[1])
        zero = None if zero_point is None else zero_point.to(torch.float32).expand(shape).contiguous()
        error = native.candidate_errors(blocks.contiguous(), scale.expand(shape).contiguous(), zero, *args.q_range)
        return error.sum(dim=(-2, -1), keepdim=True) if args.strategy == QuantizationStrategy.TENSOR else error
    s = scale.unsqueeze(-1)
    x = blocks.unsqueeze(0) / s
    if zero_point is None:
        x = round_to_grid(x, args).to(torch.float32)
    else:
        zp = zero_point.unsqueeze(-1).to(torch.float32)
        x = round_to_grid(x.add_(zp), args).to(torch.float32).sub_(zp)
    x.mul_(s).sub_(blocks)
    # |d|^norm as exp(norm * log|d|): faster than pow on a CPU (the search's costliest step)
    # and within 4e-6 of it (|d| = 0 gives exp(-inf) = 0)
    error = (x.square_() if norm == 2 else x.abs_().log_().mul_(norm).exp_()).sum(dim=-1)
    if args.strategy == QuantizationStrategy.TENSOR:
        return error.sum(dim=(-2, -1), keepdim=True)
    return error


def _mse_qparams(weight, min_vals, max_vals, args: QuantizationArgs, global_scale: torch.Tensor | None):
    """llm-compressor's search: shrink factors 1, 1 - 1/grid, ... (``int(maxshrink * grid)``
    of them) in order, each unit keeping the first factor with its lowest error, stopping once
    ``patience`` factors in a row improve no unit. Several factors are scored at once (bounded
    memory; all of them where llmpress's operator scores them); the stop is then found among them."""
    kwargs = args.observer_kwargs
    grid = float(kwargs.get("grid", 100))
    steps = max(1, int(float(kwargs.get("maxshrink", 0.2)) * grid))
    norm = float(kwargs.get("norm", 2.4))
    patience = int(kwargs.get("patience", 5))
    shrinks = [1 - step / grid for step in range(steps)]
    tensor_wide = args.strategy == QuantizationStrategy.TENSOR
    if tensor_wide:  # [1] -> [1, 1] so candidates broadcast as [candidates, 1, 1]
        min_vals, max_vals = min_vals.reshape(1, 1), max_vals.reshape(1, 1)
    chunk = max(1, _CANDIDATE_ELEMENTS // max(weight.numel(), 1))
    if norm == 2 and on_native_grid(args, weight, min_vals):  # no large temporaries: every factor in one call
        chunk = len(shrinks)
    best_error = best_scale = best_zp = None
    idle = 0  # factors in a row that improved no unit
    for first in range(0, len(shrinks), chunk):
        factors = torch.tensor(shrinks[first : first + chunk], dtype=weight.dtype, device=weight.device).reshape(-1, 1, 1)
        scale, zero_point = compute_qparams(min_vals * factors, max_vals * factors, args, global_scale)
        error = _candidate_errors(weight, scale, zero_point, args, norm, global_scale)
        # each factor against the best before it (earlier chunks, then earlier factors here)
        before = error.cummin(dim=0).values.roll(1, dims=0)
        before[0] = float("inf")
        if best_error is not None:
            before = torch.minimum(before, best_error)
        improved = (error < before).flatten(1).any(dim=1).tolist()
        kept, stopped = len(improved), False
        for index, better in enumerate(improved):
            idle = 0 if better else idle + 1
            if not better and idle >= patience:  # as llm-compressor counts: the stop is checked after a miss
                kept, stopped = index + 1, True
                break
        error, index = error[:kept].min(dim=0, keepdim=True)  # first minimum, as argmin; several times faster on CPU
        error = error[0]
        scale = scale.expand(len(factors), *error.shape)[:kept].gather(0, index)[0]
        if zero_point is not None:
            zero_point = zero_point.expand(len(factors), *error.shape)[:kept].gather(0, index)[0]
        if best_error is None:
            best_error, best_scale, best_zp = error, scale, zero_point
        else:
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_scale = torch.where(better, scale, best_scale)
            if zero_point is not None:
                best_zp = torch.where(better, zero_point, best_zp)
        if stopped:
            break
    if tensor_wide:
        best_scale = best_scale.reshape(1)
        best_zp = None if best_zp is None else best_zp.reshape(1)
    return best_scale, best_zp
