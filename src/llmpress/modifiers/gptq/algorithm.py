"""The GPTQ update (Frantar et al., 2022) as one pure function on a weight and its Hessian.

Columns are quantized one at a time; each column's rounding error is spread over the columns not
yet quantized through the Cholesky factor of the inverse Hessian, so the layer's output error
``||W X - Q X||`` stays small. Columns go in blocks ("lazy batch"): inside a block updates are
rank-1, and the rest of the matrix gets one matrix product per block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmpress.errors import UnsupportedModelError
from llmpress.quant.observers import weight_qparams
from llmpress.quant.qdq import expand_to_columns
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["GPTQResult", "gptq_quantize", "inverse_hessian_factor"]

logger = logging.getLogger(__name__)

MAX_DAMPENING_RETRIES = 6


@dataclass
class GPTQResult:
    weight: torch.Tensor  # on the quantization grid, float32, [rows, cols]
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    loss: float  # sum over entries of (w - q)^2 / d^2: GPTQ's own error measure
    dampening: float  # the dampening fraction that made the Hessian invertible


def inverse_hessian_factor(hessian: torch.Tensor, dampening_frac: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + damp * I)^-1``; retries with 10x more dampening (up to
    ``MAX_DAMPENING_RETRIES`` times) instead of failing on a Hessian that is not positive definite."""
    mean_diag = float(torch.mean(torch.diag(hessian)))
    frac = dampening_frac
    for _ in range(MAX_DAMPENING_RETRIES + 1):
        damped = hessian.clone()
        damped.diagonal().add_(frac * mean_diag)
        factor, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper, frac
        logger.warning("GPTQ: Hessian not positive definite with dampening %.3g; retrying with %.3g", frac, frac * 10)
        frac *= 10
    raise UnsupportedModelError(
        "GPTQ could not invert the Hessian even with strong dampening",
        got=f"dampening_frac up to {frac / 10:.3g}",
        expected="a positive definite Hessian",
        fix="use more or more varied calibration samples, or raise dampening_frac",
    )


def _channel_args(args: QuantizationArgs) -> QuantizationArgs:
    return args.model_copy(update={"strategy": QuantizationStrategy.CHANNEL, "group_size": None})


def _qparams(weight: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype):
    """Observer qparams with the scale rounded to the dtype it will be stored in, so the grid
    GPTQ rounds onto is exactly the one the checkpoint describes."""
    scale, zero_point = weight_qparams(weight, args)
    return scale.to(scale_dtype).to(torch.float32), zero_point


def _upfront_qparams(weight: torch.Tensor, args: QuantizationArgs, actorder: bool, scale_dtype: torch.dtype):
    """Scale / zero point fixed before the update starts, or (None, None) when group qparams are
    computed as the update reaches each group (groups without activation ordering)."""
    if args.strategy == QuantizationStrategy.GROUP and not actorder:
        return None, None
    return _qparams(weight, args, scale_dtype)


def _per_column(scale, zero_point, weight: torch.Tensor, args: QuantizationArgs, perm: torch.Tensor | None):
    """Qparams broadcast to one per column ``[rows, cols]``, in the update's column order."""
    if scale is None:
        return None, None
    cols = weight.shape[1]
    scale = expand_to_columns(scale, cols, args).expand(weight.shape[0], cols)
    zero_point = None if zero_point is None else expand_to_columns(zero_point, cols, args).expand(weight.shape[0], cols)
    if perm is not None:
        scale = scale[:, perm]
        zero_point = None if zero_point is None else zero_point[:, perm]
    return scale.contiguous(), None if zero_point is None else zero_point.float().contiguous()


def _round_column(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs) -> torch.Tensor:
    q_min, q_max = args.q_range
    if args.is_float:
        return (w / scale).clamp(q_min, q_max).to(torch.float8_e4m3fn).float() * scale
    if zero_point is None:
        return torch.clamp(torch.round(w / scale), q_min, q_max) * scale
    return (torch.clamp(torch.round(w / scale) + zero_point, q_min, q_max) - zero_point) * scale


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    args: QuantizationArgs,
    *,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: bool = False,
    scale_dtype: torch.dtype = torch.float32,
) -> GPTQResult:
    """Quantize ``weight`` ``[rows, cols]`` given the Hessian ``[cols, cols]`` of its inputs
    (``2/n * X^T X``). With ``actorder`` columns go in order of decreasing Hessian diagonal
    (the inputs with the most energy first); qparams then come from the unpermuted weight."""
    W = weight.detach().to(torch.float32).clone()
    H = hessian.to(torch.float32).clone()
    rows, cols = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    perm = torch.argsort(torch.diag(H), descending=True) if actorder else None
    fixed_scale, fixed_zp = _upfront_qparams(W, args, actorder, scale_dtype)
    col_scale, col_zp = _per_column(fixed_scale, fixed_zp, W, args, perm)
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    Hinv, used_damp = inverse_hessian_factor(H, dampening_frac)

    group = args.group_size if args.strategy == QuantizationStrategy.GROUP else None
    group_scales, group_zps = [], []
    channel = _channel_args(args)
    losses = torch.zeros(rows, dtype=torch.float32)
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        W1 = W[:, start:end].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[start:end, start:end]
        for i in range(end - start):
            col = start + i
            if col_scale is not None:
                scale, zp = col_scale[:, col], None if col_zp is None else col_zp[:, col]
            else:
                if col % group == 0:  # a new group: qparams from its (already updated) columns
                    block_part = W1[:, i : i + group]
                    rest = W[:, end : col + group] if col + group > end else W[:, :0]
                    g_scale, g_zp = _qparams(torch.cat([block_part, rest], dim=1), channel, scale_dtype)
                    group_scales.append(g_scale)
                    group_zps.append(g_zp)
                    scale = g_scale[:, 0]
                    zp = None if g_zp is None else g_zp[:, 0].float()
            w = W1[:, i]
            d = Hinv1[i, i]
            q = _round_column(w, scale, zp, args)
            Q1[:, i] = q
            err = (w - q) / d
            losses += (w - q) ** 2 / d**2
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, start:end] = Q1
        W[:, end:] -= Err1 @ Hinv[start:end, end:]

    if perm is not None:
        W = W[:, torch.argsort(perm)]
    if fixed_scale is not None:
        scale, zero_point = fixed_scale, fixed_zp
    else:
        scale = torch.cat(group_scales, dim=1)
        zero_point = None if group_zps[0] is None else torch.cat(group_zps, dim=1)
    return GPTQResult(W, scale, zero_point, float(losses.sum()), used_damp)
